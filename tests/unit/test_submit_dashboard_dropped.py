"""`raychat submit` and `raychat jobs` whose Ray dashboard answers its version, then drops every other connection
without a reply (a `ray dashboard` port-forward that drops during the working_dir upload): exit 4, "cannot be
reached" (docs/deployment.md), one line naming the dashboard's address. requests' ConnectionError is an OSError,
not the builtin ConnectionError: it reached raychat.cli's handler of bad input, exit 2 with requests' text."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.fake_dashboard import RAY_VERSION

from raychat.cli import main as raychat_main

DROPPED = "Remote end closed connection without response"


class _Dropping(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server API)
        if self.path != "/api/version":
            return self._drop()
        body = json.dumps(RAY_VERSION).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drop(self):
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    do_PUT = do_POST = _drop  # noqa: N815 (http.server API)

    def log_message(self, *args):
        pass


@pytest.fixture
def dropping_dashboard():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dropping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_dashboard_lost_during_submit_exits_4_naming_it(dropping_dashboard, tmp_path, capsys):
    (tmp_path / "run.sh").write_text("true\n")
    argv = [
        "submit",
        "--address",
        dropping_dashboard,
        "--working-dir",
        str(tmp_path),
        "--no-wait",
        "command",
        "true",
    ]
    assert raychat_main(argv) == 4
    assert capsys.readouterr() == (
        "",
        f"raychat submit: error: lost the connection to the Ray dashboard at {dropping_dashboard}: {DROPPED}; "
        "`raychat jobs list` shows whether the job was submitted\n",
    )


@pytest.mark.parametrize("command", [["list"], ["stop", "j"], ["logs", "j"]])
def test_a_dashboard_lost_during_jobs_exits_4_naming_it(dropping_dashboard, capsys, command):
    assert raychat_main(["jobs", "--address", dropping_dashboard, *command]) == 4
    assert capsys.readouterr() == (
        "",
        f"raychat jobs: error: lost the connection to the Ray dashboard at {dropping_dashboard}: {DROPPED}\n",
    )

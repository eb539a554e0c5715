"""raychat's Grafana dashboard and `raychat grafana provision` against a loopback fake of Grafana's HTTP API.

No Grafana server can be installed on these machines; the fake answers the calls grafana-client makes and
records them, so the test checks paths, methods, auth header and bodies.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from raychat import metrics
from raychat.cli import main as raychat_main
from raychat.ops import grafana


def test_dashboard_file_is_current_and_covers_every_metric():
    assert grafana.DASHBOARD_PATH.read_text() == grafana.dashboard_json(), "run `raychat grafana dashboard`"
    assert raychat_main(["grafana", "dashboard", "--check"]) == 0
    d = json.loads(grafana.DASHBOARD_PATH.read_text())
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p.get("targets", []))
    # every metric (as Ray exports it: ray_ prefix; counters _total; histograms via _bucket) is plotted
    scraped = {f"ray_{n}" for n in metrics.METRIC_NAMES}
    plotted = {re.sub(r"_(bucket|total)$", "", x) for x in re.findall(r"ray_raychat_[a-z0-9_]+", exprs)}
    assert plotted == scraped
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) == 25  # 3 rows + 22 panels
    rows = [i for i, p in enumerate(d["panels"]) if p["type"] == "row"]
    assert [d["panels"][i]["title"] for i in rows] == ["Training", "RL", "Serving"]
    rl = d["panels"][rows[1] + 1 : rows[2]]
    assert [p["title"] for p in rl] == [
        "Reward / pass@1 / prompts without signal", "Reward / advantage std", "Policy entropy (nats/token)",
        "Response length (completion tokens)", "Staleness (policy versions)", "Weight sync time",
        "Rollout tokens/s", "Learner wait", "RL step",
    ]  # fmt: skip
    assert [t["expr"] for t in rl[3]["targets"]] == [
        f'max by (run) (ray_raychat_rl_response_len_{x}{{run=~"$run"}})' for x in ("min", "mean", "max")
    ]
    assert all(
        p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for p in d["panels"]
        if p["type"] != "row"
    )


# Grafana's parse of a Prometheus query variable (grafana/grafana, the Prometheus data source's
# PrometheusLabelValuesRegex): label_values(<series selector, sent as Prometheus' match[]>, <label>)
LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?([a-zA-Z_$][a-zA-Z0-9_]*)\)\s*$")


def test_the_run_variable_lists_rl_runs_too():
    """$run listed the run label of ray_raychat_train_step alone, which an RL run never records (it records
    raychat_rl_step), so the RL panels, all filtered on $run, showed no RL run."""
    (var,) = [v for v in grafana.build_dashboard()["templating"]["list"] if v["name"] == "run"]
    assert (
        var["definition"]
        == var["query"]["query"]
        == ('label_values({__name__=~"ray_raychat_train_step|ray_raychat_rl_step"}, run)')
    )
    selector, label = LABEL_VALUES.match(var["definition"]).groups()
    (pattern,) = re.fullmatch(r'\{__name__=~"([^"]+)"\}', selector).groups()
    assert label == "run"
    matched = {n for n in metrics.METRIC_NAMES if re.fullmatch(pattern, f"ray_{n}")}  # PromQL anchors =~
    assert matched == {metrics.TRAIN_STEP, metrics.RL_STEP} == {"raychat_train_step", "raychat_rl_step"}
    # the panels $run filters: training's and RL's series, each stage's step among them
    filtered = {
        m
        for p in grafana.build_dashboard()["panels"]
        for t in p.get("targets", [])
        for m in re.findall(r"ray_(raychat_[a-z0-9_]+)\{[^}]*\$run", t["expr"])
    }
    assert {n.split("_")[1] for n in filtered} == {"train", "rl"}


class FakeGrafana(BaseHTTPRequestHandler):
    calls: list = []
    datasources: dict = {}

    def _reply(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.calls.append((self.command, self.path, self.headers.get("Authorization"), body))
        self.path = self.path.removeprefix("/grafana")  # a Grafana served under a sub-path answers there too
        if self.headers.get("Authorization") != "Bearer glsa_test":
            return self._reply(401, {"message": "Unauthorized"})
        if self.command == "GET" and self.path.startswith("/api/datasources/name/"):
            ds = self.datasources.get(self.path.rsplit("/", 1)[1])
            return self._reply(200, ds) if ds else self._reply(404, {"message": "Data source not found"})
        if self.command == "POST" and self.path == "/api/datasources":
            self.datasources[body["name"]] = {**body, "id": 1, "uid": "prom-1"}
            return self._reply(
                200, {"datasource": self.datasources[body["name"]], "message": "Datasource added"}
            )
        if self.command == "PUT" and self.path == "/api/datasources/uid/prom-1":
            return self._reply(200, {"message": "Datasource updated"})
        if self.command == "POST" and self.path == "/api/dashboards/db":
            return self._reply(200, {"status": "success", "uid": body["dashboard"]["uid"]})
        return self._reply(404, {"message": f"unexpected {self.command} {self.path}"})

    do_GET = do_POST = do_PUT = _handle  # noqa: N815 (http.server API)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_grafana():
    FakeGrafana.calls, FakeGrafana.datasources = [], {}
    server = HTTPServer(("127.0.0.1", 0), FakeGrafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def ray_temp_dir(tmp_path):
    """A Ray temp dir whose session_latest holds Ray's real generated dashboards (Ray's own factory, the code
    the head node's dashboard process runs to write them)."""
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory

    out = tmp_path / "session_x" / "metrics" / "grafana" / "dashboards"
    out.mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(tmp_path / "session_x")
    for name, gen in [("default", factory.generate_default_grafana_dashboard), ("train", factory.generate_train_grafana_dashboard), ("serve", factory.generate_serve_grafana_dashboard)]:  # fmt: skip
        content, _uid = gen()
        (out / f"{name}_grafana_dashboard.json").write_text(content)
    return tmp_path


def test_provision_creates_then_updates(fake_grafana, ray_temp_dir, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_URL", fake_grafana)
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_test")
    argv = [
        "grafana",
        "provision",
        "--ray-temp-dir",
        str(ray_temp_dir),
        "--prometheus-url",
        "http://prom:9090",
    ]
    assert raychat_main(argv) == 0
    calls = [(m, p) for m, p, _, _ in FakeGrafana.calls]
    assert calls == [
        ("GET", "/api/datasources/name/Prometheus"),
        ("POST", "/api/datasources"),
        *[("POST", "/api/dashboards/db")] * 4,
    ]
    assert {auth for _, _, auth, _ in FakeGrafana.calls} == {"Bearer glsa_test"}
    ds = FakeGrafana.calls[1][3]
    assert ds == {
        "name": "Prometheus",
        "type": "prometheus",
        "url": "http://prom:9090",
        "access": "proxy",
        "isDefault": True,
    }
    uploads = [body for _, path, _, body in FakeGrafana.calls if path == "/api/dashboards/db"]
    assert [b["dashboard"]["uid"] for b in uploads] == [
        "raychat",
        "rayDefaultDashboard",
        "rayServeDashboard",
        "rayTrainDashboard",
    ]
    assert all(b["overwrite"] is True and b["dashboard"]["id"] is None for b in uploads)
    assert uploads[0]["dashboard"]["panels"] == grafana.build_dashboard()["panels"]
    out = capsys.readouterr().out
    assert "data source Prometheus created -> http://prom:9090" in out

    FakeGrafana.calls.clear()
    assert raychat_main([*argv[:-1], "http://prom2:9090", "--no-ray-dashboards"]) == 0
    assert [(m, p) for m, p, _, _ in FakeGrafana.calls] == [
        ("GET", "/api/datasources/name/Prometheus"),
        ("PUT", "/api/datasources/uid/prom-1"),
        ("POST", "/api/dashboards/db"),
    ]
    assert FakeGrafana.calls[1][3] == {**ds, "id": 1, "uid": "prom-1", "url": "http://prom2:9090"}


def test_provision_keeps_an_existing_data_sources_settings(fake_grafana, monkeypatch, capsys):
    """Provisioning again (new dashboards after a metrics change) without --prometheus-url PUT the default
    http://127.0.0.1:9090 (Grafana's own host) over a working data source, and any provision dropped its
    authentication and jsonData and retyped a non-Prometheus data source of that name: all silently."""
    monkeypatch.setenv("GRAFANA_URL", fake_grafana)
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_test")
    mine = {
        "id": 1, "uid": "prom-1", "name": "Prometheus", "type": "prometheus", "url": "http://prom:9090",
        "access": "proxy", "basicAuth": True, "basicAuthUser": "scraper", "isDefault": False,
        "jsonData": {"httpMethod": "POST", "timeInterval": "15s"}, "version": 3,
    }  # fmt: skip
    FakeGrafana.datasources["Prometheus"] = mine
    argv = ["grafana", "provision", "--no-ray-dashboards"]
    assert raychat_main(argv) == 0
    assert [(m, p) for m, p, _, _ in FakeGrafana.calls] == [
        ("GET", "/api/datasources/name/Prometheus"),
        ("POST", "/api/dashboards/db"),
    ]
    assert "data source Prometheus kept -> http://prom:9090" in capsys.readouterr().out

    FakeGrafana.calls.clear()
    assert raychat_main([*argv, "--prometheus-url", "http://prom-b:9090"]) == 0
    assert FakeGrafana.calls[1][:2] == ("PUT", "/api/datasources/uid/prom-1")
    assert FakeGrafana.calls[1][3] == {**mine, "url": "http://prom-b:9090"}
    assert "data source Prometheus updated -> http://prom-b:9090" in capsys.readouterr().out

    FakeGrafana.calls.clear()
    FakeGrafana.datasources["Prometheus"] = {**mine, "type": "loki", "url": "http://loki:3100"}
    assert raychat_main([*argv, "--prometheus-url", "http://prom:9090"]) == 2
    assert capsys.readouterr().err == (
        "raychat grafana provision: error: Grafana's data source 'Prometheus' is of type 'loki', not prometheus: "
        "rename it in Grafana (raychat creates its own under that name); nothing was changed\n"
    )
    assert [(m, p) for m, p, _, _ in FakeGrafana.calls] == [("GET", "/api/datasources/name/Prometheus")]


def test_provision_errors(fake_grafana, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GRAFANA_URL", raising=False)
    assert raychat_main(["grafana", "provision"]) == 2
    assert "set GRAFANA_URL" in capsys.readouterr().err
    argv = ["grafana", "provision", "--url", fake_grafana, "--token", "wrong"]
    assert raychat_main([*argv, "--ray-temp-dir", str(tmp_path)]) == 2  # no session_latest there
    assert "run on the Ray head node" in capsys.readouterr().err
    assert raychat_main([*argv, "--no-ray-dashboards"]) == 4  # 401 from Grafana
    assert "refused" in capsys.readouterr().err
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert (
        raychat_main(["grafana", "provision", "--url", closed, "--no-ray-dashboards"]) == 4
    )  # was 2, urllib3's text
    assert capsys.readouterr().err == (
        f"raychat grafana provision: error: --url: cannot reach Grafana at {closed}: [Errno 111] Connection refused\n"
    )
    monkeypatch.setenv("GRAFANA_URL", closed)  # the docs' way: the line names the variable the URL came from
    assert raychat_main(["grafana", "provision", "--no-ray-dashboards"]) == 4
    assert capsys.readouterr().err == (
        f"raychat grafana provision: error: GRAFANA_URL: cannot reach Grafana at {closed}: [Errno 111] Connection refused\n"
    )


def test_provision_url_sub_path_bad_url_and_credentials(fake_grafana, monkeypatch, capsys):
    """A sub-path without a trailing slash was requested as /grafanaapi/... (404, exit 4); `--url notaurl` got
    "Invalid URL '://None/notaurlapi/...'" without the flag; a password in the URL was printed back."""
    monkeypatch.delenv("GRAFANA_URL", raising=False)
    argv = ["grafana", "provision", "--token", "glsa_test", "--no-ray-dashboards"]
    assert raychat_main([*argv, "--url", f"{fake_grafana}/grafana"]) == 0
    assert [p for _, p, _, _ in FakeGrafana.calls] == [
        "/grafana/api/datasources/name/Prometheus", "/grafana/api/datasources", "/grafana/api/dashboards/db",
    ]  # fmt: skip
    capsys.readouterr()
    for bad in ("notaurl", "ftp://grafana:3000/", "http://:3000/", "http://grafana:99999/"):
        assert raychat_main([*argv, "--url", bad]) == 2
        assert capsys.readouterr().err == (
            "raychat grafana provision: error: --url (or GRAFANA_URL) must be an http(s) URL of Grafana, e.g. "
            f"http://grafana:3000/, got {bad!r}\n"
        )
    with_password = fake_grafana.replace("http://", "http://admin:s3cret@")
    assert raychat_main([*argv[:2], "--no-ray-dashboards", "--url", with_password]) == 4  # 401: no token
    err = capsys.readouterr().err
    assert (
        err.startswith(f"raychat grafana provision: error: Grafana at {fake_grafana} refused: ")
        and "s3cret" not in err
    )
    assert raychat_main([*argv, "--url", "http://admin:s3cret@grafana:bad/"]) == 2
    assert "s3cret" not in capsys.readouterr().err


def test_the_dashboard_file_is_written_with_a_plain_files_mode(tmp_path):
    """Written through raychat.atomic: 0o644 under umask 022, not tempfile's owner-only 0o600."""
    old = os.umask(0o022)
    try:
        grafana.write_dashboard(tmp_path / "raychat.json")
    finally:
        os.umask(old)
    path = tmp_path / "raychat.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_text() == grafana.dashboard_json()
    assert [p.name for p in tmp_path.iterdir()] == ["raychat.json"]


def test_rays_dashboards_are_looked_for_in_rays_own_temp_dir(tmp_path, monkeypatch):
    """Ray's temp dir is <$RAY_TMPDIR, else $TMPDIR, else /tmp>/ray; provision looked in $RAY_TMPDIR itself
    (no ray/ below it) and never in $TMPDIR, so it refused a head whose Ray wrote its dashboards there."""
    dashboards = Path("session_latest", "metrics", "grafana", "dashboards")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "x"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "y"))
    assert grafana.ray_dashboards_dir() == tmp_path / "x" / "ray" / dashboards
    monkeypatch.delenv("RAY_TMPDIR")
    assert grafana.ray_dashboards_dir() == tmp_path / "y" / "ray" / dashboards
    monkeypatch.delenv("TMPDIR")
    assert grafana.ray_dashboards_dir() == Path("/tmp/ray") / dashboards
    assert grafana.ray_dashboards_dir(str(tmp_path / "z")) == tmp_path / "z" / dashboards  # --ray-temp-dir


def test_provision_without_the_k8s_extra_says_so_in_one_line(monkeypatch, capsys):
    """Without grafana-client and niquests (raychat[k8s]: the Dockerfile's image, the wheel) `grafana provision`
    ended in a ModuleNotFoundError traceback."""
    for name in list(sys.modules):
        if name.partition(".")[0] in ("niquests", "grafana_client"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "niquests", None)
    monkeypatch.setitem(sys.modules, "grafana_client", None)
    assert raychat_main(["grafana", "provision", "--url", "http://127.0.0.1:9/", "--no-ray-dashboards"]) == 2
    assert capsys.readouterr() == (
        "",
        f"raychat grafana provision: error: provisioning Grafana needs the k8s extra, and this Python "
        f"({sys.executable}) lacks 'niquests': pip install -c constraints.txt -e \".[k8s]\" in the raychat "
        "checkout  (RAYCHAT_DEBUG=1 shows the traceback)\n",
    )

"""An HTTP server on loopback that answers fixed replies by path, for what Ray's Jobs client (JobSubmissionClient)
reads from a dashboard without starting Ray: a real dashboard's /api/version and /api/jobs/<id> JSON, or what
something else at the address answers (a metrics port's Prometheus text)."""

from __future__ import annotations

import http.server
import json
import threading

RAY_VERSION = {"version": "4", "ray_version": "2.60.0", "ray_commit": "0" * 40}


def job_details(job_id: str, status: str, end_time_ms: int | None = None) -> dict:
    """The Jobs API's GET /api/jobs/<id> of a submitted job (Ray's JobDetails fields)."""
    return {"type": "SUBMISSION", "job_id": "02000000", "submission_id": job_id, "status": status,
            "entrypoint": "python jobs/pretrain.py", "start_time": 1, "end_time": end_time_ms}  # fmt: skip


class FakeDashboard:
    """`replies`: path -> (HTTP status, body: a dict or list sent as JSON, or bytes sent as text/plain); any
    other path answers 404 "Not Found". A context manager serving on 127.0.0.1 (`url`) in a daemon thread."""

    def __init__(self, replies: dict[str, tuple[int, object]]):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = replies.get(self.path, (404, b"Not Found"))
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(body, bytes) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeDashboard:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

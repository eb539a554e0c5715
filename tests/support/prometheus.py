"""A real Prometheus server (Debian's `prometheus` package, installed by `make test-deps`) for the tests: it
scrapes the targets of a Ray cluster's service discovery file and answers PromQL over its HTTP API.

Ray's head node writes `<ray temp dir>/prom_metrics_service_discovery.json` (file_sd format: every node's
metrics export port) and rewrites it as nodes join or leave; Prometheus re-reads it on change (file_sd).
The scrape interval is 1 s (the fixture cluster's nodes report metrics every second), so a few seconds after
a value is recorded Prometheus has it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 1


@dataclass
class Prometheus:
    """One `prometheus` process listening on 127.0.0.1:port."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>?params; returns `data` of a successful answer, raises RuntimeError otherwise."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
            raise RuntimeError(f"prometheus {path} {params}: {e.code} {e.read().decode()[:500]}") from None
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        """The series (matrix) `expr` returns over [start, end] (Unix seconds), as Grafana's time-series panels
        ask for them."""
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step_s))[
            "result"
        ]

    def targets_up(self) -> list[str]:
        """scrapeUrl of every active target whose last scrape succeeded."""
        return [t["scrapeUrl"] for t in self.api("targets")["activeTargets"] if t["health"] == "up"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_prometheus(sd_file: Path, workdir: Path, port: int, timeout_s: float = 30) -> Prometheus:
    """Start Prometheus scraping the targets listed in `sd_file` every SCRAPE_INTERVAL_S; returns once it
    answers /-/ready. Raises FileNotFoundError without the binary, RuntimeError if it does not come up."""
    if not Path(PROMETHEUS).exists():
        raise FileNotFoundError(f"{PROMETHEUS} not found: install Debian's prometheus (make test-deps)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": "5s"},
        "scrape_configs": [
            {
                "job_name": "ray",
                "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "2s"}],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    prom = Prometheus(proc, port, log)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return prom
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            prom.stop()
            raise RuntimeError(f"prometheus did not start: {log.read_text()[-2000:]}")
        time.sleep(0.3)

"""`raychat grafana provision`: a Prometheus data source, Ray's generated dashboards and raychat's dashboard.

Talks to Grafana's HTTP API through `grafana-client` (GRAFANA_URL, e.g. http://grafana:3000, and
GRAFANA_TOKEN, a service-account token with Editor rights; or --url/--token):
  1. data source "Prometheus" (type prometheus, proxy access, default): GET /api/datasources/name/Prometheus,
     then POST /api/datasources if there is none; an existing one keeps its settings, and only a
     --prometheus-url that differs from its URL is written to it (PUT /api/datasources/uid/<uid>);
  2. every dashboard with POST /api/dashboards/db, overwrite true: Ray's (written by the head node's dashboard
     process to <ray temp dir>/session_latest/metrics/grafana/dashboards/*.json) and raychat's
     (platform/raychat/ops/grafana/raychat.json, built by `build_dashboard()`).
All dashboards select their data source through the `datasource` template variable (type prometheus), as
Ray's do, so they work with any Prometheus data source.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ray._common.utils import get_default_ray_temp_dir

from raychat import metrics as m
from raychat.atomic import atomic_write_text
from raychat.ops.jobs import K8S_EXTRA_INSTALL

DASHBOARD_PATH = Path(__file__).with_name("grafana") / "raychat.json"
DASHBOARD_UID = "raychat"
DATASOURCE_NAME = "Prometheus"
_DS = {"type": "prometheus", "uid": "${datasource}"}


def _prom(name: str) -> str:
    """Ray's Prometheus exporter adds the `ray_` prefix to every custom metric."""
    return f"ray_{name}"


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": _DS,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": _DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def build_dashboard() -> dict:
    """raychat's Grafana dashboard (schemaVersion 39): training, RL and serving rows, 3 panels a row.

    Gauges are taken with `max by (<tags>)` because every Ray worker process exports its own series (a
    WorkerId label); serving rates are over 1 minute, TTFT / inter-token quantiles come from the histogram
    buckets (histogram_quantile), since Ray's `_sum` is approximate (see raychat.metrics)."""
    tr = '{run=~"$run"}'
    by_t = "max by (run, stage) "
    by_r = "max by (run) "
    dep = '{deployment=~"$deployment"}'
    rows = [
        (
            "Training",
            [
                ("Loss (nats/token)", [(by_t + f"({_prom(m.TRAIN_LOSS)}{tr})", "{{run}} {{stage}}")], "none"),
                (
                    "Validation bits per byte",
                    [(by_t + f"({_prom(m.TRAIN_BPB)}{tr})", "{{run}} {{stage}}")],
                    "none",
                ),
                (
                    "Tokens/s",
                    [(f"sum by (run, stage) ({_prom(m.TRAIN_TOKENS_PER_S)}{tr})", "{{run}}")],
                    "none",
                ),
                ("MFU", [(by_t + f"({_prom(m.TRAIN_MFU)}{tr})", "{{run}} {{stage}}")], "percentunit"),
                ("Gradient norm", [(by_t + f"({_prom(m.TRAIN_GRAD_NORM)}{tr})", "{{run}}")], "none"),
                (
                    "Data wait / learning rate",
                    [
                        (by_t + f"({_prom(m.TRAIN_DATA_WAIT)}{tr})", "data wait {{run}}"),
                        (by_t + f"({_prom(m.TRAIN_LR)}{tr})", "lr {{run}}"),
                    ],
                    "none",
                ),
                ("Step", [(by_t + f"({_prom(m.TRAIN_STEP)}{tr})", "{{run}} {{stage}}")], "none"),
            ],
        ),
        (
            "RL",
            [
                (
                    "Reward / pass@1 / prompts without signal",
                    [
                        (by_r + f"({_prom(m.RL_REWARD)}{tr})", "reward {{run}}"),
                        (by_r + f"({_prom(m.RL_PASS_AT_1)}{tr})", "pass@1 {{run}}"),
                        (by_r + f"({_prom(m.RL_ZERO_ADVANTAGE)}{tr})", "no signal {{run}}"),
                    ],
                    "none",
                ),
                (
                    "Reward / advantage std",
                    [
                        (by_r + f"({_prom(m.RL_REWARD_STD)}{tr})", "reward std {{run}}"),
                        (by_r + f"({_prom(m.RL_ADVANTAGE_STD)}{tr})", "advantage std {{run}}"),
                    ],
                    "none",
                ),
                ("Policy entropy (nats/token)", [(by_r + f"({_prom(m.RL_ENTROPY)}{tr})", "{{run}}")], "none"),
                (
                    "Response length (completion tokens)",
                    [
                        (by_r + f"({_prom(m.RL_RESPONSE_LEN_MIN)}{tr})", "min {{run}}"),
                        (by_r + f"({_prom(m.RL_RESPONSE_LEN_MEAN)}{tr})", "mean {{run}}"),
                        (by_r + f"({_prom(m.RL_RESPONSE_LEN_MAX)}{tr})", "max {{run}}"),
                    ],
                    "none",
                ),
                (
                    "Staleness (policy versions)",
                    [(by_r + f"({_prom(m.RL_STALENESS)}{tr})", "{{run}}")],
                    "none",
                ),
                ("Weight sync time", [(by_r + f"({_prom(m.RL_SYNC_TIME)}{tr})", "{{run}}")], "s"),
                ("Rollout tokens/s", [(f"sum by (run) ({_prom(m.RL_ROLLOUT_TPS)}{tr})", "{{run}}")], "none"),
                ("Learner wait", [(by_r + f"({_prom(m.RL_LEARNER_WAIT)}{tr})", "{{run}}")], "percentunit"),
                ("RL step", [(by_r + f"({_prom(m.RL_STEP)}{tr})", "{{run}}")], "none"),
            ],
        ),
        (
            "Serving",
            [
                (
                    "Time to first token",
                    [
                        (
                            f"histogram_quantile({q}, sum by (le, deployment) "
                            f"(rate({_prom(m.SERVE_TTFT)}_bucket{dep}[5m])))",
                            f"p{int(q * 100)} {{{{deployment}}}}",
                        )
                        for q in (0.5, 0.95)
                    ],
                    "s",
                ),
                (
                    "Inter-token latency",
                    [
                        (
                            f"histogram_quantile({q}, sum by (le, deployment) "
                            f"(rate({_prom(m.SERVE_INTER_TOKEN)}_bucket{dep}[5m])))",
                            f"p{int(q * 100)} {{{{deployment}}}}",
                        )
                        for q in (0.5, 0.95)
                    ],
                    "s",
                ),
                (
                    "Generated tokens/s",
                    [
                        (
                            f"sum by (deployment) (rate({_prom(m.SERVE_TOKENS)}_total{dep}[1m]))",
                            "{{deployment}}",
                        )
                    ],
                    "none",
                ),
                (
                    "Requests running / waiting",
                    [
                        (f"sum by (deployment) ({_prom(m.SERVE_RUNNING)}{dep})", "running {{deployment}}"),
                        (f"sum by (deployment) ({_prom(m.SERVE_WAITING)}{dep})", "waiting {{deployment}}"),
                    ],
                    "none",
                ),
                (
                    "KV rows in use",
                    [(f"sum by (deployment) ({_prom(m.SERVE_KV_SLOTS)}{dep})", "{{deployment}}")],
                    "none",
                ),
                (
                    "Prefix cache hit rate (prompt tokens)",
                    [
                        (
                            f"sum by (deployment) (rate({_prom(m.PREFIX_CACHE_HITS)}_total{dep}[5m])) / "
                            f"sum by (deployment) (rate({_prom(m.PREFIX_CACHE_QUERIES)}_total{dep}[5m]))",
                            "{{deployment}}",
                        )
                    ],
                    "percentunit",
                ),
            ],
        ),
    ]
    panels, pid, y = [], 1, 0
    for title, row in rows:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        pid, y = pid + 1, y + 1
        for i, (ptitle, targets, unit) in enumerate(row):
            panels.append(_panel(pid, ptitle, targets, unit, x=8 * (i % 3), y=y + 8 * (i // 3)))
            pid += 1
        y += 8 * ((len(row) + 2) // 3)

    def var(name: str, selector: str, label: str) -> dict:
        """A variable of the values of `label` on the series of `selector` (Grafana's label_values(selector,
        label): Prometheus' match[])."""
        return {
            "name": name,
            "type": "query",
            "datasource": _DS,
            "query": {"query": f"label_values({selector}, {label})", "refId": name},
            "definition": f"label_values({selector}, {label})",
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "refresh": 2,
        }

    return {
        "uid": DASHBOARD_UID,
        "title": "raychat",
        "tags": ["raychat", "ray"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "hide": 0, "current": {}},
                # a training run records the train step, an RL run the RL step alone
                var("run", f'{{__name__=~"{_prom(m.TRAIN_STEP)}|{_prom(m.RL_STEP)}"}}', "run"),
                var("deployment", _prom(m.SERVE_RUNNING), "deployment"),
            ]
        },
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def write_dashboard(path: Path = DASHBOARD_PATH) -> None:
    """Write build_dashboard() to `path` atomically (raychat.atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, dashboard_json())


def ray_dashboards_dir(temp_dir: str | None = None) -> Path:
    """<temp_dir, else Ray's default temp dir>/session_latest/metrics/grafana/dashboards. Ray's default is
    Ray's own rule (get_default_ray_temp_dir): <$RAY_TMPDIR, else $TMPDIR, else /tmp>/ray."""
    root = Path(temp_dir or get_default_ray_temp_dir())
    return root / "session_latest" / "metrics" / "grafana" / "dashboards"


def load_dashboards(ray_dir: Path | None) -> list[dict]:
    """raychat's dashboard, then every *.json in ray_dir (sorted). Raises FileNotFoundError for a missing
    ray_dir or raychat.json, ValueError for a file that is not a dashboard (no uid/title)."""
    if not DASHBOARD_PATH.is_file():
        raise FileNotFoundError(f"{DASHBOARD_PATH} missing: run `raychat grafana dashboard`")
    files = [DASHBOARD_PATH]
    if ray_dir is not None:
        if not ray_dir.is_dir():
            raise FileNotFoundError(
                f"{ray_dir} does not exist: run on the Ray head node (Ray writes its dashboards there while "
                "the dashboard runs), pass --ray-temp-dir, or --no-ray-dashboards"
            )
        files += sorted(ray_dir.glob("*.json"))
    out = []
    for f in files:
        d = json.loads(f.read_text())
        if not isinstance(d, dict) or not d.get("uid") or not d.get("title"):
            raise ValueError(f"{f}: not a Grafana dashboard (needs 'uid' and 'title')")
        out.append(d)
    return out


DEFAULT_PROMETHEUS_URL = "http://127.0.0.1:9090"


def provision(api, dashboards: list[dict], prometheus_url: str | None) -> dict:
    """Create or update the Prometheus data source, then upload `dashboards` (overwrite). `api` is a
    grafana_client.GrafanaApi.

    A new data source gets `prometheus_url` (None: DEFAULT_PROMETHEUS_URL). An existing one named "Prometheus"
    keeps every setting (authentication, jsonData, default flag): only its URL is changed, and only when
    `prometheus_url` is given and differs. Returns {"datasource": "created"|"updated"|"kept", "url": its URL,
    "dashboards": [uid, ...]}.

    Raises ValueError, before anything is written, when the data source named "Prometheus" is of another type.
    """
    from grafana_client.client import GrafanaClientError

    try:
        existing = api.datasource.get_datasource_by_name(DATASOURCE_NAME)
    except GrafanaClientError as e:
        if getattr(e, "status_code", None) != 404:
            raise
        existing = None
    if existing and existing.get("type") != "prometheus":
        raise ValueError(
            f"Grafana's data source {DATASOURCE_NAME!r} is of type {existing.get('type')!r}, not prometheus: "
            "rename it in Grafana (raychat creates its own under that name); nothing was changed"
        )
    if not existing:
        url = prometheus_url or DEFAULT_PROMETHEUS_URL
        body = {
            "name": DATASOURCE_NAME,
            "type": "prometheus",
            "url": url,
            "access": "proxy",
            "isDefault": True,
        }
        api.datasource.create_datasource(body)
        action = "created"
    elif prometheus_url and prometheus_url != existing.get("url"):
        url = prometheus_url
        api.datasource.update_datasource_by_uid(existing["uid"], {**existing, "url": url})
        action = "updated"
    else:
        url, action = existing.get("url"), "kept"
    uids = []
    for d in dashboards:
        d = {**d, "id": None}  # Grafana matches on uid; a stale numeric id would be rejected
        api.dashboard.update_dashboard(
            {"dashboard": d, "overwrite": True, "message": "raychat grafana provision"}
        )
        uids.append(d["uid"])
    return {"datasource": action, "url": url, "dashboards": uids}


def grafana_url(url: str) -> tuple[str, str]:
    """(the URL for grafana-client, the URL as messages show it) of --url / GRAFANA_URL: an http(s) URL with a
    host, its path ending in '/' (grafana-client appends "api/..." to the path as written: a Grafana behind a
    sub-path, http://host/grafana, got http://host/grafanaapi/...), shown without a user or password.
    Raises ValueError naming --url otherwise."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        shown = url if "@" not in url else url.split("@", 1)[1]
        raise ValueError(
            f"--url (or GRAFANA_URL) must be an http(s) URL of Grafana, e.g. http://grafana:3000/, got {shown!r}"
        )
    fixed = urlunsplit(parts._replace(path=parts.path if parts.path.endswith("/") else parts.path + "/"))
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    return fixed, urlunsplit(parts._replace(netloc=netloc))


def cmd_provision(args) -> int:
    try:
        import niquests
        from grafana_client import GrafanaApi
        from grafana_client.client import GrafanaException
    except ModuleNotFoundError as e:
        raise ValueError(
            f"provisioning Grafana needs the k8s extra, and this Python ({sys.executable}) lacks "
            f"{e.name.partition('.')[0]!r}: {K8S_EXTRA_INSTALL}"
        ) from None

    url = args.url or os.environ.get("GRAFANA_URL")
    token = args.token or os.environ.get("GRAFANA_TOKEN")
    if not url:
        print("raychat grafana provision: error: set GRAFANA_URL (or --url)", file=sys.stderr)
        return 2
    try:
        url, shown = grafana_url(url)
        dashboards = load_dashboards(
            None if args.no_ray_dashboards else ray_dashboards_dir(args.ray_temp_dir)
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"raychat grafana provision: error: {e}", file=sys.stderr)
        return 2
    api = GrafanaApi.from_url(url, credential=token or None)
    try:
        result = provision(api, dashboards, args.prometheus_url)
    except ValueError as e:
        print(f"raychat grafana provision: error: {e}", file=sys.stderr)
        return 2
    except GrafanaException as e:
        print(f"raychat grafana provision: error: Grafana at {shown} refused: {e}", file=sys.stderr)
        return 4
    except niquests.exceptions.ConnectionError as e:  # refused, unresolvable, timed out: as `submit`, exit 4
        why = re.search(r"\[Errno -?\d+\] [^'\")]+|Failed to resolve '[^']+'|timed out", str(e))
        print(
            f"raychat grafana provision: error: {'--url' if args.url else 'GRAFANA_URL'}: cannot reach Grafana at "
            f"{shown}: {why[0] if why else type(e).__name__}",
            file=sys.stderr,
        )
        return 4
    print(f"data source {DATASOURCE_NAME} {result['datasource']} -> {result['url']}")
    print(f"dashboards uploaded: {', '.join(result['dashboards'])}")
    return 0


def cmd_dashboard(args) -> int:
    if args.check:
        if not DASHBOARD_PATH.is_file() or DASHBOARD_PATH.read_text() != dashboard_json():
            print(f"{DASHBOARD_PATH} is out of date: run `raychat grafana dashboard`", file=sys.stderr)
            return 1
        return 0
    write_dashboard()
    print(f"wrote {DASHBOARD_PATH}")
    return 0

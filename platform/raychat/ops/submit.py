"""`raychat submit [options] <stage> [stage args]` and `raychat jobs list|stop|logs`: raychat stages as Ray jobs.

Uses the Ray Jobs SDK (`ray.job_submission.JobSubmissionClient`), which talks to the dashboard's REST API
(default http://127.0.0.1:8265; `--address`, or RAY_API_SERVER_ADDRESS / RAY_ADDRESS).

Token authentication (Ray >= 2.52; on by default in the Ray this project pins): the token is read, first
found wins, from `--token-file`, RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, then
~/.ray/auth_token (Ray's own order; raychat.ray_token), and sent as `Authorization: Bearer <token>` through
the client's `headers=` argument; for a GCS address (HOST:6379), which the client resolves to the dashboard's
URL through the GCS, it is also handed to Ray's own GCS client (raychat.ray_token.hand_to_ray). With no token
found no header is sent, which suits a cluster started with RAY_AUTH_MODE=disabled.

The job's runtime_env: `working_dir` = the repository (without .venv, runs, .git, caches and the cluster's
token file: WORKING_DIR_EXCLUDES, and what its .gitignore files ignore), `py_modules` = platform/raychat (so
the job imports the submitted code, not whatever raychat the cluster has installed), and either the cluster
image's Python environment (default) or `pip` requirements (`--pip`, `--pip-project`).

The job's Python: Ray runs the entrypoint through a shell on the driver's node (the head by default), so a
plain `python` is whatever that node's PATH finds, which need not be the Python that runs Ray (see
raychat.ops.job_python). `--python PATH` names it; when it lacks raychat's dependencies the job fails at
once with one line naming the Python that Ray runs there, and a `python` that does not exist at all (exit
127) gets the same advice from `submit`.

A job waits PENDING until a node has room for its entrypoint resources (--num-cpus, --num-gpus) and its
runtime_env is set up, or until Ray's start timeout fails it (RAY_JOB_START_TIMEOUT_SECONDS on the head,
default 900 s); following it says so every PENDING_REPORT_EVERY_S. On a cluster that cannot grow (Ray's
read-only monitor: a head started without an autoscaling config) submit refuses resources no node has
(fixed_cluster_capacity). Ray delivers a stop to a started driver only: `jobs stop` of a PENDING job says so.
A stopped job's driver gets SIGTERM, and SIGKILL RAY_JOB_STOP_WAIT_TIME_S later (Ray's default 3 s, short of what a
training driver needs to stop its workers, print its line, delete its lease and exit): a stage's job is submitted
with RAY_JOB_STOP_WAIT_TIME_S=30 in its env_vars unless --env sets it (job_env_vars).

Exit codes of `submit` and `jobs logs --follow`: 0 SUCCEEDED, 1 FAILED, 3 STOPPED, 4 cannot reach or
authenticate to the cluster, 2 bad arguments or a job the cluster does not have (deleted while followed
included); with --no-wait, 0 once the job is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import socket
import sys
import time
from pathlib import Path

import aiohttp
import requests
from ray.dashboard.consts import DEFAULT_JOB_START_TIMEOUT_SECONDS, RAY_JOB_START_TIMEOUT_SECONDS_ENV_VAR
from ray.exceptions import AuthenticationError, RpcError
from ray.job_submission import JobStatus, JobSubmissionClient

from raychat.capacity import Capacity, NodeType, fmt_bundle, missing_resources, read_only_monitor
from raychat.ops.jobs import DEFAULT_ADDRESS, STAGE_STOP_WAIT_S, STAGES, STOP_WAIT_ENV, SUBMIT_CHOICES
from raychat.ray_token import find_token, first_line, hand_to_ray, refused_message

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# what a job never reads: environments, run outputs, caches, node_modules of the JS contract test (20 MB, most
# of the checkout), benchmark results (bench/results/job_startup.md: the upload before / after), and the
# cluster's token file where docs/deployment.md section 1 writes it (`token` in the checkout): uploaded, it
# would sit in the GCS in every job's package. It holds Ray's default excludes (.git, .venv, venv, __pycache__),
# which submit turns off (packaging_quiet), so that Ray does not warn about each one it finds.
WORKING_DIR_EXCLUDES = [
    ".venv", "venv", "runs", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", ".mypy_cache",
    "node_modules", "bench/results", "/token",
]  # fmt: skip
# Ray's INFO line that a .gitignore is honoured, logged for each folder that holds one (the checkout's and the
# excluded .pytest_cache's and .ruff_cache's: 3 lines) each time the package is hashed: the upload honours
# them (module doc), the line is left out
GITIGNORE_LINE = "Ignoring upload to cluster for these files"
DEFAULT_EXCLUDES_ENV = "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES"
PACKAGING_LOGGER = "ray._private.runtime_env.packaging"
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}
EXIT_UNREACHABLE = 4
EXIT_COMMAND_NOT_FOUND = 127  # what the job's shell returns when the entrypoint's program does not exist
# a followed job still PENDING after PENDING_REPORT_AFTER_S is reported, then every PENDING_REPORT_EVERY_S
PENDING_REPORT_AFTER_S, PENDING_REPORT_EVERY_S = 5.0, 30.0
# submit's flags -> the resource each reserves for the job's entrypoint
ENTRYPOINT_FLAGS = (("--num-cpus", "CPU"), ("--num-gpus", "GPU"))
START_TIMEOUT = (
    f"Ray's start timeout ({RAY_JOB_START_TIMEOUT_SECONDS_ENV_VAR} on the head, default "
    f"{DEFAULT_JOB_START_TIMEOUT_SECONDS} s)"
)


def repo_root(flag: str = "--working-dir") -> Path:
    """The raychat checkout this module runs from (the folder holding pyproject.toml and jobs/).

    Raises FileNotFoundError when raychat runs from an installed wheel (no checkout), naming `flag`, the
    command's flag that gives the checkout instead ("pass --working-dir <repo>")."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "platform" / "raychat").is_dir():
        return root
    raise FileNotFoundError(f"no raychat checkout above {__file__}; pass {flag} <repo>")


ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # in the order resolve_address reads them
GCS_CONNECT_TIMEOUT_S = 5.0


def resolve_address(address: str | None) -> str:
    """--address, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else DEFAULT_ADDRESS."""
    return address or next((os.environ[k] for k in ADDRESS_ENV if os.environ.get(k)), DEFAULT_ADDRESS)


def address_source(address: str | None) -> str:
    """Where resolve_address(address) came from, as an error line names it: "--address", the variable it was
    read from ("RAY_ADDRESS"), or the default's note ("--address (not given, and neither RAY_API_SERVER_ADDRESS
    nor RAY_ADDRESS is set: the default)")."""
    if address:
        return "--address"
    found = next((k for k in ADDRESS_ENV if os.environ.get(k)), None)
    return found or f"--address (not given, and neither {' nor '.join(ADDRESS_ENV)} is set: the default)"


@contextlib.contextmanager
def _only(url: str):
    """Within: ADDRESS_ENV unset in this process, so a JobSubmissionClient talks to `url`: Ray's
    get_address_for_submission_client lets those variables override the address it is given (--address
    http://B with RAY_ADDRESS=http://A listed, stopped and submitted on A)."""
    saved = {k: os.environ.pop(k) for k in ADDRESS_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _probe_gcs(url: str, source: str = "--address") -> None:
    """Raise ConnectionError naming `source` (address_source) when nothing accepts a TCP connection at the GCS
    address `url` (HOST:PORT) within GCS_CONNECT_TIMEOUT_S: Ray's GCS client would wait ~35 s and raise its
    RpcError."""
    host, _, port = url.rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT (e.g. "auto"): Ray's own parsing names the problem
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"{source}: cannot reach the Ray cluster's GCS at {url}: {e}") from e


def make_client(address: str | None = None, token_file: str | None = None):
    """A JobSubmissionClient for `address` that sends the auth token if one is found (see find_token).

    The client talks to resolve_address(address) alone: --address wins over RAY_API_SERVER_ADDRESS and
    RAY_ADDRESS, which Ray's client would otherwise put in its place.

    Raises ConnectionError with one line naming the flag (or the variable the address came from,
    address_source): the dashboard or the GCS cannot be reached, or no
    GCS answers at a GCS address (--address), something that is not a Ray dashboard answers HTTP there
    (_not_a_dashboard), or the cluster refuses the token (--token-file or wherever the token came from);
    ValueError: an address Ray cannot parse, a token file that is not a regular file or is empty;
    FileNotFoundError: a missing token file."""
    url, named = resolve_address(address), address_source(address)
    # a GCS address (HOST:6379): the client asks the GCS for the dashboard's URL, over Ray's own gRPC client
    token, source = find_token(token_file) if "://" in url else hand_to_ray(token_file)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if "://" not in url:
        _probe_gcs(url, named)
    try:
        with _only(url):
            return JobSubmissionClient(url, headers=headers)
    except AuthenticationError as e:
        raise ConnectionError(refused_message(url, source, first_line(e))) from e
    # /api/version answered, but not Ray's {"ray_version": ...}: not a Ray dashboard; HTTPError: an HTTP error
    # status (500, 405, ...) other than 401 and 403 (AuthenticationError) and 404 (RuntimeError below)
    except (requests.JSONDecodeError, requests.HTTPError, KeyError) as e:
        raise ConnectionError(_not_a_dashboard(named, url, headers, e)) from e
    except RuntimeError as e:
        if not str(e).startswith("Version check returned 404"):
            raise
        raise ConnectionError(_not_a_dashboard(named, url, headers, e)) from e
    except RpcError as e:  # a GCS address where something else listens (e.g. the dashboard's port)
        raise ConnectionError(
            f"{named} {url}: no Ray GCS answered there ({first_line(e)}); a GCS address is HOST:6379, the "
            "dashboard's is http://HOST:8265"
        ) from e
    except ConnectionError as e:
        raise ConnectionError(f"{named}: cannot reach the Ray dashboard at {url}: {first_line(e)}") from e
    except ValueError as e:  # Ray's "Invalid address format: ..."
        raise ValueError(
            f"{named} {url}: {first_line(e)}; give the Ray dashboard's address, e.g. http://HEAD:8265"
        ) from e


def _not_a_dashboard(named: str, url: str, headers: dict | None, error: BaseException) -> str:
    """The line for an address where something that is not a Ray dashboard answers HTTP (a node's metrics port,
    another web server): what its GET /api/version answers (status, first bytes), asked again for this line."""
    try:
        reply = requests.get(f"{url}/api/version", headers=headers, timeout=GCS_CONNECT_TIMEOUT_S)
        answered = f"HTTP {reply.status_code}, {reply.content[:40]!r}"
    except OSError:  # it stopped answering meanwhile: what Ray's client said of it
        answered = first_line(error)
    return (
        f"{named} {url} is not a Ray dashboard: GET /api/version answered {answered} (a dashboard answers Ray's "
        "version as JSON); give the Ray dashboard's address, http://<head>:8265"
    )


def entrypoint_for(stage: str, stage_args: list[str], working_dir: Path, python: str = "python") -> str:
    """The shell command the job runs: `<python> jobs/<stage>.py <args>`, or the args themselves for `command`.

    Raises ValueError for an unknown stage, an empty `command`, or a stage whose jobs/<stage>.py is missing."""
    if stage == "command":
        if not stage_args:
            raise ValueError("stage 'command' needs a command after it, e.g. command python -c 'print(42)'")
        return shlex.join(stage_args)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(SUBMIT_CHOICES)}; got {stage!r}")
    script = Path("jobs") / f"{stage}.py"
    if not (working_dir / script).is_file():
        raise ValueError(f"stage {stage!r}: {working_dir / script} does not exist")
    return shlex.join([python, script.as_posix(), *stage_args])


def runtime_env_for(
    working_dir: Path, pip: list[str] | None = None, env_vars: dict[str, str] | None = None
) -> dict:
    """The job's runtime_env (https://docs.ray.io/en/latest/ray-core/handling-dependencies.html).

    working_dir uploads the checkout (minus WORKING_DIR_EXCLUDES); py_modules ships platform/raychat so the
    submitted code wins over an installed raychat; pip (optional) installs requirements into a per-job env,
    otherwise the job uses the cluster image's environment."""
    env: dict = {
        "working_dir": str(working_dir),
        "excludes": list(WORKING_DIR_EXCLUDES),
        "py_modules": [str(working_dir / "platform" / "raychat")],
    }
    if pip:
        env["pip"] = list(pip)
    if env_vars:
        env["env_vars"] = dict(env_vars)
    return env


class _DropLine(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def packaging_quiet():
    """Within: Ray's packaging of a runtime_env (what submit_job uploads) without its default excludes
    ($RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES empty, unless set in this environment), which
    WORKING_DIR_EXCLUDES lists itself, and without its GITIGNORE_LINE: the same files uploaded, but no
    "Directory '.git' is now ignored by default" warning for each such directory of the checkout, nor the
    INFO line of each .gitignore."""
    saved = os.environ.get(DEFAULT_EXCLUDES_ENV)
    os.environ.setdefault(DEFAULT_EXCLUDES_ENV, "")
    packaging = logging.getLogger(PACKAGING_LOGGER)
    drop = _DropLine(GITIGNORE_LINE)
    packaging.addFilter(drop)
    try:
        yield
    finally:
        packaging.removeFilter(drop)
        if saved is None:
            os.environ.pop(DEFAULT_EXCLUDES_ENV, None)


def project_requirements(working_dir: Path) -> list[str]:
    """[project].dependencies of <working_dir>/pyproject.toml, without torch (the image provides the torch
    build that matches its CUDA; a pip-resolved torch would pull a multi-GB wheel per job)."""
    deps = tomllib.loads((working_dir / "pyproject.toml").read_text())["project"]["dependencies"]
    return [
        d for d in deps if not d.replace(" ", "").lower().startswith(("torch>", "torch=", "torch<", "torch;"))
    ]


def job_env_vars(stage: str, items: list[str]) -> dict[str, str]:
    """The job's environment variables (runtime_env env_vars): --env's KEY=VALUE `items`, and for a stage (not
    `command`) RAY_JOB_STOP_WAIT_TIME_S=STAGE_STOP_WAIT_S unless --env sets it (module doc).

    Raises ValueError: an item that is not KEY=VALUE; a RAY_JOB_STOP_WAIT_TIME_S that is not a whole number of
    seconds >= 0 (Ray's supervisor would fail on it only when the job is stopped)."""
    env = _parse_env(items)
    wait = env.get(STOP_WAIT_ENV)
    if wait is not None and not (wait.isascii() and wait.isdigit()):
        raise ValueError(
            f"--env {STOP_WAIT_ENV}={wait}: Ray reads it as whole seconds; allowed: an integer >= 0"
        )
    if stage != "command":
        env.setdefault(STOP_WAIT_ENV, str(STAGE_STOP_WAIT_S))
    return env


def _parse_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env must be KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def follow(client, job_id: str, out=None, poll_s: float = 0.5, waits_for: str | None = None, err=None) -> str:
    """Print the job's logs as they come (tail_job_logs), then wait for a terminal status and return it
    (the JobStatus value: "SUCCEEDED", "FAILED" or "STOPPED"). While the job is PENDING (no log comes), say so
    on `err` (default stderr) after PENDING_REPORT_AFTER_S and every PENDING_REPORT_EVERY_S, with `waits_for`
    (what its entrypoint reserves, e.g. "{GPU: 1} (--num-gpus 1)"; "" nothing; None not known here).

    Raises RuntimeError (job_refusal's 404) for a job the cluster does not have, ValueError for a driver's job
    (no submission id: the Jobs API streams no logs of it): asked first, since the log stream of either fails
    with aiohttp's WSServerHandshakeError, which says nothing of the job. ConnectionError (one line, lost_line)
    when the dashboard stops answering after that, or refuses the log stream of a job it still has: the job runs
    on without its follower; JobGone (gone_line) when the dashboard answers that the job no longer exists
    (deleted meanwhile, before its log stream opened too)."""
    out, err = out or sys.stdout, err or sys.stderr
    if client.get_job_info(job_id).submission_id is None:
        raise ValueError(_driver_job(job_id))

    async def _tail():
        try:
            async for chunk in client.tail_job_logs(job_id):
                out.write(chunk)
                out.flush()
        # the dashboard refused the log stream's websocket (404: the job deleted since get_job_info; aiohttp keeps
        # the status, not the body that says why): the Jobs API's 404 of its status request makes it JobGone below
        except aiohttp.WSServerHandshakeError as e:
            await asyncio.to_thread(client.get_job_status, job_id)
            raise RuntimeError(f"the dashboard refused the job's log stream: {first_line(e)}") from e

    async def _report_pending():
        t0, next_at = time.monotonic(), PENDING_REPORT_AFTER_S
        while True:
            await asyncio.sleep(min(1.0, PENDING_REPORT_AFTER_S))
            try:
                status = await asyncio.to_thread(client.get_job_status, job_id)
            except (OSError, RuntimeError):  # the dashboard did not answer this time: the tail goes on
                continue
            if status != JobStatus.PENDING:
                return
            waited = time.monotonic() - t0
            if waited >= next_at:
                err.write(pending_line(job_id, waited, waits_for) + "\n")
                err.flush()
                next_at = waited + PENDING_REPORT_EVERY_S

    async def _both():
        reporter = asyncio.create_task(_report_pending())
        try:
            await _tail()
        finally:
            reporter.cancel()

    try:
        asyncio.run(_both())
        while True:
            status = client.get_job_status(job_id)
            if status.is_terminal():
                return status.value
            time.sleep(poll_s)
    # Ray's log stream raises RuntimeError on an abnormal close; its status request requests' errors (OSError)
    # and RuntimeError for the Jobs API's error answers (404: the job was deleted)
    except (OSError, RuntimeError) as e:
        if _no_such_job(e):
            raise JobGone(gone_line(client.get_address(), job_id)) from e
        raise ConnectionError(lost_line(client.get_address(), job_id, e)) from e


class JobGone(LookupError):
    """The job followed is no longer on the cluster: the Jobs API answers 404 (gone_line)."""


def gone_line(address: str, job_id: str) -> str:
    """The line of a follower whose job was deleted from the cluster while it followed it."""
    return (
        f"job {job_id} is no longer on the cluster at {address}: the Jobs API answers that it does not exist (it "
        f"was deleted while followed, e.g. `ray job delete {job_id}`, or its head restarted without its job "
        "history); its status and logs went with it"
    )


def lost_line(address: str, job_id: str, error: BaseException) -> str:
    """The line of a follower whose dashboard stopped answering (a port-forward that dropped, a head that
    restarted) while the job it followed runs on."""
    return (
        f"lost the connection to the Ray dashboard at {address} while following job {job_id} ({first_line(error)}); "
        f"the job goes on without it: `raychat jobs logs --follow {job_id}` follows it again, `raychat jobs list` "
        "shows its status"
    )


def pending_line(job_id: str, waited_s: float, waits_for: str | None = None) -> str:
    """The line a followed job that is still PENDING after `waited_s` seconds gets: what Ray waits for
    (`waits_for` as follow takes it)."""
    if waits_for is None:
        room = "a node with room for its entrypoint resources (if it reserves any) and "
    else:
        room = f"a node with room for its entrypoint {waits_for} and " if waits_for else ""
    return (
        f"job {job_id} still PENDING after {waited_s:.0f} s: its driver has not started; Ray waits for {room}its "
        f"runtime_env (working_dir upload, pip) and fails a job that has not started within {START_TIMEOUT}"
    )


def entrypoint_resources(args) -> tuple[dict, str]:
    """({resource: amount} the job's entrypoint reserves, the flags that ask for it, e.g. "--num-gpus 1")."""
    given = [(flag, res, getattr(args, flag[2:].replace("-", "_"))) for flag, res in ENTRYPOINT_FLAGS]
    given = [(flag, res, v) for flag, res, v in given if v]
    return {res: float(v) for _, res, v in given}, " ".join(f"{flag} {v:g}" for flag, _, v in given)


def fixed_cluster_capacity(client) -> Capacity | None:
    """The alive nodes of the cluster behind `client` (their CPUs and GPUs) when it cannot grow: the status of
    Ray's monitor (GET /api/cluster_status of the dashboard, what `ray status` reads) comes from Ray's read-only
    provider (raychat.capacity.read_only_monitor), as on every head started without an autoscaling config.

    None when the cluster may grow or it cannot tell: an autoscaler of node types, KubeRay's v2 autoscaler
    (which writes no such status), the monitor's first seconds, a dashboard that did not answer, a Jobs client
    without the private `_do_request` this reads through (a Ray that removed it)."""
    try:
        reply = client._do_request("GET", "/api/cluster_status")  # the Jobs client's session, token included
        status = reply.json()["data"]["clusterStatus"] or {}
    # requests' errors are OSErrors; AttributeError: a Ray whose Jobs client lacks the private _do_request
    # cannot tell, which must not fail the submission
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    # the dashboard camel-cases keys that hold "_" (autoscaler_report -> autoscalerReport); node ids and CPU,
    # GPU hold none, so they come through as Ray wrote them
    mapping = (status.get("autoscalerReport") or {}).get("nodeTypeMapping") or {}
    if not read_only_monitor({"autoscaler_report": {"node_type_mapping": mapping}}):
        return None
    nodes = (status.get("loadMetricsReport") or {}).get("usageByNode") or {}
    return Capacity(
        "alive nodes",
        tuple(
            NodeType(
                "alive node "
                + next((k[5:] for k in usage if k.startswith("node:") and k[5:6].isalnum()), "?"),
                {k: float(usage[k][1]) for k in ("CPU", "GPU") if k in usage},
                1,
            )
            for usage in nodes.values()
        ),
    )


def check_entrypoint_fits(client, resources: dict, flags: str) -> None:
    """Refuse entrypoint `resources` no node of a cluster that cannot grow has room for (see
    fixed_cluster_capacity): Ray would keep the job PENDING until its start timeout.

    Raises ValueError naming `flags`, what is missing and the cluster's nodes."""
    if not resources or (capacity := fixed_cluster_capacity(client)) is None:
        return
    if missing := missing_resources(resources, capacity):
        nodes = ", ".join(t.describe() for t in capacity.node_types) or "none"
        raise ValueError(
            f"{flags}: no node of this cluster has room for the job's entrypoint {fmt_bundle(resources)}: "
            f"{missing}; the cluster has no autoscaler to add one (its nodes: {nodes})"
        )


# Ray's JobSupervisor of a PENDING job is an actor not yet placed: stop_job queues its stop() behind run()
PENDING_STOP = (
    "the job is PENDING (its driver has not started) and Ray delivers a stop to a started driver only: it stays "
    "PENDING until it can start (a node with room for its entrypoint resources, its runtime_env set up), when Ray "
    f"starts its driver and then stops it, or until {START_TIMEOUT} fails it"
)


def _connection_errors():
    # requests' ConnectionError (refused, or dropped mid-request: a port-forward that dropped) is an OSError, not
    # the builtin ConnectionError
    return (AuthenticationError, ConnectionError, requests.ConnectionError, RuntimeError)


def connection_line(error: BaseException, client) -> str:
    """The line of a Jobs API call of `client` that failed with `error` (one of _connection_errors()): its first
    line, and for requests' ConnectionError, whose text may name no address ("('Connection aborted.',
    RemoteDisconnected(...))"), the address of the client's dashboard too (make_client raises the builtin
    ConnectionError alone: `client` may be None for any other error)."""
    if isinstance(error, requests.ConnectionError):
        return f"lost the connection to the Ray dashboard at {client.get_address()}: {first_line(error)}"
    return first_line(error)


def job_refusal(e: Exception, job_id: str | None) -> str | None:
    """The one-line reason when the Jobs API answered about the job itself (a bad request, exit 2), not about
    reaching the cluster: no such job (404), a submission id already taken (Ray answers 500 with its
    traceback, whose first line says nothing), or the logs or stop of a driver's job (400). None otherwise."""
    text = str(e)
    if _no_such_job(e):
        return f"no job {job_id!r} on this cluster (`raychat jobs list` shows its jobs)"
    if "status code 400" in text and "submission type jobs" in text:  # "Can only get logs of / stop ..."
        return _driver_job(job_id)
    if "already exists" in text and job_id:
        return _taken(job_id)
    return None


def _no_such_job(e: Exception) -> bool:
    """Whether `e` is the Jobs API's answer that a job does not exist (Ray's client: RuntimeError "Request
    failed with status code 404: Job ... does not exist.")."""
    return "status code 404" in str(e) and "does not exist" in str(e)


def _driver_job(job_id: str | None) -> str:
    return (
        f"job {job_id!r} was not submitted: it is a Ray driver that connected to the cluster itself (ray.init: "
        "`raychat serve`, a script), listed by its Ray job id; the Jobs API has no logs of it and cannot stop it: "
        "its output is where that process runs"
    )


def _taken(job_id: str) -> str:
    return f"--job-id {job_id}: a job with this submission id already exists on this cluster; choose another"


def check_job_id_free(client, job_id: str | None) -> None:
    """Refuse `--job-id job_id` that a job on the cluster behind `client` already has as its submission id, before
    anything is uploaded (submit_job uploads the working dir and raychat first, then Ray refuses the id).

    Raises ValueError: the id is taken; RuntimeError, ConnectionError as the Jobs client (other than its 404:
    no such job, the id is free)."""
    if job_id is None:
        return
    try:
        info = client.get_job_info(job_id)
    except RuntimeError as e:
        if "status code 404" in str(e):
            return
        raise
    if info.submission_id == job_id:  # get_job_info also finds a driver's Ray job id, which Ray allows
        raise ValueError(_taken(job_id))


def cmd_submit(args) -> int:
    client = None
    try:
        working_dir = Path(args.working_dir).resolve() if args.working_dir else repo_root()
        if not working_dir.is_dir():
            why = "not a directory" if working_dir.exists() else "no such directory"
            raise ValueError(f"--working-dir {args.working_dir}: {why} (the checkout the job runs in)")
        stage_args = list(args.stage_args)
        entrypoint = entrypoint_for(args.stage, stage_args, working_dir, args.python)
        for note in args.stage_notes:  # raychat.commands.StageArgs
            print(f"raychat submit: note: {note}", file=sys.stderr)
        pip = list(args.pip or [])
        if args.pip_project:
            pip = project_requirements(working_dir) + pip
        runtime_env = runtime_env_for(working_dir, pip, job_env_vars(args.stage, args.env or []))
        client = make_client(args.address, args.token_file)
        check_job_id_free(client, args.job_id)
        resources, flags = entrypoint_resources(args)
        check_entrypoint_fits(client, resources, flags)
    except (ValueError, FileNotFoundError) as e:
        print(f"raychat submit: error: {e}", file=sys.stderr)
        return 2
    except _connection_errors() as e:
        print(f"raychat submit: error: {connection_line(e, client)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    kwargs = {}
    if args.num_cpus is not None:
        kwargs["entrypoint_num_cpus"] = args.num_cpus
    if args.num_gpus is not None:
        kwargs["entrypoint_num_gpus"] = args.num_gpus
    try:
        with packaging_quiet():
            job_id = client.submit_job(
                entrypoint=entrypoint, runtime_env=runtime_env, submission_id=args.job_id, **kwargs
            )
    except _connection_errors() as e:
        if why := job_refusal(e, args.job_id):
            print(f"raychat submit: error: {why}", file=sys.stderr)
            return 2
        # dropped during the upload or the submission itself: the job may have been submitted
        if isinstance(e, requests.ConnectionError):
            why = f"{connection_line(e, client)}; `raychat jobs list` shows whether the job was submitted"
        else:
            why = f"the cluster refused the job: {first_line(e)}"
        print(f"raychat submit: error: {why}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"submitted {job_id}: {entrypoint}", file=sys.stderr)
    if args.no_wait:
        print(job_id)
        return 0
    try:
        waits_for = f"{fmt_bundle(resources)} ({flags})" if resources else ""
        status = follow(client, job_id, waits_for=waits_for)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the job keeps running. Stop it: raychat jobs stop {job_id}",
            file=sys.stderr,
        )
        return 130
    except ConnectionError as e:
        print(f"raychat submit: error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except JobGone as e:
        print(f"raychat submit: error: {e}", file=sys.stderr)
        return 2
    print(f"job {job_id} {status}", file=sys.stderr)
    if status == "FAILED" and client.get_job_info(job_id).driver_exit_code == EXIT_COMMAND_NOT_FOUND:
        if args.stage == "command":  # its words run as given: --python plays no part
            word = args.stage_args[0]
            hint = (
                f"`command` runs its words as given: {word!r} must be an executable on the PATH of the Ray node "
                "that ran the job, or its full path there"
            )
        else:
            word = entrypoint.split()[0]
            hint = "Pass --python with the cluster's Python (the one that runs Ray there), see docs/deployment.md"
        print(
            f"raychat submit: error: the job's shell found no such command ({word!r}: exit 127). {hint}",
            file=sys.stderr,
        )
    return EXIT_CODES.get(status, 1)


_ONE_FIELD = str.maketrans({"\n": "\\n", "\t": "\\t", "\r": "\\r"})  # job_lines: one line, 3 fields


def job_lines(jobs) -> list[str]:
    """One line a job of the Jobs API's list_jobs (JobDetails): "<submission id or job id>\t<status>\t<entrypoint>",
    oldest start first (Ray returns them in no stated order), ties by id; the entrypoint's newlines, tabs and
    carriage returns written as \\n, \\t, \\r (a driver's `python -c "<script>"` is listed with its script)."""
    jobs = sorted(jobs, key=lambda j: (j.start_time or 0, j.submission_id or j.job_id or ""))
    return [
        f"{j.submission_id or j.job_id}\t{j.status.value}\t{(j.entrypoint or '').translate(_ONE_FIELD)}"
        for j in jobs
    ]


def cmd_jobs(args) -> int:
    client = None
    try:
        client = make_client(args.address, args.token_file)
        if args.jobs_command == "list":
            jobs = client.list_jobs()
            for line in job_lines(jobs):
                print(line)
            if not jobs:
                # on stderr: stdout holds job lines only, for scripts that split them by tab
                print(
                    f"no jobs on the cluster at {client.get_address()} (`raychat submit` starts one)",
                    file=sys.stderr,
                )
            return 0
        if args.jobs_command == "stop":
            pending = client.get_job_status(args.job_id) == JobStatus.PENDING
            stopped = client.stop_job(args.job_id)
            if stopped and pending:
                print(f"{args.job_id}: stop requested, but {PENDING_STOP}")
            else:
                print(f"{args.job_id}: {'stop requested' if stopped else 'already finished'}")
            return 0
        if args.follow:
            return EXIT_CODES.get(follow(client, args.job_id), 1)
        sys.stdout.write(client.get_job_logs(args.job_id))
        return 0
    except (ValueError, FileNotFoundError, JobGone) as e:
        print(f"raychat jobs: error: {e}", file=sys.stderr)
        return 2
    except _connection_errors() as e:
        if why := job_refusal(e, getattr(args, "job_id", None)):
            print(f"raychat jobs: error: {why}", file=sys.stderr)
            return 2
        print(f"raychat jobs: error: {connection_line(e, client)}", file=sys.stderr)
        return EXIT_UNREACHABLE

"""Shared pytest fixtures: a tiny tokenizer, a real multi-node Ray cluster, a real S3 server. The tiers:
tests/unit (no Ray), tests/ray (a local Ray instance), tests/cluster (the multi-node fixture cluster);
helpers in tests/support."""

import os
from pathlib import Path

# Ray reads RAY_AUTH_MODE once per process, when its C++ core loads: set it before anything imports Ray.
# "token" is what Ray 2.60 picks anyway for a local ray.init(), and what the fixture cluster needs from a
# driver in this process.
os.environ["RAY_AUTH_MODE"] = "token"
# torch's OpenMP threads (libgomp) spin between parallel regions by default; on 2 cores shared by two pytest
# workers and their Ray clusters a spinning thread takes the core from the work it waits for. PASSIVE makes an
# idle thread sleep: same threads, same results. Measured (2026-12-07, 2 cores): tests/unit/test_sft_overfit.py
# + test_train_step.py alone 23.5 s either way; two copies at once (as under pytest -n 2) 76.8 s -> 33.0 s each.
# Read when libgomp loads, so set here, before anything imports torch; every process the tests start
# (subprocesses, Ray nodes and their workers) inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from support.cluster import RAY_LOG_MONITOR, RAY_STARTUP_WAIT  # noqa: E402

# and the start-up wait and log monitor of every Ray node the tests start, a local ray.init()'s too (support.cluster)
os.environ.update({k: os.environ.get(k, v) for k, v in {**RAY_STARTUP_WAIT, **RAY_LOG_MONITOR}.items()})

import pytest  # noqa: E402
import ray  # noqa: E402
from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader  # noqa: E402
from support import pip_resolve  # noqa: E402
from support.cluster import CLUSTER_WORKERS, LocalCluster, short_temp_dir  # noqa: E402
from support.s3_server import CREDENTIALS, start_s3_server  # noqa: E402
from support.tier_scheduling import TierScheduling  # noqa: E402

from raychat.tokenizer import Tokenizer  # noqa: E402

_TEXT = """The quick brown fox jumps over the lazy dog. Hello there! How are you doing today?
I am fine, thank you. What is 12 * 34? It is 408. Spell the word "apple": a-p-p-l-e.
def f(x):
    return x + 1
Ça va? Très bien. Multiple Choice question: which planet is red? - Mars=A - Venus=B
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
"""


@pytest.fixture(scope="session")
def small_tokenizer() -> Tokenizer:
    """A byte-level BPE (vocabulary <= 512) trained in ~0.1 s on a few KB of mixed text."""
    return Tokenizer.train([_TEXT] * 20, vocab_size=512)


def pytest_collection_modifyitems(items):
    """Mark each test with its tier's marker (tests/ray and tests/cluster start Ray: `ray`), and run the
    modules that use the fixture cluster last (in their usual order), so the session's cluster starts once,
    late, and is not kept idle on the 2 cores while the other tests run."""
    for it in items:
        if Path(it.path).parent.name in ("ray", "cluster"):
            it.add_marker(pytest.mark.ray)
    uses = {it.module.__name__ for it in items if "multinode_cluster" in it.fixturenames}
    items.sort(key=lambda it: it.module.__name__ in uses)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which would answer for "load"
def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n N` (--dist load, the default): tests/cluster as one unit of work, each tests/ray module
    as one, every other test on its own (tests/support/tier_scheduling.py)."""
    if config.getvalue("dist") == "load":
        return TierScheduling(config, log)
    return None


def pytest_collection_finish(session):
    """Start the pip resolutions the selected tests will wait for (marker pip_resolution), so that they run in
    the background beside the tests before them (tests/support/pip_resolve.py)."""
    # pytest-xdist's workers share their basetemp's parent (this run's temp dir): one resolution serves them all
    shared = Path(session.config.option.basetemp).parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    for it in session.items:
        for marker in it.iter_markers("pip_resolution"):
            pip_resolve.start(*marker.args, shared_root=shared)


def pytest_sessionfinish(session, exitstatus):
    # an interrupted run ends its resolutions at once; otherwise another xdist worker may still read them
    pip_resolve.stop_all(wait=exitstatus != pytest.ExitCode.INTERRUPTED)


@pytest.fixture(scope="session")
def multinode_cluster():
    """A real 3-node Ray cluster (tests/support/cluster.py): head + workers "a" and "b" (CLUSTER_WORKERS), token auth
    on, started once per session on first use and stopped at the end, also after a failure. The nodes hold
    S3 credentials (what an instance role gives a real node); the endpoint travels with the filesystem."""
    cluster = LocalCluster(short_temp_dir("rc"), extra_env=dict(CREDENTIALS))
    try:
        yield cluster.start(CLUSTER_WORKERS)
    finally:
        cluster.stop()


def _set_env(values: dict) -> dict:
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    AuthenticationTokenLoader.instance().reset_cache()  # Ray caches the token it read last
    return old


@pytest.fixture(scope="module")
def multinode_driver(multinode_cluster):
    """This pytest process as a Ray driver of multinode_cluster (connected to the head node) for one module."""
    old = _set_env({"RAY_AUTH_TOKEN": multinode_cluster.token, "RAY_ADDRESS": None})
    try:
        ray.init(address=multinode_cluster.gcs_address, log_to_driver=False)
        yield multinode_cluster
    finally:
        ray.shutdown()
        _set_env(old)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on a free loopback port for the session (tests/support/s3_server.py)."""
    server = start_s3_server(Path(tmp_path_factory.mktemp("s3")) / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables of s3_server set in this process for one test; yields the server."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(scope="session")
def tool_checkpoint(tmp_path_factory):
    """A checkpoint of tests/support/tool_model.py's tiny GPT, which calls the calculator (trained once a session)."""
    from support.tool_model import write_tool_checkpoint

    return write_tool_checkpoint(tmp_path_factory.mktemp("tool-model"))

"""serve/chat.yaml's autoscaling lives in Serve's `deployments:` section, so a new max_replicas deployed from
the config updates the running app in place: the same replica process (and its engine process) serves on. A
changed build_app arg, by contrast, is part of the app's code version and restarts the replica: the control
that shows the pids can change. The file has no API key: deployed so it is refused in Serve's build task
(DEPLOY_FAILED, the one-line reason last), and RAYCHAT_API_KEY in the app's runtime env is read there."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml
from support.cluster import init_local_ray
from support.serve_helpers import write_tiny_checkpoint

from raychat.serve.app import NO_KEY

pytestmark = pytest.mark.slow  # about 60 s: Ray, Serve, four deploys of the tiny model's app (one refused)

CHAT_YAML = Path(__file__).resolve().parents[2] / "serve" / "chat.yaml"
APP = "raychat"
KEY = {"RAYCHAT_API_KEY": "k-config-update"}


def _config(checkpoint: Path, max_replicas: int, max_slots: int | None = None, env: dict | None = KEY):
    """serve/chat.yaml's raychat application, sized for 2 CPUs, as Serve's schema (no HTTP options: Serve is
    already started), with its checkpoint replaced, ChatServer's max_replicas (and optionally args.max_slots)
    set and `env` in its runtime env (the API key, as every node of the RayService has it)."""
    from ray.serve.schema import ServeDeploySchema

    (app,) = copy.deepcopy(yaml.safe_load(CHAT_YAML.read_text())["applications"])
    app["args"] |= {"checkpoint": str(checkpoint), "torch_threads": 1}
    if env:
        app["runtime_env"] = {"env_vars": env}
    if max_slots is not None:
        app["args"]["max_slots"] = max_slots
    (server,) = [d for d in app["deployments"] if d["name"] == "ChatServer"]
    server["ray_actor_options"]["num_cpus"] = 0.5
    server["autoscaling_config"] |= {"min_replicas": 1, "max_replicas": max_replicas}
    return ServeDeploySchema.model_validate({"applications": [app]})


def _replica() -> dict:
    """pid and child_pids (the engine process) of the ChatServer replica that answers."""
    from ray import serve

    stats = serve.get_deployment_handle("ChatServer", app_name=APP).stats.remote().result(timeout_s=30)
    return {"pid": stats["pid"], "child_pids": stats["child_pids"]}


def _deployed(client) -> dict:
    """ChatServer's deployment config as the Serve controller holds it, and the app's status."""
    app = client.get_serve_details()["applications"].get(APP, {})
    server = app.get("deployments", {}).get("ChatServer", {})
    return {"status": app.get("status"), "config": server.get("deployment_config", {})}


def _wait(predicate, what: str, timeout_s: float = 180):
    """predicate's first truthy value within timeout_s. A handle call that timed out counts as not yet: while
    a replica is replaced, a call can wait out its 30 s before a replica answers (seen on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except TimeoutError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.5)


def test_a_new_max_replicas_updates_in_place_and_a_new_arg_restarts(tmp_path, monkeypatch):
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    if ray.is_initialized():
        pytest.skip("needs to start its own local cluster")
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.delenv("RAYCHAT_API_KEY", raising=False)  # the local cluster's nodes inherit this environment
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        client = _get_global_client()
        client.deploy_apps(_config(ckpt, max_replicas=2, env=None))  # no key anywhere: refused
        with pytest.raises(RuntimeError) as failed:
            client._wait_for_application_running(APP, timeout_s=120)
        assert str(failed.value).rstrip().endswith(f"raychat.config.schema.ConfigError: {NO_KEY}")
        assert _deployed(client)["status"] == "DEPLOY_FAILED"

        client.deploy_apps(_config(ckpt, max_replicas=2))  # the key in the app's runtime env
        client._wait_for_application_running(APP, timeout_s=180)
        before = _replica()
        assert _deployed(client)["config"]["autoscaling_config"]["max_replicas"] == 2
        assert len(before["child_pids"]) == 1  # the engine process (engine_process: true by default)

        client.deploy_apps(_config(ckpt, max_replicas=3))  # what `serve deploy` of the edited file does
        _wait(
            lambda: _deployed(client)["config"]["autoscaling_config"]["max_replicas"] == 3, "max_replicas 3"
        )
        _wait(lambda: _deployed(client)["status"] == "RUNNING", "app RUNNING after the update")
        assert _replica() == before, "a new max_replicas restarted the replica"

        client.deploy_apps(_config(ckpt, max_replicas=3, max_slots=4))  # an arg: a new code version
        after = _wait(
            lambda: (r := _replica()) != before and r, "a replica restarted for a new args.max_slots"
        )
        assert after["pid"] != before["pid"] and after["child_pids"] != before["child_pids"]
    finally:
        serve.shutdown()
        ray.shutdown()

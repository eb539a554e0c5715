"""build_app's arguments and the shipped Serve config (serve/chat.yaml), without starting Ray."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from ray.serve.schema import ServeDeploySchema

import raychat.serve.app as serve_app
from raychat.config.serve import ReplicaSection
from raychat.serve.deployments import SERVE_OWNED, deployment_options, read_serve_app

CHAT_YAML = Path(__file__).resolve().parents[2] / "serve" / "chat.yaml"


def test_parse_args_converts_strings_and_rejects_unknown(monkeypatch):
    monkeypatch.delenv("RAYCHAT_API_KEY", raising=False)
    a = serve_app.serve_config({"checkpoint": "/x", "max_slots": "4", "num_cpus": "0.5", "max_len": "none"})
    assert (a.replica.max_slots, a.replica.num_cpus, a.replica.max_len, a.api_key) == (4, 0.5, None, None)
    assert serve_app.serve_config({"checkpoint": "/x", "max_rows": "3"}).replica.max_slots == 3  # old name
    with pytest.raises(ValueError, match="unknown build_app args \\['rows'\\]"):
        serve_app.serve_config({"checkpoint": "/x", "rows": 2})
    with pytest.raises(ValueError, match="max_slots must be an integer"):
        serve_app.serve_config({"checkpoint": "/x", "max_slots": "many"})
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        serve_app.serve_config({"checkpoint": "/x", "stream_interval": "0"})
    assert (
        serve_app.serve_config({"checkpoint": "/x"}).replica.stream_interval
        == ReplicaSection().stream_interval
    )
    with pytest.raises(ValueError, match="checkpoint"):
        serve_app.serve_config({})
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        serve_app.serve_config({"checkpoint": "/x", "min_replicas": 3, "max_replicas": 2})
    monkeypatch.setenv("RAYCHAT_API_KEY", "k")
    assert serve_app.serve_config({"checkpoint": "/x"}).api_key == "k"


def test_build_app_needs_a_checkpoint(tmp_path):
    with pytest.raises(
        ValueError, match=rf"^checkpoint: {tmp_path} has no committed checkpoint \({tmp_path} is empty\)$"
    ):
        serve_app.build_app({"checkpoint": str(tmp_path), "allow_unauthenticated": True})


def test_chat_yaml_is_valid_and_matches_build_app():
    config = yaml.safe_load(CHAT_YAML.read_text())
    schema = ServeDeploySchema(**config)
    app = schema.applications[0]
    assert app.import_path == "raychat.serve.app:build_app"
    raw = config["applications"][0]
    c = read_serve_app(raw)  # every arg is one build_app accepts, every deployments: option one it maps
    assert not SERVE_OWNED & set(raw["args"]), "an option Serve owns is in args (a change restarts replicas)"
    defaults = serve_app.serve_config({"checkpoint": app.args["checkpoint"]})
    same = [k for k, v in raw["args"].items() if k != "checkpoint" and _arg(defaults, k) == v]
    assert not same, f"chat.yaml restates ServeConfig defaults: {same}"  # a default is stated once
    # what the file sets in deployments: is what build_app would set for the same config
    ours = deployment_options(c)
    for entry in raw["deployments"]:
        options = ours[entry["name"]]
        for key, value in entry.items():
            if key == "autoscaling_config":
                assert value == {k: v for k, v in options[key].items() if k != "initial_replicas"}
            elif key != "name":
                assert (
                    value == {k: options[key][k] for k in value}
                    if isinstance(value, dict)
                    else value == options[key]
                )
    auto = c.autoscaling
    assert 1 <= auto.min_replicas < auto.max_replicas
    assert auto.look_back_period_s > 10  # Ray requires look_back_period_s > its metrics interval (10 s)
    assert c.replica.max_ongoing_requests >= auto.target_ongoing_requests
    assert c.replica.num_cpus > 0


def test_read_serve_app_maps_deployments_and_refuses_partial_or_doubled_options():
    auto = {"min_replicas": 0, "max_replicas": 3, "target_ongoing_requests": 2, "upscale_delay_s": 1,
            "downscale_delay_s": 5, "look_back_period_s": 11, "initial_replicas": 1}  # fmt: skip
    app = {
        "args": {"checkpoint": "/c", "max_slots": 4},
        "deployments": [
            {"name": "ChatServer", "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1},
             "autoscaling_config": auto, "max_ongoing_requests": 6, "max_replicas_per_node": 1},
            {"name": "ChatIngress", "ray_actor_options": {"num_cpus": 0.2}, "max_queued_requests": 9},
        ],
    }  # fmt: skip
    c = read_serve_app(app)
    assert (c.replica.max_slots, c.replica.num_cpus, c.replica.num_gpus, c.replica.max_ongoing_requests) == (
        4,
        0.5,
        1,
        6,
    )
    assert (c.autoscaling.min_replicas, c.autoscaling.max_replicas, c.autoscaling.look_back_period_s) == (
        0,
        3,
        11,
    )
    assert (c.replica.max_replicas_per_node, c.ingress_num_cpus, c.ingress_max_queued_requests) == (1, 0.2, 9)
    # and back: build_app's options of that config are the file's (initial_replicas = max(1, min_replicas))
    server = deployment_options(c)["ChatServer"]
    assert server["autoscaling_config"] == auto and server["ray_actor_options"] == {
        "num_cpus": 0.5,
        "num_gpus": 1,
    }
    partial = {"name": "ChatServer", "autoscaling_config": {"max_replicas": 3}}
    with pytest.raises(
        ValueError, match=r"deployments\[ChatServer\].autoscaling_config: Serve replaces it whole"
    ):
        read_serve_app({"args": {"checkpoint": "/c"}, "deployments": [partial]})
    with pytest.raises(
        ValueError, match=r"deployments\[ChatServer\].ray_actor_options: .*missing \['num_cpus'\]"
    ):
        read_serve_app({"deployments": [{"name": "ChatServer", "ray_actor_options": {"num_gpus": 1}}]})
    with pytest.raises(ValueError, match=r"\['max_ongoing_requests'\] set both in args and in deployments"):
        read_serve_app(
            {
                "args": {"max_ongoing_requests": 2},
                "deployments": [{"name": "ChatServer", "max_ongoing_requests": 3}],
            }
        )
    with pytest.raises(ValueError, match=r"deployments: no deployment 'Other'"):
        read_serve_app({"deployments": [{"name": "Other"}]})
    with pytest.raises(
        ValueError, match=r"deployments\[ChatIngress\]: options \['user_config'\] are not raychat's"
    ):
        read_serve_app({"deployments": [{"name": "ChatIngress", "user_config": {}}]})


def _arg(config, name: str):
    """The value of build_app arg `name` (a field of one of ServeConfig's sections) in `config`."""
    sections = [config, *(getattr(config, f.name) for f in dataclasses.fields(config))]
    return next(getattr(s, name) for s in sections if dataclasses.is_dataclass(s) and hasattr(s, name))


def test_num_gpus_reaches_the_replica_options_and_its_device(tmp_path, monkeypatch):
    """`raychat serve --num-gpus N` -> build_app(num_gpus=N) -> the ChatServer deployment reserves N GPUs
    (ray_actor_options) and loads its model on "cuda"; 0 keeps it on the CPU."""
    from support.serve_helpers import write_tiny_checkpoint

    import raychat.serve.cli as serve_cli
    from raychat.cli import build_parser

    ckpt = write_tiny_checkpoint(tmp_path)
    seen = {}
    monkeypatch.setattr(
        serve_cli, "start", lambda config, **kw: seen.update(num_gpus=config.replica.num_gpus) or "http://x/"
    )
    args = build_parser("serve").parse_args(["serve", "--checkpoint", str(ckpt), "--num-gpus", "1", "--address", "ray://x", "--no-block"])  # fmt: skip
    assert serve_cli.main(args) == 0 and seen["num_gpus"] == 1.0
    for gpus, device in ((seen["num_gpus"], "cuda"), (0.0, "cpu"), (0.5, "cuda")):
        app = serve_app.build_app({"checkpoint": str(ckpt), "num_gpus": gpus, "allow_unauthenticated": True})
        engine = app._bound_deployment.init_args[0]._bound_deployment
        assert engine.name == serve_app.SERVER_DEPLOYMENT
        # the replica picks its device from the GPUs Ray assigned it (ray_actor_options)
        assert engine.ray_actor_options["num_gpus"] == gpus and serve_app.device_for(gpus) == device
    with pytest.raises(ValueError, match="num_gpus must be >= 0, got -1"):
        serve_app.serve_config({"checkpoint": "/x", "num_gpus": "-1"})


@pytest.mark.ray
def test_serve_refuses_gpus_this_machine_does_not_have(tmp_path, capsys, monkeypatch):
    import ray
    from support.serve_helpers import write_tiny_checkpoint

    from raychat.cli import main
    from raychat.ports import free_ports

    if ray.is_initialized() or torch.cuda.is_available():
        pytest.skip("needs to start its own local cluster, on a machine without a GPU")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ckpt = write_tiny_checkpoint(tmp_path)
    # a free --port: a busy one (8000, another server's) is refused first, before Ray starts
    assert main(["serve", "--checkpoint", str(ckpt), "--num-gpus", "1", "--port", str(free_ports(1)[0])]) == 2
    err = capsys.readouterr().err
    assert "1 engine replica x --num-gpus 1 = 1 GPU, but this machine's Ray cluster has 0" in err
    assert not ray.is_initialized()

"""build_app's arguments and the shipped Serve config (serve/chat.yaml), without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

import raychat.serve.app as serve_app
from raychat.config.serve import ReplicaSection

CHAT_YAML = Path(__file__).resolve().parents[1] / "serve" / "chat.yaml"


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
        ValueError, match=rf"^checkpoint: {tmp_path} has no complete checkpoint \({tmp_path} is empty\)$"
    ):
        serve_app.build_app({"checkpoint": str(tmp_path)})


def test_chat_yaml_is_valid_and_matches_build_app():
    config = yaml.safe_load(CHAT_YAML.read_text())
    schema = ServeDeploySchema(**config)
    app = schema.applications[0]
    assert app.import_path == "raychat.serve.app:build_app"
    c = serve_app.serve_config(app.args)  # every arg is one build_app accepts
    assert app.deployments == []  # every value is a build_app arg: one place each
    auto = c.autoscaling
    assert 1 <= auto.min_replicas < auto.max_replicas
    assert auto.look_back_period_s > 10  # Ray requires look_back_period_s > its metrics interval (10 s)
    assert c.replica.max_ongoing_requests >= auto.target_ongoing_requests
    assert c.replica.num_cpus > 0

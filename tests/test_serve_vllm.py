"""The vLLM Serve config builder. vLLM is never imported (it is a CUDA-only optional extra); where ray's
LLMConfig model imports without vLLM, the built dict is validated against it."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from raychat.serve import vllm as rv


@pytest.fixture
def hf_dir(tmp_path):
    for name in rv.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    return tmp_path


def test_llm_config_fields(hf_dir):
    cfg = rv.llm_config(hf_dir, model_id="chat-d20", accelerator_type="A100", min_replicas=0, max_replicas=3,
                        tensor_parallel_size=2)  # fmt: skip
    assert cfg["model_loading_config"] == {"model_id": "chat-d20", "model_source": str(hf_dir.resolve())}
    assert cfg["accelerator_type"] == "A100"
    auto = cfg["deployment_config"]["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (0, 1, 3)
    assert cfg["engine_kwargs"] == {"dtype": "bfloat16", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "max_model_len": 2048}  # fmt: skip


def test_llm_config_validates_against_ray_without_vllm(hf_dir):
    llm_config_mod = pytest.importorskip(
        "ray.llm._internal.serve.core.configs.llm_config", reason="ray[llm] config models"
    )
    validated = llm_config_mod.LLMConfig(**rv.llm_config(hf_dir))
    assert validated.model_loading_config.model_id == "raychat"
    assert validated.accelerator_type == "H100"
    assert validated.deployment_config["autoscaling_config"]["max_replicas"] == 2
    assert "vllm" not in sys.modules


def test_serve_config_is_a_valid_serve_file(hf_dir, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "vllm.yaml"
    assert rv.main(["--hf-dir", str(hf_dir), "--out", str(out), "--max-replicas", "4", "--port", "8100"]) == 0
    config = yaml.safe_load(out.read_text())
    schema = ServeDeploySchema(**config)
    app = schema.applications[0]
    assert app.import_path == "ray.serve.llm:build_openai_app" and app.route_prefix == "/"
    assert config["http_options"]["port"] == 8100
    assert app.args["llm_configs"][0]["deployment_config"]["autoscaling_config"]["max_replicas"] == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [({"min_replicas": 3, "max_replicas": 2}, "min_replicas"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
     ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")],
)  # fmt: skip
def test_bad_values(hf_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rv.llm_config(hf_dir, **kwargs)


def test_missing_export_names_the_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="raychat export"):
        rv.llm_config(tmp_path)

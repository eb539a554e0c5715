"""Serve an exported Hugging Face directory (`raychat export`) with vLLM through Ray Serve LLM, on GPUs.

UNTESTED WITHOUT A GPU: the tests build and validate the config (through the public `ray.serve.llm.LLMConfig`
where it imports: it needs vLLM; else through the same pydantic model inside ray.llm, which imports without
it) but never run vLLM. vLLM is the optional extra `raychat[vllm]` = `ray[llm]` of the pinned Ray (vllm
0.29.0, CUDA wheels only), with its own lock: `pip install -c constraints-vllm.txt -e ".[vllm]"`.

  python -m raychat.serve.vllm --hf-dir /mnt/raychat/hf --out vllm.yaml --accelerator-type H100
  serve run vllm.yaml          # OpenAI-compatible /v1/chat/completions, /v1/models on port 8000
  raychat serve --backend vllm --hf-dir /mnt/raychat/hf --num-gpus 1   # the same app, deployed from Python

The config is Serve's config-file format (ServeDeploySchema) with one application whose import path is
`ray.serve.llm:build_openai_app` and whose args hold one LLMConfig (Ray docs, "Serving LLMs"):
  model_loading_config   {model_id, model_source: the exported directory, readable on every GPU node}
  accelerator_type       e.g. "H100", "A100", "L4" (Ray's accelerator resource names)
  deployment_config      {autoscaling_config: min/max replicas, target_ongoing_requests, delays,
                          max_ongoing_requests}
  engine_kwargs          vLLM engine arguments: max_model_len (config.json max_position_embeddings),
                          dtype, tensor_parallel_size, gpu_memory_utilization
The chat template is the Jinja template in the directory's tokenizer_config.json, and generation stops at
the generation_config.json eos ids (<|assistant_end|>, <|bos|>), which vLLM reads by default.

Differences from `raychat serve` (raychat.serve.app), by design of this path:
  - Marker text inside content (e.g. a user typing "<|assistant_end|>") is plain text here too: the exported
    template escapes it and the exported tokenizer's normalizer restores it after special tokens are
    matched (raychat.export.hf.MARKER_ESCAPE), so vLLM sees raychat's token ids (tested with transformers'
    apply_chat_template on the exported tokenizer: tests/unit/test_serve_vllm.py).
  - The calculator is NOT available: vLLM does not run raychat's engine, so nothing executes a
    <|python_start|> ... <|python_end|> call or injects its result; a model trained to call the calculator
    gets no result and continues on its own, and vLLM returns the call as plain text in `content` (its
    tokens are specials, which vLLM drops with skip_special_tokens, leaving the bare expression). Serve
    such models with `raychat serve`, which runs the calculator and returns structured tool calls
    (docs/openai.md); OpenAI tool_calls sent back in a history are not rendered by the exported template.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import yaml

try:  # the public name: it imports only where vLLM (or SGLang) is installed
    from ray.serve.llm import LLMConfig, build_openai_app

    LLM_CONFIG_SOURCE = "ray.serve.llm"
except ImportError:  # "Neither vLLM nor SGLang is installed": the same pydantic class, which imports without
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    build_openai_app = None
    LLM_CONFIG_SOURCE = "ray.llm._internal.serve.core.configs.llm_config"

from raychat.atomic import atomic_write_text
from raychat.config import VLLMConfig, add_flags, from_args, from_dict, to_flat

IMPORT_PATH = "ray.serve.llm:build_openai_app"
APP_NAME = "raychat-vllm"  # the Serve application's name: serve_config's and `raychat serve --backend vllm`'s
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
INSTALL_HINT = 'pip install -c constraints-vllm.txt -e ".[vllm]" on a CUDA machine (docs/deployment.md)'


def vllm_installed() -> bool:
    """Whether the `vllm` package is importable here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(flag: str = "--backend vllm") -> None:
    """Raises ValueError, one line naming `flag` and what is missing, when vLLM is not installed."""
    if not vllm_installed():
        raise ValueError(
            f"{flag} needs vLLM, which this Python ({sys.executable}) does not have: {INSTALL_HINT}"
        )


def llm_config_model() -> tuple[type, str]:
    """(the LLMConfig pydantic class, where it came from): the public `ray.serve.llm.LLMConfig` when vLLM is
    installed, else the same class from ray's internal module (the public import raises without vLLM)."""
    return LLMConfig, LLM_CONFIG_SOURCE


def validate(config: dict):
    """`config` (an llm_config() dict) as a validated LLMConfig object (llm_config_model()).

    Raises ValueError (pydantic's ValidationError) naming the field Ray rejects."""
    model, _ = llm_config_model()
    return model(**config)


def llm_config(hf_dir: str | os.PathLike, check_files: bool = True, **options) -> dict:
    """One LLMConfig as a plain dict (the `llm_configs` item of build_openai_app's args); `options` are
    raychat.config.VLLMConfig fields (model_id, accelerator_type, min_replicas, max_replicas, ...).

    Raises:
        FileNotFoundError: check_files and the directory lacks one of REQUIRED_FILES.
        ValueError: an unknown option, replicas outside 0 <= min <= max (max >= 1), tensor_parallel_size < 1,
            or gpu_memory_utilization outside (0, 1].
    """
    c = from_dict(VLLMConfig, {**options, "hf_dir": str(hf_dir)}, where="llm_config options")
    hf_dir = Path(hf_dir).resolve()
    max_model_len = None
    if check_files:
        missing = [f for f in REQUIRED_FILES if not (hf_dir / f).exists()]
        if missing:
            raise FileNotFoundError(
                f"{hf_dir} lacks {missing}: create it with `raychat export --checkpoint DIR --out {hf_dir}`"
            )
        max_model_len = json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"]
    engine_kwargs = {
        "dtype": c.dtype,
        "tensor_parallel_size": c.tensor_parallel_size,
        "gpu_memory_utilization": c.gpu_memory_utilization,
    }
    if max_model_len is not None:
        engine_kwargs["max_model_len"] = max_model_len
    config = {
        "model_loading_config": {"model_id": c.model_id, "model_source": str(hf_dir)},
        "accelerator_type": c.accelerator_type,
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": c.min_replicas,
                "initial_replicas": max(1, c.min_replicas),
                "max_replicas": c.max_replicas,
                "target_ongoing_requests": c.target_ongoing_requests,
                "upscale_delay_s": 30,
                "downscale_delay_s": 300,
            },
            "max_ongoing_requests": c.max_ongoing_requests,
        },
        "engine_kwargs": engine_kwargs,
    }
    if not c.accelerator_type:  # any GPU the cluster has
        del config["accelerator_type"]
    return config


def serve_config(hf_dir: str | os.PathLike, port: int = 8000, app_name: str = APP_NAME, **kwargs) -> dict:
    """The whole Serve config file (dict) for `serve run` / `serve deploy` / a KubeRay RayService; its LLMConfig
    is validated by Ray's model first (validate()), so a field Ray rejects fails here, not at deploy time."""
    config = llm_config(hf_dir, **kwargs)
    validate(config)
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": port},
        "applications": [
            {
                "name": app_name,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {"llm_configs": [config]},
            }
        ],
    }


def application(config: dict):
    """The Ray Serve application of one LLMConfig (an llm_config() dict), built with the public Ray Serve LLM API
    (`LLMConfig`, `build_openai_app`); `raychat serve --backend vllm` deploys it as the raychat backend deploys
    its own (raychat.serve.cli.run_app). Raises ValueError (require_vllm) when vLLM is not installed."""
    require_vllm()
    return build_openai_app({"llm_configs": [LLMConfig(**config)]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raychat.serve.vllm", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    add_flags(p, VLLMConfig)
    c = from_args(p.parse_args(argv), VLLMConfig, "vllm")
    if not c.hf_dir:
        p.error("--hf-dir is required")
    if "://" in c.out:  # Path() would make s3://b/x.yaml the local ./s3:/b/x.yaml
        p.error(f"--out: {c.out!r} is a URI; give a local file path for the Serve config (e.g. vllm.yaml)")
    options = {k: v for k, v in to_flat(c).items() if k not in ("hf_dir", "out", "port")}
    try:
        config = serve_config(c.hf_dir, port=c.port, **options)
    except (FileNotFoundError, ValueError) as e:  # a missing export, a value Ray's LLMConfig refuses
        p.error(str(e))
    out = Path(c.out)
    atomic_write_text(out, yaml.safe_dump(config, sort_keys=False))
    print(f"wrote {out}; on a GPU cluster with the vLLM environment ({INSTALL_HINT}): serve run {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serve an exported Hugging Face directory (`raychat export`) with vLLM through Ray Serve LLM, on GPUs.

UNTESTED WITHOUT A GPU: this module only builds the Serve config; the tests check the config's structure
(and validate it against ray's LLMConfig model where that imports without vLLM). vLLM itself is the
optional extra `raychat[vllm]` (CUDA wheels only) and was never run on the CPU machines this was written on.

  python -m raychat.serve.vllm --hf-dir /mnt/raychat/hf --out vllm.yaml --accelerator-type H100
  serve run vllm.yaml          # OpenAI-compatible /v1/chat/completions, /v1/models on port 8000

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
    apply_chat_template on the exported tokenizer: tests/test_serve_vllm.py).
  - The calculator is NOT available: vLLM does not run raychat's engine, so nothing executes a
    <|python_start|> ... <|python_end|> call or injects its result; a model trained to call the calculator
    gets no result and continues on its own, and vLLM returns the call as plain text in `content` (its
    tokens are specials, which vLLM drops with skip_special_tokens, leaving the bare expression). Serve
    such models with `raychat serve`, which runs the calculator and returns structured tool calls
    (docs/openai.md); OpenAI tool_calls sent back in a history are not rendered by the exported template.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

IMPORT_PATH = "ray.serve.llm:build_openai_app"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def llm_config(
    hf_dir: str | os.PathLike,
    model_id: str = "raychat",
    accelerator_type: str = "H100",
    min_replicas: int = 1,
    max_replicas: int = 2,
    target_ongoing_requests: int = 32,
    max_ongoing_requests: int = 64,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.9,
    check_files: bool = True,
) -> dict:
    """One LLMConfig as a plain dict (the `llm_configs` item of build_openai_app's args).

    Raises:
        FileNotFoundError: check_files and the directory lacks one of REQUIRED_FILES.
        ValueError: replicas outside 0 <= min <= max (max >= 1), tensor_parallel_size < 1, or
            gpu_memory_utilization outside (0, 1].
    """
    hf_dir = Path(hf_dir).resolve()
    if not (0 <= min_replicas <= max_replicas and max_replicas >= 1):
        raise ValueError(
            f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got {min_replicas}, {max_replicas}"
        )
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    max_model_len = None
    if check_files:
        missing = [f for f in REQUIRED_FILES if not (hf_dir / f).exists()]
        if missing:
            raise FileNotFoundError(
                f"{hf_dir} lacks {missing}: create it with `raychat export --checkpoint DIR --out {hf_dir}`"
            )
        max_model_len = json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"]
    engine_kwargs = {
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    if max_model_len is not None:
        engine_kwargs["max_model_len"] = max_model_len
    return {
        "model_loading_config": {"model_id": model_id, "model_source": str(hf_dir)},
        "accelerator_type": accelerator_type,
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": min_replicas,
                "initial_replicas": max(1, min_replicas),
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
                "upscale_delay_s": 30,
                "downscale_delay_s": 300,
            },
            "max_ongoing_requests": max_ongoing_requests,
        },
        "engine_kwargs": engine_kwargs,
    }


def serve_config(
    hf_dir: str | os.PathLike, port: int = 8000, app_name: str = "raychat-vllm", **kwargs
) -> dict:
    """The whole Serve config file (dict) for `serve run` / `serve deploy` / a KubeRay RayService."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": port},
        "applications": [
            {
                "name": app_name,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {"llm_configs": [llm_config(hf_dir, **kwargs)]},
            }
        ],
    }


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(prog="python -m raychat.serve.vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="directory written by `raychat export`")
    p.add_argument("--out", required=True, help="YAML file to write")
    p.add_argument("--model-id", default="raychat")
    p.add_argument("--accelerator-type", default="H100")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args(argv)
    config = serve_config(
        a.hf_dir,
        port=a.port,
        model_id=a.model_id,
        accelerator_type=a.accelerator_type,
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        tensor_parallel_size=a.tensor_parallel_size,
    )
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, out)
    print(f"wrote {out}; on a GPU cluster with `pip install 'raychat[vllm]'`: serve run {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

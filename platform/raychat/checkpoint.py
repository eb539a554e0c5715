"""Checkpoint directory layout, written through `ray.train.report(checkpoint=...)` and read anywhere.

  model.safetensors      weights (rank 0), parameter names as Qwen3ForCausalLM
  meta.json              {"model_config", "tokenizer_version", "stage", "step", "metrics", "config", ...}
                         (raychat.train.checkpointer writes it; checkpoints written before had "kind")
  tokenizer.json         the tokenizer the model was trained with
  optim_rank{r}.pt       optimizer state of rank r
  state_rank{r}.json     data position and packer buffer of rank r
  rng_rank{r}.pt         torch / python RNG state of rank r

Every file is written to a temporary name and renamed, so a crash never leaves a half-written file.
read_meta and load_model also take the s3:// or gs:// URI of a checkpoint dir: it is downloaded to this
node's cache first (raychat.storage.resolve_checkpoint), so every node can load one from object storage.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from raychat.model import GPT, ModelConfig
from raychat.storage import is_remote, resolve_checkpoint
from raychat.tokenizer import Tokenizer


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_model(directory: str | os.PathLike, model: GPT, tokenizer: Tokenizer, meta: dict) -> None:
    """Write model.safetensors, tokenizer.json and meta.json (model_config and tokenizer_version added)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic(d / "model.safetensors", lambda p: save_file(state, str(p)))
    tokenizer.save(d)
    meta = {**meta, "model_config": model.config.to_dict(), "tokenizer_version": tokenizer.version}
    _atomic(d / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2, default=str)))


def save_rank_state(directory: str | os.PathLike, rank: int, optimizers: list, data_state: dict) -> None:
    """Write this rank's optimizer states, data position and RNG state."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _atomic(d / f"optim_rank{rank}.pt", lambda p: torch.save([o.state_dict() for o in optimizers], p))
    _atomic(d / f"state_rank{rank}.json", lambda p: p.write_text(json.dumps(data_state)))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    _atomic(d / f"rng_rank{rank}.pt", lambda p: torch.save(rng, p))


def load_rank_state(directory: str | os.PathLike, rank: int, optimizers: list) -> dict:
    """Restore optimizers and RNG of `rank` in place; returns the data state dict.

    Raises:
        FileNotFoundError: the checkpoint has no state for this rank (e.g. the world size changed).
    """
    d = Path(directory)
    path = d / f"optim_rank{rank}.pt"
    if not path.exists():
        raise FileNotFoundError(
            f"{d} has no optimizer state for rank {rank}; resume with the same num_workers"
        )
    for opt, state in zip(optimizers, torch.load(path, weights_only=False), strict=True):
        opt.load_state_dict(state)
    rng = torch.load(d / f"rng_rank{rank}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return json.loads((d / f"state_rank{rank}.json").read_text())


def read_meta(directory: str | os.PathLike) -> dict:
    """meta.json of a checkpoint (a local dir or a remote URI); an older checkpoint's "kind" is read as "stage".

    Raises:
        FileNotFoundError: no meta.json there. ValueError: a remote URI that names no complete checkpoint.
    """
    path = Path(_local(directory)) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a raychat checkpoint (no meta.json)")
    meta = json.loads(path.read_text())
    if "kind" in meta and "stage" not in meta:
        meta["stage"] = meta.pop("kind")
    return meta


def load_model(
    directory: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[GPT, Tokenizer, dict]:
    """Load (model in eval mode, tokenizer, meta) from a checkpoint directory (local, or a remote URI).

    Raises:
        FileNotFoundError: missing meta.json / model.safetensors / tokenizer.json.
        ValueError: the tokenizer's version differs from the one the model was trained with; a remote URI
            that names no complete checkpoint.
    """
    d = Path(_local(directory))
    meta = read_meta(d)
    tokenizer = Tokenizer.load(d)
    if meta.get("tokenizer_version") not in (None, tokenizer.version):
        raise ValueError(f"{d}: tokenizer version {tokenizer.version} != trained {meta['tokenizer_version']}")
    model = GPT(ModelConfig(**meta["model_config"]))
    model.load_state_dict(load_file(str(d / "model.safetensors"), device=str(device)))
    return model.to(device).eval(), tokenizer, meta


def _local(directory: str | os.PathLike) -> str | os.PathLike:
    return resolve_checkpoint(directory) if is_remote(directory) else directory

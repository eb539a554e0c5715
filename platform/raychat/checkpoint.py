"""Checkpoint directory layout, written through `ray.train.report(checkpoint=...)` and read anywhere.

  model.safetensors      weights (rank 0), parameter names as Qwen3ForCausalLM
  meta.json              {"model_config", "tokenizer_version", "stage", "step", "world_size", "metrics",
                         "config", ...} (raychat.train.checkpointer writes it); an RL checkpoint, whose config
                         has no model.document_masking, also "document_masking": its --init-from's
                         (document_masking reads either)
  tokenizer.json         the tokenizer the model was trained with
  optim.pt               optimizer state, ONE copy (rank 0): data-parallel ranks hold identical optimizer
                         state (gradients are all-reduced before the step; raychat's Muon keeps its momentum
                         replicated), so every rank restores from this file
  state_rank{r}.npz      the data state of rank r (row-source position and buffers; RL: the policy version)
                         in save_tree's format: JSON structure + binary arrays, never token lists as JSON
  rng_rank{r}.pt         torch / python RNG state of rank r
  commit.json            the commit marker, written last (raychat.checkpoint_manager): every file's size and
                         sha256; a directory without it is not a checkpoint

Every file is written to a unique temporary name, fsynced and renamed, so a crash never leaves a half-written
file; optimizer and RNG state load with torch.load(weights_only=True), so a checkpoint from a shared volume
or bucket never runs code. load_model checks first (check_model, which reads no tensor) every file's size
against the commit marker, meta.json and the header of model.safetensors: a damaged file is a one-line
CheckpointError naming the checkpoint and the file. load_model also takes the s3:// or gs:// URI of a
checkpoint dir: it is downloaded to this node's cache first (raychat.checkpoint_manager.resolve_checkpoint), so
every node can load one from object storage. read_meta, read_tokenizer and check_model read such a URI's small
files where they are (meta.json, tokenizer.json, commit.json and a listing of sizes), never its weights: the
checks a driver makes before Ray starts are the same for a local and a remote checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from raychat.atomic import atomic_write
from raychat.checkpoint_manager import (
    CheckpointError,
    commit_directory,
    find_checkpoint,
    resolve_checkpoint,
    verify,
    verify_stored,
)
from raychat.model import GPT, ModelConfig
from raychat.storage import is_remote, open_storage, read_bytes
from raychat.tokenizer import Tokenizer

OPTIMIZER_FILE = "optim.pt"
MODEL_FILES = ("meta.json", "tokenizer.json", "model.safetensors")  # what load_model reads
# int lists at least this long are stored as arrays (shorter ones stay in the JSON structure)
MIN_ARRAY_LEN = 8


def save_model(
    directory: str | os.PathLike, model: GPT, tokenizer: Tokenizer, meta: dict, commit: bool = False
) -> None:
    """Write model.safetensors, tokenizer.json and meta.json (model_config and tokenizer_version added).

    commit: also write the commit marker (a checkpoint one process writes whole, e.g. in tests); the
    training stages commit through raychat.checkpoint_manager.CheckpointManager once every rank's files
    are in place."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(d / "model.safetensors", lambda p: save_file(state, str(p)))
    tokenizer.save(d)
    meta = {**meta, "model_config": model.config.to_dict(), "tokenizer_version": tokenizer.version}
    atomic_write(d / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2, default=str)))
    if commit:
        commit_directory(d, int(meta.get("step", 0)), str(meta.get("stage", "")))


# ---- compact trees: JSON structure, binary leaves -------------------------------------------------------
def _is_ints(x) -> bool:
    return isinstance(x, list) and len(x) >= MIN_ARRAY_LEN and all(type(v) is int for v in x)


def _is_ragged(x) -> bool:
    return (
        isinstance(x, list)
        and len(x) > 0
        and all(isinstance(v, list) and all(type(i) is int for i in v) for v in x)
        and sum(map(len, x)) >= MIN_ARRAY_LEN
    )


def _int_array(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.int64)
    small = a.size == 0 or (a.min() >= np.iinfo(np.int32).min and a.max() <= np.iinfo(np.int32).max)
    return a.astype(np.int32) if small else a


def _encode(x, arrays: dict):
    """x with every array (and long int list) replaced by a reference into `arrays`."""

    def put(a: np.ndarray) -> str:
        if a.dtype.hasobject:
            raise TypeError(f"save_tree: an object array (dtype {a.dtype}) cannot be stored without pickle")
        key = f"a{len(arrays)}"
        arrays[key] = a
        return key

    if isinstance(x, np.ndarray):
        return {"__array__": put(x)}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {str(k): _encode(v, arrays) for k, v in x.items()}
    if isinstance(x, list | tuple):
        try:
            if _is_ragged(x):
                lengths = np.asarray([len(v) for v in x], dtype=np.int64)
                return {"__ragged__": [put(_int_array([i for v in x for i in v])), put(lengths)]}
            if _is_ints(x):
                return {"__ints__": put(_int_array(x))}
        except OverflowError:  # beyond int64: stays JSON
            pass
        return [_encode(v, arrays) for v in x]
    return x


def _decode(x, arrays):
    if isinstance(x, dict):
        if "__array__" in x:
            return arrays[x["__array__"]]
        if "__ints__" in x:
            return arrays[x["__ints__"]].tolist()
        if "__ragged__" in x:
            flat, lengths = (arrays[k] for k in x["__ragged__"])
            ends = np.cumsum(lengths)
            return [flat[e - n : e].tolist() for e, n in zip(ends, lengths)]
        return {k: _decode(v, arrays) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v, arrays) for v in x]
    return x


def save_tree(path: str | os.PathLike, tree) -> None:
    """Write a tree of dicts (str keys) / lists / scalars / numpy arrays as one .npz file, atomically.

    numpy arrays are stored as they are; int lists of >= MIN_ARRAY_LEN items as int32 (int64 when a value
    needs it) arrays; lists of int lists (token buffers) as one flat array plus lengths; the rest of the
    structure as JSON. load_tree gives back the same tree (int lists as lists, arrays as arrays, tuples as
    lists).

    Raises:
        TypeError: an object array, or a value JSON cannot hold.
    """

    def write(p: Path) -> None:
        arrays: dict[str, np.ndarray] = {}
        structure = json.dumps(_encode(tree, arrays))
        with open(p, "wb") as f:
            np.savez(f, __tree__=np.asarray(structure), **arrays)

    atomic_write(Path(path), write)


def load_tree(path: str | os.PathLike):
    """The tree save_tree wrote (no pickle: only arrays and JSON are read)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "__tree__"}
        return _decode(json.loads(str(z["__tree__"])), arrays)


# ---- optimizer, RNG and data state -----------------------------------------------------------------------
def save_optimizers(directory: str | os.PathLike, optimizers: list) -> None:
    """Write optim.pt: the state dicts of `optimizers` (rank 0 only: the state is replicated)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / OPTIMIZER_FILE, lambda p: torch.save([o.state_dict() for o in optimizers], p))


def load_optimizers(directory: str | os.PathLike, optimizers: list) -> None:
    """Load optim.pt into `optimizers` in place (tensors and plain containers only: weights_only=True): the
    per-parameter state (momentum buffers, Adam moments, step counts). Each param group keeps the
    hyperparameters `optimizers` were built with (lr, initial_lr, weight_decay, momentum, betas, ...), so a run
    resumed with another --matrix-lr or --weight-decay trains with it (torch's load_state_dict put the
    checkpoint's back, and the run went on with the old values while its meta.json recorded the new).

    Raises:
        FileNotFoundError: the checkpoint has no optimizer state.
        pickle.UnpicklingError: the file holds anything but tensors and plain containers.
    """
    path = Path(directory) / OPTIMIZER_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} has no optimizer state ({OPTIMIZER_FILE})")
    # on CPU first: the file was written from rank 0's device; load_state_dict moves each tensor to the
    # device of its parameter
    states = torch.load(path, map_location="cpu", weights_only=True)
    for opt, state in zip(optimizers, states, strict=True):
        settings = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        opt.load_state_dict(state)
        for group, own in zip(opt.param_groups, settings, strict=True):
            group.update(own)


def save_rank_state(directory: str | os.PathLike, rank: int, data_state: dict) -> None:
    """Write this rank's data state (state_rank{r}.npz, save_tree) and RNG state (rng_rank{r}.pt)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_tree(d / f"state_rank{rank}.npz", data_state)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    atomic_write(d / f"rng_rank{rank}.pt", lambda p: torch.save(rng, p))


def load_rng(directory: str | os.PathLike, rank: int) -> bool:
    """Restore the torch and python RNG of `rank`; False (nothing changed) when the checkpoint's world had
    no such rank."""
    path = Path(directory) / f"rng_rank{rank}.pt"
    if not path.exists():
        return False
    rng = torch.load(path, weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return True


def load_rank_states(directory: str | os.PathLike) -> list[dict]:
    """The data state of every rank of the world that wrote the checkpoint, by rank (index = rank).

    Raises:
        FileNotFoundError: no rank state, or a rank missing between 0 and the highest one.
    """
    d = Path(directory)
    found = {}
    for p in d.glob("state_rank*"):
        m = re.fullmatch(r"state_rank(\d+)\.npz", p.name)
        if m:
            found[int(m[1])] = p
    if not found or sorted(found) != list(range(len(found))):
        raise FileNotFoundError(f"{d}: rank states {sorted(found)}, expected ranks 0..n-1")
    return [load_tree(found[r]) for r in range(len(found))]


def read_meta(directory: str | os.PathLike) -> dict:
    """meta.json of a checkpoint (a local dir, or a remote URI: that one file is read, nothing fetched).

    Raises:
        FileNotFoundError: no meta.json there. CheckpointError (a ValueError): meta.json is not valid JSON, or
            not an object.
        ValueError: a remote URI that names no committed checkpoint. OSError: a remote one cannot be read.
    """
    data = _small_file(directory, "meta.json")
    if data is None:
        raise FileNotFoundError(f"{directory} is not a raychat checkpoint (no meta.json)")
    try:
        meta = json.loads(data.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {directory}: meta.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {directory}: meta.json is not a JSON object")
    return meta


def read_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer (tokenizer.json) of a checkpoint: a local dir, or a remote URI (that one file is read).

    Raises FileNotFoundError: no tokenizer.json there; ValueError as Tokenizer.load, or read_meta's for a remote
    URI."""
    if not is_remote(directory):
        return Tokenizer.load(directory)
    data = _small_file(directory, "tokenizer.json")
    if data is None:
        raise FileNotFoundError(f"{directory} is not a raychat checkpoint (no tokenizer.json)")
    return Tokenizer.from_json(data, f"{directory}/tokenizer.json")


def _small_file(directory: str | os.PathLike, name: str) -> bytes | None:
    """The bytes of the file `name` of a checkpoint (a local dir, or the URI of a committed remote one: one
    read of that file), None when there is none."""
    if not is_remote(directory):
        path = Path(directory) / name
        return path.read_bytes() if path.is_file() else None
    where = open_storage(find_checkpoint(directory))
    try:
        return read_bytes(where, f"{where.path}/{name}")
    except FileNotFoundError:
        return None


def document_masking(meta: dict) -> bool:
    """Whether the model of the checkpoint whose meta.json is `meta` was trained with attention masked by
    document (SFT always, pretraining with --document-masking): meta["document_masking"] where it is recorded
    (RL, from the checkpoint it started from), else its config's model.document_masking; False where neither
    is (a model-only checkpoint, an RL checkpoint written before it was recorded)."""
    if "document_masking" in meta:
        return bool(meta["document_masking"])
    return bool(meta.get("config", {}).get("model", {}).get("document_masking", False))


def check_model(directory: str | os.PathLike) -> dict:
    """The meta of the committed checkpoint `directory` once its model could load: every file as its commit
    marker lists it (sizes), meta.json with a model_config, and (local) model.safetensors with a header that
    parses. Reads no tensor; of a remote URI, only commit.json, meta.json and a listing of sizes.

    Raises:
        CheckpointError (a ValueError) naming the checkpoint and the file: not committed, a file missing or of
            another size, meta.json or model.safetensors unreadable.
        ValueError: a remote URI that names no committed checkpoint. OSError: a remote one cannot be read.
    """
    remote = is_remote(directory)
    if remote:
        where = open_storage(find_checkpoint(directory))
        verify_stored(where, where.path)
    else:
        verify(directory)
    meta = read_meta(directory)
    try:
        ModelConfig(**meta["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {directory}: meta.json has no valid model_config ({e!r})"
        ) from None
    if remote:
        return meta
    try:
        with safe_open(Path(directory) / "model.safetensors", framework="pt"):
            pass
    except SafetensorError as e:
        raise CheckpointError(
            f"checkpoint {directory}: model.safetensors is not a readable safetensors file ({e})"
        ) from None
    return meta


def load_model(
    directory: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[GPT, Tokenizer, dict]:
    """Load (model in eval mode, tokenizer, meta) from a committed checkpoint directory (local, or a remote
    URI), checked by check_model first.

    Raises:
        CheckpointError (a ValueError): not committed, a file missing or of another size, meta.json or the
            weights' header unreadable (named).
        ValueError: the tokenizer's version differs from the one the model was trained with; a remote URI
            that names no committed checkpoint.
    """
    d = Path(_local(directory))
    meta = check_model(d)
    tokenizer = Tokenizer.load(d)
    if meta.get("tokenizer_version") not in (None, tokenizer.version):
        raise ValueError(f"{d}: tokenizer version {tokenizer.version} != trained {meta['tokenizer_version']}")
    model = GPT(ModelConfig(**meta["model_config"]))
    model.load_state_dict(load_file(str(d / "model.safetensors"), device=str(device)))
    return model.to(device).eval(), tokenizer, meta


def _local(directory: str | os.PathLike) -> str | os.PathLike:
    return resolve_checkpoint(directory) if is_remote(directory) else directory

"""Shared by the engine benchmarks: a synthetic tokenizer, a random depth-derived model, the engine code of
an older commit (for before/after runs in one process tree), and a byte counter over aten ops.

Everything here uses only API that raychat had at commit 76453d3 as well (raychat.model, raychat.tokenizer),
so a worker subprocess can run it against that commit's code (PYTHONPATH=<archive>/platform).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from raychat.model import GPT, ModelConfig
from raychat.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer

REPO = Path(__file__).resolve().parents[1]


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """256 byte tokens plus printable two-byte, then three-byte tokens up to vocab_size (specials included):
    exactly vocab_size ids up to 866,665 (95**3 + 95**2 + 256 + the 9 specials). Raises ValueError beyond, or
    below 256 + the specials."""
    ranks = {bytes([i]): i for i in range(256)}
    printable = [bytes([c]) for c in range(32, 127)]
    pieces = itertools.chain(itertools.product(printable, repeat=2), itertools.product(printable, repeat=3))
    for piece in pieces:
        if len(ranks) >= vocab_size - len(SPECIAL_TOKENS):
            break
        ranks[b"".join(piece)] = len(ranks)
    tok = Tokenizer(SPLIT_PATTERN, ranks)
    if tok.vocab_size != vocab_size:
        raise ValueError(
            f"vocab_size must be in [{256 + len(SPECIAL_TOKENS)}, {tok.vocab_size}], got {vocab_size}"
        )
    return tok


def random_model(tok: Tokenizer, depth: int, max_seq_len: int, device: str = "cpu") -> GPT:
    """ModelConfig.from_depth(depth) with N(0, 1/fan_in) weights; special-token LM-head rows are zero, so
    their logit is 0 and top-k sampling (or greedy) never picks them: every run reaches its token limit."""
    cfg = ModelConfig.from_depth(depth, vocab_size=tok.vocab_size, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    if device == "meta":
        return model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1.0 if name == "model.embed_tokens.weight" else 1 / math.sqrt(p.shape[1]))
        model.lm_head.weight[list(tok.special_tokens.values())] = 0
    return model.eval()


def random_prompts(tok: Tokenizer, n: int, length: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ordinary = tok.vocab_size - len(SPECIAL_TOKENS)
    return [[tok.bos_id, *torch.randint(0, ordinary, (length - 1,), generator=g).tolist()] for _ in range(n)]


def archive(commit: str) -> Path:
    """`git archive <commit> platform` unpacked into a temporary directory; returns its platform/ path."""
    out = Path(tempfile.mkdtemp(prefix=f"raychat-{commit[:7]}-"))
    tar = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "platform"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar.stdout, check=True)
    return out / "platform"


def run_worker(script: Path, platform_dir: Path, args: list[str], threads: int) -> dict:
    """Run `script --worker ...` with raychat imported from `platform_dir`; returns its last stdout line
    parsed as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(platform_dir), str(script.parent)])}
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(
        [sys.executable, str(script), "--worker", *args, "--threads", str(threads)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class ByteCounter(TorchDispatchMode):
    """Bytes every aten op moves into memory it writes: a new output's size, or, for an op that writes
    into one of its inputs (in-place, e.g. the cache's index_put_/copy_), the bytes of the other tensors
    it reads from. Views move nothing. Works on the meta device (shapes only)."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in inputs}  # StorageImpl identity (also on meta)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            own = t.untyped_storage()._cdata
            if own not in storages:
                moved = t.numel() * t.element_size()
            elif func._schema.is_mutable:
                moved = sum(x.numel() * x.element_size() for x in inputs if x.untyped_storage()._cdata != own)
            else:
                moved = 0
            name = str(func.overloadpacket)
            self.by_op[name] = self.by_op.get(name, 0) + moved
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

"""Decode throughput of the raychat engine on this machine, side by side in one run.

1. tokens/s of `ModelRunner.generate_batch` (greedy, KV cache) at batch 1, 8 and 32;
2. KV-cache decode vs recompute without a cache (a full forward over the whole sequence for every new
   token, batch 1), both generating the same number of new tokens; the ratio is the speed-up.
tokens/s = new tokens generated / wall seconds of the whole call (prefill of the short prompt included).
The model is random (depth-derived sizes from ModelConfig.from_depth), fp32, so special tokens get logit 0
and the greedy runs always reach the token limit. Writes bench/results/engine_decode.md (atomic).

Usage: python bench/engine_decode.py [--repeats 2] [--depth 4] [--vocab 4096] [--new-tokens 256] [--batches 1,8,32] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform as pyplatform
import shlex
import sys
import time
from pathlib import Path

import torch

from raychat.engine import ModelRunner
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """256 byte tokens plus printable two-byte tokens up to vocab_size (specials included)."""
    ranks = {bytes([i]): i for i in range(256)}
    printable = [bytes([c]) for c in range(32, 127)]
    for a, b in itertools.product(printable, printable):
        if len(ranks) >= vocab_size - len(SPECIAL_TOKENS):
            break
        ranks[a + b] = len(ranks)
    return Tokenizer(SPLIT_PATTERN, ranks)


def random_model(tok: Tokenizer, depth: int, max_seq_len: int) -> GPT:
    cfg = ModelConfig.from_depth(depth, vocab_size=tok.vocab_size, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1.0 if name == "model.embed_tokens.weight" else 1 / math.sqrt(p.shape[1]))
        model.lm_head.weight[list(tok.special_tokens.values())] = 0
    return model.eval()


@torch.inference_mode()
def no_cache_greedy(model: GPT, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(new_tokens):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


def timed(fn, repeats: int = 1):
    """(result, best wall seconds over `repeats` runs): the minimum is the least disturbed by other load."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2, help="best of N wall times (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_decode.md"))
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = synthetic_tokenizer(args.vocab)
    model = random_model(tok, args.depth, args.prompt_len + args.new_tokens + 1)
    engine = ModelRunner(model, tok)
    g = torch.Generator().manual_seed(1)
    ordinary = tok.vocab_size - len(SPECIAL_TOKENS)

    def prompts(n):
        return [
            [tok.bos_id, *torch.randint(0, ordinary, (args.prompt_len - 1,), generator=g).tolist()]
            for _ in range(n)
        ]

    engine.generate_batch(prompts(2), max_tokens=8, temperature=0.0)  # warm-up

    rows = []
    for b in batches:
        res, sec = timed(
            lambda b=b: engine.generate_batch(prompts(b), max_tokens=args.new_tokens, temperature=0.0)
        )
        n = sum(len(r.completion_tokens) for r in res)
        rows.append((b, n, sec, n / sec))
        print(f"batch {b:3d}: {n} tokens in {sec:.2f} s = {n / sec:.0f} tokens/s", flush=True)

    p = prompts(1)[0]
    (cached,), t_cache = timed(
        lambda: engine.generate_batch([p], max_tokens=args.new_tokens, temperature=0.0)
    )
    ref, t_ref = timed(lambda: no_cache_greedy(model, p, args.new_tokens))
    same = cached.completion_tokens == ref
    print(
        f"KV cache {args.new_tokens / t_cache:.0f} tokens/s vs no cache {args.new_tokens / t_ref:.0f} tokens/s "
        f"= {t_ref / t_cache:.2f}x; identical tokens: {same}",
        flush=True,
    )

    cfg = model.config
    base = rows[0][3]
    lines = [
        "# ModelRunner decode throughput (CPU)",
        "",
        f"Command: `{' '.join(shlex.quote(a) for a in ['python', 'bench/engine_decode.py', *(argv or sys.argv[1:])])}`",
        "",
        f"Machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"{pyplatform.machine()}, Python {pyplatform.python_version()}. Model: random fp32 depth {cfg.n_layer} "
        f"(width {cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M params); "
        f"prompt {args.prompt_len} tokens, greedy, {args.new_tokens} new tokens per row; "
        f"tokens/s = new tokens / wall seconds of the call (prefill included), best of {args.repeats} runs. "
        "The machine was shared with other jobs while this ran: ratios are more stable than absolute numbers.",
        "",
        "| batch | new tokens | seconds | tokens/s | vs batch 1 |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {b} | {n} | {s:.2f} | {tps:.0f} | {tps / base:.2f}x |" for b, n, s, tps in rows],
        "",
        f"| batch 1, {args.new_tokens} new tokens | seconds | tokens/s |",
        "|---|---:|---:|",
        f"| KV cache (ModelRunner.generate_batch) | {t_cache:.2f} | {args.new_tokens / t_cache:.0f} |",
        f"| no cache (full forward per token) | {t_ref:.2f} | {args.new_tokens / t_ref:.0f} |",
        f"| **speed-up** | | **{t_ref / t_cache:.2f}x** |",
        "",
        f"Identical greedy tokens with and without the cache: {same}.",
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

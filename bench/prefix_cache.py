"""The engine's prefix cache (engine/prefix_cache.py): with vs without, both sides in one run.

1. Turn 8 of a conversation: a system prompt, then 7 turns of 32 new user tokens and a 32-token reply
   (sampled by the engine itself), so turn 8's prompt is about --history tokens. The conversation is played
   through a Scheduler with the prefix cache (turns 1..7 fill it) and, for the same turn-8 prompt, through
   one without it; TTFT = submit -> first token of turn 8 (Usage.ttft_s, wall seconds; the prompt's
   prefill is almost all of it). Goal: with / without <= 1/3.
2. 16 streams sharing a --system-tokens system prompt, each with its own 32-token question and 32 new
   tokens, submitted at once to a 16-slot Scheduler; tokens/s = completion tokens / wall seconds from the
   first submit to the last token (prefill included). Goal: with / without >= 2.
Each side is measured --repeats times in ABAB order on fresh Schedulers (fresh prefix caches); the median of
each side counts. Random fp32 model (ModelConfig.from_depth(--depth)), one torch thread, greedy decoding.
Writes bench/results/prefix_cache.md (atomically); the last stdout line is the JSON summary.

Usage: python bench/prefix_cache.py [--depth 6] [--history 2000] [--system-tokens 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _common import command_line, machine, uptime
from _engine_common import random_model, random_prompts, synthetic_tokenizer

from raychat.atomic import atomic_write_text
from raychat.engine import ModelRunner, SamplingParams, Scheduler

OUT = Path(__file__).parent / "results" / "prefix_cache.md"
TURN_TOKENS = 32  # new user tokens and reply tokens per turn
GREEDY = SamplingParams(max_tokens=TURN_TOKENS, temperature=0.0)


def scheduler(model, tok, cache: bool, slots: int, max_len: int) -> Scheduler:
    engine = ModelRunner(model, tok, prefix_cache_tokens="auto" if cache else 0)
    return Scheduler(engine, max_slots=slots, max_len=max_len)


def run(sched: Scheduler, prompt: list[int]):
    events = list(sched.submit(prompt, GREEDY))
    return [t for e in events for t in e.token_ids], events[-1].usage


def turn8(model, tok, history: int, max_len: int, cache: bool, seed: int) -> dict:
    """Play 7 turns on a cached Scheduler, then time turn 8 on it (cache) or on a fresh uncached one."""
    system_len = history - 7 * 2 * TURN_TOKENS
    user = random_prompts(tok, 8, TURN_TOKENS + 1, seed=seed)
    (system,) = random_prompts(tok, 1, system_len, seed=seed + 100)
    sched = scheduler(model, tok, True, 1, max_len)
    convo = list(system)
    for t in range(7):
        convo += user[t][1:]
        reply, _ = run(sched, convo)
        convo += reply
    prompt = convo + user[7][1:]
    if not cache:
        sched = scheduler(model, tok, False, 1, max_len)
    _, usage = run(sched, prompt)
    return {"prompt_tokens": len(prompt), "ttft_s": usage.ttft_s, "cached_tokens": usage.cached_tokens}


def shared_system(model, tok, system_tokens: int, streams: int, max_len: int, cache: bool, seed: int) -> dict:
    (system,) = random_prompts(tok, 1, system_tokens, seed=seed)
    questions = random_prompts(tok, streams, TURN_TOKENS + 1, seed=seed + 1)
    sched = scheduler(model, tok, cache, streams, max_len)
    t0 = time.perf_counter()
    subs = [sched.submit(system + q[1:], GREEDY) for q in questions]
    tokens, cached = 0, 0
    for s in subs:
        events = list(s)
        tokens += sum(len(e.token_ids) for e in events)
        cached += events[-1].usage.cached_tokens
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--history", type=int, default=2000, help="turn 8's prompt, tokens (about)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_len = args.history + 2 * TURN_TOKENS + 64
    tok = synthetic_tokenizer(args.vocab)
    model = random_model(tok, args.depth, max_len)
    load_before = uptime()
    ttft = {True: [], False: []}
    tps = {True: [], False: []}
    for r in range(args.repeats):
        for cache in (True, False) if r % 2 == 0 else (False, True):
            ttft[cache].append(turn8(model, tok, args.history, max_len, cache, seed=10 + r))
            tps[cache].append(
                shared_system(model, tok, args.system_tokens, args.streams, max_len, cache, 50 + r)
            )
    med = lambda rows, key: statistics.median(x[key] for x in rows)  # noqa: E731
    ttft_on, ttft_off = med(ttft[True], "ttft_s"), med(ttft[False], "ttft_s")
    tps_on, tps_off = med(tps[True], "tokens_per_s"), med(tps[False], "tokens_per_s")
    summary = {
        "bench": "prefix_cache",
        "depth": args.depth,
        "turn8_prompt_tokens": ttft[True][0]["prompt_tokens"],
        "turn8_cached_tokens": ttft[True][0]["cached_tokens"],
        "ttft_with_s": round(ttft_on, 4),
        "ttft_without_s": round(ttft_off, 4),
        "ttft_ratio": round(ttft_on / ttft_off, 4),
        "ttft_goal_met": ttft_on / ttft_off <= 1 / 3,
        "shared_tokens_per_s_with": round(tps_on, 2),
        "shared_tokens_per_s_without": round(tps_off, 2),
        "shared_speedup": round(tps_on / tps_off, 3),
        "shared_goal_met": tps_on / tps_off >= 2,
    }
    rows1 = "\n".join(
        f"| {'with' if c else 'without'} | {x['prompt_tokens']} | {x['cached_tokens']} | {x['ttft_s'] * 1000:.1f} |"
        for c in (True, False)
        for x in ttft[c]
    )
    rows2 = "\n".join(
        f"| {'with' if c else 'without'} | {x['tokens']} | {x['cached_tokens']} | {x['seconds']:.2f} | "
        f"{x['tokens_per_s']:.1f} |"
        for c in (True, False)
        for x in tps[c]
    )
    text = f"""# Prefix cache: with vs without, one run

Command: `{command_line()}`

Machine: {machine()}; 1 torch thread. Load: `{load_before}` before, `{uptime()}` after.
Model: random fp32, depth {args.depth} (ModelConfig.from_depth), vocab {args.vocab}; greedy; Scheduler defaults
(prefill_chunk_tokens 512); "with" = ModelRunner(prefix_cache_tokens="auto"), "without" = 0. {args.repeats}
repeats per side in ABAB order, fresh Schedulers; medians count. Wall seconds (the machine is shared).

## 1. TTFT of turn 8 (~{args.history} tokens of history, {TURN_TOKENS} new user tokens and a {TURN_TOKENS}-token reply a turn)

| prefix cache | prompt tokens | tokens from the cache | TTFT ms |
|---|---:|---:|---:|
{rows1}

TTFT with / without: **{ttft_on * 1000:.1f} ms / {ttft_off * 1000:.1f} ms = {ttft_on / ttft_off:.3f}** (goal <= 0.333:
{"met" if summary["ttft_goal_met"] else "NOT met"}).

## 2. {args.streams} streams sharing a {args.system_tokens}-token system prompt ({TURN_TOKENS}-token questions, {TURN_TOKENS} new tokens each)

| prefix cache | completion tokens | prompt tokens from the cache | seconds | tokens/s |
|---|---:|---:|---:|---:|
{rows2}

tokens/s with / without: **{tps_on:.1f} / {tps_off:.1f} = {tps_on / tps_off:.2f}x** (goal >= 2x:
{"met" if summary["shared_goal_met"] else "NOT met"}).

```json
{json.dumps(summary)}
```
"""
    atomic_write_text(Path(args.out), text)
    print(text)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

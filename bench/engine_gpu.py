"""The engine on one GPU, in one run of under 8 minutes: depth-12 and depth-20 random models in bf16.

Prepared on a CPU machine; runs only where torch sees CUDA. In order (each section appends its table to
--out as soon as it is done, so a run stopped by a time limit keeps what it measured):
1. correctness on the GPU (depth 12, bf16, greedy, 8 rows of 64 random prompt tokens, 48 new tokens):
   FlexAttention vs the dense-mask path vs the compiled decode step, and each against a no-cache full
   forward per token -- the share of rows whose tokens agree (bf16 kernels may flip near-ties); and the
   synchronizing CUDA calls per Scheduler step (torch.cuda.set_sync_debug_mode), expected 1: the one
   device-to-host copy of the sampled tokens;
2. decode tokens/s of ModelRunner.generate_batch (greedy, static batch, prompts of --prompt-len tokens,
   --new-tokens per row, prefill included) at 1, 8, 32, 128 rows, eager (attention "auto" = FlexAttention
   for rows of different lengths) and with compile_decode=True (torch.compile, CUDA graphs per row
   bucket); the continuous-batching Scheduler at 128 rows with max_tokens staggered 16..new-tokens;
3. vLLM on the same prompts from the same weights (raychat.export.hf -> vllm.LLM, bf16, greedy,
   ignore_eos, exactly --new-tokens per row), when `vllm` imports; the table gives raychat / vLLM.
Compiles are skipped (and say so) once --budget-s seconds have passed, so the run ends in time.

    PYTHONUNBUFFERED=1 PYTHONPATH=platform:bench python3 bench/engine_gpu.py --out $OUT/engine_gpu.md
    # a dry run of every code path on a CPU (tiny sizes, no compile, vLLM skipped):
    PYTHONPATH=platform:bench python bench/engine_gpu.py --device cpu --depths 2 --rows 1,4 \
        --prompt-len 16 --new-tokens 20 --vocab 512 --budget-s 0 --out /tmp/engine_gpu.md

Needs: torch with CUDA, tiktoken, safetensors, tokenizers, transformers (the export); vLLM optionally (the
`vllm` extra is the pinned Ray's `ray[llm]`: vllm 0.29.0, locked in constraints-vllm.txt; install it in its own
environment, `pip install -c constraints-vllm.txt -e ".[vllm]"` after the CUDA torch, docs/deployment.md "vLLM").
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from _common import machine
from _engine_common import REPO, random_model, random_prompts, synthetic_tokenizer

from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.export.hf import export_hf

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def write(out: Path, text: str) -> None:
    with out.open("a") as f:
        f.write(text.rstrip() + "\n\n")
    print(text, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(engine: ModelRunner, prompts, n: int) -> tuple[float, list]:
    """(tokens/s, results) of the second of two generate_batch calls (the first warms up / compiles)."""
    engine.generate_batch(prompts, max_tokens=n, temperature=0.0)
    sync()
    t = time.perf_counter()
    res = engine.generate_batch(prompts, max_tokens=n, temperature=0.0)
    sync()
    return sum(len(r.completion_tokens) for r in res) / (time.perf_counter() - t), res


@torch.inference_mode()
def no_cache_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.lm_head.weight.device)
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def correctness(tok, a, out: Path) -> None:
    model = random_model(tok, a.depths[0], 64 + 48 + 1).to(a.device)
    prompts = random_prompts(tok, 8, 64)
    variants = {
        "flex": ModelRunner(model, tok, dtype="bfloat16", attention="flex"),
        "dense": ModelRunner(model, tok, dtype="bfloat16", attention="dense"),
    }
    if a.budget_s > 0:
        variants["compiled"] = ModelRunner(model, tok, dtype="bfloat16", compile_decode=True)
    ref = [no_cache_greedy(model, p, 48) for p in prompts]
    runs = {k: [r.completion_tokens for r in e.generate_batch(prompts, max_tokens=48, temperature=0.0)]
            for k, e in variants.items()}  # fmt: skip
    rows = ["| variant | rows equal to no-cache | rows equal to flex |", "|---|---:|---:|"]
    for k, toks in runs.items():
        rows.append(
            f"| {k} | {sum(a == b for a, b in zip(toks, ref))}/8 | {sum(a == b for a, b in zip(toks, runs['flex']))}/8 |"
        )
    rows.append(
        f"\nSynchronizing CUDA calls per Scheduler step (8 requests, sampling + logprobs): {syncs_per_step(variants['flex'], tok, a):.2f}"
    )
    title = f"## 1. Correctness (depth {a.depths[0]}, bf16, greedy, 8 rows, 48 new tokens)"
    write(out, title + "\n\n" + "\n".join(rows))


def syncs_per_step(engine: ModelRunner, tok, a, steps: int = 10) -> float:
    """Warnings of torch.cuda.set_sync_debug_mode("warn") per step over `steps` decode steps."""
    sched = Scheduler(engine, max_slots=8, max_len=112)
    params = SamplingParams(
        max_tokens=90, temperature=0.8, top_k=50, top_p=0.9, logprobs=True, top_logprobs=5
    )
    for p in random_prompts(tok, 8, 16):
        sched.submit(p, params)
    sched.step()  # prefill
    if a.device != "cuda":
        return float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                sched.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return len(caught) / steps


def throughput(tok, depth: int, a, out: Path) -> dict[int, float]:
    model = random_model(tok, depth, a.prompt_len + a.new_tokens + 1).to(a.device)
    eager = ModelRunner(model, tok, dtype="bfloat16")
    compiled = ModelRunner(model, tok, dtype="bfloat16", compile_decode=True)
    rows, best = [], {}
    for b in a.rows:
        prompts = random_prompts(tok, b, a.prompt_len)
        tps, _ = timed_generate(eager, prompts, a.new_tokens)
        if elapsed() < a.budget_s:
            c_tps = f"{timed_generate(compiled, prompts, a.new_tokens)[0]:,.0f}"
        else:
            c_tps = "skipped (time budget)"
        best[b] = tps
        rows.append(f"| {b} | {tps:,.0f} | {c_tps} |")
    sched_tps = scheduler_tps(eager, tok, a)
    params = model.num_params() / 1e6
    write(
        out,
        f"## 2. Decode tokens/s, depth {depth} ({params:.0f}M params), bf16, generate_batch, prompts of "
        f"{a.prompt_len}, {a.new_tokens} new tokens\n\n| rows | eager | compile_decode |\n|---:|---:|---:|\n"
        + "\n".join(rows)
        + f"\n\nScheduler, {a.rows[-1]} concurrent requests, max_tokens staggered 16..{a.new_tokens}: {sched_tps:,.0f} tokens/s",
    )
    return best


def scheduler_tps(engine: ModelRunner, tok, a) -> float:
    n = a.rows[-1]
    prompts = random_prompts(tok, n, a.prompt_len, seed=3)
    sched = Scheduler(engine, max_slots=n, max_len=a.prompt_len + a.new_tokens)
    limits = [16 + (i * 37) % (a.new_tokens - 15) for i in range(n)]
    sync()
    t = time.perf_counter()
    streams = [
        sched.submit(p, SamplingParams(max_tokens=n, temperature=0.0)) for p, n in zip(prompts, limits)
    ]
    while sched.step():
        pass
    return sum(len(ev.token_ids) for s in streams for ev in s._events) / (time.perf_counter() - t)


def vllm_tps(tok, depth: int, a) -> dict[int, float]:
    from vllm import LLM
    from vllm import SamplingParams as VllmParams

    model = random_model(tok, depth, a.prompt_len + a.new_tokens + 1)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tok, tmp)
        llm = LLM(model=tmp, dtype="bfloat16", max_model_len=a.prompt_len + a.new_tokens + 8,
                  gpu_memory_utilization=0.6, skip_tokenizer_init=True)  # fmt: skip
        params = VllmParams(max_tokens=a.new_tokens, min_tokens=a.new_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)  # fmt: skip
        out = {}
        for b in a.rows:
            inputs = [{"prompt_token_ids": p} for p in random_prompts(tok, b, a.prompt_len)]
            llm.generate(inputs, params, use_tqdm=False)
            t = time.perf_counter()
            res = llm.generate(inputs, params, use_tqdm=False)
            out[b] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--budget-s", type=float, default=330.0, help="no new compile after this many seconds")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_gpu.md"))
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a dry run of the code)")
    ap.add_argument("--depths", default="12,20")
    ap.add_argument("--rows", default="1,8,32,128")
    a = ap.parse_args()
    a.depths, a.rows = [int(d) for d in a.depths.split(",")], [int(r) for r in a.rows.split(",")]
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("engine_gpu.py needs a CUDA device (torch.cuda.is_available() is False)")
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (dry run)"
    out = Path(a.out)
    out.write_text(
        f"# Engine on {name} (bf16)\n\nCommand: `python3 bench/engine_gpu.py "
        f"--prompt-len {a.prompt_len} --new-tokens {a.new_tokens} --vocab {a.vocab}`\n\n"
        f"Machine: {machine()}, CUDA {torch.version.cuda}.\n\n"
    )
    tok = synthetic_tokenizer(a.vocab)
    sections = [("correctness", lambda: correctness(tok, a, out))]
    ours: dict[int, dict[int, float]] = {}
    for depth in a.depths:
        sections.append((f"depth {depth}", lambda d=depth: ours.setdefault(d, throughput(tok, d, a, out))))
    for name, fn in sections:
        try:
            fn()
        except Exception:  # noqa: BLE001 - record it and go on: the other sections still measure
            write(out, f"## {name}: FAILED\n\n```\n{traceback.format_exc()[-3000:]}\n```")
        if a.device == "cuda":
            torch.cuda.empty_cache()
    lines = ["## 3. raychat (eager) vs vLLM, same prompts and weights, bf16, greedy", "",
             "| depth | rows | raychat tokens/s | vLLM tokens/s | raychat / vLLM |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for depth in a.depths:
        try:
            theirs = vllm_tps(tok, depth, a)
        except Exception as e:  # noqa: BLE001 - e.g. vllm not installed on this machine
            lines.append(f"| {depth} | - | - | not run: {type(e).__name__}: {str(e)[:200]} | - |")
            continue
        for b, v in theirs.items():
            r = ours.get(depth, {}).get(b)
            lines.append(f"| {depth} | {b} | {r or 0:,.0f} | {v:,.0f} | {(r / v if r else 0):.2f}x |")
    write(out, "\n".join(lines) + f"\n\nTotal wall time: {elapsed():.0f} s")
    os.sync()


if __name__ == "__main__":
    main()

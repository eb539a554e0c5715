"""raychat's engine vs Hugging Face transformers `generate` on the same weights, side by side in one run.

A random depth-derived model (default depth 8, the CPU comparison the engine issue asks for) or a given
checkpoint is exported with raychat.export.hf (Qwen3 layout) and loaded with AutoModelForCausalLM (fp32,
its default SDPA attention). Both generate greedily with a KV cache, as a static batch of --rows prompts of
--prompt-len random tokens, exactly --new-tokens tokens per row (HF: min_new_tokens = max_new_tokens;
raychat: the random model's special-token logits are 0 and never win the argmax; a checkpoint may stop a
row early, so its tokens are counted). raychat runs `ModelRunner.generate_batch` (the batch path) and the
continuous-batching Scheduler over the same prompts. tokens/s = new tokens / wall seconds of the call
(prefill included), best of --repeats; every engine runs in this process with the same torch threads.
The machine is shared with other jobs, so every call is timed twice: wall seconds and this process' CPU
seconds (time.process_time; with one thread, the work done without the waits for a core). The ratio
uses CPU seconds; wall tokens/s are shown beside it.

    python bench/engine_vs_hf.py --rows 1,8,32 --new-tokens 128
    python bench/engine_vs_hf.py --checkpoint runs/rl/rl/checkpoint_000020 --rows 1
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, uptime
from _engine_common import REPO, random_model, random_prompts, synthetic_tokenizer
from transformers import AutoModelForCausalLM

from raychat.checkpoint import load_model
from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.export.hf import export_hf


def best_of(fn, repeats: int) -> tuple[float, float, object]:
    """(best CPU seconds, best wall seconds, the last result) over `repeats` calls."""
    cpu, wall, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - t0)
    return cpu, wall, out


def scheduler_run(engine: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    sched = Scheduler(engine, max_slots=len(prompts), max_len=len(prompts[0]) + n)
    streams = [sched.submit(p, SamplingParams(max_tokens=n, temperature=0.0)) for p in prompts]
    while sched.step():
        pass
    return [[t for ev in s._events for t in ev.token_ids] for s in streams]


def compare(engine: ModelRunner, hf, prompts: list[list[int]], n: int, repeats: int) -> tuple:
    """(rows, rows with identical tokens, {engine: (tokens per CPU-second, tokens/s wall)})."""
    c_rc, t_rc, res = best_of(lambda: engine.generate_batch(prompts, max_tokens=n, temperature=0.0), repeats)
    c_sc, t_sc, sc = best_of(lambda: scheduler_run(engine, prompts, n), repeats)
    ids = torch.tensor(prompts)

    def hf_generate():
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, max_length=None, use_cache=True, pad_token_id=0)  # fmt: skip

    c_hf, t_hf, out = best_of(hf_generate, repeats)
    rc_tokens = [r.completion_tokens for r in res]
    hf_tokens = out[:, ids.shape[1] :].tolist()
    same = sum(x == y[: len(x)] for x, y in zip(rc_tokens, hf_tokens))
    rc_new, sc_new, hf_new = sum(map(len, rc_tokens)), sum(map(len, sc)), sum(map(len, hf_tokens))
    rates = {"batch": (rc_new / c_rc, rc_new / t_rc), "sched": (sc_new / c_sc, sc_new / t_sc)}
    rates["hf"] = (hf_new / c_hf, hf_new / t_hf)
    return len(prompts), same, rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="a raychat checkpoint instead of the random model")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_vs_hf.md"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    load_before = uptime()
    if a.checkpoint:
        model, tokenizer, _ = load_model(a.checkpoint)
        what = f"checkpoint {a.checkpoint}"
    else:
        tokenizer = synthetic_tokenizer(a.vocab)
        model = random_model(tokenizer, a.depth, a.prompt_len + a.new_tokens)
        what = f"random depth {a.depth}, vocab {a.vocab}"
    engine = ModelRunner(model, tokenizer)
    n = a.new_tokens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tokenizer, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        for b in [int(r) for r in a.rows.split(",")]:
            rows.append(compare(engine, hf, random_prompts(tokenizer, b, a.prompt_len), n, a.repeats))
            print(b, rows[-1], flush=True)
    lines = [
        "# raychat engine vs transformers generate (same exported weights, CPU, greedy, KV cache)",
        "",
        f"Command: `python bench/engine_vs_hf.py --depth {a.depth} --vocab {a.vocab} --rows {a.rows} --prompt-len {a.prompt_len} --new-tokens {n} "
        f"--repeats {a.repeats} --threads {a.threads}"
        + (f" --checkpoint {a.checkpoint}`" if a.checkpoint else "`"),
        "",
        f"Machine: {machine()}; {a.threads} torch thread(s). Load: `{load_before}` before, `{uptime()}` after.",
        f"Model: {what} ({model.num_params() / 1e6:.1f}M params), fp32; prompts of {a.prompt_len} random "
        f"tokens, {n} new tokens per row, static batch; best of {a.repeats}.",
        "",
        "tokens per CPU-second (tokens/s wall in brackets):",
        "",
        "| rows | raychat generate_batch | raychat Scheduler | transformers generate "
        "| **generate_batch / transformers** | Scheduler / transformers | rows with identical greedy tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {b} | {r['batch'][0]:,.0f} ({r['batch'][1]:,.0f}) | {r['sched'][0]:,.0f} ({r['sched'][1]:,.0f}) | "
            f"{r['hf'][0]:,.0f} ({r['hf'][1]:,.0f}) | **{r['batch'][0] / r['hf'][0]:.2f}x** | "
            f"{r['sched'][0] / r['hf'][0]:.2f}x | {same}/{b} |"
            for b, same, r in rows
        ],
        "",
    ]
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

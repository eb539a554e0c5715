"""raychat's engine vs Hugging Face transformers `generate` on the same weights, side by side in one run.

The checkpoint is exported with raychat.export.hf (Qwen3 layout) and loaded with
AutoModelForCausalLM; both generate greedily with a KV cache, batch 1, a fixed number of new tokens from
the same prompt (end-of-turn tokens are not allowed to stop either run: HF gets min_new_tokens, raychat's
engine gets a model whose special-token logits are unchanged but we count the tokens it produced).
tokens/s = new tokens / wall seconds of the call, best of --repeats. Both use the same torch thread count.

    python bench/engine_vs_hf.py --checkpoint runs/rl/rl/checkpoint_000020 --new-tokens 256
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/engine_vs_hf.md")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from transformers import AutoModelForCausalLM

    from raychat.checkpoint import load_model
    from raychat.engine import ModelRunner
    from raychat.export.hf import export_hf

    model, tokenizer, _ = load_model(a.checkpoint)
    prompt = tokenizer.encode("The Python standard library", prepend_bos=True)
    n = min(a.new_tokens, model.config.max_seq_len - len(prompt))
    engine = ModelRunner(model, tokenizer)
    t_rc, res = best_of(lambda: engine.generate_batch([prompt], max_tokens=n, temperature=0.0), a.repeats)
    rc_new = len(res[0].completion_tokens)

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tokenizer, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
        ids = torch.tensor([prompt])

        def hf_generate():
            with torch.no_grad():
                return hf.generate(ids, max_new_tokens=rc_new, min_new_tokens=rc_new, do_sample=False,
                                   max_length=None, use_cache=True)  # fmt: skip

        t_hf, out = best_of(hf_generate, a.repeats)
    hf_new = out.shape[1] - len(prompt)
    same = out[0, len(prompt) :].tolist() == res[0].completion_tokens[:hf_new]
    rows = [
        "# raychat engine vs transformers generate (same weights, CPU, batch 1, greedy, KV cache)",
        "",
        f"Command: `python bench/engine_vs_hf.py --checkpoint {a.checkpoint} --new-tokens {a.new_tokens} "
        f"--repeats {a.repeats} --threads {a.threads}`",
        "",
        "| engine | new tokens | best wall s | tokens/s |",
        "|---|---:|---:|---:|",
        f"| raychat ModelRunner.generate_batch | {rc_new} | {t_rc:.3f} | {rc_new / t_rc:,.0f} |",
        f"| transformers generate | {hf_new} | {t_hf:.3f} | {hf_new / t_hf:,.0f} |",
        "",
        f"ratio raychat / transformers: **{(rc_new / t_rc) / (hf_new / t_hf):.2f}x**; identical greedy tokens: {same}",
        "",
    ]
    Path(a.out).write_text("\n".join(rows))
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""A tiny chat checkpoint for RL measurements: SFT a small random model on the Calculator task (bench only).

Stand-in until the CPU preset's SFT checkpoint exists. Trains a 512-token BPE on calculator prompts, then a
depth-2 width-128 GPT with plain AdamW on rendered conversations (loss on supervised tokens only), and saves
the model after --steps. Prints greedy and sampled pass@1 on the held-out split.

    python bench/rl_tiny_sft.py --out runs/bench/tiny_sft --steps 300 --max-operand 99
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from raychat.chat_template import render_conversation, render_for_completion
from raychat.checkpoint import save_model
from raychat.engine import ModelRunner
from raychat.model import GPT, ModelConfig
from raychat.tasks import Calculator
from raychat.tokenizer import Tokenizer


def pass_at_1(model, tok, task, n, temperature, samples=1, max_tokens=40) -> float:
    model.eval()
    eng = ModelRunner(model, tok)
    convs = [task[i] for i in range(n)]
    prompts = [render_for_completion(tok, c["messages"][:-1]) for c in convs]
    res = eng.generate_batch(
        prompts, num_samples=samples, max_tokens=max_tokens, temperature=temperature, seed=0
    )
    model.train()
    return sum(task.is_correct(convs[r.prompt_index], r.text) for r in res) / len(res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench/tiny_sft")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-operand", type=int, default=99)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    train = Calculator("train", size=20_000, seed=1000 + args.seed, max_operand=args.max_operand)
    test = Calculator("test", size=128, seed=0, max_operand=args.max_operand)
    texts = []
    for i in range(2000):
        c = train[i]
        texts += [c["messages"][0]["content"], "Let me compute it. #### " + c["answer"]]
    tok = Tokenizer.train(texts, vocab_size=512)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, n_layer=args.depth, n_embd=args.width, n_head=args.width // 32,
        n_kv_head=args.width // 32, head_dim=32, intermediate_size=4 * args.width, max_seq_len=128,
    )  # fmt: skip
    model = GPT(cfg).init_weights(args.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()
    for step in range(args.steps):
        rows = [
            render_conversation(tok, train[(step * args.batch + j) % len(train)]) for j in range(args.batch)
        ]
        T = max(len(r.ids) for r in rows) - 1
        x = torch.zeros(len(rows), T, dtype=torch.long)
        y = torch.zeros_like(x)
        m = torch.zeros_like(x, dtype=torch.bool)
        for i, r in enumerate(rows):
            n = len(r.ids) - 1
            x[i, :n], y[i, :n] = torch.tensor(r.ids[:-1]), torch.tensor(r.ids[1:])
            m[i, :n] = torch.tensor(r.supervised[1:], dtype=torch.bool)
        lr = args.lr * min(1.0, (args.steps - step) / (0.3 * args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(x)
        loss = F.cross_entropy(logits[m], y[m])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            greedy = pass_at_1(model, tok, test, 64, 0.0)
            print(
                f"step {step + 1} loss {loss.item():.4f} greedy pass@1 {greedy:.3f} ({time.time() - t0:.0f}s)",
                flush=True,
            )
    sampled = pass_at_1(model, tok, test, 64, 1.0, samples=8)
    print(f"final: sampled (T=1) pass@1 {sampled:.3f}")
    save_model(
        args.out, model.eval(), tok, {"stage": "sft", "step": args.steps, "bench": vars(args)}, commit=True
    )
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()

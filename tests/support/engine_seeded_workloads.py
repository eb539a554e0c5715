"""Seeded sampling workloads whose tokens were recorded from the engine at commit 76453d3 (before the
serving-scale rewrite), so tests/unit/test_engine_chunked.py can assert the rewrite draws the same samples
(for rows without top-k: rows with top-k draw over their k candidates since, engine/sampling.py).

Recorded with the old engine's code (run from this repository's root):
    mkdir -p /tmp/raychat-76453d3 && git archive 76453d3 platform | tar -x -C /tmp/raychat-76453d3
    PYTHONPATH=/tmp/raychat-76453d3/platform:tests .venv/bin/python tests/support/engine_seeded_workloads.py \
        tests/data/engine_seeded_76453d3.json
Only public API that both versions share is used (ModelRunner.generate_batch, Scheduler.submit/step).
"""

from __future__ import annotations

import json
import sys

from raychat.engine import ModelRunner, SamplingParams, Scheduler
from support.engine_fixtures import byte_tokenizer, tiny_gpt

TEXTS = ("a", "the quick brown fox", "1+1=", "xyzzy plugh and more words here")

# (temperature, top_k, top_p, stop) per generate_batch call; seeds 11, 12, ... Stop strings of common
# bytes end rows at scattered steps, so later steps decode non-contiguous rows.
VOWELS = ("a", "e", "i", "o", "u", "A", "E")
BATCH_SETTINGS = [
    (1.0, None, None, ()),
    (0.8, 20, None, VOWELS),
    (1.2, None, 0.9, VOWELS),
    (0.7, 50, 0.8, ()),
    (2.0, 5, 0.95, VOWELS),
]

# Scheduler requests: (text, max_tokens, temperature, top_k, top_p, seed, submitted before step)
REQUESTS = [
    ("alpha", 30, 1.0, None, None, 1, 0),
    ("bee", 5, 0.9, 10, None, 2, 0),
    ("gamma ray", 25, 1.1, None, 0.85, 3, 0),
    ("delta", 12, 0.0, None, None, None, 2),
    ("epsilon zeta", 18, 1.5, 40, 0.9, 4, 3),
    ("eta", 40, 0.6, None, None, 5, 3),
    ("theta iota kappa", 9, 1.0, 3, None, 6, 7),
]


def prompts(tok):
    return [[tok.bos_id, *tok.encode(t)] for t in TEXTS]


def run_batches(engine, tok) -> list[list[list[int]]]:
    """tokens of every result of every generate_batch call (3 samples per prompt, up to 40 tokens)."""
    out = []
    for i, (t, k, p, stop) in enumerate(BATCH_SETTINGS):
        res = engine.generate_batch(prompts(tok), num_samples=3, max_tokens=40, temperature=t, top_k=k,
                                    top_p=p, seed=11 + i, stop=stop)  # fmt: skip
        out.append([r.tokens for r in res])
    return out


def run_scheduler(engine, tok) -> list[list[int]]:
    """completion tokens of each request of REQUESTS on a 3-slot Scheduler (rows admitted and freed in a
    scattered order)."""
    sched = Scheduler(engine, max_slots=3, max_len=96)
    streams, step = {}, 0
    while len(streams) < len(REQUESTS) or sched.num_active or sched.num_pending:
        for i, (text, n, t, k, p, seed, at) in enumerate(REQUESTS):
            if at == step and i not in streams:
                params = SamplingParams(max_tokens=n, temperature=t, top_k=k, top_p=p, seed=seed)
                streams[i] = sched.submit([tok.bos_id, *tok.encode(text)], params)
        sched.step()
        step += 1
    return [[t for ev in streams[i]._events for t in ev.token_ids] for i in range(len(REQUESTS))]


def run_alone(engine, tok, i: int) -> list[int]:
    """completion tokens of REQUESTS[i] alone on a 1-slot Scheduler."""
    text, n, t, k, p, seed, _ = REQUESTS[i]
    sched = Scheduler(engine, max_slots=1, max_len=96)
    stream = sched.submit([tok.bos_id, *tok.encode(text)], SamplingParams(n, t, k, p, seed))
    while sched.step():
        pass
    return [t for ev in stream._events for t in ev.token_ids]


def record() -> dict:
    tok = byte_tokenizer()
    engine = ModelRunner(tiny_gpt(tok), tok)
    return {"generate_batch": run_batches(engine, tok), "scheduler": run_scheduler(engine, tok)}


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(record(), f)

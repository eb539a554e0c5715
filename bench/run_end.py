"""How long a finished training run takes to reach its driver: Ray Train's controller poll interval, before vs after.

    python bench/run_end.py [--repeats 2] [--out bench/results/run_end.md]

Runs `raychat pretrain` (depth 1, 2 workers x 0.5 CPUs, 4 steps; it starts its own local Ray cluster) on a
synthetic corpus, with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2 (Ray's default: "before") and unset (raychat's default,
raychat.train.launch.HEALTH_CHECK_INTERVAL_S: "after"), in ABBA order, --repeats times each. From each run's
start-up trace (RAYCHAT_STARTUP_TRACE, raychat.train.startup_trace), in seconds:
  - end: the last worker's "worker_fn_end" (its training function returned) -> the driver's "fit_returned";
  - run: the command's wall time, from its launch to its exit.
Prints a markdown table and one JSON line last; the losses of the runs must be equal (same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import append_result, command_line, machine, uptime

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa river stone light cloud tree bird wind".split()
)
SETTINGS = {"before": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}, "after": {}}


def make_corpus(root: Path) -> None:
    """600 documents of random words in 5 shards and a 300-token BPE trained on them."""
    from raychat.data.corpus.shards import write_manifest, write_shards
    from raychat.tokenizer import Tokenizer

    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + "." for _ in range(600)]
    entries = write_shards(docs, root / "shards", num_shards=5, row_group_size=64, log=lambda *_: None)
    write_manifest(root / "shards", {"source": "bench", "shards": entries})
    Tokenizer.train(docs, vocab_size=300).save(root / "tok")


def run(root: Path, name: str, extra_env: dict) -> dict:
    """One `raychat pretrain` in a child process; returns {"end_s", "run_s", "losses"}."""
    trace = root / f"{name}.trace"
    cmd = [sys.executable, "-m", "raychat.cli", "pretrain", "--preset", "none",
           "--data-dir", str(root / "shards"), "--tokenizer-path", str(root / "tok"),
           "--storage-path", str(root / "runs"), "--run-name", name, "--depth", "1", "--aspect-ratio", "64",
           "--head-dim", "32", "--seq-len", "32", "--device-batch-size", "2", "--total-batch-size", "128",
           "--num-iterations", "4", "--eval-every", "0", "--eval-tokens", "64", "--buffer-size", "8",
           "--num-workers", "2", "--cpus-per-worker", "0.5"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *SETTINGS["before"])}
    env.update(
        RAYCHAT_STARTUP_TRACE=str(trace), RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(root / "ray"), **extra_env
    )
    t0 = time.time()
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    t1 = time.time()
    events: dict[str, list[float]] = {}
    for line in trace.read_text().splitlines():
        _, event, when, *_ = line.split()
        events.setdefault(event, []).append(float(when))
    losses = [
        json.loads(x)["loss"] for x in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "end_s": min(events["fit_returned"]) - max(events["worker_fn_end"]),
        "run_s": t1 - t0,
        "losses": losses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting (ABBA order)")
    ap.add_argument("--out", default=None, help="append the markdown to this file")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="run_end-"))
    make_corpus(root)
    load_before = uptime()
    order = [s for r in range(a.repeats) for s in (("before", "after"), ("after", "before"))[r % 2]]
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for i, setting in enumerate(order):
        r = run(root, f"{setting}-{i}", SETTINGS[setting])
        results[setting].append(r)
        print(f"[run_end] {i + 1}/{len(order)} {setting}: end {r['end_s']:.2f} s, run {r['run_s']:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    losses = {tuple(r["losses"]) for rs in results.values() for r in rs}
    med = {
        s: {k: statistics.median(r[k] for r in rs) for k in ("end_s", "run_s")} for s, rs in results.items()
    }
    rows = [
        "| | RAY_TRAIN_HEALTH_CHECK_INTERVAL_S | end s (each run) | median end s | median run s |",
        "|---|---|---|---:|---:|",
    ]
    for s, rs in results.items():
        interval = SETTINGS[s].get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "unset (raychat: 0.5)")
        each = ", ".join(f"{r['end_s']:.2f}" for r in rs)
        rows.append(f"| {s} | {interval} | {each} | {med[s]['end_s']:.2f} | {med[s]['run_s']:.1f} |")
    text = "\n".join(
        [
            f"Command: `{command_line()}`",
            "",
            f"Machine: {machine()}. Load: `{load_before}` before, `{uptime()}` after.",
            "",
            *rows,
            "",
            f"Losses equal in every run: {len(losses) == 1}.",
        ]
    )
    print(text)
    if a.out:
        append_result(a.out, text)
    print(json.dumps({"bench": "run_end", **{s: med[s] for s in med}, "losses_equal": len(losses) == 1}))


if __name__ == "__main__":
    main()

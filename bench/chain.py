"""Behaviour check: a tiny pretrain -> SFT -> RL chain on CPU, through the `raychat` command's flags only.

Prints (and writes to --json) every number the chain's training produces that does not depend on wall time:
per-step loss, grad_norm and lr; validation BPB; SFT task accuracies; RL reward, pass@1, response length and
held-out pass@k. Run it on two commits and compare: the numbers must be bit-identical (floats are written with
repr, so equal text means equal bits).

  RAY_TMPDIR=/tmp/ray-x python bench/chain.py --out /tmp/chain --json bench/results/chain_<commit>.json
  python bench/chain.py --compare bench/results/chain_before.json bench/results/chain_after.json

Stages (same seeds everywhere): pretrain 30 steps (depth 1, width 64, 2 DDP workers, 2 micro-batches a step),
SFT 20 steps on calculator + spelling + chatterbot, RL 3 steps (2 learner workers, 1 rollout actor) from a
tiny calculator model (bench/rl_tiny_sft.py, 100 steps), so that rewards, advantages and gradients are not 0.
Each stage is its own `raychat` process with its own local Ray cluster (about 5 minutes on 2 cores).

--compare maps renamed keys (RENAMED below) from the first file's names to the second's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from raychat.checkpoint_manager import find_checkpoint

RAYCHAT = [sys.executable, "-m", "raychat.cli"]
WORDS = (
    "the a river stone light cloud tree bird wind fire water runs falls grows sings over under near "
    "green blue old new small large one two three four five six seven eight nine ten plus minus times"
).split()
TRAIN_KEYS = ("step", "loss", "grad_norm", "lr")
RL_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "reward_mean",
    "pass_at_1",
    "response_len_mean",
    "num_tokens",
    "version",
)
# SFT validation covered only the calculator before the Trainer of components (issue 11); its BPB is now
# reported per task, and val_bpb is over every SFT task's held-out rows.
RENAMED = {"sft": {"val_bpb": "calculator_val_bpb"}}

SIZES = [
    "--seq-len", "96", "--device-batch-size", "4", "--num-workers", "2", "--cpus-per-worker", "0.5",
    "--total-batch-size", "768", "--seed", "0", "--keep-checkpoints", "1",
]  # fmt: skip
# pretraining's alone: SFT takes the shape from its --init-from and reads no shards (it refuses these flags)
PRETRAIN_SIZES = ["--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--buffer-size", "16"]


def run(args: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with open(log, "w") as f:
        proc = subprocess.run([*RAYCHAT, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        sys.exit(f"raychat {args[0]} failed (exit {proc.returncode}); see {log}")


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def chain(out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    corpus = out / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(0)
    for i in range(400):
        (corpus / f"doc{i:03d}.txt").write_text(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 90)))
        )
    run(
        ["data", "prepare", "--source", str(corpus), "--out", str(out / "data"), "--num-shards", "3"],
        out / "data.log",
    )
    run(["tokenizer", "train", "--data-dir", str(out / "data"), "--out", str(out / "tok"), "--vocab-size", "400"],
        out / "tok.log")  # fmt: skip
    common = ["--preset", "none", "--tokenizer-path", str(out / "tok"), "--storage-path", str(out / "ck"),
              *SIZES]  # fmt: skip
    run(["pretrain", *common, *PRETRAIN_SIZES, "--data-dir", str(out / "data"), "--run-name", "base",
         "--num-iterations", "30", "--eval-every", "10", "--eval-tokens", "1536", "--checkpoint-every", "15"],
        out / "pretrain.log")  # fmt: skip
    base = find_checkpoint(out / "ck" / "base")
    run(["sft", *common, "--run-name", "sft", "--init-from", base, "--num-iterations", "20", "--eval-every", "10",
         "--eval-tokens", "1536", "--checkpoint-every", "20", "--eval-examples", "8",
         "--sft-tasks", "calculator:300,spelling:200,chatterbot:200"], out / "sft.log")  # fmt: skip
    # 20 SFT steps of a depth-1 model never solve a calculator problem (every reward 0, so every advantage,
    # loss and gradient is 0); RL starts from a tiny calculator model instead, whose rewards vary
    tiny = out / "tiny_sft"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("rl_tiny_sft.py")), "--out", str(tiny),
                           "--steps", "100", "--max-operand", "9", "--eval-every", "100"],
                          stdout=open(out / "tiny_sft.log", "w"), stderr=subprocess.STDOUT)  # fmt: skip
    if proc.returncode:
        sys.exit(f"rl_tiny_sft.py failed; see {out / 'tiny_sft.log'}")
    run(["rl", "--init-from", str(tiny), "--storage-path", str(out / "rl"), "--run-name", "rl", "--steps", "3",
         "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-tokens", "24", "--max-operand", "9",
         "--micro-batch-size", "4", "--learner-workers", "2", "--rollout-workers", "1", "--cpus-per-rollout",
         "0.5", "--cpus-per-learner", "0.5", "--eval-every", "3", "--eval-examples", "8", "--eval-samples", "2",
         "--checkpoint-every", "3", "--seed", "0"], out / "rl.log")  # fmt: skip

    def train_numbers(lines: list[dict]) -> list[dict]:
        keep = lambda k: k in TRAIN_KEYS or k.endswith(("val_bpb", "_accuracy"))  # noqa: E731
        return [{k: v for k, v in x.items() if keep(k)} for x in lines]

    rl = [{k: x[k] for k in RL_KEYS if k in x} | ({"eval": x["eval"]} if "eval" in x else {})
          for x in jsonl(out / "rl" / "rl" / "metrics.jsonl")]  # fmt: skip
    return {
        "pretrain": train_numbers(jsonl(out / "ck" / "base" / "metrics.jsonl")),
        "sft": train_numbers(jsonl(out / "ck" / "sft" / "metrics.jsonl")),
        "rl": rl,
    }


def compare(before: dict, after: dict) -> list[str]:
    """Differences (as text) between two chain outputs: every number of `before` must be in `after`, equal."""
    diffs = []
    for stage, rows in before.items():
        if len(rows) != len(after.get(stage, [])):
            diffs.append(f"{stage}: {len(rows)} lines before, {len(after.get(stage, []))} after")
            continue
        for a, b in zip(rows, after[stage]):
            for key, value in a.items():
                new_key = RENAMED.get(stage, {}).get(key, key)
                if b.get(new_key, "<missing>") != value:
                    diffs.append(
                        f"{stage} step {a.get('step')}: {key} {value!r} -> {new_key} {b.get(new_key)!r}"
                    )
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/raychat-chain", help="scratch directory (deleted first)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two outputs and exit")
    a = ap.parse_args()
    if a.compare:
        before, after = (json.loads(Path(p).read_text()) for p in a.compare)
        diffs = compare(before, after)
        n = sum(len(x) for rows in before.values() for x in rows)
        print("\n".join(diffs) or f"bit-identical: {n} values over {sum(map(len, before.values()))} lines")
        return 1 if diffs else 0
    numbers = chain(Path(a.out))
    text = json.dumps(numbers, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

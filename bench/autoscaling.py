"""Cold start and scale-down on a cluster that starts empty: submission -> first pretraining step when the
autoscaler must first start a worker node (cold), against the same job while that node is still up (warm), and
how long an idle node takes to go away.

The cluster is tests/support/autoscaler.py's (Ray's own autoscaler with the fake_multinode provider: real
raylets on this machine, shaped like ray_cluster.yaml and k8s/: a head of 0 CPUs, CPU and GPU worker types
from 0 nodes), with an idle timeout of --idle-timeout-min. The job is tests/cluster/test_autoscaling.py's tiny
pretraining (2 Ray Train workers x 0.5 CPU, 2 steps). Not a timed test: the numbers depend on the machine's
load, printed beside them.

  .venv/bin/python bench/autoscaling.py --out bench/results/autoscaling.md
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.autoscaler import AutoscalingCluster  # noqa: E402
from support.cluster import short_temp_dir  # noqa: E402
from support.stage_chain import submit  # noqa: E402

from raychat.data.corpus.shards import write_manifest, write_shards  # noqa: E402
from raychat.tokenizer import Tokenizer  # noqa: E402

TOKENS_PER_S = re.compile(r"tok/s ([\d,]+)")
WAITING = re.compile(r"placed .* after ([\d.]+) s")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def write_corpus(root: Path) -> None:
    """A storage root with `data` (3 train shards + validation) and a 512-token BPE `tokenizer`."""
    docs = [
        " ".join(["river stone light", "cloud tree bird"][i % 2] for _ in range(5 + i % 40))
        for i in range(200)
    ]
    entries = write_shards(docs, root / "data", num_shards=3, row_group_size=64, log=lambda *_: None)
    write_manifest(root / "data", {"source": "bench", "shards": entries})
    Tokenizer.train(
        ["the river runs over stone, light on the cloud and tree; a bird."] * 200, vocab_size=512
    ).save(root / "tokenizer")


def pretrain_args(root: Path, run_name: str) -> list[str]:
    return [
        "pretrain", "--preset", "none", "--storage-path", str(root), "--run-name", run_name,
        "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--seq-len", "32", "--device-batch-size", "2",
        "--total-batch-size", "128", "--num-iterations", "2", "--eval-every", "0", "--eval-tokens", "64",
        "--checkpoint-every", "0", "--buffer-size", "8", "--max-failures", "0",
        "--num-workers", "2", "--cpus-per-worker", "0.5",
    ]  # fmt: skip


def row(name: str, run, nodes_at_submit: int) -> str:
    tok = TOKENS_PER_S.findall(run.output)
    waited = WAITING.findall(run.output)
    status = "SUCCEEDED" if run.returncode == 0 else f"exit {run.returncode}"
    first = "" if run.first_step_s is None else f"{run.first_step_s:.1f}"
    return (
        f"| {name} | {nodes_at_submit} | {status} | {first} | {waited[-1] if waited else ''} | "
        f"{run.wall_s:.1f} | {tok[-1] if tok else ''} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="markdown report to write")
    p.add_argument(
        "--idle-timeout-min", type=float, default=1.0, help="the autoscaler's idle_timeout_minutes"
    )
    args = p.parse_args()
    os.environ["RAY_AUTH_MODE"] = "token"
    began, load_before = datetime.now(), load()
    cluster = AutoscalingCluster(short_temp_dir("asb"), idle_timeout_minutes=args.idle_timeout_min)
    t0 = time.monotonic()
    try:
        cluster.start()
        started_s = time.monotonic() - t0
        with tempfile.TemporaryDirectory(prefix="raychat-as-bench-") as tmp:
            root = Path(tmp)
            write_corpus(root)
            assert cluster.worker_nodes() == [], "the cluster should start without worker nodes"
            cold = submit(pretrain_args(root, "cold"), "asb-cold", cluster.dashboard_url, cluster.token_file)
            warm_nodes = len(cluster.worker_nodes())
            warm = submit(pretrain_args(root, "warm"), "asb-warm", cluster.dashboard_url, cluster.token_file)
            ended = time.monotonic()
            cluster.wait_workers(lambda nodes: bool(nodes), timeout_s=5)  # still up right after the job
            cluster.wait_workers(lambda nodes: not nodes, timeout_s=args.idle_timeout_min * 60 + 300)
            gone_s = time.monotonic() - ended
    finally:
        cluster.stop()
    for name, run in (("cold", cold), ("warm", warm)):
        if run.returncode != 0:
            print(run.output[-4000:], file=sys.stderr)
            raise SystemExit(f"the {name} job failed")
    timeout_s = args.idle_timeout_min * 60
    text = f"""# Autoscaling: cold start against a warm cluster, and scale-down (issue 20)

## Run at {began:%Y-%m-%d %H:%M}-{datetime.now():%H:%M}

Command: `.venv/bin/python bench/autoscaling.py --out bench/results/autoscaling.md --idle-timeout-min {args.idle_timeout_min:g}`
Machine: 2 cores, shared with other work. Load average (1, 5, 15 min) before: {load_before}; after: {load()}.
Cluster: tests/support/autoscaler.py (Ray's autoscaler, fake_multinode provider: each node a real raylet on this
machine; head 0 CPUs; cpu_worker 2 CPUs, 0..2 nodes; gpu_worker 2 CPUs + 1 GPU, 0..1 nodes), head started in
{started_s:.1f} s. Job: tiny pretraining, 2 Ray Train workers x 0.5 CPU, 2 steps (one cpu_worker node holds both).

First step = submission -> the job's first training step line reaching `raychat submit` (runtime-env upload,
job supervisor, driver imports, the wait for the workers' resources, Ray Train, Ray Data, step 1).
Wait = what the run itself printed (`placed ... after N s`): the time its worker group waited to be placed
(empty: placed at once, no wait line).

| run | worker nodes at submission | status | first step s | wait s | wall s | tokens/s |
|---|---|---|---|---|---|---|
{row("cold", cold, 0)}
{row("warm", warm, warm_nodes)}

Cold start costs {cold.first_step_s - warm.first_step_s:.1f} s more than warm to the first step
({cold.first_step_s / warm.first_step_s:.2f}x).

Scale-down: with `idle_timeout_minutes: {args.idle_timeout_min:g}` ({timeout_s:.0f} s), the last worker node was gone
{gone_s:.1f} s after the warm job's end reached `raychat submit` ({gone_s - timeout_s:+.1f} s against the timeout).
A node's idle clock starts when its last worker process exits, a few seconds before the job's end reaches
`raychat submit` (the driver's shutdown, the job status poll), and the autoscaler checks every
AUTOSCALER_UPDATE_INTERVAL_S (1 s here); so a node goes away about the idle timeout after its work ends.
"""
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

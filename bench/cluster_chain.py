"""Job overhead on a real multi-node Ray cluster: the wall time of the whole chain of stage jobs, of each job,
and each training job's start-up (submission -> its first training step line arriving at `raychat submit`).

The chain and the cluster are the ones of tests/cluster/test_stage_jobs.py: tests/support/cluster.py's LocalCluster (a head
with no CPUs, workers a and b with 2 logical CPUs each (CLUSTER_WORKERS), token auth) and tests/support/stage_chain.py's run_chain (the KubeRay
cpu-dev RayJobs' entrypoints, the PVC mapped to a temp dir, each command submitted with `raychat submit`).
Not a timed test: the numbers depend on the machine's load, printed beside them.

  RAY_TMPDIR=/tmp/ray-bench .venv/bin/python bench/cluster_chain.py --out bench/results/cluster_chain.md
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.cluster import CLUSTER_WORKERS, LocalCluster, short_temp_dir  # noqa: E402
from support.stage_chain import run_chain  # noqa: E402

TOKENS_PER_S = re.compile(r"tok/s ([\d,]+)|rollout_tokens_per_s=([\d.e+]+)")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def tokens_per_s(output: str) -> str:
    """The last tokens/s a job's step lines reported ('' when it has none)."""
    found = TOKENS_PER_S.findall(output)
    return (found[-1][0] or found[-1][1]) if found else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="markdown report to write")
    args = p.parse_args()
    os.environ["RAY_AUTH_MODE"] = "token"
    load_before = load()
    cluster = LocalCluster(short_temp_dir("rcb"))
    t0 = time.monotonic()
    try:
        cluster.start(CLUSTER_WORKERS)
        started_s = time.monotonic() - t0
        with tempfile.TemporaryDirectory(prefix="raychat-pvc-") as mount:
            t1 = time.monotonic()
            runs = run_chain(Path(mount), cluster.dashboard_url, cluster.token_file, prefix="bench")
            chain_s = time.monotonic() - t1
    finally:
        cluster.stop()
    rows = [
        f"| {r.job_id} | `{r.command}` | {'SUCCEEDED' if r.returncode == 0 else f'exit {r.returncode}'} | "
        f"{r.wall_s:.1f} | {'' if r.first_step_s is None else f'{r.first_step_s:.1f}'} | {tokens_per_s(r.output)} |"
        for r in runs
    ]
    report = "\n".join(
        [
            "# The chain of stage jobs on the fixture cluster (issue 12)",
            "",
            f"Command: `RAY_TMPDIR={os.environ.get('RAY_TMPDIR', '')} .venv/bin/python bench/cluster_chain.py "
            f"--out {args.out}`",
            f"Load average (1, 5, 15 min) before: {load_before}; after: {load()} (2 cores, shared).",
            f"Cluster start (head + 2 workers): {started_s:.1f} s. Whole chain: {chain_s:.1f} s.",
            "",
            "Start-up = submission -> the job's first training step line reaching `raychat submit` (runtime-env "
            "upload, job supervisor, driver imports, Ray Train / RL actors, data, first step).",
            "",
            "| job | command (PVC mount mapped) | status | wall s | start-up s | tokens/s |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    Path(args.out).write_text(report)
    print(report)
    return 0 if all(r.returncode == 0 for r in runs) and len(runs) == 7 else 1


if __name__ == "__main__":
    sys.exit(main())

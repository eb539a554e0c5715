"""The parts of a job's start-up that happen before any cluster work, before (commit f873b17) vs after (this tree):
  1. the runtime_env package: `raychat submit` zips the checkout (working_dir minus WORKING_DIR_EXCLUDES, and
     .gitignore'd files, as Ray's packaging does) and uploads it; zip bytes and CPU seconds to build it with
     Ray's own packaging.create_package, with the old and the new exclude lists;
  2. the job driver's imports: fresh `python -c "import <module>"` processes for the module each stage's
     entrypoint runs (raychat.commands names it), with raychat from `git archive f873b17` (before) or this
     checkout (after), --repeats times each in ABBA order; median wall and CPU (user + sys) seconds, and
     whether torch._dynamo was imported (torch.compile's machinery, which no job driver uses).
A Ray Train worker imports the same training modules again, so the import saving counts once per worker
too. The cluster-side phases (job supervisor actor, Ray Train controller and worker group, Ray Data start)
are timed by bench/cluster_chain.py on the fixture cluster.

    python bench/job_startup.py [--repeats 3] [--out bench/results/job_startup.md]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, uptime
from _engine_common import REPO, archive

BASE = "f873b17"
OLD_EXCLUDES = [".venv", "runs", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"]
MODULES = {
    "pretrain / sft (Trainer on Ray Train)": "raychat.train.pretrain",
    "rl": "raychat.rl.cli",
    "eval": "raychat.eval.cli",
}


def package(excludes: list[str]) -> tuple[int, float]:
    """(zip bytes, CPU seconds) of the working_dir package Ray would upload with these excludes."""
    from ray._private.runtime_env import packaging

    target = Path(tempfile.mkdtemp()) / "pkg.zip"
    c0 = time.process_time()
    packaging.create_package(str(REPO), target, include_gitignore=True, excludes=excludes)
    return target.stat().st_size, time.process_time() - c0


def import_once(module: str, platform_dir: Path) -> dict:
    code = f"import sys, {module}; print('torch._dynamo' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(platform_dir)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "dynamo": out.stdout.strip().splitlines()[-1] == "True"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "platform"))
    from raychat.ops.submit import WORKING_DIR_EXCLUDES

    load_before = uptime()
    pkg = {"before": package(OLD_EXCLUDES), "after": package(list(WORKING_DIR_EXCLUDES))}
    old, new = archive(BASE), REPO / "platform"
    imports = {}
    for label, module in MODULES.items():
        runs = {"before": [], "after": []}
        order = (("before", old), ("after", new))
        for k in range(a.repeats):
            for name, path in order if k % 2 == 0 else order[::-1]:
                runs[name].append(import_once(module, path))
        imports[label] = {
            name: {
                "module": module,
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                "dynamo": rs[0]["dynamo"],
            }
            for name, rs in runs.items()
        }
        print(label, json.dumps(imports[label]), flush=True)
    load_after = uptime()
    result = {"package": pkg, "imports": imports, "load": [load_before, load_after], "machine": machine()}
    if a.out:
        lines = [
            f"# Job start-up before the cluster work: runtime_env package and driver imports ({BASE} vs after)",
            "",
            f"Command: `python bench/job_startup.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
            "",
            f"Machine: {machine()}. Load: `{load_before}` before, `{load_after}` after (shared machine: "
            "read the CPU seconds and the ratios).",
            "",
            "## 1. runtime_env package (working_dir zip, Ray's packaging.create_package)",
            "",
            "| | excludes | zip bytes | CPU s to build |",
            "|---|---|---:|---:|",
            f"| before | {', '.join(OLD_EXCLUDES)} | {pkg['before'][0]:,} | {pkg['before'][1]:.3f} |",
            f"| after | {', '.join(WORKING_DIR_EXCLUDES)} | {pkg['after'][0]:,} | {pkg['after'][1]:.3f} |",
            "",
            f"## 2. Job driver imports (median of {a.repeats} fresh processes each, ABBA)",
            "",
            "| stage | module | before wall s | before CPU s | after wall s | after CPU s | CPU before / after "
            "| torch._dynamo imported (before -> after) |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for label, r in imports.items():
            o, n = r["before"], r["after"]
            lines.append(
                f"| {label} | `{o['module']}` | {o['wall_s']:.2f} | {o['cpu_s']:.2f} | {n['wall_s']:.2f} | "
                f"{n['cpu_s']:.2f} | **{o['cpu_s'] / n['cpu_s']:.2f}x** | {o['dynamo']} -> {n['dynamo']} |"
            )
        lines.append("")
        Path(a.out).write_text("\n".join(lines))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

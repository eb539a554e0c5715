"""How long `raychat --help` and one command's `--help` take against `python -c pass`, in fresh processes.

    python bench/cli_startup.py [--repeat 5]

Prints the median wall seconds of each over --repeat runs, side by side in one run (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "raychat --help": [sys.executable, "-m", "raychat.cli", "--help"],
    "raychat jobs --help": [sys.executable, "-m", "raychat.cli", "jobs", "--help"],
    "raychat pretrain --help": [sys.executable, "-m", "raychat.cli", "pretrain", "--help"],
}


def median_seconds(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    base = None
    for name, cmd in CASES.items():
        s = median_seconds(cmd, args.repeat)
        base = base or s
        print(f"{name:26s} {s:7.3f} s  ({s / base:6.1f}x python -c pass)")


if __name__ == "__main__":
    main()

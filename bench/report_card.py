"""The report card's wall time for a speedrun's three checkpoints (base, SFT, RL) on this machine.

    python bench/report_card.py --run runs                       # a finished `raychat speedrun --out runs`
    python bench/report_card.py --base B --sft S --rl R          # any three checkpoints

Times raychat.eval.report_card.checkpoint_row for each, as the speedrun's report card step calls it (CORE of
the base checkpoint when the bundle is there, the chat evals of the SFT and RL checkpoints with the data on
this machine, --examples items each), and appends the table and the seconds to --out (default
bench/results/report_card.md). A benchmark (minutes at most), not run by the tests.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _common import append_result, command_line, machine, uptime

from raychat.checkpoint_manager import find_checkpoint
from raychat.eval.report_card import checkpoint_row, format_markdown
from raychat.storage import open_storage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=None, help="a speedrun's --out: its checkpoints/{base,sft} and rl/rl")
    ap.add_argument("--base", default=None)
    ap.add_argument("--sft", default=None)
    ap.add_argument("--rl", default=None)
    ap.add_argument("--examples", type=int, default=64, help="items per chat eval (the cpu preset's 64)")
    ap.add_argument("--task-data-dir", default=None, help="hub task files (default: raychat's default)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "report_card.md"))
    args = ap.parse_args()
    if args.run:
        root = Path(args.run).resolve()
        refs = {"base": (root / "checkpoints", "base"), "sft": (root / "checkpoints", "sft"),
                "rl": (root / "rl", "rl")}  # fmt: skip
        checkpoints = {k: find_checkpoint(run, open_storage(str(s)), "--run") for k, (s, run) in refs.items()}
    else:
        checkpoints = {k: getattr(args, k) for k in ("base", "sft", "rl") if getattr(args, k)}
    rows, seconds = {}, {}
    t_all = time.perf_counter()
    for stage, checkpoint in checkpoints.items():
        t0 = time.perf_counter()
        rows[stage] = checkpoint_row(
            checkpoint, stage != "base", args.task_data_dir, max_problems=args.examples
        )
        seconds[stage] = time.perf_counter() - t0
        rows[stage]["wall_s"] = seconds[stage]  # this table's "wall time": the card's own seconds per row
    total = time.perf_counter() - t_all
    table = format_markdown(rows)
    print(table)
    print(f"report card: {total:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in seconds.items())})")
    append_result(
        args.out,
        f"## {time.strftime('%Y-%m-%d %H:%M')}: {total:.1f} s for {len(rows)} checkpoints\n\n"
        f"`{command_line()}` on {machine()}; load: {uptime()}\n\n"
        f"Checkpoints: {', '.join(f'{k} `{v}`' for k, v in checkpoints.items())}. Seconds per row (model load "
        f"included): {', '.join(f'{k} {v:.1f}' for k, v in seconds.items())}; the wall time column below is "
        f"those seconds (not the stages' training time).\n\n{table}",
    )


if __name__ == "__main__":
    main()

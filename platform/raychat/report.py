"""The speedrun report: a markdown table of every stage, and the curves of every stage drawn from its metrics
sink (raychat.metrics_sink: metrics.jsonl) as PNG pictures with matplotlib (Agg backend, no display).

curves_<stage>.png: left, the training loss per step (and its smoothed value where the stage logs one); right,
validation BPB at each evaluation (pretraining, SFT: "val_bpb" and every "<task>_val_bpb") or, for RL, the
rollouts' mean reward per step, shaded +- its reward_std where the lines have one (reward_band; a run of one
step: an error bar), and held-out pass@1 at each evaluation, the baseline (step 0) first. Every step axis is
ticked at whole steps only (a curve of one point, val_bpb measured once: that step alone).

The run's report state, stages.json in the output directory: {stage: {"output", "wall_s", "figures"}}, written
(atomically) as each stage finishes by the invocation that ran it, so that a resumed speedrun reports a stage it
reused (its output already made) with the wall time and figures measured when it ran, marked "reused". "output"
is the identity of what the stage made (file_id: the data manifest, tokenizer.json, the final checkpoint's
commit marker): a record whose output has since been replaced is not used. Before pretraining runs, the
invocation also records its start ({"started": {"from", "at"}}: mark_start), so that the next invocation
records a final checkpoint committed by one stopped before its record was written (recover_record).

`raychat report RUN_DIR ...` draws the same curves for runs of your own (main): RUN_DIR/curves.png.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from raychat.atomic import atomic_write, atomic_write_text  # noqa: E402
from raychat.metrics_sink import read_jsonl  # noqa: E402
from raychat.storage import copy_command, is_remote  # noqa: E402

STATE_FILE = "stages.json"
# the wall-time line's order
WALL_STAGES = ("data", "tokenizer", "pretrain", "eval", "sft", "rl", "report_card")


def file_id(path: str | Path | None) -> str | None:
    """The sha256 (hex) of a file's bytes: the identity of a stage's output; None when there is no such file."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def read_state(out_dir: Path) -> dict:
    """The run's report state (module doc) in out_dir; {} when there is none or it does not parse (then a
    reused stage's figures are this invocation's, its wall time unknown)."""
    try:
        state = json.loads((Path(out_dir) / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def settle_stage(
    report: dict,
    state: dict,
    out_dir: Path,
    stage: str,
    wall_s: float,
    figures,
    output: str | None,
    ran: bool,
):
    """This invocation's report of `stage`: returns its figures and sets report["timings_s"][stage].

    ran: the stage did its work now: `wall_s` (seconds) and `figures` (JSON-able) are recorded in `state` under
    `output` (file_id of what it made) and state is written to out_dir/stages.json at once. Reused (ran False):
    the record of the same output gives the wall time and figures, and the stage is appended to
    report["reused"]; with no such record (an output made before raychat kept the state, or by hand), the
    figures given and a wall time of None. Raises OSError when the state cannot be written."""
    report.setdefault("reused", [])
    if ran:
        state[stage] = {"output": output, "wall_s": wall_s, "figures": figures}
        atomic_write_text(Path(out_dir) / STATE_FILE, json.dumps(state, indent=2, default=str))
        report["timings_s"][stage] = wall_s
        return figures
    report["reused"].append(stage)
    record = state.get(stage)
    if record is None or output is None or record.get("output") != output:
        report["timings_s"][stage] = None
        return figures
    report["timings_s"][stage] = record["wall_s"]
    return record["figures"]


def restore_state(out_dir: Path, saved: bytes | None) -> None:
    """Put back out_dir/stages.json as it was: `saved`, its bytes read before (None: there was none)."""
    path = Path(out_dir) / STATE_FILE
    if saved is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write(path, lambda p: p.write_bytes(saved))


def mark_start(state: dict, out_dir: Path, stage: str, before: str | None, at: float) -> None:
    """Record that this invocation starts `stage` at `at` (time.time()) from the output `before` (file_id of the
    stage's newest output then; None: none): state[stage]["started"], beside the stage's record, written to
    out_dir/stages.json at once, so that an invocation stopped after the stage made its output but before
    settle_stage recorded it leaves what the next one needs (recover_record). Raises OSError as settle_stage."""
    state.setdefault(stage, {})["started"] = {"from": before, "at": at}
    atomic_write_text(Path(out_dir) / STATE_FILE, json.dumps(state, indent=2, default=str))


def recover_record(
    state: dict, out_dir: Path, stage: str, output: str | None, made_at: float | None, figures
) -> None:
    """Record `stage` as made by the invocation that last started it (mark_start) when that one was stopped
    after making `output` (made at `made_at`, time.time(): a checkpoint's committed_at) but before recording it:
    wall_s from its start to made_at, `figures` as given, written at once. Nothing when state records `output`
    already, or the start is not one that made it (none, from `output` itself, or after made_at)."""
    record = state.get(stage) or {}
    started = record.get("started")
    if output is None or made_at is None or record.get("output") == output or not started:
        return
    if started["from"] == output or started["at"] > made_at:
        return
    state[stage] = {"output": output, "wall_s": made_at - started["at"], "figures": figures}
    atomic_write_text(Path(out_dir) / STATE_FILE, json.dumps(state, indent=2, default=str))


def wall_line(t: dict, reused: list[str]) -> str:
    """The wall-time cell: the run's total (the stages' recorded wall times), each stage's ("reused": measured
    by the invocation that ran it; n/a: not known), then this invocation's time."""
    parts = []
    for stage in (s for s in WALL_STAGES if s in t):
        value = t[stage]
        text = f"{value:.0f}" if isinstance(value, (int, float)) else "n/a"
        parts.append(f"{stage.replace('_', ' ')} {text}" + (" reused" if stage in reused else ""))
    unknown = " + n/a" if any(t[s] is None for s in WALL_STAGES if s in t) else ""
    return (
        f"{run_total(t):.0f} s{unknown} ({', '.join(parts)}); this invocation {t.get('invocation', 0):.0f} s"
    )


def run_total(t: dict) -> float:
    """The run's wall time, seconds: the sum of the stages' known wall times in t (report["timings_s"])."""
    return sum(t.get(stage) or 0.0 for stage in WALL_STAGES)


def reward_band(lines: list[dict]) -> tuple[list[int], list[float], list[float]] | None:
    """The band drawn around an RL run's reward curve: (steps, reward_mean - reward_std, reward_mean +
    reward_std) of its step `lines` (each with "step" and "reward_mean"), NaN (no band there) at a line
    without reward_std, written before RL logged it; None when no line has one."""
    if not any(x.get("reward_std") is not None for x in lines):
        return None
    std = [x.get("reward_std") for x in lines]
    return (
        [x["step"] for x in lines],
        [math.nan if s is None else x["reward_mean"] - s for x, s in zip(lines, std)],
        [math.nan if s is None else x["reward_mean"] + s for x, s in zip(lines, std)],
    )


def plot_stage(stage: str, lines: list[dict], path: Path) -> Path | None:
    """Write curves_<stage>.png of a stage's metrics lines (module doc); None when there are no lines."""
    evals = [x["eval"] for x in lines if isinstance(x.get("eval"), dict)]  # RL's, its baseline (step 0) first
    lines = [x for x in lines if isinstance(x.get("step"), int) and x.get("loss") is not None]
    if not lines:
        return None
    rl = stage == "rl" and all("reward_mean" in x for x in lines)  # a pretraining run may be named "rl"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    steps = [x["step"] for x in lines]
    dot = "o" if len(steps) == 1 else None  # a line of one point draws nothing: the tiny preset's 1 RL step
    left.plot(steps, [x["loss"] for x in lines], lw=1, marker=dot, label="loss")
    if all("smooth_loss" in x for x in lines):
        left.plot(steps, [x["smooth_loss"] for x in lines], lw=1.5, marker=dot, label="smoothed")
    left.set(
        title=f"{stage}: training loss",
        xlabel="step",
        ylabel="loss (nats/token)" if not rl else "loss",
    )
    left.legend()
    if rl:
        right.plot(steps, [x["reward_mean"] for x in lines], lw=1, marker=dot, label="rollout reward (mean)")
        if (band := reward_band(lines)) and dot:  # one step: a band of one point draws nothing
            mean, std = lines[0]["reward_mean"], lines[0]["reward_std"]
            right.errorbar(steps, [mean], yerr=[std], fmt="none", capsize=4, label="reward ± std")
        elif band:
            right.fill_between(*band, alpha=0.2, lw=0, label="reward ± std")
        if evals:
            right.plot(
                [e["step"] for e in evals], [e["pass@1"] for e in evals], "o-", label="held-out pass@1"
            )
        right.set(title="rl: reward and pass@1", xlabel="step", ylim=(-0.02, 1.02))
    else:
        keys = sorted(
            {k for x in lines for k in x if k.endswith("val_bpb")}, key=lambda k: (k != "val_bpb", k)
        )
        for key in keys:
            pts = [(x["step"], x[key]) for x in lines if x.get(key) is not None]
            right.plot(*zip(*pts), "o-", lw=1.5 if key == "val_bpb" else 1, label=key)
        right.set(title=f"{stage}: validation BPB", xlabel="step", ylabel="bits per byte")
    if right.lines:
        right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
        # min_n_ticks=1: a view holding one whole step (one evaluation) gets it alone, not 3.8, 3.9, ... 4.2
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return path


def write_report(out_dir: Path, r: dict, metrics_files: dict[str, Path] | None = None) -> Path:
    """report.md (a table of the run, the report card (r["report_card"]["markdown"], raychat.eval.report_card),
    the curves of every stage, greedy samples) and report.json in out_dir.

    metrics_files: {stage: its metrics.jsonl}; each stage found gets curves_<stage>.png (plot_stage).
    A stage's figures are the metrics of its final checkpoint (Ray Train's last report): "step" counts the
    optimizer steps done (from 1, resumes included: the whole plan, as a speedrun sets no --stop-after), and
    "loss", "val_bpb", "tokens_per_s", "data_wait_frac" are those of that last step; each row names its stage.
    """
    p, t = r["pretrain"], r["timings_s"]
    curves = []
    for stage, path in (metrics_files or {}).items():
        png = (
            plot_stage(stage, read_jsonl(path), out_dir / f"curves_{stage}.png")
            if Path(path).exists()
            else None
        )
        if png is not None:
            curves += [f"![{stage} curves]({png.name})", ""]
    lines = [
        f"# raychat speedrun report (preset `{r['preset']}`)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| corpus | {r['data'].get('source')} ({r['data'].get('license')}), "
        f"{r['data'].get('documents'):,} documents, {r['data'].get('bytes', 0) / 1e6:.1f} MB |",
        f"| tokenizer | vocab {r['tokenizer'].get('vocab_size')}, "
        f"{r['tokenizer'].get('val_bytes_per_token', 'n/a')} bytes/token (val) |",
        f"| pretrain optimizer steps | {p.get('step')} |",
        f"| pretrain train loss (last step) | {p.get('loss', float('nan')):.4f} |",
        f"| pretrain validation BPB (last step) | {p.get('val_bpb', float('nan')):.4f} |",
        f"| unigram baseline BPB | {r['unigram_bpb']:.4f} |",
        f"| pretrain tokens/s (last step, all workers) | {p.get('tokens_per_s', 0):,.0f} |",
        f"| pretrain data wait (last step) | {100 * p.get('data_wait_frac', 0):.1f}% |",
        f"| wall time | {wall_line(t, r.get('reused', []))} |",
        *(
            [
                f"| reused stages | {', '.join(r['reused'])} (made by an earlier invocation: its figures and wall time) |"
            ]
            if r.get("reused")
            else []
        ),
        f"| pretrain checkpoint | `{r['checkpoint']}` |",
        *(
            [
                f"| SFT optimizer steps | {r['sft'].get('step')} (val BPB on held-out conversations of its tasks "
                f"{r['sft'].get('val_bpb', float('nan')):.4f}) |",
                *(
                    [
                        f"| {r['sft'].get('accuracy_task', 'calculator')} accuracy before / after SFT | "
                        f"{r['sft']['accuracy_before']:.3f} / {r['sft']['accuracy_after']:.3f} "
                        f"({r['sft']['eval_examples']} held-out problems) |"
                    ]
                    if "accuracy_before" in r["sft"]
                    else []
                ),
            ]
            if r.get("sft")
            else []
        ),
        *([f"| RL | {r['rl'].get('summary', '')} |"] if r.get("rl") else []),
        f"| final checkpoint | `{r.get('final_checkpoint')}` |",
        "",
        *(["## Report card", "", r["report_card"]["markdown"], ""] if r.get("report_card") else []),
        *(["## Curves", "", *curves] if curves else []),
        "## Samples (greedy)",
        "",
        *[f"- {json.dumps(s)}" for s in r.get("samples", [])],
        "",
    ]
    path = out_dir / "report.md"
    atomic_write_text(path, "\n".join(lines))
    atomic_write_text(out_dir / "report.json", json.dumps(r, indent=2, default=str))
    return path


def not_a_run_directory(run: str) -> str | None:
    """Why `raychat report` cannot read `run` as a run directory (an s3:// or gs:// URI, with the command that
    copies it here; a file), or None."""
    if is_remote(run):
        name = run.rstrip("/").rsplit("/", 1)[-1]
        return (
            f"{run} is a URI: raychat report reads a run directory on a local or mounted filesystem; copy it here "
            f"first ({copy_command(run, '.')}), then raychat report {name}"
        )
    if Path(run).exists() and not Path(run).is_dir():
        return f"{run} is a file, not a run directory (give a pretrain, sft or rl run directory)"
    return None


def main(args) -> int:
    """`raychat report RUN_DIR [RUN_DIR ...]` (args.run_dirs): the curves of each run directory of pretrain, sft
    or rl (on a local or mounted filesystem) from its metrics.jsonl, as the speedrun draws a stage's (plot_stage;
    the title is the directory's name, or rl for an RL run's lines), written to RUN_DIR/curves.png; one line on
    stdout for each. Returns exit status 2, with a line on stderr naming the directory, when one holds no
    metrics.jsonl or no step in it, or is no local directory (not_a_run_directory), or its curves.png cannot be
    written (the others are drawn); 0 otherwise."""
    status = 0
    for text in args.run_dirs:
        if why := not_a_run_directory(text):
            print(f"raychat report: error: {why}", file=sys.stderr)
            status = 2
            continue
        run = Path(text)
        metrics = run / "metrics.jsonl"
        lines = read_jsonl(metrics) if metrics.is_file() else []
        steps = [x for x in lines if isinstance(x.get("step"), int) and x.get("loss") is not None]
        if not steps:
            below = ", ".join(str(m.parent) for m in runs_below(run))
            why = (
                "holds no step yet"
                if metrics.is_file()
                else "is not there (give a pretrain, sft or rl run directory"
                + (f"; run directories under {run}: {below})" if below else ")")
            )
            print(f"raychat report: error: {metrics} {why}", file=sys.stderr)
            status = 2
            continue
        stage = "rl" if any("reward_mean" in x for x in steps) else run.resolve().name
        try:
            path = plot_stage(stage, lines, run / "curves.png")
        except OSError as e:  # a read-only mount, a directory in the way: this one only, the others are drawn
            print(f"raychat report: error: {run / 'curves.png'} cannot be written: {e}", file=sys.stderr)
            status = 2
            continue
        n = len(steps)
        print(f"wrote {path} ({n} step{'s' if n != 1 else ''}, {steps[0]['step']}..{steps[-1]['step']})")
    return status


def runs_below(root: Path) -> list[Path]:
    """The metrics.jsonl files one to three directories below root, sorted: the run directories a speedrun's
    --out holds (checkpoints/base, checkpoints/sft, rl/rl), for an error that names them."""
    return sorted(m for depth in (1, 2, 3) for m in root.glob("/".join(["*"] * depth) + "/metrics.jsonl"))


if __name__ == "__main__":  # the command it was before
    sys.exit("python -m raychat.report is now `raychat report RUN_DIR [RUN_DIR ...]`")

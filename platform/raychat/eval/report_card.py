"""The report card: nanochat's table of a run (CORE, the chat evals, ChatCORE) for one or more checkpoints.

Columns (nanochat's report; chat evals as its scripts/chat_eval.py runs them, SpellingBee as in its version
that had it, commit 950a1dc^):
  CORE           raychat.eval.core.core_scores on the DCLM eval bundle (mean centered accuracy)
  ARC-Easy, ARC-Challenge, MMLU   categorical: argmax of the answer letters' logits (raychat.eval.tasks)
  GSM8K, HumanEval, SpellingBee   generative, greedy (GSM8K and SpellingBee with the calculator tool;
                 HumanEval's programs run in raychat.tasks.sandbox); SpellingBee is raychat's `spelling`
                 task (spell a word / count a letter, /usr/share/dict/words), 256 items as nanochat's
  ChatCORE       the mean over the six chat evals of (accuracy - baseline) / (1 - baseline), baseline 0.25
                 for the categorical ones (nanochat's "multiple choice 1 of 4"), 0 for the generative ones;
                 only when all six were measured (nanochat computes it only then)
A cell is {"value": float or None, "note": why there is no value, "examples": items scored, "stderr": the
standard error of a chat eval's accuracy (raychat.eval.tasks.accuracy_stderr; None for one item, for CORE and
ChatCORE, and without a value)}, and for a generative column "max_tokens": the completion budget it was
measured at (each task's own, raychat.eval.tasks.MAX_TOKENS: GSM8K, HumanEval 512 as nanochat's chat_eval,
SpellingBee 128, unless one budget was given for every task; the table shows a budget other than the task's
own after the value), and "too_long": how many of its items had a prompt too long for the model, scored
incorrect (raychat.eval.tasks.too_long; only when some had). Notes:
"n/a: no data" (the task's files or the CORE bundle are not on this machine), "-" (not measured: the speedrun
measures CORE on base checkpoints and the chat evals on chat checkpoints, as nanochat; `raychat eval` the columns
its --tasks name, all six with chatcore), "n/a: sampled" (`raychat eval` scored the task by sampling, --temperature
above 0: its pass@1 is in eval.json's tasks, not on this greedy card), "n/a: needs all six".
"""

from __future__ import annotations

import time
from pathlib import Path

from raychat.checkpoint import load_model
from raychat.eval.core import core_scores
from raychat.eval.tasks import accuracy_stderr, task_accuracy_counts, task_budget
from raychat.log import plural
from raychat.tasks.hub_data import HUB_SPLITS, TASK_DATA_ENV, download_command, task_data_dir
from raychat.tasks.registry import make_task
from raychat.tasks.spelling import DEFAULT_WORDS

# column -> (registry task, random baseline accuracy): nanochat scripts/chat_eval.py baseline_accuracies
CHAT_TASKS = {
    "ARC-Easy": ("arc-easy", 0.25),
    "ARC-Challenge": ("arc-challenge", 0.25),
    "MMLU": ("mmlu", 0.25),
    "GSM8K": ("gsm8k", 0.0),
    "HumanEval": ("humaneval", 0.0),
    "SpellingBee": ("spelling", 0.0),
}
SPELLING_EXAMPLES = 256  # nanochat: SpellingBee(size=256, split="test")
COLUMNS = ("CORE", *CHAT_TASKS, "ChatCORE")
NO_DATA, NOT_MEASURED, NEEDS_ALL = "n/a: no data", "-", "n/a: needs all six"
SAMPLED = "n/a: sampled"  # raychat eval's sampled score of a card task, kept off the greedy card
BUNDLE_DIR = "eval_bundle"  # CORE's default place: <task data dir>/eval_bundle


def cell(
    value: float | None = None,
    note: str | None = None,
    examples: int | None = None,
    max_tokens: int | None = None,
    stderr: float | None = None,
) -> dict:
    """A card cell (module doc); "max_tokens" only when given (a generative column's budget)."""
    return {"value": value, "note": note, "examples": examples, "stderr": stderr} | (
        {"max_tokens": max_tokens} if max_tokens else {}
    )


def accuracy_cell(accuracy: float, examples: int, max_tokens: int | None = None, too_long: int = 0) -> dict:
    """The cell of a chat eval's `accuracy` over `examples` items, with its standard error; "too_long" when
    `too_long` of them had a prompt too long for the model."""
    out = cell(accuracy, examples=examples, max_tokens=max_tokens, stderr=accuracy_stderr(accuracy, examples))
    return out | ({"too_long": too_long} if too_long else {})


def centered(accuracy: float, baseline: float) -> float:
    """(accuracy - baseline) / (1 - baseline): 0 at chance, 1 perfect (nanochat's ChatCORE term)."""
    return (accuracy - baseline) / (1.0 - baseline)


def chatcore(cells: dict) -> dict:
    """The ChatCORE cell of a row's chat cells (module doc)."""
    values = [cells.get(c, {}).get("value") for c in CHAT_TASKS]
    if any(v is None for v in values):
        return cell(note=NEEDS_ALL)
    terms = [centered(v, baseline) for v, (_, baseline) in zip(values, CHAT_TASKS.values())]
    return cell(sum(terms) / len(terms))


def measured_line(
    stage: str, checkpoint: str, column: str, c: dict, seconds: float, what: str = "report card"
) -> str:
    """The line logged when chat eval `column` of the `stage` checkpoint at `checkpoint` is measured: its cell
    `c`'s accuracy, its standard error when it has one, its items, and the wall time in seconds, e.g. `report
    card, sft checkpoint runs/sft/checkpoint_000002: SpellingBee 0.0625 ± 0.0152 (256 items, 1.2 s)` (stage '':
    `report card, checkpoint ...`; `what` in place of "report card": raychat eval's --tasks lines)."""
    named = f"{stage} checkpoint" if stage else "checkpoint"
    spread = f" ± {c['stderr']:.4f}" if c.get("stderr") is not None else ""
    items = f"{c['examples']} item{'' if c['examples'] == 1 else 's'}"
    if c.get("too_long"):
        items += f", {c['too_long']} too long for the model"
    return f"{what}, {named} {checkpoint}: {column} {c['value']:.4f}{spread} ({items}, {seconds:.1f} s)"


def chat_cells(
    model, tokenizer, data_dir: str | None = None, max_problems: int | None = None,
    max_tokens: int | None = None, columns=tuple(CHAT_TASKS), seed: int = 0, log=None,
    scored: tuple[str, str] = ("", ""),
) -> dict:  # fmt: skip
    """{column: cell} of the chat evals in `columns` on the test splits: a task whose files are missing under
    the task data directory gets "n/a: no data" (never 0; no_data_lines says where its files go). max_problems
    caps the items of each task (None: all, SpellingBee 256); max_tokens: the completion budget of every
    generative one (None: each its own, raychat.eval.tasks.task_budget), recorded in its cell; log: a
    callable given each measured column's line (measured_line), which names `scored`: (stage, checkpoint) of
    the model."""
    out = {}
    for column in columns:
        name, _ = CHAT_TASKS[column]
        try:
            task = make_task(name, "test", None, seed, data_dir=data_dir)
        except FileNotFoundError:
            out[column] = cell(note=NO_DATA)
            continue
        n = len(task) if name != "spelling" else SPELLING_EXAMPLES
        n = min(n, max_problems or n, len(task))
        t0 = time.perf_counter()
        budget = task_budget(name, max_tokens) if task.eval_type == "generative" else None
        accuracy, long = task_accuracy_counts(model, tokenizer, task, n, max_tokens=budget)
        out[column] = accuracy_cell(accuracy, n, budget, long)
        if log:
            log(measured_line(*scored, column, out[column], time.perf_counter() - t0))
    return out


def no_data_lines(rows: dict[str, dict], data_dir: str | None = None) -> list[str]:
    """The lines saying which chat evals of `rows` ({stage: row or {column: cell}}) read "n/a: no data": one
    summary line naming each column once (with the stages that wanted it when `rows` has several stages),
    then one line per missing source: the hub repo's download into the task data directory
    (raychat.tasks.hub_data; ARC-Easy and ARC-Challenge share one), or the word list's package. [] when every
    chat column had its data."""
    wanted: dict[str, list[str]] = {}
    for stage, row in rows.items():
        for column in CHAT_TASKS:
            if row.get(column, {}).get("note") == NO_DATA:
                wanted.setdefault(column, []).append(stage)
    if not wanted:
        return []
    base = task_data_dir(data_dir)
    groups: dict[tuple[str, ...], list[str]] = {}
    for column, stages in wanted.items():
        groups.setdefault(tuple(stages), []).append(column)
    named = "; ".join(
        ", ".join(columns) + (f" ({', '.join(stages)})" if len(rows) > 1 else "")
        for stages, columns in groups.items()
    )
    sources: dict[str, list[str]] = {}
    for column in wanted:
        name = CHAT_TASKS[column][0]
        spec = HUB_SPLITS.get((name, "test"))
        where = (
            download_command(spec, base)
            if spec
            else f"{DEFAULT_WORDS}: install the Debian package `wamerican`"
        )
        sources.setdefault(where, []).append(column)
    return [
        f"report card: {NO_DATA} for {named}; get their files into the task data directory {base} "
        f"(--task-data-dir or ${TASK_DATA_ENV}; layouts: raychat.tasks.hub_data):",
        *(f"  {', '.join(columns)}: {where}" for where, columns in sources.items()),
    ]


def bundle_path(bundle_dir: str | None = None, data_dir: str | None = None) -> Path | None:
    """The CORE bundle directory: bundle_dir, else <task data dir>/eval_bundle; None when it has no core.yaml."""
    root = Path(bundle_dir) if bundle_dir else task_data_dir(data_dir) / BUNDLE_DIR
    return root if (root / "core.yaml").exists() else None


def core_cell(
    model,
    tokenizer,
    bundle_dir: str | None = None,
    max_per_task: int = -1,
    data_dir: str | None = None,
    **core_kw,
) -> dict:
    """The CORE cell: core_scores on the bundle at bundle_dir ('' / None: <task data dir>/eval_bundle, the task
    data dir being data_dir's as raychat.tasks.hub_data.task_data_dir reads it); "n/a: no data" when no bundle
    is there."""
    root = bundle_path(bundle_dir, data_dir)
    if root is None:
        return cell(note=NO_DATA)
    scores = core_scores(model, tokenizer, root, max_per_task=max_per_task, **core_kw)
    examples = sum(t["examples"] for t in scores["tasks"].values())
    if scores["core_metric"] is None:
        return cell(note=f"n/a: {plural(len(scores['errors']), 'task')} failed", examples=examples)
    return cell(scores["core_metric"], examples=examples)


def checkpoint_row(
    checkpoint: str, chat: bool, data_dir: str | None = None, bundle_dir: str | None = None,
    max_problems: int | None = None, log=None, stage: str = "", **extra,
) -> dict:  # fmt: skip
    """The card row of one checkpoint: CORE when `chat` is False (a base model), the chat evals when True; the
    model is loaded only when a cell has data to score; log: given each measured chat column's line, naming
    `stage` and the checkpoint (measured_line)."""
    core, chat_row, model = None, None, None
    if not chat and bundle_path(bundle_dir, data_dir) is not None:
        model, tokenizer, _ = load_model(checkpoint)
        core = core_cell(model, tokenizer, str(bundle_path(bundle_dir, data_dir)))
    elif not chat:
        core = cell(note=NO_DATA)
    if chat:
        model, tokenizer, _ = load_model(checkpoint)
        chat_row = chat_cells(model, tokenizer, data_dir, max_problems, log=log, scored=(stage, checkpoint))
    return card_row(core, chat_row, checkpoint=checkpoint, **extra)


def card_row(core: dict | None = None, chat: dict | None = None, **extra) -> dict:
    """A full row: CORE, the chat columns and ChatCORE ("-" where not measured), plus extra fields (e.g.
    wall_s, tokens_per_s, checkpoint)."""
    chat = chat or {}
    row = {"CORE": core or cell(note=NOT_MEASURED)}
    row |= {c: chat.get(c, cell(note=NOT_MEASURED)) for c in CHAT_TASKS}
    row["ChatCORE"] = chatcore(row) if chat else cell(note=NOT_MEASURED)
    return row | extra


LEGEND = (
    f"{NOT_MEASURED}: not measured (the speedrun: CORE on the base model, chat evals on chat models; raychat eval: "
    f"the columns --tasks names); {NO_DATA}: the files are not on this machine (README: nanochat's full report "
    f"card); {SAMPLED}: scored by sampling (--temperature above 0), kept off this greedy card (eval.json's tasks "
    f"hold it); {NEEDS_ALL}: ChatCORE averages all six chat evals; (N tok): measured at a completion budget of N "
    "tokens, not the task's own."
)

# the speedrun's timed columns (raychat.speedrun.report_card): one column of two throughputs
TIMED_LEGEND = (
    "wall time (s): the stage's; tokens/s: its median step's, training tokens over all workers for pretraining "
    "(base) and SFT, completion tokens the rollout actors generated for RL."
)


def _text(c: dict, column: str) -> str:
    if c.get("value") is None:
        return c.get("note") or NOT_MEASURED
    budget, own = c.get("max_tokens"), task_budget(CHAT_TASKS[column][0]) if column in CHAT_TASKS else None
    return f"{c['value']:.4f}" + (f" ({budget} tok)" if budget and budget != own else "")


def _number(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


def format_markdown(rows: dict[str, dict]) -> str:
    """A markdown table: one line per stage (row name), the COLUMNS, then wall time (s) and tokens/s when a
    row has them (wall_s, tokens_per_s), and a legend line (with those columns, TIMED_LEGEND after it)."""
    timed = any("wall_s" in r or "tokens_per_s" in r for r in rows.values())
    head = ["stage", *COLUMNS, *(["wall time (s)", "tokens/s"] if timed else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage, r in rows.items():
        cells = [stage, *(_text(r[c], c) for c in COLUMNS)]
        if timed:
            cells += [_number(r.get("wall_s"), ".0f"), _number(r.get("tokens_per_s"), ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", LEGEND + (f" {TIMED_LEGEND}" if timed else "")]
    return "\n".join(lines)

"""`raychat eval`: validation BPB and held-out task accuracy of one checkpoint, as JSON.

  --checkpoint REF  -> raychat.checkpoint_manager.resolve_checkpoint (fetched when remote) -> load_model
  BPB               the validation shard of --data-dir, best-fit packed into rows of the model's
                    max_seq_len + 1 tokens (raychat.data.loader.pipeline.validation_rows, the pretraining validator's
                    rows), --eval-tokens of them (raychat.eval.bpb: nats / (ln 2 * UTF-8 bytes) over the
                    target tokens), with the checkpoint's document masking: a pretraining checkpoint's logged
                    val_bpb at the same --eval-tokens. --eval-tokens 0: none (a chat checkpoint scored without
                    the pretraining data, as nanochat's chat_eval): --data-dir is not read, val_bpb is null and
                    val_bpb_note says why
  accuracy          the test split of each --tasks entry (raychat.eval.tasks.task_accuracy: greedy, exact
                    answer for generative tasks, argmax over the letters for categorical ones); a generative
                    task's completion budget: --max-tokens for every task when given, else the task's own
                    (raychat.eval.tasks.task_budget), the same as the report card's, recorded in the result;
                    --temperature above 0: --samples completions of each generative item, pass@1..pass@samples
                    (raychat.eval.tasks.task_pass_at_k), which the greedy report card does not take

  report card       raychat.eval.report_card: CORE (when the bundle is at --core-bundle) and the chat evals
                    of --tasks (chatcore[:N]: all six, "n/a: no data" for those whose files are missing)

  inputs            not given, --data-dir and the task data directory (--task-data-dir, $RAYCHAT_TASK_DATA)
                    are those of the speedrun whose --out holds the checkpoint (X/checkpoints/<run>/ or
                    X/rl/<run>/: X/data with a manifest.json, X/task_data), each named in one stderr line
                    (speedrun_inputs); else runs/data (--storage-path's run 'data') and runs/task_data

The result goes to stdout (one JSON document, its "report_card" the card's row) and to
<storage-path>/<run-name>/eval.json (written whole: raychat.storage.write_bytes); the card's markdown table to
stderr and to <storage-path>/<run-name>/report_card.md; the last line of stderr names both files. Not given,
the two are the checkpoint's: <root>/<run>/checkpoint_<step> writes <root>/<run>-eval-step<step>/
(raychat.checkpoint_manager.output_place). Every input is resolved and the root checked for writing
before the model loads: a bad flag fails in one line naming it, a bad record of a task's files (--tasks, and with
chatcore every chat eval whose files are in the task data directory) in one line naming its file and line. A
model whose validation loss is not finite (NaN or inf weights) is refused after the BPB pass (without BPB: before
the tasks, from its weights), before anything is written (JSON has no NaN).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.fs as pafs
import torch

from raychat.atomic import remove_leftovers
from raychat.checkpoint import document_masking, load_model
from raychat.checkpoint_manager import check_output_target, find_checkpoint, is_run_checkpoint, output_place
from raychat.config import EvalConfig, from_args, to_dict
from raychat.config.eval import CHATCORE, CHECKPOINTS_ROOT
from raychat.config.flags import chosen
from raychat.config.speedrun import CHECKPOINTS, DATA, RL, TASK_DATA
from raychat.data.corpus.shards import list_shards
from raychat.data.loader.pipeline import validation_rows
from raychat.engine.sampling import is_greedy
from raychat.eval.bpb import bpb_sums
from raychat.eval.report_card import (
    CHAT_TASKS,
    SAMPLED,
    accuracy_cell,
    bundle_path,
    card_row,
    cell,
    chat_cells,
    core_cell,
    format_markdown,
    measured_line,
    no_data_lines,
)
from raychat.eval.tasks import accuracy_stderr, mean_stderr, task_accuracy_counts, task_budget, task_pass_at_k
from raychat.storage import Storage, check_writable, open_storage, read_bytes, run_directory, write_bytes
from raychat.tasks.hub_data import TASK_DATA_ENV, task_data_dir
from raychat.tasks.registry import check_data, check_present_data, make_task, parse_mixture

RESULT_FILE = "eval.json"
CARD_FILE = "report_card.md"
CARD_NAMES = {name: column for column, (name, _) in CHAT_TASKS.items()}
BPB_SKIPPED = "not measured: --eval-tokens 0"  # eval.json's val_bpb_note when val_bpb is null


def check_eval_target(storage: Storage, run_name: str) -> str:
    """<root>/<run_name>, where eval writes RESULT_FILE and CARD_FILE: nothing there, an empty directory or an
    earlier eval's results (only those two files, killed writes' leftovers aside). Another stage's directory
    is refused: a training run, a checkpoint, an export, data or a tokenizer, whose own reruns would then refuse
    it for holding eval's files.

    Raises ValueError naming --run-name (raychat.checkpoint_manager.check_output_target)."""
    own = {RESULT_FILE, CARD_FILE}
    return check_output_target(
        storage, storage.writable_run_path(run_name), "--run-name", "eval results", "an earlier eval's results",
        lambda entries, killed: all(e.type == pafs.FileType.File and e.base_name in own for e in entries),
    )  # fmt: skip


def replaced_line(storage: Storage, run_name: str) -> str | None:
    """The stderr line saying which earlier evaluation this one's files replace at <root>/<run_name>, e.g.
    `eval: replacing runs/rl/rl50-eval-step50's results (rl checkpoint .../checkpoint_000050, 2026-12-06T09:30:00+00:00);
    give another --run-name to keep both`; None when there is no earlier eval.json there."""
    path = f"{storage.run_path(run_name)}/{RESULT_FILE}"
    try:
        earlier = json.loads(read_bytes(storage, path))
    except (OSError, ValueError):  # none there, or a half-written one: nothing to name
        return None
    scored = " ".join(str(x) for x in (earlier.get("stage"), "checkpoint", earlier.get("checkpoint")) if x)
    when = f", {earlier['finished_at']}" if earlier.get("finished_at") else ""
    return (
        f"eval: replacing {storage.uri_of(storage.run_path(run_name))}'s results ({scored}{when}); give another "
        "--run-name to keep both"
    )


def split_card_tasks(spec: str) -> tuple[str, int | None, bool]:
    """(--tasks without its chatcore entry, chatcore's examples cap, whether chatcore was named)."""
    rest, cap, named = [], None, False
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, count = item.partition(":")
        if name.strip() == CHATCORE:
            named, cap = True, int(count) if count else None
        else:
            rest.append(item)
    return ",".join(rest), cap, named


def categorical_line(categorical: list[str], cfg: EvalConfig) -> str | None:
    """The stderr line saying that the `categorical` tasks (their names) are scored greedily though cfg asks for
    sampling (a --temperature above 0), e.g. `eval: mmlu, arc-easy measured greedily, as accuracy: a categorical
    task's answer is the letter with the highest logit, with no completion to sample (--samples 4 --temperature
    0.8 sample the generative tasks only)`; None at temperature 0 or without a categorical task."""
    if is_greedy(cfg.temperature) or not categorical:
        return None
    return (
        f"eval: {', '.join(categorical)} measured greedily, as accuracy: a categorical task's answer is the letter "
        f"with the highest logit, with no completion to sample (--samples {cfg.samples} --temperature "
        f"{cfg.temperature:g} sample the generative tasks only)"
    )


def task_scores(
    model, tokenizer, tasks: list[tuple[str, int | None]], cfg: EvalConfig, chatcore: tuple[bool, int | None],
    scored: tuple[str, str] = ("", ""),
) -> tuple[dict, dict]:  # fmt: skip
    """({name: {"accuracy", "stderr", "examples", "max_tokens"[, "too_long"]}} of `tasks` (too_long: items whose
    prompt the model could not take, scored incorrect; raychat.eval.tasks.too_long), {column: cell} of the report card's
    chat evals): stderr the accuracy's standard error (raychat.eval.tasks.accuracy_stderr); a generative task
    at task_budget(name, cfg.max_tokens), its budget recorded (None: categorical); at a cfg.temperature above
    0 a generative task's entry also holds "samples", "temperature" and "pass@k" ({"pass@1": ...,
    f"pass@{samples}": ...}; raychat.eval.tasks.task_pass_at_k), its accuracy pass@1 and stderr that of the
    items' pass@1 (mean_stderr); a greedy card task named in `tasks` fills its column, a sampled one's column
    reads "n/a: sampled" (the card is greedy), chatcore (whether, examples cap) measures the other columns
    greedily at the same budgets (raychat.eval.report_card.chat_cells); each
    score's line on stderr (raychat.eval.report_card.measured_line: `eval, ...` for `tasks`, `report card,
    ...` for chatcore's) names `scored`: (stage, checkpoint); at a cfg.temperature above 0, first a line naming
    the categorical tasks of `tasks`, scored greedily (categorical_line)."""
    built = {name: make_task(name, "test", None, cfg.seed, data_dir=cfg.task_data_dir) for name, _ in tasks}
    line = categorical_line([name for name, task in built.items() if task.eval_type == "categorical"], cfg)
    if line:
        print(line, file=sys.stderr)
    accuracy = {}
    for name, n in tasks:
        task = built[name]
        examples = min(n or len(task), len(task))
        budget = task_budget(name, cfg.max_tokens) if task.eval_type == "generative" else None
        t0 = time.perf_counter()
        if budget is not None and not is_greedy(cfg.temperature):
            passes, per_item = task_pass_at_k(
                model, tokenizer, task, examples, cfg.samples, cfg.temperature, cfg.seed, max_tokens=budget
            )
            score, stderr = passes["pass@1"], mean_stderr(per_item)
            sampled = {"samples": cfg.samples, "temperature": cfg.temperature, "pass@k": passes}
        else:
            score, long = task_accuracy_counts(model, tokenizer, task, examples, max_tokens=budget)
            stderr, sampled = accuracy_stderr(score, examples), {"too_long": long} if long else {}
        accuracy[name] = {
            "accuracy": score,
            "stderr": stderr,
            "examples": examples,
            "max_tokens": budget,
            **sampled,
        }
        label = f"{name} pass@1" if "samples" in sampled else name
        measured = {
            "value": score,
            "stderr": stderr,
            "examples": examples,
            "too_long": sampled.get("too_long"),
        }
        print(measured_line(*scored, label, measured, time.perf_counter() - t0, what="eval"), file=sys.stderr)
        if "samples" in sampled:
            print(f"  {name} at temperature {cfg.temperature:g}, {cfg.samples} samples an item: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in passes.items()), file=sys.stderr)  # fmt: skip
    # the report card is greedy (nanochat's): a sampled score does not fill its column ("n/a: sampled" unless
    # chatcore measures it greedily)
    chat = {CARD_NAMES[n]: accuracy_cell(a["accuracy"], a["examples"], a["max_tokens"], a.get("too_long", 0))
            for n, a in accuracy.items() if n in CARD_NAMES and "samples" not in a}  # fmt: skip
    if chatcore[0]:
        missing = [c for c in CHAT_TASKS if c not in chat]
        chat |= chat_cells(model, tokenizer, cfg.task_data_dir, chatcore[1], cfg.max_tokens, missing, cfg.seed,
                           log=lambda line: print(line, file=sys.stderr), scored=scored)  # fmt: skip
        for line in no_data_lines({"eval": chat}, cfg.task_data_dir):
            print(line, file=sys.stderr)
    kept_off = {
        CARD_NAMES[n]: cell(note=SAMPLED) for n, a in accuracy.items() if n in CARD_NAMES and "samples" in a
    }
    return accuracy, kept_off | chat


def validation_bpb(model, tokenizer, val_file: str, masking: bool, cfg: EvalConfig) -> dict:
    """{"val_bpb", "val_bpb_note" (None), "val_tokens", "val_bytes"} of `model` on cfg.eval_tokens of the
    validation shard `val_file` (module doc); val_bpb may be NaN or inf (a model that is not finite).

    Raises ValueError naming --data-dir when the shard is too small for one row of the model's length."""
    seq_len = model.config.max_seq_len
    try:
        rows = validation_rows(val_file, tokenizer, seq_len + 1, cfg.eval_tokens)
    except ValueError as e:
        raise ValueError(f"--data-dir: {e}") from None
    token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.int64)
    nats, nbytes = bpb_sums(
        model, rows, token_bytes, tokenizer.bos_id, cfg.device_batch_size, masking, device=cfg.device
    )
    return {
        "val_bpb": nats / (math.log(2) * nbytes),
        "val_bpb_note": None,
        "val_tokens": int(rows["input_ids"].shape[0] * seq_len),
        "val_bytes": int(nbytes),
    }


def evaluate(
    checkpoint: str,
    val_file: str | None,
    tasks: list[tuple[str, int | None]],
    cfg: EvalConfig,
    chatcore: tuple[bool, int | None] = (False, None),
) -> dict:
    """{"checkpoint", "stage", "step", "val_bpb", "val_bpb_note", "val_tokens", "val_bytes",
    "val_document_masking", "tasks": {name: {"accuracy", "stderr", "examples", "max_tokens"}}, "report_card":
    {column: cell}, "seconds", "settings", "finished_at"} of the checkpoint at `checkpoint` (a local dir or a
    remote URI); val_tokens: target positions of the BPB rows (rows x T), val_bytes: the UTF-8 bytes of their
    targets (BPB's denominator), val_document_masking: the checkpoint's (document_masking); val_file None
    (--eval-tokens 0): no BPB, every val_* None but val_bpb_note "not measured: --eval-tokens 0" (None when
    measured); max_tokens: the completion budget a generative task was measured at (None: categorical), a
    sampled task's "samples", "temperature" and "pass@k" (task_scores); chatcore: (whether to run the six chat
    evals, their examples cap); settings: every EvalConfig field as given (checkpoint as typed, e.g. latest;
    data_dir and task_data_dir the speedrun's where speedrun_inputs chose them), task_data_dir resolved to the
    directory read; finished_at: UTC, ISO 8601 to the second.

    Raises ValueError naming --checkpoint when the model's validation loss (without BPB: a weight) is not
    finite (NaN or inf)."""
    t0 = time.perf_counter()
    model, tokenizer, meta = load_model(checkpoint, device=cfg.device)
    masking = document_masking(meta)
    # a model that is not finite is refused before the tasks, whose generation would fail on its logits
    if val_file:
        val = validation_bpb(model, tokenizer, val_file, masking, cfg)
        if not math.isfinite(val["val_bpb"]):
            raise ValueError(
                f"--checkpoint {checkpoint}: the model's validation loss is {val['val_bpb']} (its logits are not "
                "finite: NaN or inf in the weights, e.g. a diverged run); nothing evaluated or written"
            )
    else:
        val = {"val_bpb": None, "val_bpb_note": BPB_SKIPPED, "val_tokens": None, "val_bytes": None,
               "val_document_masking": None}  # fmt: skip
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise ValueError(
                f"--checkpoint {checkpoint}: the model's weights are not finite (NaN or inf, e.g. a diverged "
                "run); nothing evaluated or written"
            )
    accuracy, chat = task_scores(
        model, tokenizer, tasks, cfg, chatcore, (meta.get("stage") or "", checkpoint)
    )
    core = core_cell(
        model, tokenizer, cfg.core_bundle or None, cfg.core_max_per_task, cfg.task_data_dir or None
    )
    return {
        "checkpoint": checkpoint,
        "stage": meta.get("stage"),
        "step": meta.get("step"),
        "val_document_masking": masking,
        **val,
        "tasks": accuracy,
        "report_card": card_row(core, chat),
        "seconds": round(time.perf_counter() - t0, 2),
        "settings": to_dict(cfg) | {"task_data_dir": str(task_data_dir(cfg.task_data_dir))},
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def card_source(result: dict) -> str:
    """The line under report_card.md's table naming what was scored and when, e.g. `checkpoint
    runs/rl/rl50/checkpoint_000050 (rl, step 50), evaluated 2026-12-06T09:30:00+00:00`."""
    step = None if result["step"] is None else f"step {result['step']}"
    kind = ", ".join(x for x in (result["stage"], step) if x) or "no stage recorded"
    return f"checkpoint {result['checkpoint']} ({kind}), evaluated {result['finished_at']}"


def speedrun_data_hint(storage: Storage, checkpoint: str, data_dir: str, storage_path: str | None) -> str:
    """'; ... --data-dir X/data' when prepared data (X/data holding a manifest.json) is beside the storage root
    `storage` (X/checkpoints: --storage-path `storage_path`, or CHECKPOINTS_ROOT when it is None) or a speedrun's
    is above the checkpoint (X/rl/rl/checkpoint_000001), and is not data_dir; else ''."""
    beside = Path(storage.path).parent / "data"
    if storage.is_local and beside != Path(data_dir) and (beside / "manifest.json").is_file():
        if storage_path:
            return f"; the speedrun's data beside --storage-path is {beside}: --data-dir {beside}"
        return (
            f"; the data beside {CHECKPOINTS_ROOT} (the storage root: --storage-path not given) is {beside}: "
            f"--data-dir {beside}"
        )
    if "://" in checkpoint:
        return ""
    for out in Path(checkpoint).parents:
        data = out / "data"
        if data != Path(data_dir).absolute() and (data / "manifest.json").is_file():
            return f"; the checkpoint's speedrun (--out {out}) has its data in {data}: --data-dir {data}"
    return ""


def speedrun_out(checkpoint: str) -> Path | None:
    """The --out of the speedrun whose layout holds `checkpoint` (what find_checkpoint returned): X of a local
    X/checkpoints/<run>/checkpoint_<step> or X/rl/<run>/checkpoint_<step> (raychat.config.speedrun); else None."""
    if not is_run_checkpoint(checkpoint):
        return None
    roots = Path(checkpoint).parents[1]
    return roots.parent if roots.name in (CHECKPOINTS, RL) else None


def speedrun_inputs(cfg: EvalConfig, checkpoint: str, given: set[str]) -> tuple[EvalConfig, list[str]]:
    """(cfg, the stderr lines that say so) with the inputs of the speedrun whose --out holds `checkpoint`
    (speedrun_out) in place of the defaults: its X/data when BPB is measured (cfg.eval_tokens above 0), X/data
    holds a manifest.json and --data-dir is not in `given` (the flat names the command line sets:
    raychat.config.flags.chosen), e.g. `data: /home/me/runs-tiny/data (the speedrun's, beside the checkpoint;
    --data-dir to choose another)`; its X/task_data when that is a directory, --task-data-dir is not given and
    $RAYCHAT_TASK_DATA is not set, as `task data: ...` naming --task-data-dir. Unchanged cfg and no line for a
    checkpoint outside a speedrun's layout."""
    out = speedrun_out(checkpoint)
    if out is None:
        return cfg, []
    found = {}
    if cfg.eval_tokens and "data_dir" not in given and (out / DATA / "manifest.json").is_file():
        found["data_dir"] = ("data", out / DATA, "--data-dir")
    if "task_data_dir" not in given and not os.environ.get(TASK_DATA_ENV) and (out / TASK_DATA).is_dir():
        found["task_data_dir"] = ("task data", out / TASK_DATA, "--task-data-dir")
    lines = [
        f"{what}: {path} (the speedrun's, beside the checkpoint; {flag} to choose another)"
        for what, path, flag in found.values()
    ]
    return dataclasses.replace(cfg, **{name: str(path) for name, (_, path, _) in found.items()}), lines


def validation_shard(cfg: EvalConfig, storage: Storage, checkpoint: str) -> str:
    """The validation shard of --data-dir (a directory, or a run name under --storage-path) that BPB reads.

    Raises ValueError naming --data-dir (and --eval-tokens 0, which skips BPB) when it holds no prepared shards
    or is on object storage, and the speedrun's data directory where one is beside the storage root or above
    the checkpoint (speedrun_data_hint)."""
    data_dir = run_directory(cfg.data_dir, storage, "--data-dir")
    try:
        return list_shards(data_dir)[1]
    except (OSError, ValueError) as e:
        hint = speedrun_data_hint(storage, checkpoint, data_dir, cfg.storage_path)
        raise ValueError(
            f"--data-dir: {e} (BPB needs the pretraining data's validation shard; --eval-tokens 0 skips BPB and "
            f"scores only --tasks and the report card{hint})"
        ) from e


def main(args) -> int:
    """`raychat eval` (its parser: raychat.commands.eval_)."""
    cfg = from_args(args, EvalConfig, "eval", where="eval settings")
    if not cfg.checkpoint:
        raise ValueError("--checkpoint: required: a checkpoint, its run (dir or name), or latest")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda, but this machine has no CUDA device")
    lookup = open_storage(cfg.storage_path or CHECKPOINTS_ROOT)  # latest, a run name, --data-dir's run name
    checkpoint = find_checkpoint(cfg.checkpoint, lookup, "--checkpoint")
    cfg, followed = speedrun_inputs(cfg, checkpoint, chosen(args, EvalConfig, "eval"))
    spec, cap, named = split_card_tasks(cfg.tasks)
    tasks = parse_mixture(spec, "--tasks", empty_ok=True)
    names = [name for name, _ in tasks]
    check_data(names, ("test",), cfg.task_data_dir, "--tasks")
    if named:  # the card's other chat evals: those whose files are here, checked before the model loads
        others = [name for name, _ in CHAT_TASKS.values() if name not in names]
        check_present_data(others, "test", cfg.task_data_dir, f"--tasks {CHATCORE}")
    bundle = Path(cfg.core_bundle)
    # '' = the default place, which may hold none
    if cfg.core_bundle and not (bundle / "core.yaml").is_file():
        why = "no core.yaml there" if bundle.is_dir() else "not a directory"
        if (bundle / "eval_bundle" / "core.yaml").is_file():  # the task data dir given for the bundle's own
            why += f"; the bundle is {bundle / 'eval_bundle'}"
        raise ValueError(
            f"--core-bundle {cfg.core_bundle}: {why} (give the CORE bundle's directory: core.yaml, "
            "eval_meta_data.csv, eval_data/; or leave the flag out)"
        )
    if (
        not cfg.eval_tokens
        and not tasks
        and not named
        and bundle_path(cfg.core_bundle or None, cfg.task_data_dir or None) is None
    ):
        raise ValueError(
            "--eval-tokens 0 with --tasks '' and no CORE bundle (--core-bundle): nothing to measure; give --tasks "
            "or an --eval-tokens above 0"
        )
    storage, run_name, storage_flag = output_place(checkpoint, cfg.storage_path, cfg.run_name, "eval")
    check_eval_target(storage, run_name)  # before the evaluation runs
    replacing = replaced_line(storage, run_name)
    val_file = validation_shard(cfg, lookup, checkpoint) if cfg.eval_tokens else None
    check_writable(storage, storage_flag)
    for line in filter(None, [*followed, replacing]):
        print(line, file=sys.stderr)
    result = evaluate(checkpoint, val_file, tasks, cfg, (named, cap))
    if storage.is_local:  # object storage writes in one PUT: no leftovers there
        remove_leftovers(storage.run_path(run_name))
    text = json.dumps(result, indent=2)
    where = write_bytes(storage, f"{storage.run_path(run_name)}/{RESULT_FILE}", (text + "\n").encode())
    table = format_markdown({result["stage"] or "checkpoint": result["report_card"]})
    scored = card_source(result)
    card = write_bytes(
        storage, f"{storage.run_path(run_name)}/{CARD_FILE}", f"{table}\n\n{scored}\n".encode()
    )
    print(text)
    print(table, file=sys.stderr)
    if result["val_bpb"] is None:
        print(f"validation BPB: {BPB_SKIPPED}", file=sys.stderr)
    else:
        print(
            f"validation BPB: {result['val_bpb']:.4f} ({result['val_tokens']:,} tokens, {result['val_bytes']:,} "
            f"bytes of {val_file})",
            file=sys.stderr,
        )
    print(f"wrote {where} and {card}", file=sys.stderr)
    return 0

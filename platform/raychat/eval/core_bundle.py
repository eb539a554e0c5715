"""The CORE eval bundle (DCLM layout, as nanochat downloads it): reading, checking and downloading it.

Layout of a bundle directory (the unpacked eval_bundle.zip of nanochat's scripts/base_eval.py):
  core.yaml            `icl_tasks:` a list of {label, dataset_uri, icl_task_type, num_fewshot,
                       continuation_delimiter (optional, default " ")}; num_fewshot is an int or a list whose
                       first entry is used (as nanochat does with the DCLM list)
  eval_meta_data.csv   one row per task: "Eval Task" (the label) and "Random baseline" (percent, in [0, 100))
  eval_data/<uri>      one JSONL file per task, one item per line; fields by icl_task_type:
                         multiple_choice    query (str), choices (list of >= 2 str), gold (int index)
                         schema             context_options (list of >= 2 str), continuation (str), gold (int)
                         language_modeling  context (str), continuation (str)
                       a number where text is expected is read as str(number), as nanochat's Jinja renders it

Items are put in nanochat's order: shuffled with random.Random(1337), then cut to `max_per_task`, so the
same items are scored (and the same few-shot examples drawn) as in nanochat.

Errors: a wrong core.yaml or eval_meta_data.csv raises BundleError naming the file, the entry and the field
before any model runs. A wrong task data file (missing, empty, bad JSON, a missing or mistyped field, a gold
index past the choices, too few items for its shots) does not raise: its CoreTask carries `error`, one line
naming the file, the line and the field, and the other tasks load as usual.
"""

from __future__ import annotations

import csv
import json
import os
import random
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from raychat.data.corpus.download import download_file

# The bundle nanochat downloads (scripts/base_eval.py, EVAL_BUNDLE_URL): DCLM's CORE tasks and baselines.
EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337  # nanochat's evaluate_core: random.Random(1337).shuffle(data)
META_TASK, META_BASELINE = "Eval Task", "Random baseline"


class BundleError(ValueError):
    """core.yaml or eval_meta_data.csv is missing or wrong (the message names the file, entry and field)."""


class TaskDataError(ValueError):
    """One task's data file or item is wrong (the message names the file, the line and the field)."""


@dataclass
class CoreTask:
    """One CORE task, ready to score.

    Attributes:
        label: the task's name (core.yaml `label`, the eval_meta_data.csv "Eval Task").
        task_type: one of TASK_TYPES.
        num_fewshot: examples shown before each item (drawn from the other items of the task).
        continuation_delimiter: text between a context and its continuation.
        random_baseline: accuracy of guessing, in percent ([0, 100)).
        path: the task's JSONL file.
        items: the items in scoring order (shuffled, cut to max_per_task); [] when `error` is set.
        lines: the 1-based line of each item in `path` (same order as items).
        error: why the task cannot be scored (one line naming file, line and field), else None.
    """

    label: str
    task_type: str
    num_fewshot: int
    continuation_delimiter: str
    random_baseline: float
    path: Path
    items: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    error: str | None = None


def _type_name(value) -> str:
    return type(value).__name__


def _text(value) -> str | None:
    """A text field's string: a str as is, a number as str(number) (as nanochat's Jinja renders it), else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _text_list(path: Path, line: int, item: dict, name: str) -> list[str]:
    value = item[name]
    texts = [_text(v) for v in value] if isinstance(value, list) else None
    if texts is None or None in texts:
        raise TaskDataError(
            f"{path}:{line}: field {name!r} must be a list of strings, got {_type_name(value)}"
        )
    if len(texts) < 2:
        raise TaskDataError(f"{path}:{line}: field {name!r} has {len(texts)} entries; at least 2 are needed")
    return texts


REQUIRED = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}


def check_item(path: Path, line: int, item, task_type: str) -> dict:
    """The item, its text fields as str (numbers become str(number)), if it has every field its task type
    needs with the right types; else TaskDataError naming `path:line` and the field (a gold index must be an
    int in [0, number of choices))."""
    if not isinstance(item, dict):
        raise TaskDataError(f"{path}:{line}: an item must be a JSON object, got {_type_name(item)}")
    for name in REQUIRED[task_type]:
        if name not in item:
            need = ", ".join(REQUIRED[task_type])
            raise TaskDataError(f"{path}:{line}: field {name!r} is missing ({task_type} items need {need})")
    item = dict(item)
    for name in ("query", "context", "continuation"):
        if name in REQUIRED[task_type]:
            item[name] = _text(item[name])
            if item[name] is None:
                raise TaskDataError(f"{path}:{line}: field {name!r} must be a string")
    if task_type != "language_modeling":
        options = "choices" if task_type == "multiple_choice" else "context_options"
        item[options] = _text_list(path, line, item, options)
        n = len(item[options])
        gold = item["gold"]
        if not isinstance(gold, int) or isinstance(gold, bool):
            raise TaskDataError(f"{path}:{line}: field 'gold' must be an integer, got {_type_name(gold)}")
        if not 0 <= gold < n:
            raise TaskDataError(
                f"{path}:{line}: field 'gold' = {gold} but the item has {n} {options} (allowed 0..{n - 1})"
            )
    return item


def read_items(path: Path, task_type: str) -> tuple[list[dict], list[int]]:
    """(items, 1-based lines) of a JSONL task file in file order; blank lines are skipped.

    Raises:
        TaskDataError: the file is missing or holds no items, a line is not JSON, or check_item fails.
    """
    if not path.is_file():
        raise TaskDataError(f"{path}: task data file not found")
    items, lines = [], []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{line}: not valid JSON ({e.msg})") from None
            items.append(check_item(path, line, item, task_type))
            lines.append(line)
    if not items:
        raise TaskDataError(f"{path}: no items (empty file)")
    return items, lines


def _read_yaml_tasks(path: Path) -> list[dict]:
    if not path.is_file():
        raise BundleError(f"{path}: not found (a CORE bundle directory holds core.yaml; see download_bundle)")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise BundleError(f"{path}: not valid YAML ({e})") from None
    tasks = doc.get("icl_tasks") if isinstance(doc, dict) else None
    if not isinstance(tasks, list) or not tasks:
        raise BundleError(f"{path}: field 'icl_tasks' must be a non-empty list of tasks")
    return tasks


def _task_spec(path: Path, i: int, entry) -> dict:
    """The checked fields of core.yaml's icl_tasks[i]."""
    where = f"{path}: icl_tasks[{i}]"
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: must be a mapping, got {_type_name(entry)}")
    for name in ("label", "dataset_uri", "icl_task_type", "num_fewshot"):
        if name not in entry:
            raise BundleError(f"{where}: field {name!r} is missing")
    label = entry["label"]
    if not isinstance(label, str) or not label:
        raise BundleError(f"{where}: field 'label' must be a non-empty string")
    where = f"{where} ({label})"
    task_type = entry["icl_task_type"]
    if task_type not in TASK_TYPES:
        raise BundleError(f"{where}: field 'icl_task_type' = {task_type!r}; allowed: {', '.join(TASK_TYPES)}")
    shots = entry["num_fewshot"]
    if isinstance(shots, list) and shots:
        shots = shots[0]  # nanochat: task['num_fewshot'][0]
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise BundleError(f"{where}: field 'num_fewshot' must be an integer >= 0 or a list starting with one")
    delimiter = entry.get("continuation_delimiter", " ")
    if not isinstance(delimiter, str):
        raise BundleError(f"{where}: field 'continuation_delimiter' must be a string")
    uri = entry["dataset_uri"]
    if not isinstance(uri, str) or not uri or Path(uri).is_absolute() or ".." in Path(uri).parts:
        raise BundleError(
            f"{where}: field 'dataset_uri' must be a relative path inside eval_data/, got {uri!r}"
        )
    return {"label": label, "task_type": task_type, "num_fewshot": shots, "delimiter": delimiter, "uri": uri}


def read_baselines(path: Path) -> dict[str, float]:
    """{label: random baseline in percent} from eval_meta_data.csv.

    Raises:
        BundleError: the file or a column is missing, or a baseline is not a number in [0, 100).
    """
    if not path.is_file():
        raise BundleError(f"{path}: not found (a CORE bundle holds eval_meta_data.csv with random baselines)")
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for column in (META_TASK, META_BASELINE):
            if column not in (reader.fieldnames or []):
                raise BundleError(f"{path}: column {column!r} is missing (columns: {reader.fieldnames})")
        baselines = {}
        for row in reader:
            where = f"{path}:{reader.line_num}"
            try:
                value = float(row[META_BASELINE])
            except (TypeError, ValueError):
                raise BundleError(
                    f"{where}: {META_BASELINE!r} = {row[META_BASELINE]!r} is not a number"
                ) from None
            if not 0 <= value < 100:
                raise BundleError(f"{where}: {META_BASELINE!r} = {value} must be in [0, 100) percent")
            baselines[row[META_TASK]] = value
    return baselines


def load_bundle(bundle_dir: str | os.PathLike, max_per_task: int = -1) -> list[CoreTask]:
    """The tasks of a bundle directory, in core.yaml order, each with its items in scoring order.

    Args:
        bundle_dir: the directory holding core.yaml, eval_meta_data.csv and eval_data/.
        max_per_task: keep the first max_per_task items after nanochat's shuffle; -1 (or 0) keeps all.
    Returns:
        one CoreTask per core.yaml entry; a task whose data is wrong has `error` set and no items.
    Raises:
        BundleError: core.yaml or eval_meta_data.csv is missing or wrong, a label repeats, or a task has no
            random baseline.
    """
    root = Path(bundle_dir)
    yaml_path = root / "core.yaml"
    entries = _read_yaml_tasks(yaml_path)
    specs = [_task_spec(yaml_path, i, e) for i, e in enumerate(entries)]
    labels = [s["label"] for s in specs]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise BundleError(f"{yaml_path}: labels must be unique; repeated: {', '.join(repeated)}")
    baselines = read_baselines(root / "eval_meta_data.csv")
    tasks = []
    for spec in specs:
        if spec["label"] not in baselines:
            raise BundleError(
                f"{root / 'eval_meta_data.csv'}: no {META_BASELINE!r} row for task {spec['label']!r}"
            )
        task = CoreTask(
            spec["label"],
            spec["task_type"],
            spec["num_fewshot"],
            spec["delimiter"],
            baselines[spec["label"]],
            root / "eval_data" / spec["uri"],
        )
        try:
            items, lines = read_items(task.path, task.task_type)
            order = list(zip(items, lines))
            random.Random(SHUFFLE_SEED).shuffle(order)
            if max_per_task > 0:
                order = order[:max_per_task]
            if len(order) <= task.num_fewshot:
                raise TaskDataError(
                    f"{task.path}: num_fewshot = {task.num_fewshot} needs more than {task.num_fewshot} items, "
                    f"{len(order)} are scored"
                )
            task.items = [item for item, _ in order]
            task.lines = [line for _, line in order]
        except TaskDataError as e:
            task.error = str(e)
        tasks.append(task)
    return tasks


def _check_zip(path: str) -> None:
    """download_file's verify hook: a complete zip archive, else OSError (so the download is retried)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as e:
        raise OSError(f"not a zip archive ({e})") from None
    if bad is not None:
        raise OSError(f"zip member {bad} is corrupt")


def download_bundle(dest: str | os.PathLike, url: str = EVAL_BUNDLE_URL, **download_kw) -> Path:
    """Download the eval bundle zip and unpack it so that `dest` is the bundle directory (dest/core.yaml).

    Needs the internet for the default URL (nanochat's, ~25 MB: DCLM's 22 CORE tasks). A `dest` that already
    holds core.yaml is kept as is (no download). The zip (whose top folder is eval_bundle/, or the files at its
    root) is fetched with retries and checked (raychat's data download helper), unpacked into a temporary
    folder beside `dest`, checked with load_bundle, and only then renamed to `dest`.

    Args:
        download_kw: attempts, backoff_s, timeout_s passed to the download helper.
    Raises:
        DownloadError: the zip could not be fetched.
        BundleError: the archive holds no valid bundle, or `dest` is a non-empty directory without core.yaml.
    """
    dest = Path(dest)
    if (dest / "core.yaml").is_file():
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BundleError(f"{dest}: exists but holds no core.yaml; give an empty or new directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        archive = download_file(url, Path(tmp) / "eval_bundle.zip", verify=_check_zip, **download_kw)
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(archive) as z:
            z.extractall(unpacked)  # zipfile drops absolute paths and '..' parts
        found = unpacked / "eval_bundle" if (unpacked / "eval_bundle" / "core.yaml").is_file() else unpacked
        load_bundle(found)  # raises BundleError naming what is wrong
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(found, dest)
    return dest

"""Where the Hugging Face hub datasets of the real tasks live on disk (the hub cannot be reached from here).

The task data directory: the `--task-data-dir` flag of a stage, else $RAYCHAT_TASK_DATA, else runs/task_data
(made absolute against the current directory); the speedrun sets <out>/task_data unless its preset names one or
$RAYCHAT_TASK_DATA is set (raychat.config.speedrun). A split of a dataset is found there in either layout:
  <dir>/<name>/<folder>/<split>-*.parquet|.jsonl|.json or <split>.jsonl   `hf download <repo>
        --repo-type dataset --local-dir <dir>/<name>` (the hub repo's own files; folder = the config name, or
        "data" for single-config repos such as smol-smoltalk)
  <dir>/<owner>--<name>/<config>/<split>/*.parquet                        nanochat's task_data cache and the
        hub's refs/convert/parquet export
Files are read in sorted order (raychat.tasks.loaders.read_records).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TASK_DATA_ENV = "RAYCHAT_TASK_DATA"
DEFAULT_TASK_DATA = "runs/task_data"
SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class HubSplit:
    """One split of a hub dataset: repo "owner/name", config (subset) name, split name, and the folder of the
    repo's own files (None: the config name)."""

    repo: str
    config: str
    split: str
    folder: str | None = None

    @property
    def name(self) -> str:
        return self.repo.split("/")[1]

    def candidates(self, root: Path) -> tuple[Path, Path]:
        """(the hub repo's folder holding <split>-* files, nanochat's <owner>--<name>/<config>/<split> dir)."""
        return (
            root / self.name / (self.folder or self.config),
            root / self.repo.replace("/", "--") / self.config / self.split,
        )


# nanochat's tasks (tasks/*.py, scripts/chat_sft.py, scripts/chat_eval.py): which split each stage reads.
HUB_SPLITS = {
    ("smoltalk", "train"): HubSplit("HuggingFaceTB/smol-smoltalk", "default", "train", "data"),
    ("smoltalk", "test"): HubSplit("HuggingFaceTB/smol-smoltalk", "default", "test", "data"),
    ("gsm8k", "train"): HubSplit("openai/gsm8k", "main", "train"),
    ("gsm8k", "test"): HubSplit("openai/gsm8k", "main", "test"),
    ("mmlu", "train"): HubSplit("cais/mmlu", "all", "auxiliary_train"),
    ("mmlu", "test"): HubSplit("cais/mmlu", "all", "test"),
    ("arc-easy", "train"): HubSplit("allenai/ai2_arc", "ARC-Easy", "train"),
    ("arc-easy", "test"): HubSplit("allenai/ai2_arc", "ARC-Easy", "test"),
    ("arc-challenge", "train"): HubSplit("allenai/ai2_arc", "ARC-Challenge", "train"),
    ("arc-challenge", "test"): HubSplit("allenai/ai2_arc", "ARC-Challenge", "test"),
    ("humaneval", "test"): HubSplit("openai/openai_humaneval", "openai_humaneval", "test"),
}


def task_data_dir(value: str | None = None) -> Path:
    """The task data directory (module doc): `value`, else $RAYCHAT_TASK_DATA, else runs/task_data; absolute."""
    return Path(value or os.environ.get(TASK_DATA_ENV) or DEFAULT_TASK_DATA).resolve()


def split_files(task: str, spec: HubSplit, root: str | os.PathLike | None = None) -> list[Path]:
    """The data files of `spec` under the task data directory `root` (task_data_dir(root)), sorted.

    Raises:
        FileNotFoundError: neither layout holds a file; one line naming the expected paths and the download.
    """
    base = task_data_dir(str(root) if root else None)
    repo_dir, cache_dir = spec.candidates(base)
    files = sorted(
        p for p in repo_dir.glob(f"{spec.split}*") if p.suffix in SUFFIXES and is_split(p.name, spec.split)
    )
    if not files and cache_dir.is_dir():
        files = sorted(p for p in cache_dir.iterdir() if p.suffix in SUFFIXES)
    if not files:
        raise FileNotFoundError(
            f"task {task!r} ({spec.split} split): no data file at {repo_dir}/{spec.split}-*.parquet "
            f"or {cache_dir}/*.parquet (download: {download_command(spec, base)}; the directory: --task-data-dir "
            f"or ${TASK_DATA_ENV})"
        )
    return files


def download_command(spec: HubSplit, base: Path) -> str:
    """The command that puts `spec`'s hub repo in the task data directory `base` (the hub repo's layout)."""
    return f"hf download {spec.repo} --repo-type dataset --local-dir {base / spec.name}"


def is_split(filename: str, split: str) -> bool:
    """`<split>-00000-of-00001.parquet` or `<split>.jsonl`, not another split that starts alike."""
    stem = filename.split(".")[0]
    return stem == split or stem.startswith(f"{split}-")

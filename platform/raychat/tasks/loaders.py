"""Tasks read from local files in the Hugging Face hub formats (the hub cannot be reached from here).

- SmolTalk (HuggingFaceTB/smol-smoltalk): parquet with a `messages` column, list of {"role", "content"}.
- GSM8K (openai/gsm8k): jsonl (or parquet) with `question` and `answer`; the answer holds calculator
  annotations "<<48/2=24>>" and ends with "#### 72". Each annotation becomes a python call (expr) plus its
  output (result); the text around it is kept, so the final text part ends with "#### 72".
- MMLU (cais/mmlu): `question`, `choices` (list of str), `answer` (int index), `subject`.
- ARC (allenai/ai2_arc): `id`, `question`, `choices` {"text": [...], "label": [...]}, `answerKey`.
- HumanEval (openai/openai_humaneval): `task_id`, `prompt`, `canonical_solution`, `test`, `entry_point`
  (raychat.tasks.humaneval).
Files may be .parquet, .jsonl or .json (JSON lines); a directory means every such file in it, sorted; a list
means those files. `seed` (optional) puts the rows in a seeded order (numpy PCG64 permutation), so a prefix
(`stop`) is a sample of the whole file, not its first subjects.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from raychat.tasks.base import Task, extract_answer

GSM8K_CALC_RE = re.compile(r"<<([^=<>]*)=([^<>]*)>>")
LETTERS = "ABCDEFGHIJ"


def record_files(path: str | Path | list[Path]) -> list[Path]:
    """The files `path` names: the file, a directory's .parquet/.jsonl/.json files (sorted), or the list.

    Raises FileNotFoundError: nothing at path (or a listed file missing)."""
    if isinstance(path, (list, tuple)):
        files = [Path(f) for f in path]
        missing = [f for f in files if not f.exists()]
        if not files or missing:
            raise FileNotFoundError(f"no .parquet/.jsonl/.json data at {missing or path}")
    else:
        p = Path(path)
        files = (
            sorted(f for f in p.iterdir() if f.suffix in (".parquet", ".jsonl", ".json"))
            if p.is_dir()
            else [p]
        )
        if not p.exists() or not files:
            raise FileNotFoundError(f"no .parquet/.jsonl/.json data at {path}")
    return files


def read_records(path: str | Path | list[Path], columns: list[str], seed: int | None = None) -> list[dict]:
    """Rows of a .parquet / .jsonl / .json file (or a directory or list of them: record_files) as dicts; with
    `seed`, in a seeded order (numpy PCG64 permutation).

    Raises:
        FileNotFoundError: nothing at path. ValueError: unknown suffix, no record at all, or a required
            column is missing.
    """
    rows: list[dict] = []
    for f in record_files(path):
        if f.suffix == ".parquet":
            rows.extend(pq.read_table(f).to_pylist())
        elif f.suffix in (".jsonl", ".json"):
            rows.extend(
                json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()
            )
        else:
            raise ValueError(f"{f}: suffix must be one of ['.parquet', '.jsonl', '.json']")
    if not rows:
        raise ValueError(f"{path}: no records (an empty dataset file)")
    for i, r in enumerate(rows):
        missing = [c for c in columns if c not in r]
        if missing:
            raise ValueError(f"{path}: record {i} lacks column(s) {missing}; expected {columns}")
    if seed is not None:
        rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
    return rows


class SmolTalk(Task):
    name = "smoltalk"
    eval_type = "generative"

    def __init__(self, path: str | Path | list[Path], seed: int | None = None, **slice_kw):
        self.rows = read_records(path, ["messages"], seed)
        self.source_files = tuple(str(f) for f in record_files(path))
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        messages = [{"role": m["role"], "content": m["content"]} for m in self.rows[index]["messages"]]
        return {"id": self._id(index), "messages": messages}


def gsm8k_parts(answer: str) -> list[dict]:
    """GSM8K answer text -> assistant parts; "<<a*b=c>>" -> python "a*b" then python_output "c"."""
    parts, pos = [], 0
    for m in GSM8K_CALC_RE.finditer(answer):
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos : m.start()]})
        parts.append({"type": "python", "text": m.group(1)})
        parts.append({"type": "python_output", "text": m.group(2)})
        pos = m.end()
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return parts


class GSM8K(Task):
    name = "gsm8k"
    eval_type = "generative"

    def __init__(self, path: str | Path | list[Path], seed: int | None = None, **slice_kw):
        self.rows = read_records(path, ["question", "answer"], seed)
        self.source_files = tuple(str(f) for f in record_files(path))
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        row = self.rows[index]
        reference = extract_answer(row["answer"])
        if reference is None:
            raise ValueError(f"gsm8k record {index}: answer has no final '#### <number>'")
        messages = [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": gsm8k_parts(row["answer"])},
        ]
        return {"id": self._id(index), "messages": messages, "answer": reference}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return extract_answer(completion) == conversation["answer"]


def render_multiple_choice(question: str, letters: list[str], choices: list[str]) -> str:
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(letters, choices)]
    lines.append("Respond only with the letter of the correct answer.")
    return "\n".join(lines)


class MultipleChoice(Task):
    """MMLU (`format="mmlu"`) or ARC (`format="arc"`) items as categorical tasks; the reply is the letter."""

    eval_type = "categorical"

    def __init__(
        self,
        path: str | Path | list[Path],
        format: str,
        seed: int | None = None,
        name: str | None = None,
        **slice_kw,
    ):
        if format not in ("mmlu", "arc"):
            raise ValueError(f"format must be one of ['mmlu', 'arc'], got {format!r}")
        self.name, self.format = name or format, format
        cols = ["question", "choices", "answer"] if format == "mmlu" else ["question", "choices", "answerKey"]
        self.rows = read_records(path, cols if format == "arc" else [], seed)
        self.source_files = tuple(str(f) for f in record_files(path))
        # cais/mmlu's `auxiliary_train` config nests each row in a `train` column
        self.rows = [r["train"] if "train" in r and "question" not in r else r for r in self.rows]
        for i, r in enumerate(self.rows):
            missing = [c for c in cols if c not in r]
            if missing:
                raise ValueError(f"{path}: record {i} lacks column(s) {missing}; expected {cols}")
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        row = self.rows[index]
        if self.format == "mmlu":
            choices = list(row["choices"])
            letters = list(LETTERS[: len(choices)])
            if not 0 <= int(row["answer"]) < len(choices):
                raise ValueError(
                    f"mmlu record {index}: answer index {row['answer']} is not one of the "
                    f"{len(choices)} choices (0..{len(choices) - 1})"
                )
            answer = letters[int(row["answer"])]
        else:
            choices, letters = list(row["choices"]["text"]), list(row["choices"]["label"])
            if row["answerKey"] not in letters:
                raise ValueError(
                    f"arc record {index}: answerKey {row['answerKey']!r} not in labels {letters}"
                )
            answer = row["answerKey"]
        messages = [
            {"role": "user", "content": render_multiple_choice(row["question"], letters, choices)},
            {"role": "assistant", "content": answer},
        ]
        return {"id": self._id(index), "messages": messages, "letters": letters, "answer": answer}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return completion.strip() == conversation["answer"]

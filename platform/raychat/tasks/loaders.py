"""Tasks read from local files in the Hugging Face hub formats (the hub cannot be reached from here).

- SmolTalk (HuggingFaceTB/smol-smoltalk): parquet with a `messages` column, list of {"role", "content"}.
- GSM8K (openai/gsm8k): jsonl (or parquet) with `question` and `answer`; the answer holds calculator
  annotations "<<48/2=24>>" and ends with "#### 72". Each annotation becomes a python call (expr) plus its
  output: the engine's result for that call (gsm8k_parts); the text around it is kept, so the final text
  part ends with "#### 72".
- MMLU (cais/mmlu): `question`, `choices` (list of str), `answer` (int index), `subject`.
- ARC (allenai/ai2_arc): `id`, `question`, `choices` {"text": [...], "label": [...]}, `answerKey`.
- HumanEval (openai/openai_humaneval): `task_id`, `prompt`, `canonical_solution`, `test`, `entry_point`
  (raychat.tasks.humaneval).
Files may be .parquet, .jsonl or .json (JSON lines); a directory means every such file in it, sorted; a list
means those files. `seed` (optional) puts the rows in a seeded order (numpy PCG64 permutation), so a prefix
(`stop`) is a sample of the whole file, not its first subjects.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from raychat.calculator import calculate
from raychat.chat_template import PARTS_FORM, ROLES, validate_messages
from raychat.log import plural
from raychat.tasks.base import Task, extract_answer

GSM8K_CALC_RE = re.compile(r"<<([^=<>]*)=([^<>]*)>>")
COMPUTED_FORMS = (  # what raychat.calculator computes, as a refusal tells it
    "write the call as arithmetic it computes (integers and decimals, + - * / // %, parentheses, 1,000, or "
    "'word'.count('letters'))"
)
LETTERS = "ABCDEFGHIJ"


def record_files(path: str | Path | list[Path]) -> list[Path]:
    """The files `path` names: the file, a directory's .parquet/.jsonl/.json files (sorted), or the list.

    Raises FileNotFoundError: nothing at path (or a listed file missing)."""
    if isinstance(path, (list, tuple)):
        files = [Path(f) for f in path]
        missing = [f for f in files if not f.exists()]
        if not files or missing:
            raise FileNotFoundError(
                f"no .parquet/.jsonl/.json data at {named(missing)}" if missing else "no data file named"
            )
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


def named(files: Sequence[Path]) -> str:
    """Files as a message names them: comma-separated paths (not a list's repr)."""
    return ", ".join(str(f) for f in files)


def read_records(path: str | Path | list[Path], columns: list[str], seed: int | None = None) -> list[dict]:
    """Rows of a .parquet / .jsonl / .json file (or a directory or list of them: record_files) as dicts; with
    `seed`, in a seeded order (numpy PCG64 permutation).

    Raises:
        FileNotFoundError: nothing at path. ValueError: unknown suffix, no record at all, a line that is not
            UTF-8 or not a JSON object, or a required column is missing (located_records).
    """
    return located_records(path, columns, seed)[1]


def located_records(
    path: str | Path | list[Path],
    columns: list[str],
    seed: int | None = None,
    check: Callable[[dict], str | None] | None = None,
) -> tuple[list[str], list[dict]]:
    """(where, rows): read_records' rows and, for each, where it is: "FILE line N" (JSON lines, 1-based, as an
    editor counts) or "FILE row N" (parquet, 0-based, as pyarrow and pandas count). check: why a record (a
    dict with `columns`) is bad, or None; with it every record is checked in one pass, whatever its fault.

    Raises:
        FileNotFoundError: nothing at path. ValueError: unknown suffix, no record at all, or one line naming
            the file and line/row of the first record that is not UTF-8, not a JSON object or lacks a column;
            with `check`, of the first bad record in file order, whatever its fault (not UTF-8, not JSON, not an
            object, a missing column, check's reason), and how many are bad: "FILE line N: <fault> (K of M
            records are bad)".
    """
    wheres: list[str] = []
    rows: list[dict] = []
    unread: dict[int, str] = {}  # the index of a line that is no JSON object -> why
    files = record_files(path)
    for f in files:
        if f.suffix == ".parquet":
            table = pq.read_table(f).to_pylist()
            wheres.extend(f"{f} row {i}" for i in range(len(table)))
            rows.extend(table)
        elif f.suffix in (".jsonl", ".json"):
            # a leading BOM dropped; each line decoded on its own: a line that is no UTF-8 is that line's fault;
            # a line of only whitespace (Unicode's too: a no-break space) is blank
            for n, line in enumerate(f.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines(), 1):
                if line.decode("utf-8", errors="replace").strip():
                    wheres.append(f"{f} line {n}")
                    record, error = _json_record(line)
                    if error and check is None:
                        raise ValueError(f"{wheres[-1]}: {error}")
                    if error:
                        unread[len(rows)] = error
                    rows.append(record)
        else:
            raise ValueError(f"{f}: suffix must be one of ['.parquet', '.jsonl', '.json']")
    if not rows:
        raise ValueError(
            f"{named(files)}: no records ({'every file is empty' if len(files) > 1 else 'an empty file'})"
        )
    if check is None:
        for where, r in zip(wheres, rows):
            missing = [c for c in columns if c not in r]
            if missing:
                raise ValueError(f"{where}: lacks column(s) {missing}; expected {columns}")
    else:
        bad = [
            (w, e)
            for i, (w, r) in enumerate(zip(wheres, rows))
            if (e := unread.get(i) or _fault(r, columns, check))
        ]
        if bad:
            (where, error), n = bad[0], len(bad)
            raise ValueError(f"{where}: {error} ({n} of {len(rows)} records {'is' if n == 1 else 'are'} bad)")
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(rows))
        wheres, rows = [wheres[i] for i in order], [rows[i] for i in order]
    return wheres, rows


def _fault(record: dict, columns: list[str], check: Callable[[dict], str | None]) -> str | None:
    missing = [c for c in columns if c not in record]
    return f"lacks column(s) {missing}; expected {columns}" if missing else check(record)


def _json_record(line: bytes) -> tuple[dict | None, str | None]:
    """(the line's JSON object, None) or (None, why it is none: not UTF-8, not JSON, not an object)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, (
            f"not UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line: {e.reason}); each line "
            "is one JSON object in UTF-8"
        )
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e}); each line is one JSON object"
    if not isinstance(record, dict):
        return None, f"each line is one JSON object, got a {type(record).__name__}"
    return record, None


def conversation_error(messages) -> str | None:
    """Why a `messages` value is no conversation SFT can train on (chat template rules, naming the field as
    "messages[i].content"; a call with no result right after it: unanswered_call; a result that is not the
    engine's: engine_result_error), or None. An OpenAI `tool_calls` message is refused by name: training data
    write the call as the assistant's {"type": "python", "text": EXPR} content part (raychat.chat_template)."""
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, Sequence):
        return f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}"
        if m.get("tool_calls"):
            return (
                f"messages[{i}].tool_calls: not read in training data; write the call as a content part "
                '{"type": "python", "text": EXPR} and its result as the next "tool" message'
            )
        if "role" not in m:
            return f"messages[{i}] lacks 'role' (one of {list(ROLES)})"
        if "content" not in m:
            return f"messages[{i}] lacks 'content' (a string; an assistant's may be a list of parts: {PARTS_FORM})"
    try:
        validate_messages(messages)
    except ValueError as e:
        return re.sub(r"^message (\d+)(?: part (\d+))?", _field, str(e))
    if not any(m["role"] == "assistant" for m in messages):
        return "messages: no 'assistant' message (nothing to train on)"
    return unanswered_call(messages) or engine_result_error(messages)


def unanswered_call(messages: Sequence[dict]) -> str | None:
    """Why a conversation (valid for the chat template) trains on a turn the engine never produces: a python
    call not followed right away by its result (the next part a python_output part, or the call the last part of
    its message and the next message a tool message), e.g. `messages[1].content[1]: the python call '12*7' ends
    the assistant's turn with no result after it (a 'user' message follows): ...`, or a python_output part
    with no call right before it in its message (a result the engine never gives); or None. At inference the
    engine answers a call as soon as the model emits <|python_end|>, forcing <|output_start|> result
    <|output_end|>, and the model goes on after it in the same turn (raychat.engine.row_state); a call the
    engine's calculator cannot compute gets no output there, and is no training data either: left unanswered,
    it is refused as one the calculator cannot compute (answered, by engine_result_error)."""
    for i, m in enumerate(messages):
        parts = m["content"] if m["role"] == "assistant" and not isinstance(m["content"], str) else []
        for j, part in enumerate(parts):
            if part["type"] == "python_output" and (j == 0 or parts[j - 1]["type"] != "python"):
                return (
                    f"messages[{i}].content[{j}]: a python_output part with no python call right before it: the "
                    "engine gives a result only right after the call that asks for it, so put the call "
                    '({"type": "python", "text": EXPR}) right before it, or leave the result out'
                )
            if part["type"] != "python":
                continue
            after = parts[j + 1]["type"] if j + 1 < len(parts) else None
            role = messages[i + 1]["role"] if i + 1 < len(messages) else None
            if after == "python_output" or (after is None and role == "tool"):
                continue
            if calculate(part["text"]) is None:
                return (
                    f"messages[{i}].content[{j}]: the python call {part['text']!r} is one the engine's calculator "
                    f"cannot compute (it answers nothing at inference): {COMPUTED_FORMS}, with its result right "
                    "after it, or leave the call out"
                )
            if after is not None:
                what = f"is followed by a {after} part, not by its result"
            elif role is None:
                what = "ends the conversation with no result after it"
            else:
                what = f"ends the assistant's turn with no result after it (a {role!r} message follows)"
            return (
                f"messages[{i}].content[{j}]: the python call {part['text']!r} {what}: at inference the engine "
                "answers a call with its result right after it and the assistant goes on, so give the result "
                'right after the call, as the next message {"role": "tool", "content": RESULT} (or a '
                '{"type": "python_output", "text": RESULT} part), then the assistant\'s reply'
            )
    return None


def engine_result_error(messages: Sequence[dict]) -> str | None:
    """Why a conversation whose every call is answered right away (unanswered_call found nothing) trains on a
    result the engine never gives, or None. At inference the engine injects `raychat.calculator.calculate(call)`
    as the result ("47 * 12" -> "564", "7/2" -> "3.5", "84/2" -> "42"), and nothing at all for a call it cannot
    compute (calculate -> None: e.g. "2**10", "sqrt(2)"). So a result (a python_output part, or the tool message
    that answers a call ending its message) must be that text exactly, e.g. `messages[1].content[2]: the result
    '564.0' of the python call '47 * 12' is not the engine's: at inference the engine answers that call with
    '564', so write '564'`; and a call the engine cannot compute is refused with its result, naming the result's
    field: the model would learn to lean on a result it never gets."""
    for i, m in enumerate(messages):
        parts = m["content"] if m["role"] == "assistant" and not isinstance(m["content"], str) else []
        for j, part in enumerate(parts):
            if part["type"] != "python":
                continue
            if j + 1 < len(parts):
                field, given = f"messages[{i}].content[{j + 1}]", parts[j + 1]["text"]
            else:
                field, given = f"messages[{i + 1}].content", messages[i + 1]["content"]
            engine = calculate(part["text"])
            if engine == given:
                continue
            if engine is None:
                return (
                    f"{field}: the result {given!r} of the python call {part['text']!r} is one the engine never "
                    "gives: its calculator cannot compute that expression and answers nothing at inference, so "
                    f"{COMPUTED_FORMS}, or leave the call and its result out"
                )
            return (
                f"{field}: the result {given!r} of the python call {part['text']!r} is not the engine's: at "
                f"inference the engine answers that call with {engine!r}, so write {engine!r}"
            )
    return None


def _field(m: re.Match) -> str:
    """chat_template's "message 3 part 1" -> "messages[3].content[1]" (the field as the record spells it)."""
    i, part = m.groups()
    return f"messages[{i}]" + (f".content[{part}]" if part else "")


class SmolTalk(Task):
    name = "smoltalk"
    eval_type = "generative"

    def __init__(self, path: str | Path | list[Path], seed: int | None = None, **slice_kw):
        """Every record is checked as it is read (conversation_error), so a bad one stops the stage before any
        work and none is trained on; SmolTalk's own files and a user's conversations in its layout alike.

        Raises:
            ValueError: one line: the first bad record's file and line (row for parquet), the field and what
                is allowed there, and how many records are bad in all, e.g. `.../train.jsonl line 9:
                messages[1]: role must be one of ['system', 'user', 'assistant', 'tool'], got 'bot' (1 of 12
                records is bad)`; the first in file order whatever its fault, a line that is not JSON or a
                record without `messages` alike (located_records with a check); or an empty file.
        """
        self.wheres, self.rows = located_records(
            path, ["messages"], seed, check=lambda r: conversation_error(r["messages"])
        )
        self.source_files = tuple(str(f) for f in record_files(path))
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        """{"id", "messages", "where": its file and line (parquet: row), as located_records says}."""
        messages = [{"role": m["role"], "content": m["content"]} for m in self.rows[index]["messages"]]
        return {"id": self._id(index), "messages": messages, "where": self.wheres[index]}


def gsm8k_parts(answer: str) -> list[dict]:
    """GSM8K answer text -> assistant parts: each calculator annotation "<<a*b=c>>" becomes a python call "a*b"
    and, as its python_output, the text the engine injects for that call at inference
    (raychat.calculator.calculate), not GSM8K's "c"; the text around it is kept.

    GSM8K writes its results by hand: in openai/gsm8k's main config (openai/grade-school-math's train.jsonl and
    test.jsonl), 667 of the train split's 23,716 annotations (2.8%, in 295 of 7,473 records) and 156 of the
    test split's 4,282 (3.6%, in 63 of 1,319) are not the engine's text for their call, every one the same number written otherwise ("<<8*18=144.00>>":
    the engine injects "144"; "<<2*20*.01=.4>>": "0.4"; "<<3/4=3/4>>": "0.75"), and none is a call the engine
    cannot compute. Trained as written, the model would condition on results it never sees at inference
    (nanochat's tasks/gsm8k.py keeps GSM8K's text; its engine injects str(eval(call)), "24.0" for "48/2"), so
    the engine's text replaces them. An annotation whose call the engine cannot compute (calculate -> None: it
    injects nothing at inference) is left out, call and result, so the model never learns to make a call that
    goes unanswered; GSM8K repeats each result in the text after its annotation ("<<48/2=24>>24 clips"), so
    the solution still reads whole. No record is refused for its annotations: a dataset the hub provides
    always loads.
    """
    parts, pos = [], 0
    for m in GSM8K_CALC_RE.finditer(answer):
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos : m.start()]})
        pos = m.end()
        result = calculate(m.group(1))
        if result is not None:
            parts.append({"type": "python", "text": m.group(1)})
            parts.append({"type": "python_output", "text": result})
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return _merged_text(parts)


def _merged_text(parts: list[dict]) -> list[dict]:
    """parts with adjacent text parts joined (a left-out annotation leaves its two sides next to each other)."""
    out: list[dict] = []
    for part in parts:
        if out and part["type"] == out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"]}
        else:
            out.append(part)
    return out


def _not_a_string(field: str, value) -> str | None:
    """Why `value` is no string ("<field> must be a string, got <its type>"), or None: it is one."""
    return None if isinstance(value, str) else f"{field} must be a string, got {type(value).__name__}"


def gsm8k_error(record: dict) -> str | None:
    """Why a GSM8K record is bad (its question is no string, its answer has no final "#### <number>"), or
    None."""
    if error := _not_a_string("question", record["question"]):
        return error
    answer = record["answer"]
    if isinstance(answer, str) and extract_answer(answer) is not None:
        return None
    return "answer has no final '#### <number>'"


class GSM8K(Task):
    name = "gsm8k"
    eval_type = "generative"

    def __init__(self, path: str | Path | list[Path], seed: int | None = None, **slice_kw):
        """Every record is checked as it is read (gsm8k_error).

        Raises:
            ValueError: one line: the first bad record in file order, its file and line (parquet: row), what is
                wrong (a question that is no string, an answer with no final "#### <number>") and how many
                records are bad, e.g. `.../test.jsonl line 4: answer has no final '####
                <number>' (1 of 8 records is bad)`; a line that is not JSON or a missing column alike
                (located_records with a check); or an empty file.
        """
        self.wheres, self.rows = located_records(path, ["question", "answer"], seed, check=gsm8k_error)
        self.source_files = tuple(str(f) for f in record_files(path))
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        """{"id", "messages", "answer": the number after the answer's final "#### "}."""
        row = self.rows[index]
        messages = [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": gsm8k_parts(row["answer"])},
        ]
        return {"id": self._id(index), "messages": messages, "answer": extract_answer(row["answer"])}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return extract_answer(completion) == conversation["answer"]


def render_multiple_choice(question: str, letters: list[str], choices: list[str]) -> str:
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(letters, choices)]
    lines.append("Respond only with the letter of the correct answer.")
    return "\n".join(lines)


def _arc_choices_error(choices) -> str | None:
    """What is wrong with an ARC record's `choices` (None: nothing): it must be {"text": [...], "label": [...]},
    one label per text, every text and label a string ("choices.label[0] must be a string, got int")."""
    expected = 'expected {"text": [...], "label": [...]}'
    if not isinstance(choices, dict):
        return f"choices is a {type(choices).__name__}; {expected}"
    missing = [k for k in ("text", "label") if k not in choices]
    if missing:
        return f"choices lacks field(s) {missing}; {expected}"
    if not all(isinstance(choices[k], list) for k in ("text", "label")):
        return f"choices' text and label must be lists; {expected}"
    if len(choices["text"]) != len(choices["label"]):
        texts, labels = plural(len(choices["text"]), "text"), plural(len(choices["label"]), "label")
        return f"choices has {texts} and {labels}; one label per text"
    for k in ("text", "label"):
        for i, value in enumerate(choices[k]):
            if error := _not_a_string(f"choices.{k}[{i}]", value):
                return error
    return None


def arc_error(record: dict) -> str | None:
    """Why an ARC record is bad (its question is no string, its `choices` are not {"text": [...], "label":
    [...]} of strings with one label per text, or its answerKey is no string or not one of the labels), or
    None."""
    error = (
        _not_a_string("question", record["question"])
        or _arc_choices_error(record["choices"])
        or _not_a_string("answerKey", record["answerKey"])
    )
    if error is None and record["answerKey"] not in record["choices"]["label"]:
        return f"answerKey {record['answerKey']!r} not in labels {record['choices']['label']}"
    return error


MMLU_COLUMNS = ["question", "choices", "answer"]


def _unnested(record: dict) -> dict:
    """The record; cais/mmlu's `auxiliary_train` config nests each in a `train` column."""
    return record["train"] if "train" in record and "question" not in record else record


def mmlu_error(record: dict) -> str | None:
    """Why an MMLU record (nested or not: _unnested) is bad (a missing column, a question that is no string,
    choices that are not a list of 1..10 strings (one per letter of LETTERS), or an answer that is not the index
    of one of its choices: an int, as cais/mmlu stores it; a bool, a float or a string is refused), or None."""
    row = _unnested(record)
    missing = [c for c in MMLU_COLUMNS if c not in row]
    if missing:
        return f"lacks column(s) {missing}; expected {MMLU_COLUMNS}"
    if error := _not_a_string("question", row["question"]):
        return error
    choices = row["choices"]
    if not (isinstance(choices, list) and 1 <= len(choices) <= len(LETTERS)) or not all(
        isinstance(c, str) for c in choices
    ):
        return f"choices {str(choices)[:60]} are not a list of 1..{len(LETTERS)} strings"
    n, answer = len(choices), row["answer"]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < n:
        return None
    return f"answer {answer!r} is not the index of one of the {n} choices (0..{n - 1})"


class MultipleChoice(Task):
    """MMLU (`format="mmlu"`) or ARC (`format="arc"`) items as categorical tasks; the reply is the letter.

    Every record is checked as it is read (mmlu_error, arc_error).

    Raises:
        ValueError: an unknown format; or one line: the first bad record in file order, its file and line
            (parquet: row), what is wrong and how many records are bad (located_records with a check): a
            missing column, a question that is no string, ARC `choices` that are not {"text": [...], "label":
            [...]} of strings with one label per text, an ARC answerKey that is no string or not one of its
            labels or an MMLU answer that is not the index of a choice,
            e.g. `.../mmlu.parquet row 4: answer 4 is not the index of one of the 4 choices (0..3) (1 of 6
            records is bad)`; or an empty file.
    """

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
        if format == "mmlu":  # its columns are checked by mmlu_error, after un-nesting
            self.wheres, rows = located_records(path, [], seed, check=mmlu_error)
        else:
            self.wheres, rows = located_records(
                path, ["question", "choices", "answerKey"], seed, check=arc_error
            )
        self.rows = [_unnested(r) for r in rows] if format == "mmlu" else rows
        self.source_files = tuple(str(f) for f in record_files(path))
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        row = self.rows[index]
        if self.format == "mmlu":
            choices = list(row["choices"])
            letters = list(LETTERS[: len(choices)])
            answer = letters[row["answer"]]
        else:
            choices, letters = list(row["choices"]["text"]), list(row["choices"]["label"])
            answer = row["answerKey"]
        messages = [
            {"role": "user", "content": render_multiple_choice(row["question"], letters, choices)},
            {"role": "assistant", "content": answer},
        ]
        return {"id": self._id(index), "messages": messages, "letters": letters, "answer": answer}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return completion.strip() == conversation["answer"]

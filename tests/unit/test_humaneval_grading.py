"""HumanEval grading (raychat.tasks.humaneval): a completion is correct only when check() ran and returned, not
whenever the program exits 0 (a `__main__` block that calls sys.exit(0) ended it before check() ran)."""

import json

import pytest

from raychat.tasks.humaneval import HumanEval
from raychat.tasks.sandbox import SandboxLimits, SandboxResult, run_python

LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0)
PROMPT = 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


@pytest.fixture
def task(tmp_path):
    row = {"task_id": "HumanEval/0", "prompt": PROMPT, "canonical_solution": "    return a + b\n", "test": TEST,
           "entry_point": "add"}  # fmt: skip
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return HumanEval(path, limits=LIMITS)


def test_a_wrong_completion_that_exits_0_before_check_runs_is_wrong(task):
    exits = (
        "import sys\n\ndef add(a, b):\n    return a - b\n\nif __name__ == '__main__':\n    print(add(2, 3))\n"
    )
    graded = [
        task.is_correct(task[0], f"```python\n{exits}    sys.exit(0)\n```"),
        task.is_correct(task[0], f"```python\n{exits}    import os\n    os._exit(0)\n```"),
        task.is_correct(task[0], f"```python\n{exits}    raise SystemExit\n```"),
    ]
    assert graded == [False, False, False]


def test_a_correct_completion_passes_whatever_it_prints(task):
    graded = [
        task.is_correct(task[0], "def add(a, b):\n    return a + b"),
        task.is_correct(task[0], "def add(a, b):\n    return a + b\n\nprint('no newline', end='')"),
        task.is_correct(task[0], task[0]["messages"][1]["content"]),  # the reference solution
    ]
    assert graded == [True, True, True]


def test_the_token_is_printed_after_check_and_the_programs_output_is_kept():
    from raychat.tasks.humaneval import (
        build_program,
        passed,
    )  # (imported here: the unfixed module lacks them)

    conv = {"messages": [{"role": "user", "content": PROMPT}], "test": TEST, "entry_point": "add"}
    program = build_program(conv, "def add(a, b):\n    print('adding')\n    return a + b", "0a1b")
    assert program.endswith("check(add)\nprint('\\n0a1b')\n")
    r = run_python(program, LIMITS)
    assert (r.stdout, passed(r, "0a1b"), passed(r, "0a1c")) == ("adding\nadding\n\n0a1b\n", True, False)
    exited = SandboxResult(True, "passed", 0, "-1\n", "", 0.1, "netns")  # exit status 0, no token
    assert not passed(exited, "0a1b")

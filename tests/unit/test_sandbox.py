"""The HumanEval sandbox (raychat.tasks.sandbox) and the HumanEval grader: attacks are stopped and scored as
failures, and the items around them are scored as usual."""

import json
import socket
import time

import pytest

from raychat.tasks.humaneval import HumanEval, build_program, extract_imports, extract_program
from raychat.tasks.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0, max_processes=16)

ADD_PROMPT = 'from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    """a + b"""\n'
ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_a_correct_program_passes_and_a_wrong_one_fails():
    ok = run_python("import math\nassert math.gcd(12, 18) == 6\nprint('fine')", LIMITS)
    assert (ok.passed, ok.status, ok.returncode, ok.stdout.strip()) == (True, "passed", 0, "fine")
    bad = run_python("assert 1 + 1 == 3", LIMITS)
    assert (bad.passed, bad.status, bad.returncode) == (False, "failed", 1)
    assert "AssertionError" in bad.stderr


def test_an_infinite_loop_is_stopped_by_the_limits():
    t0 = time.perf_counter()
    r = run_python("while True:\n    pass", LIMITS)
    assert not r.passed and r.status in ("timeout", "killed")  # RLIMIT_CPU (SIGXCPU) or the wall clock
    assert time.perf_counter() - t0 < LIMITS.wall_s + 3


def test_a_fork_bomb_is_stopped_and_leaves_no_process():
    t0 = time.perf_counter()
    r = run_python("import os\nwhile True:\n    os.fork()", LIMITS)
    assert not r.passed
    assert time.perf_counter() - t0 < LIMITS.wall_s + 3
    after = run_python("print('next item')", LIMITS)  # the next item runs as usual
    assert after.passed and after.stdout.strip() == "next item"


def test_a_write_outside_the_sandbox_is_refused(tmp_path):
    target = tmp_path / "pwned.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", LIMITS)
    assert not r.passed and not target.exists()
    assert "PermissionError" in r.stderr
    inside = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", LIMITS)
    assert inside.passed and inside.stdout.strip() == "ok"  # its own directory is writable


def test_the_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", LIMITS)
    finally:
        server.close()
    assert not r.passed


def test_memory_is_capped():
    r = run_python("x = bytearray(4 << 30)", SandboxLimits(cpu_s=2, wall_s=4.0, memory_bytes=512 << 20))
    assert not r.passed and "MemoryError" in r.stderr


def test_program_extraction_follows_nanochat():
    assert extract_imports("import math\nfrom typing import List\n\ndef f():\n    import os\n") == (
        "import math\nfrom typing import List"
    )
    assert extract_program("Here:\n```python\ndef f():\n    return 1\n```\nmore") == "def f():\n    return 1"
    assert extract_program("  def f(): return 1  ") == "def f(): return 1"
    conv = {"messages": [{"role": "user", "content": ADD_PROMPT}], "test": ADD_TEST, "entry_point": "add"}
    assert build_program(conv, "def add(a, b):\n    return a + b", "5eed") == (
        "from typing import List\n\ndef add(a, b):\n    return a + b\n\n"
        + ADD_TEST
        + "\ncheck(add)\nprint('\\n5eed')\n"
    )


@pytest.fixture
def humaneval_file(tmp_path):
    rows = [
        {"task_id": f"HumanEval/{i}", "prompt": ADD_PROMPT, "canonical_solution": "    return a + b\n",
         "test": ADD_TEST, "entry_point": "add"}
        for i in range(4)
    ]  # fmt: skip
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_humaneval_scores_attacks_as_failures_and_the_rest_as_usual(humaneval_file, tmp_path):
    task = HumanEval(humaneval_file, limits=LIMITS)
    assert len(task) == 4 and task[0]["id"] == "HumanEval/0"
    assert task[0]["messages"][1]["content"] == ADD_PROMPT + "\n    return a + b\n"
    outside = tmp_path / "escape.txt"
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # correct
        "def add(a, b):\n    while True:\n        pass",  # hangs
        f"def add(a, b):\n    open({str(outside)!r}, 'w').write('x')\n    return a + b",  # attacks the disk
        "def add(a, b):\n    return a - b",  # wrong
    ]
    graded = [task.is_correct(task[i], c) for i, c in enumerate(completions)]
    assert graded == [True, False, False, False]
    assert not outside.exists()
    # the reference solution passes its own tests
    assert task.is_correct(task[0], task[0]["messages"][1]["content"])

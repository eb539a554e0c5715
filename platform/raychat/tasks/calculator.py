"""Calculator arithmetic: generated problems whose assistant answers call the python tool.

Example (split "train", index 0, seed 0 gives some such problem):
    user:      What is 47 * 12?
    assistant: [text "Let me compute it. ", python "47 * 12", python_output "564", text "#### 564"]

Problems: a op b with op in + - *, a, b uniform in [0, max_operand]. Example i of a split is drawn from
numpy PCG64 seeded with (seed, i, attempt); a problem belongs to "test" when sha256("a op b") % 10 == 0,
else to "train", and attempts continue until the split matches, so the two splits never share a problem
whatever the seed. The checker compares the number after the last "####" with the exact result.
"""

from __future__ import annotations

import hashlib

import numpy as np

from raychat.tasks.base import Task, extract_answer

SPLITS = ("train", "test")
OPS = ("+", "-", "*")
PROMPTS = ("What is {e}?", "Compute {e}.", "Calculate {e}", "{e} = ?", "Please work out {e}.")


def split_of(expr: str) -> str:
    """ "test" for one problem in ten (by sha256 of the expression text), else "train"."""
    return "test" if int(hashlib.sha256(expr.encode()).hexdigest(), 16) % 10 == 0 else "train"


class Calculator(Task):
    eval_type = "generative"

    def __init__(
        self, split: str = "train", size: int = 10_000, seed: int = 0, max_operand: int = 999, **slice_kw
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        if size < 0 or max_operand < 1:
            raise ValueError(f"size must be >= 0 and max_operand >= 1, got {size}, {max_operand}")
        self.name = f"calculator-{split}"
        self.split, self.size, self.seed, self.max_operand = split, size, seed, max_operand
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return self.size

    def problem(self, index: int) -> tuple[str, int, str]:
        """(expression, exact result, prompt template) of physical example `index`."""
        for attempt in range(10_000):
            rng = np.random.default_rng([self.seed, index, attempt])
            a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
            op = OPS[int(rng.integers(len(OPS)))]
            expr = f"{a} {op} {b}"
            if split_of(expr) == self.split:
                result = a + b if op == "+" else a - b if op == "-" else a * b
                return expr, result, PROMPTS[int(rng.integers(len(PROMPTS)))]
        raise RuntimeError(f"no {self.split} problem found for index {index}")  # pragma: no cover

    def get_example(self, index: int) -> dict:
        expr, result, prompt = self.problem(index)
        parts = [
            {"type": "text", "text": "Let me compute it. "},
            {"type": "python", "text": expr},
            {"type": "python_output", "text": str(result)},
            {"type": "text", "text": f"#### {result}"},
        ]
        messages = [
            {"role": "user", "content": prompt.format(e=expr)},
            {"role": "assistant", "content": parts},
        ]
        return {"id": self._id(index), "messages": messages, "answer": str(result)}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return extract_answer(completion) == conversation["answer"]

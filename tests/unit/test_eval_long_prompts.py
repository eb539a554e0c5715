"""Task evaluation (raychat.eval.tasks) of an item whose prompt the model cannot take: scored incorrect, counted
and named in a log line; the other items are scored as usual and nothing raises (HumanEval's prompts exceed the
256 tokens of the small presets, and one crashed the chat evaluation of every task)."""

from support.engine_fixtures import byte_tokenizer, scripted_model, tiny_gpt

from raychat.eval.tasks import task_accuracy, task_pass_at_k
from raychat.tasks.base import Task


class Sized(Task):
    """Items whose user turn is `sizes[i]` x's (one token each for the byte tokenizer); every completion is
    correct; categorical items' answer is the letter `answer`."""

    name = "sized"

    def __init__(self, sizes: list[int], eval_type: str = "generative", answer: str = "A"):
        self.sizes, self.eval_type, self.answer = sizes, eval_type, answer
        super().__init__()

    def num_examples(self) -> int:
        return len(self.sizes)

    def get_example(self, index: int) -> dict:
        conv = {"id": f"sized/{index}", "messages": [{"role": "user", "content": "x" * self.sizes[index]}]}
        return conv | (
            {"letters": ["A", "B"], "answer": self.answer} if self.eval_type == "categorical" else {}
        )

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return True


def test_a_generative_prompt_too_long_is_scored_incorrect_and_logged(capsys):
    tok = byte_tokenizer()
    model = scripted_model(tok.vocab_size, {}, tok.special_id("<|assistant_end|>"), max_seq_len=64)
    # the template adds 4 tokens: 59 x's make 63 (room for one token), 60 make 64 (none)
    assert task_accuracy(model, tok, Sized([10, 60, 59]), 3, max_tokens=4) == 2 / 3
    assert capsys.readouterr().out == (
        "sized: 1 prompt of 3 longer than 63 tokens (max_seq_len 64) scored incorrect: sized/1\n"
    )
    passes, per_item = task_pass_at_k(model, tok, Sized([10, 300, 20]), 3, samples=2, temperature=1.0, seed=0,
                                      max_tokens=4)  # fmt: skip
    assert (passes, per_item) == ({"pass@1": 2 / 3, "pass@2": 2 / 3}, [1.0, 0.0, 1.0])


def test_a_categorical_prompt_too_long_is_scored_incorrect_and_counted(capsys):
    from raychat.eval.tasks import task_accuracy_counts  # (imported here: the unfixed module lacks it)

    tok = byte_tokenizer()
    model = tiny_gpt(tok, max_seq_len=64)
    fits = task_accuracy_counts(model, tok, Sized([10], "categorical"), 1)
    answer = "A" if fits == (1.0, 0) else "B"  # the letter the model picks for the item that fits
    assert task_accuracy_counts(model, tok, Sized([10, 61], "categorical", answer), 2) == (0.5, 1)  # 65 > 64
    assert capsys.readouterr().out.splitlines()[-1] == (
        "sized: 1 prompt of 2 longer than 64 tokens (max_seq_len 64) scored incorrect: sized/1"
    )


def test_the_chat_evaluation_of_humaneval_goes_on_past_a_long_prompt(tmp_path, capsys):
    import json

    from support.serve_helpers import tiny_model_and_tokenizer

    from raychat.eval.report_card import chat_cells

    rows = [
        {"task_id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """{" ".join(["word"] * words)}"""\n',
         "canonical_solution": "    return x\n", "test": "def check(candidate):\n    assert candidate(1) == 1\n",
         "entry_point": f"f{i}"}
        for i, words in enumerate([5, 400])
    ]  # fmt: skip
    (tmp_path / "openai_humaneval/openai_humaneval").mkdir(parents=True)
    (tmp_path / "openai_humaneval/openai_humaneval/test.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    model, tok = tiny_model_and_tokenizer(max_seq_len=256)
    lines = []
    cells = chat_cells(model, tok, str(tmp_path), max_tokens=8, columns=("HumanEval",), log=lines.append)
    assert cells["HumanEval"]["examples"] == 2 and cells["HumanEval"]["value"] == 0.0
    assert cells["HumanEval"]["too_long"] == 1
    assert lines[0].startswith(
        "report card, checkpoint : HumanEval 0.0000 ± 0.0000 (2 items, 1 too long for the model, "
    )
    assert (
        "humaneval: 1 prompt of 2 longer than 255 tokens (max_seq_len 256) scored incorrect: HumanEval/1"
        in (capsys.readouterr().out.splitlines())
    )

"""Task accuracy of a chat model: categorical (argmax over the answer letters) or generative (exact answer).

categorical: after the prompt (rendered for completion), the model's choice is the letter whose token has
the highest logit among the task's `letters`; accuracy = fraction equal to `answer`.
generative: greedy completion through the engine (tool calls evaluated); accuracy = fraction that
`task.is_correct(conversation, completion_text)` accepts. Its completion budget (tokens, forced tool output
included) is the task's own, MAX_TOKENS, unless one budget is given for every task (task_budget).
sampled (task_pass_at_k): k completions of each generative item at a temperature, pass@1..pass@k by the
unbiased estimator (raychat.tasks.pass_at_k, RL's held-out evaluation's).
An item whose prompt the model cannot take (longer than its max_seq_len, or as long for a generative task: no
room to generate; HumanEval's prompts exceed the 256 of the small presets) is scored incorrect, counted
(task_accuracy_counts) and logged with its id, not an error that stops the evaluation of every task.
"""

from __future__ import annotations

import math
from itertools import groupby

import torch

from raychat.chat_template import render_for_completion
from raychat.engine import ModelRunner
from raychat.log import log, plural
from raychat.model import eval_mode
from raychat.tasks.pass_at_k import pass_at_k

# a generative task's own completion budget, tokens, by registry name: nanochat's chat_eval --max-new-tokens
# (512) for GSM8K and HumanEval; 128 for the local tasks, above their longest gold answer at one token per
# byte (spelling 73, calculator 50), so no tokenizer's gold answer is cut (a greedy model stops at its turn's end)
MAX_TOKENS = {"gsm8k": 512, "humaneval": 512, "spelling": 128, "calculator": 128}


def task_budget(name: str, given: int | None = None) -> int | None:
    """The completion budget (tokens) task `name` (a registry name) is measured at: `given` (one budget for
    every task) when set, else the task's own (MAX_TOKENS); None for a task that generates nothing."""
    return given if given is not None else MAX_TOKENS.get(name)


def accuracy_stderr(accuracy: float, n: int) -> float | None:
    """The standard error of an accuracy over `n` items each scored 0 or 1: their sample standard deviation
    over sqrt(n), sqrt(p (1 - p) / (n - 1)) (lm-evaluation-harness's mean_stderr, its `acc_stderr`); None for
    one item (no spread to measure)."""
    return math.sqrt(accuracy * (1.0 - accuracy) / (n - 1)) if n > 1 else None


def mean_stderr(values: list[float]) -> float | None:
    """The standard error of the mean of per-item scores: their sample standard deviation over sqrt(n)
    (lm-evaluation-harness's mean_stderr); None for one item."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def prompt_messages(conversation: dict) -> list[dict]:
    """The messages up to (not including) the final assistant reply."""
    messages = conversation["messages"]
    return messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages


def first_items(tokenizer, task, num_examples: int) -> tuple[list[dict], list[list[int]]]:
    """The first `num_examples` conversations of `task` (fewer if the task is smaller) and each one's prompt,
    token ids rendered for completion (raychat.chat_template.render_for_completion)."""
    conversations = [task[i] for i in range(min(num_examples, len(task)))]
    return conversations, [render_for_completion(tokenizer, prompt_messages(c)) for c in conversations]


def too_long(model, task, conversations: list[dict], prompts: list[list[int]]) -> list[bool]:
    """Whether each prompt is too long for `model`: more than its config.max_seq_len tokens, or that many for a
    generative task (no room to generate); none for a model without one. Logs one line naming the task, the
    items (their ids, else indexes) and the limit when any is."""
    max_seq_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if max_seq_len is None:
        return [False] * len(prompts)
    limit = max_seq_len - (task.eval_type == "generative")
    long = [len(p) > limit for p in prompts]
    if any(long):
        items = [str(c.get("id", i)) for i, (c, lg) in enumerate(zip(conversations, long)) if lg]
        log(
            f"{task.name}: {plural(len(items), 'prompt')} of {len(prompts)} longer than {limit} tokens "
            f"(max_seq_len {max_seq_len}) scored incorrect: {', '.join(items)}"
        )
    return long


@torch.no_grad()
def task_accuracy(
    model, tokenizer, task, num_examples: int, max_tokens: int | None = 48, batch_size: int = 16
) -> float:
    """Accuracy in [0, 1] over the first `num_examples` examples of `task` (fewer if the task is smaller):
    task_accuracy_counts' accuracy.

    Raises:
        ValueError: num_examples < 1 or an unknown eval_type.
    """
    return task_accuracy_counts(model, tokenizer, task, num_examples, max_tokens, batch_size)[0]


@torch.no_grad()
def task_accuracy_counts(
    model, tokenizer, task, num_examples: int, max_tokens: int | None = 48, batch_size: int = 16
) -> tuple[float, int]:
    """(accuracy in [0, 1], too_long) over the first `num_examples` examples of `task` (fewer if the task is
    smaller); too_long: how many of them had a prompt too long for the model (too_long), scored incorrect.
    max_tokens: a generative task's completion budget, tokens (categorical tasks generate nothing).

    Raises:
        ValueError: num_examples < 1 or an unknown eval_type.
    """
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if task.eval_type not in ("categorical", "generative"):
        raise ValueError(f"task {task.name!r}: eval_type must be 'categorical' or 'generative'")
    conversations, prompts = first_items(tokenizer, task, num_examples)
    long = too_long(model, task, conversations, prompts)
    items = [(c, p) for c, p, lg in zip(conversations, prompts, long) if not lg]
    correct = 0
    with eval_mode(model):
        if task.eval_type == "categorical":
            device = next(model.parameters()).device
            for conv, ids in items:
                logits = model(torch.tensor([ids], device=device))[0, -1]
                letter_ids = [tokenizer.encode(letter)[0] for letter in conv["letters"]]
                choice = conv["letters"][int(torch.argmax(logits[letter_ids]))]
                correct += choice == conv["answer"]
        elif items:
            engine = ModelRunner(model, tokenizer, dtype="model")  # evaluate the weights as they are
            for i in range(0, len(items), batch_size):
                batch = items[i : i + batch_size]
                results = engine.generate_batch([p for _, p in batch], max_tokens=max_tokens, temperature=0.0)
                for (conv, _), r in zip(batch, results):
                    correct += bool(task.is_correct(conv, r.text))
    return correct / len(prompts), sum(long)


@torch.no_grad()
def task_pass_at_k(
    model, tokenizer, task, num_examples: int, samples: int, temperature: float, seed: int,
    max_tokens: int | None = 128, batch_size: int = 16,
) -> tuple[dict[str, float], list[float]]:  # fmt: skip
    """({"pass@1": ..., ..., f"pass@{samples}": ...}, each item's pass@1) over the first `num_examples` items of
    generative `task` (fewer if the task is smaller): `samples` completions of each at `temperature`, seeded by
    `seed` (item i's from (seed, i), whatever the batching: raychat.engine.ModelRunner.generate_batch), scored by
    task.is_correct; pass@k = the mean over items of the unbiased pass_at_k(samples, correct, k); an item too
    long for the model (too_long) has none correct; max_tokens: the completion budget, tokens. batch_size: items
    decoded at once.

    Raises:
        ValueError: num_examples or samples < 1, a categorical task, or a bad temperature (the engine's).
    """
    if num_examples < 1 or samples < 1:
        raise ValueError(f"num_examples and samples must be >= 1, got {num_examples} and {samples}")
    if task.eval_type != "generative":
        raise ValueError(f"task {task.name!r}: pass@k needs a generative task, not {task.eval_type!r}")
    conversations, prompts = first_items(tokenizer, task, num_examples)
    long = too_long(model, task, conversations, prompts)
    correct = [0] * len(conversations)
    with eval_mode(model):
        engine = ModelRunner(model, tokenizer, dtype="model")  # evaluate the weights as they are
        for skipped, run in groupby(range(len(prompts)), key=long.__getitem__):
            if skipped:
                continue
            run = list(run)  # consecutive items that fit: item i still seeded from (seed, i)
            results = engine.generate_batch(
                prompts[run[0] : run[-1] + 1], num_samples=samples, max_tokens=max_tokens,
                temperature=temperature, seed=seed, max_rows=batch_size * samples, seed_offset=run[0],
            )  # fmt: skip
            for j, i in enumerate(run):
                samples_i = results[j * samples : (j + 1) * samples]
                correct[i] = sum(bool(task.is_correct(conversations[i], r.text)) for r in samples_i)
    n = len(conversations)
    scores = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in correct) / n for k in range(1, samples + 1)}
    return scores, [c / samples for c in correct]

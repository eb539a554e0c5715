"""CORE: in-context-learning accuracy of a base model on the DCLM task suite, scored as nanochat scores it.

Source: nanochat (github.com/karpathy/nanochat: nanochat/core_eval.py, scripts/base_eval.py), which follows
the CORE metric of the DCLM paper (Li et al. 2024, "DataComp-LM", arXiv:2406.11794, section 3.5 and App. G).
The bundle (task list, random baselines, one JSONL per task) is read by raychat.eval.core_bundle.

One item of a task (evaluate_item):
  multiple_choice    one prompt per choice: shots + query + delimiter + choice. The scored tokens are those
                     after the prompts' common token prefix; the answer is the choice whose scored tokens
                     have the lowest mean cross entropy; correct if it is `gold`.
  schema             one prompt per context option: shots + option + delimiter + continuation. The scored
                     tokens are the prompts' common token suffix; lowest mean cross entropy wins.
  language_modeling  shots + context.strip() + delimiter, stripped, then the same + continuation; correct if
                     the greedy (argmax) prediction of every continuation token is that token.
Shots: num_fewshot other items of the task, drawn with random.Random(1234 + item index), each rendered with
its gold answer and followed by a blank line ("\\n\\n"). Each sequence starts with BOS; one longer than the
model's max_seq_len keeps its last max_seq_len tokens. Each item is one forward pass of its own (no batching
across items), so a score does not depend on which worker computed it.

centered accuracy = (accuracy - b / 100) / (1 - b / 100), b = the task's random baseline in percent
(nanochat's evaluate_core); CORE = the mean centered accuracy over the bundle's tasks.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence

import ray
import torch
import torch.nn.functional as F
from ray.exceptions import GetTimeoutError

from raychat.eval.core_bundle import CoreTask, load_bundle
from raychat.model import eval_mode

FEWSHOT_SEED = 1234  # nanochat's evaluate_example: random.Random(1234 + idx)
SHOT_SEPARATOR = "\n\n"


def render_prompts(task_type: str, item: dict, delimiter: str, shots: Sequence[dict] = ()) -> list[str]:
    """The prompt texts of one item (equal, character for character, to nanochat's Jinja templates).

    Returns:
        multiple_choice: one prompt per choice; schema: one per context option; language_modeling:
        [prompt without the continuation (stripped), prompt with it].
    Raises:
        ValueError: an unknown task_type.
    """
    if task_type == "multiple_choice":
        block = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}{SHOT_SEPARATOR}" for s in shots)
        return [f"{block}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        block = "".join(
            f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}{SHOT_SEPARATOR}" for s in shots
        )
        return [f"{block}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    if task_type == "language_modeling":
        block = "".join(
            f"{s['context'].strip()}{delimiter}{s['continuation']}{SHOT_SEPARATOR}" for s in shots
        )
        head = f"{block}{item['context'].strip()}{delimiter}"
        return [head.strip(), head + item["continuation"]]
    raise ValueError(f"task type {task_type!r}; allowed: multiple_choice, schema, language_modeling")


def fewshot_indices(index: int, num_items: int, num_fewshot: int) -> list[int]:
    """The indices (into the task's scoring order) of the shots shown before item `index`: nanochat's
    random.Random(1234 + index).sample of the other items, in the sampled order; [] for 0 shots."""
    if num_fewshot == 0:
        return []
    others = [i for i in range(num_items) if i != index]
    return random.Random(FEWSHOT_SEED + index).sample(others, num_fewshot)


def common_length(seqs: Sequence[Sequence[int]], from_end: bool = False) -> int:
    """Length of the token prefix (or suffix, with from_end) that every sequence shares."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        j = -1 - i if from_end else i
        if any(s[j] != seqs[0][j] for s in seqs):
            return i
    return n


def token_spans(
    tokenizer, task_type: str, prompts: list[str]
) -> tuple[list[list[int]], list[int], list[int]]:
    """(token rows with BOS first, start, end of each row's scored tokens [start, end)).

    Raises:
        ValueError: language_modeling prompts whose tokens without the continuation are not a strict prefix
            of those with it (the continuation cannot be told apart in token space).
    """
    rows = tokenizer.encode_batch(prompts, prepend_bos=True)
    ends = [len(r) for r in rows]
    if task_type == "multiple_choice":
        start = common_length(rows)
        return rows, [start] * len(rows), ends
    if task_type == "schema":
        suffix = common_length(rows, from_end=True)
        return rows, [e - suffix for e in ends], ends
    without, with_ = rows
    if not (len(without) < len(with_) and with_[: len(without)] == without):
        raise ValueError(
            "the tokens of the context alone are not a strict prefix of those of context + continuation "
            "(empty continuation, or a token merging across the delimiter)"
        )
    return [with_], [len(without)], [len(with_)]


def crop(rows, starts, ends, max_seq_len: int | None):
    """Keep the last max_seq_len tokens of each longer row and shift its span (nanochat's crop).

    Raises:
        ValueError: the crop would cut into the scored tokens or leave no token before them.
    """
    if max_seq_len is None:
        return rows, starts, ends
    out = ([], [], [])
    for row, s, e in zip(rows, starts, ends):
        cut = max(0, len(row) - max_seq_len)
        if s - cut < 1:
            raise ValueError(f"the scored tokens do not fit in max_seq_len = {max_seq_len} after the context")
        out[0].append(row[cut:])
        out[1].append(s - cut)
        out[2].append(e - cut)
    return out


@torch.no_grad()
def losses_and_predictions(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, predictions), both (B, T): the cross entropy (nats, float32) of token t+1 given tokens 0..t
    (the last column is NaN: nothing follows it) and the argmax token id at t. `model(input_ids)` must return
    (B, T, vocab) logits, as raychat.model.GPT does."""
    logits = model(input_ids).float()
    targets = torch.roll(input_ids, shifts=-1, dims=1)
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(input_ids.shape)
    losses[:, -1] = float("nan")
    return losses, logits.argmax(dim=-1)


def evaluate_item(model, tokenizer, task: CoreTask, index: int, device, max_seq_len: int | None) -> bool:
    """Whether the model answers item `index` of `task` (in scoring order) correctly; see the module doc.

    Raises:
        ValueError: the item cannot be scored (token spans, crop).
    """
    item = task.items[index]
    shots = [task.items[i] for i in fewshot_indices(index, len(task.items), task.num_fewshot)]
    prompts = render_prompts(task.task_type, item, task.continuation_delimiter, shots)
    rows, starts, ends = crop(*token_spans(tokenizer, task.task_type, prompts), max_seq_len)
    input_ids = torch.full((len(rows), max(len(r) for r in rows)), tokenizer.bos_id, dtype=torch.long)
    for i, r in enumerate(rows):  # right-padded with BOS (the padding is never scored)
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    input_ids = input_ids.to(device)
    losses, predictions = losses_and_predictions(model, input_ids)
    if task.task_type == "language_modeling":
        s, e = starts[0], ends[0]
        return bool(torch.equal(predictions[0, s - 1 : e - 1], input_ids[0, s:e]))
    mean_losses = [losses[i, s - 1 : e - 1].mean().item() for i, (s, e) in enumerate(zip(starts, ends))]
    return mean_losses.index(min(mean_losses)) == item["gold"]


def score_share(
    model,
    tokenizer,
    tasks: list[CoreTask],
    rank: int,
    world: int,
    device="cpu",
    max_seq_len: int | None = None,
) -> dict[str, dict]:
    """Score every `world`-th item of the bundle (all tasks' items in one list), starting at `rank`.

    Returns:
        {label: {"correct": [(index, bool)], "error": (index, message) | None}}; a task stops at its first
        item that fails (message: "file:line: what"); tasks that failed to load are skipped.
    """
    model = model.to(device)
    out = {t.label: {"correct": [], "error": None} for t in tasks}
    units = [(t, i) for t in tasks if t.error is None for i in range(len(t.items))]
    with eval_mode(model):
        for task, i in units[rank::world]:
            share = out[task.label]
            if share["error"] is not None:
                continue
            try:
                share["correct"].append((i, evaluate_item(model, tokenizer, task, i, device, max_seq_len)))
            except Exception as e:  # one bad item fails its task, never the others
                share["error"] = (i, f"{task.path}:{task.lines[i]}: {type(e).__name__}: {e}")
    return out


_score_share_remote = ray.remote(score_share)


def centered_accuracy(accuracy: float, random_baseline: float) -> float:
    """(accuracy - b/100) / (1 - b/100), b = random baseline in percent ([0, 100)); 0 = chance, 1 = perfect.

    Source: nanochat scripts/base_eval.py evaluate_core (DCLM's centered accuracy)."""
    b = 0.01 * random_baseline
    return (accuracy - b) / (1.0 - b)


def _cpu_model(model):
    tensors = [*model.parameters(), *model.buffers()]
    return model if all(t.device.type == "cpu" for t in tensors) else copy.deepcopy(model).cpu()


def score_tasks(
    model,
    tokenizer,
    tasks: list[CoreTask],
    num_workers: int = 0,
    device=None,
    max_seq_len: int | None = None,
    timeout_s: float | None = None,
) -> dict:
    """Score loaded tasks in this process (num_workers 0) or on num_workers Ray tasks; see core_scores."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 (0 = in this process), got {num_workers}")
    t0 = time.perf_counter()
    if max_seq_len is None:
        max_seq_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if num_workers == 0:
        if device is None:
            params = list(model.parameters())
            device = params[0].device if params else "cpu"
        shares = [score_share(model, tokenizer, tasks, 0, 1, device, max_seq_len)]
    else:
        device = str(device or "cpu")
        remote = _score_share_remote.options(num_cpus=1, num_gpus=1 if device.startswith("cuda") else 0)
        model_ref, tok_ref, tasks_ref = ray.put(_cpu_model(model)), ray.put(tokenizer), ray.put(tasks)
        refs = [
            remote.remote(model_ref, tok_ref, tasks_ref, rank, num_workers, device, max_seq_len)
            for rank in range(num_workers)
        ]
        try:
            shares = ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise TimeoutError(
                f"CORE: {num_workers} Ray workers did not finish within {timeout_s} s"
            ) from None
    return _merge(tasks, shares, num_workers, time.perf_counter() - t0)


def _merge(tasks: list[CoreTask], shares: list[dict], num_workers: int, seconds: float) -> dict:
    per_task, errors = {}, {}
    for task in tasks:
        correct = [None] * len(task.items)
        failures = []
        for share in shares:
            for i, ok in share[task.label]["correct"]:
                correct[i] = ok
            if share[task.label]["error"] is not None:
                failures.append(share[task.label]["error"])
        error = task.error or (min(failures)[1] if failures else None)
        row = {
            "task_type": task.task_type,
            "num_fewshot": task.num_fewshot,
            "random_baseline": task.random_baseline,
            "examples": len(task.items),
            "accuracy": None,
            "centered": None,
            "error": error,
        }
        if error is None:
            row["accuracy"] = sum(correct) / len(correct)
            row["centered"] = centered_accuracy(row["accuracy"], task.random_baseline)
        else:
            errors[task.label] = error
        per_task[task.label] = row
    results = {k: v["accuracy"] for k, v in per_task.items() if v["error"] is None}
    centered = {k: v["centered"] for k, v in per_task.items() if v["error"] is None}
    return {
        "core_metric": None if errors else sum(centered.values()) / len(centered),
        "results": results,
        "centered_results": centered,
        "tasks": per_task,
        "errors": errors,
        "workers": num_workers,
        "seconds": round(seconds, 3),
    }


def core_scores(
    model,
    tokenizer,
    bundle_dir,
    max_per_task: int = -1,
    num_workers: int = 0,
    device=None,
    timeout_s: float | None = None,
) -> dict:
    """CORE of a base model on the bundle in `bundle_dir` (DCLM/nanochat layout, raychat.eval.core_bundle).

    Args:
        model: called as model(input_ids (B, T) int64) -> (B, T, vocab) logits (raychat.model.GPT's forward);
            its config.max_seq_len, when it has one, is the crop length.
        tokenizer: raychat.tokenizer.Tokenizer (encode_batch, bos_id).
        max_per_task: items per task after nanochat's shuffle; -1 = all.
        num_workers: 0 scores in this process; n >= 1 splits the items over n Ray tasks (1 CPU each, and 1
            GPU each when device is cuda) on the connected Ray cluster (a local one is started if none is);
            the model is copied to each on CPU. The scores are the same for any n.
        device: where the model runs: default its own device in-process, "cpu" on workers.
        timeout_s: with workers, raise TimeoutError (and cancel them) after this many seconds; None = no limit.
    Returns:
        {"core_metric": mean centered accuracy over all tasks, None when any task failed,
         "results": {label: accuracy in [0, 1]}, "centered_results": {label: centered accuracy},
         "tasks": {label: {"task_type", "num_fewshot", "random_baseline" (percent), "examples",
                           "accuracy", "centered", "error"}},
         "errors": {label: one line naming file:line and field}, "workers": n, "seconds": wall time}.
        results/centered_results hold only the tasks that scored (nanochat's keys).
    Raises:
        BundleError: core.yaml or eval_meta_data.csv is missing or wrong (before the model runs).
        TimeoutError: workers ran past timeout_s.
    """
    tasks = load_bundle(bundle_dir, max_per_task)
    return score_tasks(model, tokenizer, tasks, num_workers, device, timeout_s=timeout_s)

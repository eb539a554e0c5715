"""A rollout actor decodes at most --max-slots KV-cache rows at once (serving's slot budget): a larger share of
prompts x samples is generated in batches of whole prompts, seeded as one batch; a group larger than the slots is
refused with the config."""

from types import SimpleNamespace

import pytest
from support.rl_fixtures import rl_config, tiny_checkpoint

from raychat.rl.dispatcher import EvalProgress, RolloutDispatcher, chunk_seed, split_batches
from raychat.rl.loop import RESUME_OPTIONS, rl_tasks
from raychat.rl.rollout import RolloutWorker
from raychat.tasks.registry import make_task


@pytest.fixture
def checkpoint(tmp_path, small_tokenizer) -> str:
    return tiny_checkpoint(tmp_path / "ck", small_tokenizer)  # 1 layer, 2 kv heads x 32, max_seq_len 96, fp32


def _tasks() -> dict:
    return {split: make_task("calculator", split, 16, 0, max_operand=9) for split in ("train", "test")}


def _rows_per_batch(worker: RolloutWorker) -> list[int]:
    """Records the rows of every KV cache the worker's engine allocates from now on."""
    rows, new_cache = [], worker.engine.new_cache

    def recording(batch_size, max_len, budget_bytes=None):
        rows.append(batch_size)
        return new_cache(batch_size, max_len, budget_bytes)

    worker.engine.new_cache = recording
    return rows


def test_a_rollout_beyond_max_slots_is_generated_in_batches_of_whole_prompts(checkpoint):
    """5 prompts x 2 samples = 10 rows with --max-slots 4: batches of 2 prompts (4, 4, then 2 rows), under a KV
    budget of 4 slots x 96 tokens x 512 bytes/token (2 k/v x 1 layer x 2 kv heads x 32 head_dim x 4 bytes) =
    196,608 bytes; the samples are those of one unbounded batch (each prompt seeded by its index). Before, the
    actor decoded all 10 rows at once, whatever their number (out of memory on a GPU at the cluster preset's
    evaluation: 67 prompts x 8 samples a rollout actor)."""
    tasks, indices = _tasks(), [3, 0, 7, 1, 5]
    bounded = RolloutWorker(checkpoint, tasks, max_slots=4)
    assert bounded.engine.kv_budget_bytes == 196_608
    rows = _rows_per_batch(bounded)
    got = bounded.rollout(indices, num_samples=2, max_tokens=8, temperature=1.0, seed=11)["samples"]
    assert rows == [4, 4, 2]
    assert [(s["prompt_index"], s["sample_index"]) for s in got] == [
        (i, j) for i in indices for j in range(2)
    ]

    whole = RolloutWorker(checkpoint, tasks)
    assert whole.engine.kv_budget_bytes is None
    rows = _rows_per_batch(whole)
    want = whole.rollout(indices, num_samples=2, max_tokens=8, temperature=1.0, seed=11)["samples"]
    assert rows == [10]
    assert [s["tokens"] for s in got] == [s["tokens"] for s in want]

    evaluation = _rows_per_batch(bounded)
    correct = bounded.evaluate(indices, num_samples=4, max_tokens=8, temperature=1.0, seed=2)["correct"]
    assert evaluation == [4] * 5 and len(correct) == 5  # 4 samples a prompt: one prompt a batch


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"samples_per_prompt": 8, "max_slots": 4},
         "--samples-per-prompt 8 exceeds --max-slots 4: a prompt's samples are decoded together; raise "
         "--max-slots or lower --samples-per-prompt"),
        ({"eval_samples": 8, "max_slots": 4, "samples_per_prompt": 4},
         "--eval-samples 8 exceeds --max-slots 4: a held-out prompt's samples are decoded together; raise "
         "--max-slots or lower --eval-samples"),
    ],
)  # fmt: skip
def test_a_group_larger_than_max_slots_is_refused_with_the_config(kw, message):
    with pytest.raises(ValueError) as e:
        rl_config(**kw)
    assert str(e.value) == message


def test_generate_batch_refuses_fewer_rows_than_a_prompts_samples(checkpoint):
    engine = RolloutWorker(checkpoint, _tasks()).engine
    with pytest.raises(ValueError) as e:
        engine.generate_batch([[1, 2, 3]], num_samples=4, max_tokens=2, max_rows=3)
    assert str(e.value) == (
        "max_rows must be None or an int >= num_samples 4 (a prompt's samples are decoded together), got 3"
    )


def test_max_slots_changes_no_rollout_so_rl_resumes_under_another(checkpoint):
    """Is --max-slots part of RL's resume check (RESUME_OPTIONS)? Only if it changed what a step samples. It
    does not: the prompts of a step come from the dispatcher (--seed, --prompts-per-step), a chunk's seed from
    (seed, step, chunk), and within the chunk the engine seeds each prompt from (chunk seed, its index in the
    chunk) whichever batch it lands in. A run's step 3 chunk, 5 prompts x 2 samples, generated with --max-slots 2
    (a prompt a batch), 4 (2 + 2 + 1 prompts) and 64 (one batch): the same samples in the same order, and the
    same held-out counts; so a run may resume with another --max-slots (docs: README.md)."""
    cfg = rl_config(task_examples=16, max_operand=9, prompts_per_step=5, samples_per_prompt=2, seed=3)
    dispatcher = RolloutDispatcher(cfg, actors=None, sync=None, num_prompts=cfg.task.task_examples)
    indices, seed = dispatcher.prompts_for(3), chunk_seed(cfg.run.seed, 3, 0)
    tasks = rl_tasks(cfg)
    samples, correct, batches = {}, {}, {}
    for slots in (2, 4, 64):
        worker = RolloutWorker(checkpoint, tasks, max_slots=slots)
        rows = _rows_per_batch(worker)
        got = worker.rollout(indices, num_samples=2, max_tokens=8, temperature=1.0, seed=seed)["samples"]
        batches[slots] = list(rows)
        samples[slots] = [
            (s["prompt_index"], s["sample_index"], s["tokens"], s["mask"], s["reward"], s["finish_reason"])
            for s in got
        ]
        correct[slots] = worker.evaluate(indices, num_samples=2, max_tokens=8, temperature=1.0, seed=7)[
            "correct"
        ]
    assert batches == {2: [2, 2, 2, 2, 2], 4: [4, 4, 2], 64: [10]}
    assert [s[:2] for s in samples[64]] == [(i, j) for i in indices for j in range(2)]
    assert len({tuple(s[2]) for s in samples[64]}) > 5  # sampled, not one greedy completion per prompt
    assert samples[2] == samples[4] == samples[64]
    assert correct[2] == correct[4] == correct[64]
    assert "max_slots" not in RESUME_OPTIONS


def test_rollout_workers_change_a_steps_samples_so_rl_refuses_to_resume_under_another(checkpoint):
    """Is --rollout-workers part of RL's resume check? It is: a step's prompts (the same under any number of
    actors) are split over the actors and chunk c is seeded (seed, step, c) (RolloutDispatcher.chunks_for), each
    prompt then from (chunk seed, its index in the chunk). Step 3's 4 prompts x 2 samples under 1 actor (one
    chunk) and 2 (2 + 2 prompts): the learner's batch (ordered by prompt, then sample, as RLRun.learner_step
    orders it) holds the same prompts in the same order, the first two with the same completions (chunk 0 both
    times, same positions) and the last two with other ones (chunk 1's seed, not chunk 0's); so a resumed run
    with another --rollout-workers would train on other samples than it would have, and is refused
    (tests/unit/test_bad_input.py)."""
    cfg = rl_config(task_examples=16, max_operand=9, prompts_per_step=4, samples_per_prompt=2, seed=3)
    worker = RolloutWorker(checkpoint, rl_tasks(cfg))
    batches, seeds = {}, {}
    for n in (1, 2):
        actors = SimpleNamespace(rollouts=[None] * n)
        dispatcher = RolloutDispatcher(cfg, actors=actors, sync=None, num_prompts=cfg.task.task_examples)
        chunks = dispatcher.chunks_for(3)
        seeds[n] = [(c["worker"], c["indices"], c["seed"]) for c in chunks]
        order = dispatcher.prompts_for(3)
        samples = [s for c in chunks for s in worker.rollout(c["indices"], 2, 8, 1.0, c["seed"])["samples"]]
        samples.sort(key=lambda s: (order.index(s["prompt_index"]), s["sample_index"]))
        batches[n] = [(s["prompt_index"], s["sample_index"], s["tokens"]) for s in samples]
    prompts = dispatcher.prompts_for(3)
    assert seeds == {
        1: [(0, prompts, chunk_seed(3, 3, 0))],
        2: [(0, prompts[:2], chunk_seed(3, 3, 0)), (1, prompts[2:], chunk_seed(3, 3, 1))],
    }
    assert (
        [b[:2] for b in batches[1]]
        == [b[:2] for b in batches[2]]
        == [(i, j) for i in prompts for j in (0, 1)]
    )
    assert batches[1][:4] == batches[2][:4]
    assert all(one[2] != two[2] for one, two in zip(batches[1][4:], batches[2][4:]))
    assert "rollout_workers" in RESUME_OPTIONS


def test_an_evaluation_in_chunks_samples_what_one_call_of_each_part_samples(checkpoint):
    """An evaluation was one call a rollout actor (its part of the held-out prompts), so a long one said nothing
    until it ended; it is now issued in about EVAL_CHUNKS chunks of whole --max-slots batches, round by round,
    and each chunk's prompts are seeded at their place in the part (the engine's seed_offset): 25 problems on 2
    actors with --max-slots 4 x 2 samples (2 prompts a batch): parts of 13 and 12 prompts, chunks of 2 batches.
    Every prompt's samples, so its correct count, are those of one call of its part; without the offset they
    are not."""
    cfg = rl_config(eval_examples=25, eval_samples=2, max_slots=4, samples_per_prompt=2, task_examples=16)
    dispatcher = RolloutDispatcher(cfg, SimpleNamespace(rollouts=[None, None]), None, 16)
    chunks = dispatcher.eval_chunks(25)
    seeds = [chunk_seed(cfg.run.seed, -1, i) for i in (0, 1)]
    assert [(c["worker"], c["indices"], c["offset"], c["seed"]) for c in chunks] == [
        (0, [0, 1, 2, 3], 0, seeds[0]), (1, [13, 14, 15, 16], 0, seeds[1]),
        (0, [4, 5, 6, 7], 4, seeds[0]), (1, [17, 18, 19, 20], 4, seeds[1]),
        (0, [8, 9, 10, 11], 8, seeds[0]), (1, [21, 22, 23, 24], 8, seeds[1]),
        (0, [12], 12, seeds[0]),
    ]  # fmt: skip
    assert split_batches(list(range(4)), 32, 5) == [
        (0, [0, 1, 2, 3])
    ]  # the tiny preset's: one chunk an actor

    tasks = {split: make_task("calculator", split, 25, 0, max_operand=9) for split in ("train", "test")}
    tasks["test"].is_correct = lambda conversation, completion: len(completion) % 2 == 0  # differs by sample
    worker = RolloutWorker(checkpoint, tasks, max_slots=4)

    def counts(chunk, offset):
        return worker.evaluate(chunk["indices"], 2, 8, 1.0, chunk["seed"], 0, offset)["correct"]

    whole = [n for i, part in enumerate(([*range(13)], [*range(13, 25)])) for n in counts(
        {"indices": part, "seed": seeds[i]}, 0)]  # fmt: skip
    by_chunk = sorted((c["indices"][0], counts(c, c["offset"])) for c in chunks)
    assert [n for _, part in by_chunk for n in part] == whole
    assert len(set(whole)) > 1  # the checker tells the samples apart
    unseeded = sorted((c["indices"][0], counts(c, 0)) for c in chunks)
    assert [n for _, part in unseeded for n in part] != whole


def test_generate_batch_refuses_a_negative_seed_offset(checkpoint):
    engine = RolloutWorker(checkpoint, _tasks()).engine
    with pytest.raises(ValueError) as e:
        engine.generate_batch([[1, 2, 3]], max_tokens=2, seed_offset=-1)
    assert str(e.value) == "seed_offset must be an int >= 0, got -1"


def test_a_long_evaluation_logs_its_progress_every_tenth_and_a_short_one_nothing():
    """A held-out evaluation of the GPU presets (400 problems x 8 samples) printed nothing until it ended. Once it
    has run EVAL_QUIET_S (30 s), a line each time the problems done reach another tenth, with an ETA from its
    rate so far; none at the end (the evaluation's own line follows) nor in a short one."""
    now, lines = [0.0], []
    progress = EvalProgress("eval step 10", 400, lines.append, clock=lambda: now[0])
    for seconds, problems in [(20, 36), (40, 36), (50, 36), (60, 10), (200, 62), (210, 220)]:
        now[0] = seconds
        progress.add(problems)
    assert lines == [
        "eval step 10: 72/400 held-out problems (18%) in 40s, eta 3m02s",  # 40 s x 328 / 72 = 182 s
        "eval step 10: 108/400 held-out problems (27%) in 50s, eta 2m15s",
        "eval step 10: 180/400 held-out problems (45%) in 3m20s, eta 4m04s",  # 118 at 60 s crossed no tenth
    ]
    quiet = []  # 2 of 4 problems at once: a tenth crossed, but in under EVAL_QUIET_S
    EvalProgress("eval step 0", 4, quiet.append, clock=lambda: 1.0).add(2)
    assert quiet == []

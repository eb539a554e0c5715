"""The deadline of a rollout chunk (raychat.rl.actors.rollout_deadline), worked out by hand: ROLLOUT_FACTOR (10) x
the longest chunk of each kind so far, or, of a kind none of which has completed yet, its completion budget
(prompts x samples x --max-tokens) at FIRST_TOKENS_PER_S of the device, summed over the chunks on the actor up to
this one, at least ROLLOUT_MIN_S (600 s); the line says how it was sized. Those of a learner step (step_deadline),
a checkpoint save (save_deadline) and a weight sync (sync_deadline, WeightSync.deadlines), --deadline-factor
in the ActorTimeout line, and which of the calls waited for together, each for its own deadline, are named late
first (late_calls, late_budget)."""

import pyarrow.fs as pafs
from support.rl_fixtures import tiny_config

from raychat.checkpoint_manager import commit_directory
from raychat.rl import actors
from raychat.rl.actors import (
    ActorGroup,
    ActorTimeout,
    checkpoint_bytes,
    late_budget,
    late_calls,
    read_budget,
    read_deadline_s,
    rollout_deadline,
    save_deadline,
    step_deadline,
    sync_deadline,
)
from raychat.rl.dispatcher import RolloutDispatcher
from raychat.rl.sync import WeightSync

SLOW = "on slow hardware, raise --deadline-factor (now 1), which multiplies every deadline"


def test_the_first_chunk_of_a_kind_is_sized_from_its_completion_budget():
    """The baseline evaluation at step 0 had 600 s whatever its size: a CPU run's evaluation of 640 held-out
    prompts x 8 samples x 256 tokens over 2 actors (655,360 tokens an actor, hours on a CPU) was killed at every
    restart (it comes again after each) until the run gave up. Now its budget at 5 tokens/s (CPU) or 100 (GPU)."""
    assert (actors.ROLLOUT_MIN_S, actors.ROLLOUT_FACTOR) == (600.0, 10.0)
    assert actors.FIRST_TOKENS_PER_S == {"cpu": 5.0, "cuda": 100.0}
    assert rollout_deadline({}, [("test", 320 * 8 * 256)], "cpu") == (
        131072.0,
        "at least 600 s, else 655,360 tokens at 5 tokens/s (no evaluation chunk done yet: prompts x samples x "
        "--max-tokens)",
    )
    assert rollout_deadline({}, [("test", 320 * 8 * 256)], "cuda")[0] == 6553.6
    # a small first chunk (the cpu preset's first rollout: 8 prompts x 8 samples x 40 tokens) keeps the minimum
    assert rollout_deadline({}, [("train", 8 * 8 * 40)], "cpu") == (
        600.0,
        "at least 600 s, else 2,560 tokens at 5 tokens/s (no training chunk done yet: prompts x samples x "
        "--max-tokens)",
    )
    # a training chunk measured says nothing of an evaluation's (another size: --eval-examples x --eval-samples)
    assert rollout_deadline({"train": 90.0}, [("test", 32 * 8 * 48)], "cpu")[0] == 2457.6


def test_a_measured_chunk_sizes_the_next_of_its_kind():
    """Once one chunk of its kind completed, its budget no longer counts: 10 x the longest, at least 600 s."""
    assert rollout_deadline({"train": 1.5}, [("train", 10**6)], "cpu") == (
        600.0,
        "at least 600 s, else 10 x the longest training chunk so far (1.5 s)",
    )  # 15 s < the minimum
    assert rollout_deadline({"train": 75.0, "test": 2.0}, [("train", 10**6)], "cpu") == (
        750.0,
        "at least 600 s, else 10 x the longest training chunk so far (75 s)",
    )


def test_the_chunks_queued_on_its_actor_ahead_of_it_add_up():
    """An evaluation issued in async mode (--max-staleness 2) waits behind the next 2 steps' training chunks on
    its actor: 10 x (2 x 40 s + 100 s) = 1,800 s; before any evaluation completed, 10 x 2 x 40 s + 20,000
    tokens at 5 tokens/s = 4,800 s."""
    assert rollout_deadline(
        {"train": 40.0, "test": 100.0}, [("train", 1), ("train", 1), ("test", 1)], "cpu"
    ) == (
        1800.0,
        "at least 600 s, else 10 x 2 x the longest training chunk so far (40 s), the longest evaluation chunk so "
        "far (100 s): the 3 chunks on its actor, this one last",
    )
    assert rollout_deadline({"train": 40.0}, [("train", 1), ("train", 1), ("test", 20_000)], "cpu") == (
        4800.0,
        "at least 600 s, else 10 x 2 x the longest training chunk so far (40 s) + 20,000 tokens at 5 tokens/s (no "
        "evaluation chunk done yet: prompts x samples x --max-tokens): the 3 chunks on its actor, this one last",
    )


def test_a_chunks_completion_budget_is_its_prompts_x_samples_x_max_tokens(tmp_path):
    """What the dispatcher sizes a first chunk from: a training chunk's prompts x --samples-per-prompt x
    --max-tokens, an evaluation's prompts x --eval-samples x --max-tokens."""
    cfg = tiny_config("ck", str(tmp_path), samples_per_prompt=3, eval_samples=5, max_tokens=7)
    work = RolloutDispatcher(cfg, None, None, 10)._work
    assert work({"split": "train", "indices": [4, 1]}) == ("train", 2 * 3 * 7)
    assert work({"split": "test", "indices": [0, 1, 2]}) == ("test", 3 * 5 * 7)


def test_a_checkpoint_read_is_sized_from_its_commit_marker_twice_when_remote(tmp_path, s3_env):
    """An actor's start waited START_S + READ_BASE_S + --init-from's bytes at READ_BYTES_PER_S, those bytes summed
    from a local directory only: of an s3:// --init-from, 0 bytes, though each node downloads it and then reads
    it again for its sha256 check. Now the bytes its commit marker lists (11 + 5 = 16 here), twice when remote."""
    ck = tmp_path / "checkpoint_000003"
    ck.mkdir()
    (ck / "meta.json").write_bytes(b'{"step": 3}')  # 11 bytes
    (ck / "model.safetensors").write_bytes(b"w" * 5)
    commit_directory(ck, 3, "sft")
    bucket = s3_env.make_bucket()
    pafs.copy_files(str(ck), f"{bucket}/run/checkpoint_000003", destination_filesystem=s3_env.filesystem())
    uri = f"s3://{bucket}/run/checkpoint_000003"
    assert checkpoint_bytes(str(ck)) == checkpoint_bytes(uri) == 16
    assert checkpoint_bytes(str(tmp_path / "missing")) == 0  # the actors raise their own error
    assert read_deadline_s(16 * 10**6) == 61.6 and read_budget(16 * 10**6) == "60 s + 16 MB at 10 MB/s"
    assert read_deadline_s(16 * 10**6, remote=True) == 63.2
    assert read_budget(16 * 10**6, remote=True) == "60 s + 2 x 16 MB at 10 MB/s (downloaded, then checked)"


def test_an_actor_timeouts_line_reads_well_for_one_two_and_more_actors():
    """With several actors late the line read "rollout actor 0, rollout actor 1 and learner 0 did not return its
    start": one actor's call and fix, worded for one, now named as one, neither/nor or none of, each fix."""
    call, fix = "its start", "check that its node starts Ray workers"

    def line(*who: str) -> str:
        return str(ActorTimeout(list(who), call, 61.25, "60 s + 1.2 MB at 10 MB/s", fix))

    assert line("learner 0") == (
        "learner 0 did not return its start within 61.2 s (60 s + 1.2 MB at 10 MB/s); if it recurs, check that "
        f"its node starts Ray workers; {SLOW}"
    )
    assert line("rollout actor 0", "learner 0") == (
        "neither rollout actor 0 nor learner 0 returned its start within 61.2 s (60 s + 1.2 MB at 10 MB/s); if "
        f"it recurs, for each: check that its node starts Ray workers; {SLOW}"
    )
    assert line("rollout actor 0", "rollout actor 1", "learner 0") == (
        "none of rollout actor 0, rollout actor 1 and learner 0 returned its start within 61.2 s (60 s + 1.2 MB "
        f"at 10 MB/s); if it recurs, for each: check that its node starts Ray workers; {SLOW}"
    )
    assert str(
        ActorTimeout(["learner 0", "learner 1", "learner 2", "learner 3"], "Learner.restore of x", 3, "", fix)
    ) == (
        "none of learner 0, learner 1, learner 2 and learner 3 returned Learner.restore of x within 3 s; if it "
        f"recurs, for each: check that its node starts Ray workers; {SLOW}"
    )


def test_a_learner_step_is_sized_from_the_runs_longest_step_the_first_from_a_cold_start():
    """A learner step was waited for with no deadline (a hung all-reduce hung the run for ever). Now 10 x the
    longest step so far, at least 600 s; the first (cold: torch.compile, first allocations) 1,800 s."""
    assert step_deadline(None) == (
        1800.0,
        "1800 s for the first learner step (a cold start: torch.compile, first allocations)",
    )
    assert step_deadline(1.5) == (600.0, "at least 600 s, else 10 x the longest learner step so far (1.5 s)")
    assert step_deadline(75.0)[0] == 750.0
    # a restarted group's first step is cold again, whatever the run's longest step was (a compile cache on the
    # first node made it fast): at least 1,800 s
    assert step_deadline(1.5, cold=True) == (
        1800.0,
        "at least 1800 s for these learners' first step (a cold start), else 10 x the longest learner step so far "
        "(1.5 s)",
    )
    assert step_deadline(200.0, cold=True)[0] == 2000.0


def test_a_save_and_a_sync_are_sized_from_the_weights_bytes():
    """A save writes at most 3 x the weights' bytes (the weights, AdamW's two moments) twice (a temporary
    directory, then --storage-path): 60 s + 2 x 3 x 4 MB at 10 MB/s = 62.4 s. A sync moves them once: 60 s + 16 MB
    at 10 MB/s = 61.6 s, plus the chunks queued on the actor before it: 10 x 2 x 75 s = 1,500 s."""
    assert save_deadline(4 * 10**6) == (
        62.4,
        "60 s + 2 x 3 x 4 MB at 10 MB/s (written, then uploaded; the weights and their optimizer state)",
    )
    assert sync_deadline(16 * 10**6) == (61.6, "60 s + 16 MB at 10 MB/s of the weights")
    ahead = rollout_deadline({"train": 75.0}, [("train", 1), ("train", 1)], "cpu", own=False)
    assert ahead == (
        1500.0,
        "at least 600 s, else 10 x 2 x the longest training chunk so far (75 s): the 2 chunks on its actor",
    )
    assert sync_deadline(16 * 10**6, ahead) == (
        1561.6,
        "60 s + 16 MB at 10 MB/s of the weights + the chunks queued on its actor before it (at least 600 s, else "
        "10 x 2 x the longest training chunk so far (75 s): the 2 chunks on its actor)",
    )


def test_a_syncs_part_on_an_actor_adds_the_chunks_issued_there_before_it(tmp_path):
    """In async mode a rollout actor's set_weights ack queues behind the rollouts issued to it before: the sync's
    deadline on actor 0, which holds a training chunk (10 x 100 s) and an evaluation chunk of 3 prompts x 5
    samples x 7 tokens at 5 tokens/s (21 s) not yet collected, is 60 s + 16 MB at 10 MB/s + 1,021 s; actor 1, with
    none queued, 61.6 s. The dispatcher gives the sync its queue (WeightSync.ahead)."""
    cfg = tiny_config("ck", str(tmp_path), samples_per_prompt=3, eval_samples=5, max_tokens=7)
    actors = ActorGroup(cfg, {})
    actors.rollouts, actors.weight_bytes = [None, None], 16 * 10**6  # what start() sets: no Ray needed here
    sync = WeightSync(actors, "object_store")
    dispatcher = RolloutDispatcher(cfg, actors, sync, 10)
    dispatcher.longest = {"train": 100.0}
    dispatcher.queued = {0: [{"split": "train", "indices": [4, 1]}, {"split": "test", "indices": [0, 1, 2]}]}
    assert dispatcher.ahead(1) is None
    assert sync.deadlines() == [
        (
            1082.6,
            "60 s + 16 MB at 10 MB/s of the weights + the chunks queued on its actor before it (at least 600 s, "
            "else 10 x the longest training chunk so far (100 s) + 105 tokens at 5 tokens/s (no evaluation chunk "
            "done yet: prompts x samples x --max-tokens): the 2 chunks on its actor)",
        ),
        (61.6, "60 s + 16 MB at 10 MB/s of the weights"),
    ]


def test_deadline_factor_multiplies_the_deadline_and_the_line_says_how_to_raise_it():
    """--deadline-factor 2 doubles the 600 s of a learner step to 1,200 s; the line says so, and names the flag
    as the command does (the speedrun's: its preset's key)."""
    line = str(
        ActorTimeout(["learner 0"], "Learner.step (the update of step 3)", 1200.0,
                     "at least 600 s, else 10 x the longest learner step so far (1.5 s)", "see what it does", 2.0,
                     "rl.deadline_factor")
    )  # fmt: skip
    assert line == (
        "learner 0 did not return Learner.step (the update of step 3) within 1,200 s (rl.deadline_factor 2 x (at "
        "least 600 s, else 10 x the longest learner step so far (1.5 s))); if it recurs, see what it does; on slow "
        "hardware, raise rl.deadline_factor (now 2), which multiplies every deadline"
    )


def test_a_deadline_the_factor_does_not_multiply_does_not_offer_it_and_seconds_near_1000_read_whole():
    """The 30 s wait for a re-synced rollout actor's info (PING_S, not multiplied) said "raise
    --deadline-factor (now 1)" whatever the run's factor, which would not have lengthened it: a fixed deadline
    (factor None) ends at its fix. 999.6 s (1.666 x 600 s) read "1e+03 s"; now "1,000 s"."""
    fix = "see what its process does"
    assert str(
        ActorTimeout(["rollout actor 1"], "RolloutActor.info (after its re-sync)", 30.0, "", fix, None)
    ) == (
        "rollout actor 1 did not return RolloutActor.info (after its re-sync) within 30 s; if it recurs, see what "
        "its process does"
    )
    assert str(ActorTimeout(["learner 0"], "Learner.step", 1.666 * 600, "at least 600 s", fix, 1.666)) == (
        "learner 0 did not return Learner.step within 1,000 s (--deadline-factor 1.666 x (at least 600 s)); if it "
        "recurs, see what its process does; on slow hardware, raise --deadline-factor (now 1.666), which "
        "multiplies every deadline"
    )


def test_calls_waited_for_together_name_every_one_late_at_the_first_deadline_past():
    """A weight sync's parts were waited for one after another: of 3 hung rollout actors only the first was named,
    and actor 1's deadline started after actor 0's ran out. Now all are waited for from one start, each for its
    own deadline (get_each_within): past the first (61.6 s), every pending call of that deadline is named (actors
    0 and 2); actor 1, with a chunk queued ahead of its ack (661.6 s), is not late yet. The same seconds sized
    differently (ROLLOUT_MIN_S: 1 or 2 chunks ahead, both 600 s) are named together, each with its sizing."""
    waits = [61.6, 661.6, 61.6]
    assert late_calls([0, 1, 2], waits) == [0, 2]
    assert late_calls([2, 1], waits) == [2]  # actor 0 acked
    assert late_calls([1], waits) == [1]
    assert late_budget(["rollout actor 0", "rollout actor 2"], ["60 s + 16 MB"] * 2) == "60 s + 16 MB"
    one, two = (
        "at least 600 s, else 10 x the longest training chunk so far (1.5 s)",
        "at least 600 s, else 10 x 2 x the longest training chunk so far (1.5 s): the 2 chunks on its actor",
    )
    budget = late_budget(["rollout actor 0", "rollout actor 1"], [one, two])
    assert budget == f"rollout actor 0: {one}; rollout actor 1: {two}"
    assert str(ActorTimeout(["rollout actor 0", "rollout actor 1"], "RolloutActor.set_weights", 661.6, budget,
                            "see what its process does")) == (
        "neither rollout actor 0 nor rollout actor 1 returned RolloutActor.set_weights within 662 s (rollout actor 0: "
        f"{one}; rollout actor 1: {two}); if it recurs, for each: see what its process does; {SLOW}"
    )  # fmt: skip

"""The deadline of a rollout chunk (raychat.rl.actors.rollout_deadline), worked out by hand: ROLLOUT_FACTOR (10) x
the longest chunk of each kind so far, summed over the chunks on the actor up to this one, at least ROLLOUT_MIN_S
(600 s); the line says how it was sized."""

from raychat.rl import actors
from raychat.rl.actors import rollout_deadline


def test_the_first_chunk_of_a_kind_has_the_minimum_only():
    assert (actors.ROLLOUT_MIN_S, actors.ROLLOUT_FACTOR) == (600.0, 10.0)
    assert rollout_deadline({}, ["train"]) == (
        600.0,
        "at least 600 s, else 10 x the longest training chunk so far (none yet)",
    )
    # a training chunk measured says nothing of an evaluation's (another size: --eval-examples x --eval-samples)
    assert rollout_deadline({"train": 90.0}, ["test"]) == (
        600.0,
        "at least 600 s, else 10 x the longest evaluation chunk so far (none yet)",
    )


def test_a_measured_chunk_sizes_the_next_of_its_kind():
    assert rollout_deadline({"train": 1.5}, ["train"]) == (
        600.0,
        "at least 600 s, else 10 x the longest training chunk so far (1.5 s)",
    )  # 15 s < the minimum
    assert rollout_deadline({"train": 75.0, "test": 2.0}, ["train"]) == (
        750.0,
        "at least 600 s, else 10 x the longest training chunk so far (75 s)",
    )


def test_the_chunks_queued_on_its_actor_ahead_of_it_add_up():
    """An evaluation issued in async mode (--max-staleness 2) waits behind the next 2 steps' training chunks on
    its actor: 10 x (2 x 40 s + 100 s) = 1,800 s."""
    assert rollout_deadline({"train": 40.0, "test": 100.0}, ["train", "train", "test"]) == (
        1800.0,
        "at least 600 s, else 10 x 2 x the longest training chunk so far (40 s), the longest evaluation chunk so "
        "far (100 s): the 3 chunks on its actor, this one last",
    )

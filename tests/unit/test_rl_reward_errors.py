"""A reward (or checker) that raises, or returns a value that is not a finite number, scores 0 and is counted
(raychat.rl.rollout.ScoreErrors): one bad sample does not end the run."""

import pytest

from raychat.rl.rollout import ScoreErrors


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_reward_that_is_not_a_finite_number_scores_0_and_is_counted(value):
    """A NaN reward was returned as is, not counted in reward_errors: its group's advantages became NaN and the
    run stopped on a NaN grad norm, blaming the learning rate."""
    errors = ScoreErrors()
    assert errors.score(lambda conversation, completion: value, {}, "x", 3) == 0.0
    assert errors.score(lambda conversation, completion: 0.5, {}, "y", 4) == 0.5
    assert (errors.scored, errors.raised, errors.first_prompt) == (2, 1, 3)
    assert (
        f"{type(errors.first).__name__}: {errors.first}"
        == f"ValueError: returned {value}, not a finite number"
    )
    assert errors.result()["reward_errors"] == 1

"""The plan's line of an automatic batch of an elastic run (--min-workers): the unit it is rounded to divides on
every world size of the run, the lcm of --min-workers..--num-workers workers."""

from __future__ import annotations

from raychat.config import TrainConfig, from_dict
from raychat.train.plan import make_plan, print_plan


def test_an_elastic_runs_automatic_batch_names_the_lcm_of_its_worker_range(capsys):
    values = {"depth": 4, "seq_len": 256, "device_batch_size": 8, "num_iterations": 10}
    # 10 steps x 3 workers x 8 rows x 256 tokens x 8 = 491,520 tokens -> power law 16,384 -> rounded to a
    # multiple of lcm(2, 3) = 6 x 8 x 256 = 12,288
    cfg = from_dict(TrainConfig, {**values, "num_workers": 3, "min_workers": 2})
    print_plan(cfg, make_plan(cfg, vocab_size=4096))
    assert (
        "  (automatic: power law 16,384 tokens, rounded to 12,288: the nearest multiple of 6 (the lcm of 2..3 "
        "workers) x 8 rows x 256 tokens = 12,288)\n"
    ) in capsys.readouterr().out
    fixed = from_dict(TrainConfig, {**values, "num_workers": 3})
    print_plan(fixed, make_plan(fixed, vocab_size=4096))
    assert (
        "  (automatic: power law 16,384 tokens, rounded to 18,432: the nearest multiple of 3 workers x 8 rows x "
        "256 tokens = 6,144)\n"
    ) in capsys.readouterr().out

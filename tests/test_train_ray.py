"""Ray tier: the training loop on Ray Train (gloo DDP on CPU): exact resume, fault tolerance, NaN stop."""

import json
import os
import random
import sys

import pytest
import ray

from raychat.config import TrainConfig, from_dict
from raychat.train.pretrain import pretrain
from raychat.train.trainer import Callback

pytestmark = [pytest.mark.ray]

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega river stone light cloud tree bird wind fire water"
).split()


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from raychat.data.shards import write_manifest, write_shards
    from raychat.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + "." for _ in range(600)]
    entries = write_shards(docs, root / "shards", num_shards=5, row_group_size=64, log=lambda *_: None)
    write_manifest(root / "shards", {"source": "test", "shards": entries})
    Tokenizer.train(docs, vocab_size=300).save(root / "tok")
    return root


def tiny_config(data, storage, **overrides):

    values = dict(
        run_name="t",
        storage_path=str(storage),
        data_dir=str(data / "shards"),
        tokenizer_path=str(data / "tok"),
        depth=1,
        aspect_ratio=64,
        head_dim=32,
        seq_len=32,
        device_batch_size=2,
        num_workers=2,
        cpus_per_worker=0.5,
        total_batch_size=256,
        num_iterations=6,
        eval_every=3,
        eval_tokens=256,
        checkpoint_every=3,
        buffer_size=8,
        seed=1,
        max_failures=0,
    )
    values.update(overrides)
    return from_dict(TrainConfig, values)


def losses(storage, name="t"):
    lines = (storage / name / "metrics.jsonl").read_text().splitlines()
    return {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}


def final_state(result, rank):
    with result.checkpoint.as_directory() as d:
        return json.loads(open(f"{d}/state_rank{rank}.json").read())


class FailOnce(Callback):
    """Fault injection: rank 1 (or 0 alone) dies with os._exit at step `at_step` the first time only, like
    a lost node (the marker file remembers it); Ray Train then restarts the group from the last checkpoint."""

    def __init__(self, at_step: int, marker: str):
        self.at_step, self.marker = at_step, marker

    def on_step_begin(self, trainer, step):
        if (
            step == self.at_step
            and trainer.rank == min(1, trainer.world - 1)
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            os._exit(1)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/


def test_exact_resume_matches_a_straight_run(ray_cluster, data, tmp_path):
    straight = pretrain(tiny_config(data, tmp_path / "a"))
    assert straight.metrics["step"] == 6
    assert straight.metrics["val_bpb"] > 0

    stopped = pretrain(tiny_config(data, tmp_path / "b", stop_after=3))
    assert stopped.metrics["step"] == 3
    resumed = pretrain(tiny_config(data, tmp_path / "b"))
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bitwise equal on CPU
    for rank in (0, 1):  # same documents consumed, same packer buffer
        assert final_state(straight, rank) == final_state(resumed, rank)
    assert straight.metrics["val_bpb"] == resumed.metrics["val_bpb"]


def test_killed_worker_restarts_from_checkpoint_and_completes(ray_cluster, data, tmp_path):
    marker = tmp_path / "died"
    result = pretrain(tiny_config(data, tmp_path / "c", max_failures=1), callbacks=[FailOnce(4, str(marker))])
    assert marker.exists()  # the worker did die once
    assert result.metrics["step"] == 6
    assert sorted(losses(tmp_path / "c"))[-1] == 6

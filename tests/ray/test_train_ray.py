"""Ray tier: the training loop on Ray Train (gloo DDP on CPU): exact resume, fault tolerance, the stop on a
non-finite loss or gradient norm, one optimizer file per checkpoint."""

import json
import os
import random
import sys
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from support.autoscaling_requests import data_requesters

from raychat.checkpoint import load_tree, read_meta
from raychat.checkpoint_manager import find_checkpoint
from raychat.config import TrainConfig, from_dict
from raychat.rl.weights import weights_hash
from raychat.train.pretrain import pretrain
from raychat.train.step import NonFiniteError
from raychat.train.trainer import Callback

pytestmark = [pytest.mark.ray]

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega river stone light cloud tree bird wind fire water"
).split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from raychat.data.corpus.shards import write_manifest, write_shards
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
    return load_tree(f"{result.checkpoint}/state_rank{rank}.npz")


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


class Poison(Callback):
    """Fault injection at 0-based step `at` on the last rank: NaN logits (what="loss") or an inf factor on the
    lm_head gradient (what="grad norm": the loss stays finite). DDP's all-reduces carry either to every
    rank. Rank 0 appends a line to `attempts` whenever the loop (re)starts, so a retry would show."""

    def __init__(self, at: int, what: str, attempts: str):
        self.at, self.what, self.attempts = at, what, attempts

    def on_step_begin(self, trainer, step):
        if step == trainer.start_step and trainer.rank == 0:
            with open(self.attempts, "a") as f:
                f.write(f"{step}\n")
        if step != self.at or trainer.rank != trainer.world - 1:
            return
        if self.what == "loss":
            trainer.model.register_forward_hook(lambda module, args, logits: logits * float("nan"))
        else:
            trainer.model.lm_head.weight.register_hook(lambda grad: grad * float("inf"))


class OptimizerHashes(Callback):
    """At the end, every rank's hash of its optimizer state (all-gathered), written by rank 0 to `path`."""

    def __init__(self, path: str):
        self.path = path

    def on_train_end(self, trainer):
        mine = weights_hash(
            {f"{i}.{k}": v for i, o in enumerate(trainer.optimizers) for k, v in flat_state(o).items()}
        )
        hashes = [None] * trainer.world
        dist.all_gather_object(hashes, mine)
        if trainer.rank == 0:
            with open(self.path, "w") as f:
                json.dump(hashes, f)


def flat_state(opt) -> dict[str, torch.Tensor]:
    return {
        f"{p}.{k}": torch.as_tensor(v).reshape(-1)
        for p, st in opt.state_dict()["state"].items()
        for k, v in st.items()
    }


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/


@pytest.fixture(scope="module")
def straight(ray_cluster, data, tmp_path_factory):
    """6 steps straight on 2 workers: (its storage dir, its result); rank 0 records both ranks' optimizer
    hashes in optim_hashes.json; data_requesters_left.json lists the Ray Data autoscaling requests the run
    left behind."""
    storage = tmp_path_factory.mktemp("straight")
    before = data_requesters()
    result = pretrain(
        tiny_config(data, storage), callbacks=[OptimizerHashes(str(storage / "optim_hashes.json"))]
    )
    (storage / "data_requesters_left.json").write_text(json.dumps(sorted(data_requesters() - before)))
    return storage, result


def test_a_finished_run_leaves_no_data_pipeline_holding_nodes(straight):
    """Each rank's Ray Data pipeline registers an autoscaling request (tests/ray/test_pipeline_ray.py); the
    worker closes its row source when training ends, so none outlives the run (left open, a request keeps
    the autoscaler's nodes for 180 s after the job)."""
    storage, _ = straight
    assert json.loads((storage / "data_requesters_left.json").read_text()) == []


@pytest.mark.slow
def test_exact_resume_matches_a_straight_run(data, straight, tmp_path):
    storage, result = straight
    assert result.metrics["step"] == 6
    assert result.metrics["val_bpb"] > 0

    stopped = pretrain(tiny_config(data, tmp_path / "b", stop_after=3))
    assert stopped.metrics["step"] == 3
    resumed = pretrain(tiny_config(data, tmp_path / "b"))
    a, b = losses(storage), losses(tmp_path / "b")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bitwise equal on CPU
    for rank in (0, 1):  # same documents consumed, same packer buffer
        assert json.dumps(final_state(result, rank), sort_keys=True) == json.dumps(
            final_state(resumed, rank), sort_keys=True
        )
    assert result.metrics["val_bpb"] == resumed.metrics["val_bpb"]


def test_a_checkpoint_holds_one_optimizer_state_for_both_ranks(straight):
    """The optimizer state is the same on both DDP ranks (so writing it once loses nothing), and a 2-worker
    checkpoint holds it once."""
    storage, result = straight
    hashes = json.loads((storage / "optim_hashes.json").read_text())
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    names = sorted(os.listdir(result.checkpoint))
    assert names == [
        "commit.json", "meta.json", "model.safetensors", "optim.pt", "rng_rank0.pt", "rng_rank1.pt",
        "state_rank0.npz", "state_rank1.npz", "tokenizer.json",
    ]  # fmt: skip
    # the commit marker lists both ranks' files, with their sizes
    commit = json.loads((Path(result.checkpoint) / "commit.json").read_text())
    assert {n: f["size"] for n, f in commit["files"].items()} == {
        n: os.path.getsize(os.path.join(result.checkpoint, n)) for n in names if n != "commit.json"
    }


@pytest.mark.parametrize("what", ["loss", "grad norm"])
def test_a_non_finite_step_stops_the_run_without_a_retry(data, straight, tmp_path, what):
    """Step 5 (0-based 4) turns non-finite: no update, the run stops with the step in the message, Ray Train
    does not retry though max_failures allows it, and the last checkpoint is step 3's, finite and equal to
    the straight run's step 3."""
    attempts = tmp_path / "attempts"
    with pytest.raises(NonFiniteError, match=f"{what} is (nan|inf) at step 5: the update was skipped"):
        pretrain(tiny_config(data, tmp_path, max_failures=2), callbacks=[Poison(4, what, str(attempts))])
    assert attempts.read_text().split() == ["0"]  # one attempt: not retried
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]
    last = Path(find_checkpoint(str(tmp_path / "t")))
    assert read_meta(last)["step"] == 3
    weights = load_file(str(last / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    straight_dir, _ = straight
    kept = [p for p in (straight_dir / "t").glob("checkpoint_*") if p.is_dir()]
    straight_3 = min(kept, key=lambda p: read_meta(p)["step"])
    assert read_meta(straight_3)["step"] == 3
    expected = load_file(str(straight_3 / "model.safetensors"))
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_killed_worker_restarts_from_checkpoint_and_completes(ray_cluster, data, tmp_path):
    marker = tmp_path / "died"
    result = pretrain(tiny_config(data, tmp_path / "c", max_failures=1), callbacks=[FailOnce(4, str(marker))])
    assert marker.exists()  # the worker did die once
    assert result.metrics["step"] == 6
    assert sorted(losses(tmp_path / "c"))[-1] == 6

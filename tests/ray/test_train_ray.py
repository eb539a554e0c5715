"""Ray tier: the training loop on Ray Train (gloo DDP on CPU): exact resume, fault tolerance, the stop on a
non-finite loss, one optimizer file per checkpoint, and FP8 (torchao's emulated float8 matmuls,
raychat.train.fp8) stopped and resumed against the fp32 straight run.

FP8 (issue 21 item 4), asserted: every eligible Linear of the model (raychat.train.fp8.fp8_filter) is a torchao
Float8Linear on both ranks, in the first attempt and after the resume, and the training forwards ran
through them (a forward hook counts each call: converted modules x micro-batches x steps); the only plain
nn.Linear of the trained model is the LM head; the FP8 losses stay within FP8_LOSS_TOLERANCE of the fp32
straight run's, step for step."""

import json
import os
import random
import sys
from pathlib import Path
from unittest import mock

import pytest
import ray
import torch
import torch.distributed as dist
from ray.train import ControllerError, RunConfig, UserCallback
from safetensors.torch import load_file
from support.autoscaling_requests import data_requesters
from support.cluster import init_local_ray
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from raychat.checkpoint import load_tree, read_meta
from raychat.checkpoint_manager import find_checkpoint
from raychat.config import TrainConfig, from_dict
from raychat.log import RunGaveUp
from raychat.rl.weights import weights_hash
from raychat.train import launch
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


def smooth_losses(storage, name="t"):
    return [json.loads(x)["smooth_loss"] for x in (storage / name / "metrics.jsonl").read_text().splitlines()]


def final_state(result, rank):
    return load_tree(f"{result.checkpoint}/state_rank{rank}.npz")


class FailOnce(Callback):
    """Fault injection: rank 1 (or 0 alone; `rank` if given) dies with os._exit at step `at_step` the first time
    only (the first `times` times), like a lost node or a kill -9 (the marker file counts them, a line each); Ray
    Train then restarts the group from the last checkpoint."""

    def __init__(self, at_step: int, marker: str, rank: int | None = None, times: int = 1):
        self.at_step, self.marker, self.rank, self.times = at_step, marker, rank, times

    def on_step_begin(self, trainer, step):
        rank = min(1, trainer.world - 1) if self.rank is None else self.rank
        died = len(open(self.marker).readlines()) if os.path.exists(self.marker) else 0
        if step == self.at_step and trainer.rank == rank and died < self.times:
            with open(self.marker, "a") as f:
                f.write(f"{step}\n")
            os._exit(1)


class Poison(Callback):
    """Fault injection at 0-based step `at` on the last rank: NaN logits, which the loss all-reduce carries to
    every rank. Rank 0 appends a line to `attempts` whenever the loop (re)starts, so a retry would show."""

    def __init__(self, at: int, attempts: str):
        self.at, self.attempts = at, attempts

    def on_step_begin(self, trainer, step):
        if step == trainer.start_step and trainer.rank == 0:
            with open(self.attempts, "a") as f:
                f.write(f"{step}\n")
        if step == self.at and trainer.rank == trainer.world - 1:
            trainer.model.register_forward_hook(lambda module, args, logits: logits * float("nan"))


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


class CountLinears(Callback):
    """Per rank: how many Float8Linear modules the trained model holds and how often each kind of Linear ran
    (forward hooks added at the attempt's first step, removed when a step in `last_steps` is saved). The
    attempt's final validation runs with them on but swaps the Float8Linears for new plain Linears, which
    carry no hook: "float8" counts training forwards only, "plain" (the LM head) validation forwards too.
    Appends one JSON line per rank to `path`."""

    def __init__(self, path: str, last_steps: tuple[int, ...]):
        self.path, self.last_steps = path, last_steps

    def on_step_begin(self, trainer, step):
        if step != trainer.start_step:
            return
        self.calls = {"float8": 0, "plain": 0}
        self.hooks = []
        for m in trainer.model.modules():
            if isinstance(m, nn.Linear):
                kind = "float8" if isinstance(m, Float8Linear) else "plain"
                self.hooks.append(m.register_forward_hook(lambda *_, k=kind: self.calls.__setitem__(k, self.calls[k] + 1)))  # fmt: skip

    def on_save(self, trainer, step):
        if step in self.last_steps:  # the last training forward of the attempt has run
            for h in self.hooks:
                h.remove()
            self.hooks = []

    def on_train_end(self, trainer):
        line = {
            "rank": trainer.rank,
            "start_step": trainer.start_step,
            "grad_accum": trainer.plan.grad_accum,
            "float8_modules": sum(isinstance(m, Float8Linear) for m in trainer.model.modules()),
            "plain_modules": sum(
                isinstance(m, nn.Linear) and not isinstance(m, Float8Linear) for m in trainer.model.modules()
            ),
            **self.calls,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/


@pytest.fixture(scope="module")
def ray_cluster(s3_server):
    """tests/ray/conftest.py's 2-CPU Ray instance, its node holding the S3 test server's AWS variables, as a
    cluster's nodes hold their own credentials: the workers of a run on s3:// open that storage themselves."""
    with mock.patch.dict(os.environ, s3_server.env):
        init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


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
    # the loss's moving average goes on from the checkpoint's (it restarted at step 4's loss: a step in its curve)
    assert smooth_losses(tmp_path / "b") == smooth_losses(storage)
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


def test_a_non_finite_step_stops_the_run_in_one_line_without_a_retry_and_resumes_with_a_lower_lr(
    data, straight, tmp_path
):
    """Step 5's (0-based 4) loss turns non-finite on one rank: no update, Ray Train does not retry though
    max_failures allows it, and the last checkpoint is step 3's, finite and equal to the straight run's step 3.
    The NonFiniteError reached `raychat pretrain` as a traceback; now the run ends in RunGaveUp's one line (exit
    status 1: tests/unit/test_cli.py), naming the run, the step, what was not finite, the learning rates to lower
    and the checkpoint a new start resumes from; its cause is the NonFiniteError. Started again with a lower
    --matrix-lr (no poison this time), the run resumes from step 3 and completes. (A non-finite gradient norm
    raises the same NonFiniteError from optimizer_step, the same step on every rank, since DDP all-reduces the
    gradients: tests/unit/test_train_step.py.)"""
    attempts = tmp_path / "attempts"
    with pytest.raises(RunGaveUp) as e:
        pretrain(tiny_config(data, tmp_path, max_failures=2), callbacks=[Poison(4, str(attempts))])
    assert str(e.value) == (
        "pretrain run 't' stopped at step 5: its loss was nan, so that update was skipped and the run not retried "
        "(the same step would fail again); lower the learning rates (now --matrix-lr 0.02, --embedding-lr 0.2, "
        "--unembedding-lr 0.004, --scalar-lr 0.02) and start it again: it resumes from its newest committed "
        f"checkpoint {tmp_path}/t/checkpoint_000003"
    )
    assert isinstance(e.value.__cause__, NonFiniteError) and e.value.__cause__.step == 5
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
    result = pretrain(  # Poison at no step: it records where the attempt starts
        tiny_config(data, tmp_path, max_failures=2, matrix_lr=0.01), callbacks=[Poison(-1, str(attempts))]
    )
    assert attempts.read_text().split() == ["0", "3"]
    assert result.metrics["step"] == 6 and sorted(losses(tmp_path)) == [1, 2, 3, 4, 5, 6]
    # the lower lr is the one trained with: the optimizer state loaded at the resume put the checkpoint's 0.02
    # back (the warmdown, round(0.4 x 6) = 2 steps, halves the last step's)
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [x["lr"] for x in lines] == [0.02, 0.02, 0.02, 0.01, 0.01, 0.005]


class FailingReport(UserCallback):
    """Ray Train's controller runs this callback on every report (a checkpoint's); it raises, a controller error."""

    def after_report(self, run_context, metrics, checkpoint):
        raise RuntimeError("the report callback failed")


def test_a_controller_error_ends_the_run_in_one_line(ray_cluster, data, tmp_path, capsys):
    """Ray Train's controller fails (a UserCallback of its RunConfig raises at the report of checkpoint 3, the
    run's last): Ray Train does not retry it (controller_failure_limit 0), and its ControllerError reached
    `raychat pretrain` as a traceback. Now RunGaveUp's one line names the run, the controller's own error and the
    checkpoint a new start resumes from, the ControllerError logged once in full above it."""
    with_callback = lambda **kw: RunConfig(callbacks=[FailingReport()], **kw)  # noqa: E731
    with mock.patch.object(launch, "RunConfig", with_callback), pytest.raises(RunGaveUp) as e:
        pretrain(tiny_config(data, tmp_path, num_workers=1, num_iterations=3))
    assert str(e.value) == (
        "pretrain run 't' gave up: Ray Train's controller failed (RuntimeError: the report callback failed), not "
        f"retried; started again, it resumes from its newest committed checkpoint {tmp_path}/t/checkpoint_000003"
    )
    assert isinstance(e.value.__cause__, ControllerError)
    _, full = capsys.readouterr().out.split("pretrain run 't': the failure that ended it, in full:\n")
    assert full.startswith(
        "ControllerError: Training failed due to controller error:\nthe report callback failed"
    )


def test_killed_worker_restarts_from_checkpoint_gives_up_past_max_failures_and_resumes(
    ray_cluster, data, tmp_path, capsys
):
    """The worker dies (os._exit, as a kill -9) as step 5 (0-based 4) begins, twice. Ray Train restarts it from
    checkpoint 3 once (--max-failures 1); at the second death the run gives up. It ended in ~50 lines of two
    chained tracebacks; now RunGaveUp is one line (`raychat` prints it last: tests/unit/test_cli.py) naming the
    worker, the error, the failure count and budget and the checkpoint a new start resumes from, and Ray Train's
    error is logged once in full above it. Started again, the run resumes from that checkpoint and completes.
    (One worker: with two, the dead rank's DDP peer raises its own error, which may reach Ray Train first.)"""
    marker, root = tmp_path / "died", tmp_path / "c"
    cfg = tiny_config(data, root, max_failures=1, num_workers=1)
    with pytest.raises(RunGaveUp) as e:
        pretrain(cfg, callbacks=[FailOnce(4, str(marker), times=2)])
    assert marker.read_text().split() == ["4", "4"]  # died, restarted from checkpoint 3, died again
    assert str(e.value) == (
        "pretrain run 't' gave up: worker rank 0 was lost (ActorDiedError: The actor died unexpectedly before "
        "finishing this task.), failure 2 where --max-failures 1 allows 1 failure; started again (a higher "
        f"--max-failures survives more), it resumes from its newest committed checkpoint {root}/t/checkpoint_000003"
    )
    _, full = capsys.readouterr().out.split("pretrain run 't': the failure that ended it, in full:\n")
    assert full.startswith(
        "WorkerGroupError: Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n"
    )
    assert "The actor died unexpectedly before finishing this task." in full
    result = pretrain(cfg, callbacks=[FailOnce(4, str(marker), times=2)])
    assert result.metrics["step"] == 6
    assert sorted(losses(root))[-1] == 6


def test_a_run_on_object_storage_logs_each_step_once_across_a_worker_restart(
    ray_cluster, data, s3_env, tmp_path
):
    """A run on s3:// wrote no metrics.jsonl. Rank 0, the one that logs, dies at step 5 as in a kill -9 (no
    close, no finally); Ray Train restarts the group from the bucket's checkpoint 3. Step 4's line was logged but
    never stored (object storage cannot append: the sink PUTs the whole file at intervals and before each
    commit); the restarted rank 0 reads the stored lines 1-3 and logs 4-6 anew."""
    bucket, marker = s3_env.make_bucket(), tmp_path / "died"
    cfg = tiny_config(data, f"s3://{bucket}/runs", max_failures=1)
    result = pretrain(cfg, callbacks=[FailOnce(4, str(marker), rank=0)])
    assert marker.exists() and result.metrics["step"] == 6
    assert result.checkpoint == f"s3://{bucket}/runs/t/checkpoint_000006"
    with s3_env.filesystem().open_input_stream(f"{bucket}/runs/t/metrics.jsonl") as f:
        lines = [json.loads(line) for line in f.read().decode().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[-1]["loss"] == result.metrics["loss"] and lines[2]["val_bpb"] > 0


# Relative difference of the FP8 loss from the fp32 loss at the same step. Measured (2026-12-03, this test):
# step 1 equal (the zero-initialized o_proj and down_proj make the blocks' first output 0, so only the
# high-precision embedding and LM head count), then 2.4e-5, 1.2e-4, 6.3e-5, 2.7e-4, 4.0e-4 at steps 2-6
# (losses 5.70 -> 2.55). 2e-3 is 5x the largest: an FP8 path that lost its scales or trained the wrong
# weights would be off by far more.
FP8_LOSS_TOLERANCE = 2e-3


@pytest.mark.slow
def test_fp8_run_with_ddp_and_resume_tracks_fp32(data, straight, tmp_path):
    """The straight run's config with --fp8 and eval_every 0 (validation reads its own shard under no_grad and
    the model has no dropout, so the straight run's evaluations at step 3 do not move its losses; measured:
    step 1 is equal to the bit, steps 2-6 within 4e-4), stopped after step 3 and resumed to step 6."""
    counts, fp8 = tmp_path / "counts.jsonl", dict(fp8=True, eval_every=0)
    callbacks = [CountLinears(str(counts), last_steps=(3, 6))]
    stopped = pretrain(tiny_config(data, tmp_path, stop_after=3, **fp8), callbacks=callbacks)
    assert stopped.metrics["step"] == 3
    resumed = pretrain(tiny_config(data, tmp_path, **fp8), callbacks=callbacks)
    assert resumed.metrics["step"] == 6

    lines = [json.loads(x) for x in counts.read_text().splitlines()]
    assert sorted((x["start_step"], x["rank"]) for x in lines) == [(0, 0), (0, 1), (3, 0), (3, 1)]
    for x in lines:
        # depth 1, width 64: q, k, v, o (64x64) and the MLP's gate, up (64->256), down (256->64) are converted;
        # the LM head is not
        assert (x["float8_modules"], x["plain_modules"]) == (7, 1), x
        forwards = x["grad_accum"] * 3  # 3 steps in each attempt
        assert x["float8"] == 7 * forwards, x  # every training forward went through the 7 Float8Linears
        # the LM head (the one plain Linear of the trained model) ran in them too, and in the final validation,
        # which swaps the Float8Linears for plain Linears (raychat.train.fp8.high_precision_linears)
        assert x["plain"] > forwards, x

    a, b = losses(straight[0]), losses(tmp_path)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    rel = {s: abs(b[s] - a[s]) / a[s] for s in a}
    print(f"fp32 losses {a}\nfp8 losses {b}\nrelative difference {rel}")
    assert max(rel.values()) <= FP8_LOSS_TOLERANCE, rel
    assert any(b[s] != a[s] for s in a)  # the FP8 matmuls did change the numbers (this is not the fp32 path)
    assert b[6] < b[1]  # and it trained

"""raychat.train.trainer.Trainer.train: a run stopped early by --stop-after ends as a run's last step does."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import raychat.train.trainer as trainer_module
import raychat.train.validators as validators
from raychat.config import TrainConfig, from_dict
from raychat.train.trainer import Trainer
from raychat.train.validators import SamplesValidator


def test_a_stop_after_run_samples_at_its_last_step(monkeypatch):
    """Its last step evaluated and checkpointed (at --stop-after) but took no greedy samples: validate_all was
    told the plan's last step (4), and --sample-every 0 samples only there. Now step 2 of 4 samples, step 1
    does not, and the checkpoint's report holds them."""
    monkeypatch.setattr(validators, "greedy_samples", lambda model, tokenizer, device=None: ["hi there"])
    monkeypatch.setattr(trainer_module, "freeze_gc_heap", lambda: 0)
    config = from_dict(TrainConfig, {"num_iterations": 4, "stop_after": 2, "sample_every": 0})
    plan = SimpleNamespace(num_iterations=4, total_batch_size=64, flops_per_token=10)
    model = torch.nn.Linear(1, 1)
    run = Trainer(
        config, plan, model, model, [], None, [SamplesValidator(None, 0, torch.device("cpu"))], None, None,
        None, bos_id=0, rank=0, world=1, device=torch.device("cpu"),
    )  # fmt: skip
    run.train_step = lambda step: run.step_stats(step + 1, 2.5, 1e-3, 0.5, 0.25, 0.0)
    saved, logged = [], []
    run.save = lambda step, report: saved.append((step, report.get("samples")))
    run.log_step = lambda stats, seconds: logged.append((stats["step"], stats.get("samples")))
    run.train()
    assert run.stop == 2
    assert logged == [(1, None), (2, ["hi there"])]
    assert saved == [(2, ["hi there"])]

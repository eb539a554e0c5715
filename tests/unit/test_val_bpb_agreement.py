"""One checkpoint, one validation BPB: the value a pretraining run logs (its BPBValidator on every rank, sums
added as the all-reduce adds them) and `raychat eval` of the checkpoint measure the same rows of the
validation shard with the same attention, so they agree.

They once differed on the same weights (the tiny speedrun: 4.2171 logged, 4.0465 from eval at the same 512
tokens): the validator packed the shard with the run's --buffer-size (16 in the tiny preset, eval: 256), rounded
its row count down to a multiple of the world size (eval: world 1), and ran the model with the run's
--document-masking (eval: never)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from raychat.checkpoint import save_model
from raychat.checkpoint_manager import CheckpointManager
from raychat.cli import main as raychat_main
from raychat.config import RLConfig, TrainConfig, from_dict, to_dict
from raychat.config.train import SFT_DEFAULTS
from raychat.data.corpus.shards import write_manifest, write_shards
from raychat.model import GPT, ModelConfig
from raychat.rl.learner import Learner
from raychat.storage import open_storage
from raychat.train.pretrain import Pretraining

WORDS = "the a river stone light cloud tree bird wind fire water runs falls grows over under".split()


def test_eval_of_a_checkpoint_reproduces_the_val_bpb_its_run_logged(tmp_path, small_tokenizer, capsys):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + "." for _ in range(400)]
    entries = write_shards(docs, tmp_path / "data", 2, log=lambda *_: None)
    write_manifest(tmp_path / "data", {"source": "test", "shards": entries})
    seq_len, world = 32, 2
    cfg = from_dict(TrainConfig, {
        "data_dir": str(tmp_path / "data"), "seq_len": seq_len, "buffer_size": 4, "document_masking": True,
        "eval_tokens": 9 * seq_len, "device_batch_size": 4,
    })  # fmt: skip
    model = GPT(ModelConfig.from_depth(1, small_tokenizer.vocab_size, seq_len, aspect_ratio=64, head_dim=32))
    model.init_weights(0)
    nats = nbytes = 0.0
    for rank in range(world):  # each rank's share; the all-reduce adds the sums
        bpb = Pretraining().validators(cfg, small_tokenizer, rank, world, torch.device("cpu"), None)[0]
        bpb.validate(model, 1, 1)
        nats, nbytes = nats + bpb.last_sums[0], nbytes + bpb.last_sums[1]
    logged = nats / (math.log(2) * nbytes)

    root = tmp_path / "runs"
    meta = {"step": 1, "stage": "pretrain", "world_size": world, "config": to_dict(cfg)}
    save_model(root / "base" / "checkpoint_000001", model, small_tokenizer, meta, commit=True)
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "base", "--data-dir", str(tmp_path / "data"),
            "--tasks", "", "--eval-tokens", str(9 * seq_len)]  # fmt: skip
    assert raychat_main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["val_bpb"] == pytest.approx(logged, rel=1e-12)
    assert result["val_tokens"] == 9 * seq_len and result["val_bytes"] == nbytes
    # stderr said only "validation BPB: not measured" when skipped; a measured one was in the JSON alone
    assert (
        f"validation BPB: {logged:.4f} (288 tokens, {int(nbytes):,} bytes of {(tmp_path / 'data').resolve() / entries[-1]['file']})"
        in (err.splitlines())
    )
    assert result["val_document_masking"] is True


def test_eval_of_an_rl_checkpoint_masks_documents_as_its_sft_parent(tmp_path, small_tokenizer, capsys):
    """RL's checkpoints recorded no document_masking (RLConfig has no such option), so `raychat eval` ran an RL
    checkpoint without it while its SFT parent, trained with it, was scored with it: the two rows of one model
    differed in how they were measured. An RL checkpoint now carries its --init-from's setting: eval of an RL
    checkpoint whose learner has not stepped (the SFT weights) gives the SFT checkpoint's BPB."""
    rng = random.Random(1)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(200)]
    entries = write_shards(docs, tmp_path / "data", 2, log=lambda *_: None)
    write_manifest(tmp_path / "data", {"source": "test", "shards": entries})
    root = tmp_path / "runs"
    sft = root / "sft" / "checkpoint_000002"
    model = GPT(ModelConfig.from_depth(1, small_tokenizer.vocab_size, 32, aspect_ratio=64, head_dim=32))
    with torch.no_grad():  # the init's zero projections would make every position's logits the same
        for p in model.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    cfg = from_dict(TrainConfig, SFT_DEFAULTS)
    save_model(sft, model, small_tokenizer, {"step": 2, "stage": "sft", "config": to_dict(cfg)},
               commit=True)  # fmt: skip
    learner = Learner(str(sft), from_dict(RLConfig, {"init_from": str(sft)}))
    checkpoints = CheckpointManager(open_storage(root), "rl")
    checkpoints.prepare(1)
    checkpoints.commit(1, [learner.save(checkpoints, step=1)], "rl")  # what RLRun.save does with its learners
    results = {}
    for run in ("sft", "rl"):
        argv = ["eval", "--storage-path", str(root), "--checkpoint", run, "--data-dir", str(tmp_path / "data"),
                "--tasks", "", "--eval-tokens", "256"]  # fmt: skip
        assert raychat_main(argv) == 0
        results[run] = json.loads(capsys.readouterr().out)
    assert results["rl"]["stage"] == "rl"
    assert results["rl"]["val_document_masking"] is results["sft"]["val_document_masking"] is True
    assert results["rl"]["val_bpb"] == results["sft"]["val_bpb"]

"""Supervised fine-tuning: the Trainer fed with packed conversations of a task mixture (--sft-tasks).

Components: SFTRows (raychat.data.loader.sft_rows: the rank's share of the global mixture stream) for training,
with replay records of every step (raychat.train.replay_recorder); for every mixture task with a held-out split,
validation BPB on its packed test conversations ("<task>_val_bpb", and "val_bpb" over all of them) and, on
rank 0, greedy accuracy on --eval-examples of them ("<task>_accuracy"). Document masking is on.
`raychat sft --init-from <pretraining checkpoint>` (or `jobs/sft.py`; `--init-from latest`: the newest pretraining
checkpoint under --storage-path); the checkpoint's meta.stage is "sft".
"""

from __future__ import annotations

from raychat.config import SFT_DEFAULTS, TrainConfig, from_dict
from raychat.data.loader.sft_rows import SFTRows, validation_rows
from raychat.ray_token import token_for
from raychat.tasks.hub_data import task_data_dir
from raychat.tasks.registry import check_data, graded, held_out, make_task, mixture_tasks, parse_mixture
from raychat.tokenizer import Tokenizer
from raychat.train.launch import COMMANDS, Flags, config_from, resolve_paths, run_training
from raychat.train.replay_recorder import ReplayRecorder
from raychat.train.validators import AccuracyValidator, BPBValidator, MeanBPBValidator


class SFT:
    data_cpus = 0.0  # no Ray Data: conversations are rendered in the workers

    def row_source(self, cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int) -> SFTRows:
        tasks = mixture_tasks(cfg.data.sft_tasks, "train", cfg.run.seed, cfg.data.task_data_dir)
        return SFTRows(tasks, cfg.run.seed, tokenizer, cfg.model.seq_len + 1, rank, world)

    def validators(self, cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int, device, autocast):
        names = [name for name, _ in parse_mixture(cfg.data.sft_tasks) if held_out(name)]
        names = list(dict.fromkeys(names))
        size, seed = validation_size(cfg), cfg.run.seed
        bpb = []
        for name in names:
            rows = validation_rows(
                make_task(name, "test", size, seed, data_dir=cfg.data.task_data_dir),
                tokenizer,
                cfg.model.seq_len + 1,
                world,
            )
            bpb.append(BPBValidator(
                f"{name}_val_bpb", {k: v[rank::world] for k, v in rows.items()}, tokenizer,
                cfg.train.batch.device_batch_size, True, device, autocast,
            ))  # fmt: skip
        out = [*bpb, MeanBPBValidator("val_bpb", bpb)] if bpb else []
        if rank == 0:
            n = cfg.train.eval.eval_examples
            out += [
                AccuracyValidator(
                    f"{m}_accuracy",
                    make_task(m, "test", None, seed, data_dir=cfg.data.task_data_dir),
                    tokenizer,
                    n,
                )
                for m in names
                if graded(m)
            ]
        return out


def validation_size(cfg: TrainConfig) -> int:
    """Held-out conversations of each task that SFT's validators measure BPB on."""
    return max(64, cfg.train.eval.eval_tokens // 32)


def sft_defaults() -> TrainConfig:
    return from_dict(TrainConfig, SFT_DEFAULTS)


def sft(cfg: TrainConfig, callbacks=(), dry_run: bool = False, flags: Flags = COMMANDS):
    """Run (or resume) SFT of cfg.run.init_from on the current Ray cluster; returns its
    raychat.train.launch.TrainingResult (None with `dry_run`: every check, then the plan printed). flags: how the
    refusals and the finished line name the options (raychat.train.launch.Flags).

    Raises:
        ValueError (before Ray starts): no --init-from, or one that names no committed checkpoint; a hub
            task of --sft-tasks whose file is missing under --task-data-dir (one line naming it), a bad record
            of smoltalk's files (its file, line and field: raychat.tasks.registry.check_data), a held-out task
            none of whose conversations fits a row (check_validation_rows); or as run_training (a run
            directory whose newest checkpoint this run cannot resume).
    """
    if not cfg.run.init_from:
        raise ValueError("--init-from: required: a pretraining checkpoint, its run (name or dir), or latest")
    data_dir = str(task_data_dir(cfg.data.task_data_dir))  # resolved here: workers run elsewhere
    names = [name for name, _ in parse_mixture(cfg.data.sft_tasks)]
    check_data(names, ("train",), data_dir)
    check_data([n for n in names if held_out(n)], ("test",), data_dir)
    cfg = from_dict(
        TrainConfig, {"stage": "sft", "document_masking": True, "task_data_dir": data_dir}, base=cfg
    )
    check_validation_rows(cfg)
    return run_training(cfg, SFT(), [ReplayRecorder(), *callbacks], dry_run, flags)


def check_validation_rows(cfg: TrainConfig) -> None:
    """What every worker's validators build first (SFT.validators), built here to fail in one line, not in each
    worker after Ray started: each held-out task's packed conversations.

    Raises:
        ValueError: "--sft-tasks: task <name>'s held-out conversations (N) fill no row of <T+1> tokens: ..." (a
            longer --seq-len or shorter conversations in its test split keep some), or as resolve_paths.
    """
    names = list(dict.fromkeys(name for name, _ in parse_mixture(cfg.data.sft_tasks) if held_out(name)))
    if not names:
        return
    tokenizer = Tokenizer.load(resolve_paths(cfg, writable=False).tokenizer_path)
    for name in names:
        task = make_task(name, "test", validation_size(cfg), cfg.run.seed, data_dir=cfg.data.task_data_dir)
        try:
            validation_rows(task, tokenizer, cfg.model.seq_len + 1, 1)
        except ValueError as e:
            raise ValueError(f"--sft-tasks: {e} (a longer --seq-len keeps some)") from None


def main(args) -> int:
    """`raychat sft` (its parser: raychat.commands.sft); the Ray auth token as `raychat pretrain`'s
    (raychat.train.pretrain.main)."""
    with token_for(None, args.token_file):
        sft(config_from(args, sft_defaults(), "sft"), dry_run=args.dry_run)
    return 0

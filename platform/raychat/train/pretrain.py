"""Pretraining: the Trainer fed with best-fit packed rows of the training shards (Ray Data streams them).

Components: PretrainRows (raychat.data.loader.pipeline: the rank's share of the global document stream, packed
with --overflow crop|split) for training; validation BPB on the validation shard and, on rank 0, greedy
samples; replay records of every step (raychat.train.replay_recorder). `raychat pretrain` (or `jobs/pretrain.py`); same --run-name resumes.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from raychat.config import TrainConfig, preset_section
from raychat.config.flags import TYPED
from raychat.data.corpus.shards import check_text_column, list_shards, read_manifest
from raychat.data.loader.pipeline import PretrainRows, validation_rows
from raychat.log import plural
from raychat.ray_token import token_for
from raychat.tokenizer import Tokenizer
from raychat.train.launch import (
    COMMANDS,
    Flags,
    check_resume,
    check_shape_flags,
    config_from,
    resolve_paths,
    run_training,
)
from raychat.train.plan import make_plan, print_plan
from raychat.train.replay_recorder import ReplayRecorder
from raychat.train.startup_trace import mark
from raychat.train.validators import BPBValidator, SamplesValidator


class Pretraining:
    data_cpus = 0.25  # what each Ray Data read+tokenize task reserves

    def row_source(self, cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int) -> PretrainRows:
        train_files, _ = list_shards(cfg.data.data_dir)
        d = cfg.data
        return PretrainRows(
            train_files, d.tokenizer_path, cfg.model.seq_len + 1, rank, world, d.buffer_size,
            num_cpus=self.data_cpus, seed=cfg.run.seed, overflow=d.overflow, min_fragment=d.min_fragment,
        )  # fmt: skip

    def validators(self, cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int, device, autocast):
        _, val_file = list_shards(cfg.data.data_dir)
        row_len, tokens = cfg.model.seq_len + 1, cfg.train.eval.eval_tokens
        rows = validation_rows(val_file, tokenizer, row_len, tokens)
        rows = {k: v[rank::world] for k, v in rows.items()}
        bpb = BPBValidator(
            "val_bpb", rows, tokenizer, cfg.train.batch.device_batch_size,
            cfg.model.document_masking, device, autocast,
        )  # fmt: skip
        return [bpb, SamplesValidator(tokenizer, cfg.train.eval.sample_every, device)] if rank == 0 else [bpb]


def pretrain(cfg: TrainConfig, callbacks=(), typed=(), flags: Flags = COMMANDS):
    """Run (or resume) pretraining on the current Ray cluster, with replay records; returns the
    ray.train.Result. typed: the options typed on the command line (raychat.config.flags.TYPED); flags: how the
    refusals and the finished line name the options (raychat.train.launch.Flags).

    Raises:
        ValueError: (before Ray starts) as run_training, or --data-dir holds no prepared shards (no or a
            malformed manifest.json, a listed shard missing or not a readable text shard: validation_shard) or
            a validation shard too small for one row, or a typed shape flag that is not the --init-from
            checkpoint's (check_shape_flags).
    """
    paths = resolve_paths(cfg, writable=False)
    check_shape_flags(paths.config(cfg), typed)
    val_file = validation_shard(paths.data_dir)
    tokenizer = load_tokenizer(paths.tokenizer_path, paths.data_dir, flags)
    check_validation_rows(val_file, tokenizer, cfg.model.seq_len)
    resolved = paths.config(cfg)
    print(data_line(resolved, tokenizer, make_plan(resolved, tokenizer.vocab_size).tokens, flags))
    return run_training(cfg, Pretraining(), [ReplayRecorder(), *callbacks], flags=flags)


def validation_shard(data_dir: str) -> str:
    """The validation shard of --data-dir, whose manifest and shards every worker reads first: checked here, in
    one line, not in each of them (each shard's parquet footer is read; its text only in a row group whose
    footer records no null count).

    Raises:
        ValueError: "--data-dir: <why>": no or a malformed manifest.json (its line names the command that
            prepares the directory), or a listed shard missing (raychat.data.corpus.shards.list_shards), or a
            shard that is not a readable parquet file, has no `text` column of strings, or holds a null text
            (raychat.data.corpus.shards.check_text_column: naming the shard).
    """
    try:
        train_files, val_file = list_shards(data_dir)
        for shard in [*train_files, val_file]:
            check_text_column(shard)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data-dir: {e}") from None
    return val_file


def check_validation_rows(val_file: str, tokenizer: Tokenizer, seq_len: int) -> None:
    """Refuse a validation shard that packs into no row of seq_len + 1 tokens (every rank's validator packs it
    first).

    Raises:
        ValueError: "--data-dir: the validation shard ... holds too little text for one row ...".
    """
    try:
        validation_rows(val_file, tokenizer, seq_len + 1, 1)
    except ValueError as e:
        raise ValueError(f"--data-dir: {e}") from None


def dry_run_data_line(cfg: TrainConfig, tokens: int) -> str | None:
    """What a dry run says of --data-dir before the plan: the run's data_line where the data and the tokenizer
    are there, else the one line the run would refuse the data with ("data: not ready; the run would refuse it:
    --data-dir: .../manifest.json not found: ... run `raychat data prepare --out ...` first"), without failing
    the dry run (it plans before the data are prepared); None where the data are good but no tokenizer is there
    yet to measure them (the dry run's tokenizer line says so)."""
    try:
        val_file = validation_shard(cfg.data.data_dir)
        if not (Path(cfg.data.tokenizer_path) / "tokenizer.json").exists():
            return None
        tokenizer = Tokenizer.load(cfg.data.tokenizer_path)
        check_validation_rows(val_file, tokenizer, cfg.model.seq_len)
        return data_line(cfg, tokenizer, tokens)
    except ValueError as e:
        return f"data: not ready; the run would refuse it: {e}"


SAMPLE_BYTES = 1_000_000  # of the validation shard's text, tokenized for the bytes per token of data_line


def data_line(cfg: TrainConfig, tokenizer: Tokenizer, tokens: int, flags: Flags = COMMANDS) -> str:
    """The line saying how much of --data-dir's training text the run's `tokens` (the plan's) read, in epochs,
    about: the training shards' UTF-8 bytes (the manifest's) over the bytes per token of the validation
    shard's first documents (SAMPLE_BYTES of them, or all); with --overflow crop, of which only the share a
    row (--seq-len + 1 tokens, BOS included) holds of each of those documents. Past 1 epoch the stream goes on
    with the same documents in another order (raychat.data.loader.cursor), which nothing else says. --overflow is
    named as `flags` names it.

    Raises ValueError/FileNotFoundError as list_shards (a run checks the data before)."""
    train = [e for e in read_manifest(cfg.data.data_dir)["shards"] if e.get("split") == "train"]
    text_bytes = sum(e["bytes"] for e in train)
    _, val_file = list_shards(cfg.data.data_dir)
    row = cfg.model.seq_len + 1
    sample_bytes = sample_tokens = kept = 0
    texts = (
        t
        for b in pq.ParquetFile(val_file).iter_batches(64, columns=["text"])
        for t in b.column(0).to_pylist()
    )
    for text in texts:  # a hub shard is ~100 MB: read its first batches only
        if sample_bytes >= SAMPLE_BYTES:
            break
        n = len(tokenizer.encode(text)) + 1  # with its BOS
        sample_bytes, sample_tokens, kept = (
            sample_bytes + len(text.encode()),
            sample_tokens + n,
            kept + min(n, row),
        )
    per_token = sample_bytes / max(sample_tokens, 1)
    available = text_bytes / per_token
    line = (
        f"data: {plural(len(train), 'training shard')}, {text_bytes / 1e6:.3g} MB of text, about {available:,.0f} "
        f"tokens ({per_token:.2f} bytes/token on the validation shard)"
    )
    if cfg.data.overflow == "crop":
        share = kept / max(sample_tokens, 1)
        available *= share
        line += (
            f"; {flags.option('overflow')} crop keeps at most a row ({row} tokens) of each document, about {100 * share:.2g}% of "
            f"them: {available:,.0f} tokens an epoch"
        )
    epochs = tokens / max(available, 1)
    line += f"; the run's {tokens:,} tokens are {epochs:.3g} epochs"
    if epochs > 1:
        line += ": from the second on the same documents repeat, each epoch in another order"
    return line


def load_tokenizer(path: str, data_dir: str, flags: Flags = COMMANDS) -> Tokenizer:
    """The tokenizer at `path` (--tokenizer-path, resolved); data_dir: the run's --data-dir, which the command
    that trains a missing one reads.

    Raises:
        FileNotFoundError: no tokenizer.json there: one line naming --tokenizer-path (as `flags` does) and the
            command that trains one there.
        ValueError: as Tokenizer.load.
    """
    try:
        return Tokenizer.load(path)
    except FileNotFoundError:
        flag = flags.option("tokenizer_path")
        raise FileNotFoundError(
            f"{flag}: no tokenizer.json in {path}: give {flag} a directory `raychat tokenizer train` wrote, or "
            f"run `raychat tokenizer train --data-dir {data_dir} --out {path}` first"
        ) from None


def dry_run_vocab_size(cfg: TrainConfig, preset: str | None) -> int:
    """The vocabulary of the run's tokenizer, or (before one is trained) the preset's tokenizer.vocab_size.

    Raises:
        FileNotFoundError: no tokenizer at --tokenizer-path and no vocab_size in the preset (load_tokenizer's
            line, which adds that a preset's tokenizer.vocab_size sizes the plan without one).
    """
    if (Path(cfg.data.tokenizer_path) / "tokenizer.json").exists():
        return Tokenizer.load(cfg.data.tokenizer_path).vocab_size
    size = preset_section(preset, "tokenizer").get("vocab_size") if preset and preset != "none" else None
    if not size:
        try:
            load_tokenizer(cfg.data.tokenizer_path, cfg.data.data_dir)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{e} (or, to size the plan without one, a --preset whose tokenizer section sets vocab_size)"
            ) from None
    print(f"(no tokenizer in {cfg.data.tokenizer_path} yet: sizes for the preset's vocab_size {size})")
    return int(size)


def main(args) -> int:
    """`raychat pretrain` (its parser: raychat.commands.pretrain). The Ray auth token (--token-file, else where
    Ray looks: raychat.ray_token) is handed to Ray before it connects to RAY_ADDRESS; a cluster that refuses it
    raises ConnectionError naming where it came from."""
    mark("driver_imports_done")
    with token_for(None, args.token_file):
        return _pretrain(args)


def _pretrain(args) -> int:
    cfg = config_from(args, TrainConfig(), "pretrain")
    typed = getattr(args, TYPED, {})
    if args.dry_run:
        paths = resolve_paths(cfg, writable=False)
        cfg = paths.config(cfg)
        check_shape_flags(cfg, typed)
        plan = make_plan(cfg, dry_run_vocab_size(cfg, args.preset))
        if (line := dry_run_data_line(cfg, plan.tokens)) is not None:  # as the run prints it first
            print(line)
        if (
            paths.checkpoints.newest() is not None
        ):  # a run to resume: its check, as the real run makes it first
            tokenizer = load_tokenizer(paths.tokenizer_path, paths.data_dir)
            check_resume(cfg, paths, plan, lambda: Pretraining().row_source(cfg, tokenizer, 0, 1))
        print_plan(cfg, plan)
        return 0
    pretrain(cfg, typed=typed)
    return 0

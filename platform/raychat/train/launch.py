"""Driver side of pretraining and SFT: resolve the run's inputs, check its storage, derive and print the plan,
start Ray Train, return its result; and the command-line plumbing both commands share.

Storage (raychat.storage): checkpoints go to <--storage-path>/<--run-name>/checkpoint_<step:06d>, committed by
raychat.checkpoint_manager (Ray Train's RunConfig(storage_path, storage_filesystem) holds its run state beside
them), on a local or NFS directory, s3:// or gs://; --data-dir and
--tokenizer-path are directories or run names under the storage root; --init-from is any checkpoint
reference, `latest` being the newest pretraining checkpoint under the root. Every reference is resolved, the
run's newest checkpoint checked for resuming (check_resume) and the root checked for writing before Ray starts.

A train spec (the stage's components; torchtitan's TrainSpec) is an object with `row_source(cfg, tokenizer,
rank, world)`, `validators(cfg, tokenizer, rank, world, device, autocast)` and `data_cpus` (CPUs each of its
Ray Data tasks reserves; 0 = none): raychat.train.pretrain.Pretraining and raychat.train.sft.SFT.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray
from ray.data._internal.stats import get_or_create_stats_actor
from ray.train import (
    ControllerError,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    WorkerGroupError,
)
from ray.train.torch import TorchConfig, TorchTrainer

from raychat.capacity import (
    Capacity,
    WaitReporter,
    missing_resources,
    placement_state,
    read_capacity,
)
from raychat.checkpoint import check_model, load_tree, read_meta
from raychat.checkpoint_manager import CheckpointError, CheckpointManager, find_checkpoint, verify_stored
from raychat.config import ConfigError, TrainConfig, from_args, from_dict, to_dict, to_flat
from raychat.config.schema import flag_name, shown
from raychat.config.train import elastic_grad_accum
from raychat.data.loader.document_order import changed_shards
from raychat.data.loader.row_source import RowSource, same_stream
from raychat.data.loader.sft_rows import changed_task_files
from raychat.lease import RunLease
from raychat.log import RunGaveUp, log, plural
from raychat.metrics_sink import read_logged
from raychat.model import ModelConfig
from raychat.sigterm import SigtermAsSigint, Terminated
from raychat.storage import Storage, check_writable, is_remote, open_storage, read_bytes, run_directory, why
from raychat.tasks.sft_data import SFT_DATA
from raychat.tokenizer import Tokenizer
from raychat.train.layout import layout_flags, start_or_connect, worker_bundle
from raychat.train.optim import lr_multiplier, lr_peak_from, warmdown_start
from raychat.train.plan import Plan, make_plan, print_plan
from raychat.train.startup_trace import mark
from raychat.train.step import NonFiniteError
from raychat.train.worker import train_loop_per_worker

WORKER_GROUP_START_TIMEOUT_ENV = (
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # ray/train/v2/_internal/constants.py
)
HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # ray/train/v2/_internal/constants.py
# How often Ray Train's controller polls the workers (Ray's default 2 s): it sees a finished run, a report or a
# failed worker at the next poll. bench/results/run_end.md (2 cores, local Ray): the workers' function returned
# -> fit() returned took 2.8-3.7 s at 2 s and 0.7-1.3 s at 0.5 s; a 4-step run 39.1 -> 32.4 s. A poll is one
# small actor call per worker; a worker slower than the interval to answer only misses that poll (Ray Train
# ends a worker after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, 10 min, of missed polls). Set unless the
# environment sets it.
HEALTH_CHECK_INTERVAL_S = 0.5
# An elastic run (--min-workers) places its worker group in attempts of at most this long: after a lost node
# Ray Train's next attempt asks for the workers the cluster has (Ray's own start timeout is 60 s).
ELASTIC_ATTEMPT_S = 60.0


def scaling_config(cfg: TrainConfig) -> ScalingConfig:
    """Ray Train's ScalingConfig: num_workers=(min, max) when elastic (Train V2 restarts the group on the
    workers that remain, from the last checkpoint), else the fixed --num-workers."""
    c = cfg.layout
    fewest, most = c.worker_range
    return ScalingConfig(
        num_workers=(fewest, most) if fewest < most else most,
        use_gpu=c.use_gpu,
        resources_per_worker={"CPU": c.cpus_per_worker},
        placement_strategy=c.placement_strategy,
    )


@dataclass(frozen=True)
class RunPaths:
    """A training run's inputs and outputs, resolved and checked once, before Ray starts; the rest of the
    driver and every worker read them from here.

    storage: the root (local, NFS, s3://, gs://); data_dir, tokenizer_path: absolute local paths (a run name
    is a run under the root; data_dir only for pretraining, as given for SFT, which reads no shards); init_from: the committed checkpoint --init-from names (a path or URI), or None;
    checkpoints: the run's CheckpointManager (<root>/<run>/checkpoint_<step:06d>, pruned to keep_checkpoints).
    """

    storage: Storage
    data_dir: str
    tokenizer_path: str
    init_from: str | None
    checkpoints: CheckpointManager

    @property
    def run_dir(self) -> str:
        """<root>/<run> (a local path, or a URI)."""
        return self.storage.uri_of(self.checkpoints.run_path)

    def config(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with its references replaced by what they resolved to (workers do not run in the driver's
        directory)."""
        paths = {
            "storage_path": self.storage.uri,
            "data_dir": self.data_dir,
            "tokenizer_path": self.tokenizer_path,
        }
        return from_dict(TrainConfig, {**paths, "init_from": self.init_from or ""}, base=cfg)


def resolve_paths(cfg: TrainConfig, writable: bool = True) -> RunPaths:
    """Resolve --storage-path, --data-dir, --tokenizer-path, --init-from and --run-name into RunPaths; with
    `writable`, also create the root if needed and check that it can be written.

    Raises ValueError naming the flag: an unsupported scheme, pretraining data on object storage, a run name that breaks
    the rule, a checkpoint reference that names nothing (`latest`: no committed pretraining checkpoint under
    the root), a root that cannot be written; CheckpointError naming the file: an --init-from that could not
    load (raychat.checkpoint.check_model; a remote one's sizes and meta.json, its weights not fetched)."""
    storage = open_storage(cfg.run.storage_path)
    init_from = (
        find_checkpoint(cfg.run.init_from, storage, "--init-from", stages=("pretrain",))
        if cfg.run.init_from
        else None
    )
    if init_from:
        check_model(init_from)
    paths = RunPaths(
        storage=storage,
        data_dir=(
            run_directory(cfg.data.data_dir, storage, "--data-dir")
            if cfg.run.stage == "pretrain"
            else cfg.data.data_dir
        ),
        tokenizer_path=run_directory(cfg.data.tokenizer_path, storage, "--tokenizer-path"),
        init_from=init_from,
        checkpoints=CheckpointManager(storage, cfg.run.run_name, cfg.train.checkpoint.keep_checkpoints),
    )
    if writable:
        check_writable(storage)
    return paths


def check_tokenizer(paths: RunPaths, tokenizer: Tokenizer) -> None:
    """Refuse an --init-from checkpoint (local or remote: its meta.json is read) trained with another tokenizer
    than --tokenizer-path's (the same vocabulary size loads, but every token id would mean other text).

    Raises:
        ConfigError: one line naming --tokenizer-path, --init-from and both tokenizer versions.
    """
    if not paths.init_from:
        return
    trained = read_meta(paths.init_from).get("tokenizer_version")
    if trained not in (None, tokenizer.version):
        own = (  # --tokenizer-path is read as files by every node: not a remote checkpoint itself
            f"a local copy of {paths.init_from}/tokenizer.json"
            if is_remote(paths.init_from)
            else f"its own copy: {paths.init_from}"
        )
        raise ConfigError(
            f"--tokenizer-path: {paths.tokenizer_path} holds tokenizer {tokenizer.version}, but the --init-from "
            f"checkpoint {paths.init_from} was trained with tokenizer {trained} (give --tokenizer-path the "
            f"tokenizer it was trained with, e.g. {own})"
        )


def check_shape_flags(cfg: TrainConfig, typed) -> None:
    """Refuse a shape flag typed on the command line (`typed`: the names of raychat.config.flags.TYPED) whose
    value is not the --init-from checkpoint's (cfg.run.init_from, resolved): pretraining from a checkpoint keeps
    its shape (make_plan), so such a flag was silently ignored. --depth, --head-dim and --kv-group are compared
    with the model's layers, head dim and query heads per KV head; --aspect-ratio with the width it gives at the
    model's depth and head dim. (--seq-len: make_plan's range check; --tokenizer-path: check_tokenizer.)

    Raises:
        ConfigError: one line naming each such flag, the checkpoint's value and the given one.
    """
    if not cfg.run.init_from:
        return
    meta = read_meta(cfg.run.init_from)
    mc, m = meta["model_config"], cfg.model
    try:
        made_ar = to_flat(from_dict(TrainConfig, meta["config"]))["aspect_ratio"]
    except (KeyError, TypeError, ValueError):  # a checkpoint without its config (model-only)
        made_ar = None
    width = ModelConfig.from_depth(mc["n_layer"], 1, 1, m.aspect_ratio, mc["head_dim"]).n_embd
    checkpoint = {
        "depth": mc["n_layer"],
        "head_dim": mc["head_dim"],
        "kv_group": mc["n_head"] // mc["n_kv_head"],
        "aspect_ratio": m.aspect_ratio if width == mc["n_embd"] else made_ar or mc["n_embd"] // mc["n_layer"],
    }
    changed = [
        (flag_name(k), v, getattr(m, k)) for k, v in checkpoint.items() if k in typed and v != getattr(m, k)
    ]
    if changed:
        names, was, now = _values(changed)
        raise ConfigError(
            f"{names}: the --init-from checkpoint {cfg.run.init_from} has {was}, given {now} (a run from a "
            "checkpoint keeps its shape: leave the flag out, or start from scratch without --init-from)"
        )


# The options a model's shape derives from (ModelConfig.from_depth and the vocabulary); SFT's is --init-from's.
SHAPE_OPTIONS = ("depth", "aspect_ratio", "head_dim", "kv_group", "seq_len", "tokenizer_path")
# The options a stage's row source stream is made of (its fingerprint).
DATA_OPTIONS = {
    "pretrain": ("data_dir", "seed"),
    "sft": ("sft_tasks", "sft_data", "sft_test_size", "seed", "seq_len", "task_data_dir"),
}
# Where a stream's files are: another one with the same files is the same stream, so one of these is named only
# when no other option of DATA_OPTIONS differs (it named itself beside the option that changed the stream).
PLACE_OPTIONS = ("data_dir", "task_data_dir")
# What makes a pretraining run's rows of its documents (the packer's buffer, what it does with a tail that fits
# nowhere) and what the model sees of them: not in the stream's fingerprint, refused as its options are.
ROW_OPTIONS = {"pretrain": ("document_masking", "overflow", "buffer_size", "min_fragment")}


@dataclass(frozen=True)
class Flags:
    """How a stage's user-visible lines (refusals to resume, the finished line) name what its user sets.

    option: an option's name (a config field: "depth") -> the text naming it ("--depth"); other_run: how to start
    another run instead ("another --run-name"); same_settings: how to resume this one ("the same settings");
    laid_out: the options (config fields) whose values another option lays out, which its user cannot give
    (the speedrun's --out lays out "tokenizer_path", "data_dir", ...). COMMANDS: the flags of pretrain, sft
    and rl; the speedrun's, whose runs go under --out and whose settings come from --preset:
    raychat.speedrun.speedrun_flags.
    """

    option: Callable[[str], str] = flag_name
    other_run: str = "another --run-name"
    same_settings: str = "the same settings"
    laid_out: frozenset[str] = frozenset()

    @property
    def resume_hint(self) -> str:
        """'(use <other_run>, or <same_settings> to resume)'."""
        return f"(use {self.other_run}, or {self.same_settings} to resume)"


COMMANDS = Flags()
# The options the lr schedule derives from: the horizon (a derived one divides by the total batch) and the
# schedule's own; then those an automatic total batch, and so a derived horizon, also derives from.
SCHEDULE_OPTIONS = (
    "num_iterations", "target_flops", "target_param_data_ratio", "total_batch_size", "warmup_ratio",
    "warmdown_ratio", "final_lr_frac",
)  # fmt: skip
BATCH_OPTIONS = ("num_workers", "min_workers", "device_batch_size")
# What else a resumed run may change that changes its updates: told in one line (settings_change), not refused.
UPDATE_OPTIONS = (
    "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "grad_clip", "ns_dtype",
    "total_batch_size", "fp8", "fp8_recipe", "compile",
)  # fmt: skip


def check_resume(
    cfg: TrainConfig,
    paths: RunPaths,
    plan: Plan,
    row_source: Callable[[], RowSource],
    flags: Flags = COMMANDS,
) -> None:
    """Check that the run's newest committed checkpoint, if there is one, is one this run can resume, before
    Ray starts (each worker would fail on it in turn, and the run retry until --max-failures): every file its
    commit marker lists is there with its size, it is of this stage, an SFT run's was made from this
    --init-from (the same checkpoint, as resolved), its model is plan.model_config, a pretraining run's rows are
    packed and masked as this run's (ROW_OPTIONS: --document-masking, --overflow, --buffer-size and, under split,
    --min-fragment) and its data state was made on this run's stream (the comparison each worker makes as it resumes:
    raychat.data.loader.row_source.resume_cursor, same_stream: for pretraining, the shards' names, layout, seed
    and content, their sha256 from the data manifest; for SFT, the mixture, row length and the sha256 of the
    tasks' files; a checkpoint written before the fingerprint held the content is compared without it);
    row_source() builds this run's row source (rank 0 of 1); every refusal names the options as `flags` does.
    When this run's lr schedule is not the checkpoint's (another horizon, given or derived, or other ratios),
    logs one line with the lr multiplier of the resume step under each (schedule_change), and one naming the
    other settings_change options, both only where steps are left to train.

    Raises:
        CheckpointError: a file of the checkpoint is missing or of another size (named).
        ConfigError: another stage, --init-from (SFT), model, packing (pretraining) or stream: one line naming each option that differs, with the
            checkpoint's value and this run's; or the shards of --data-dir that now hold other documents under
            the same names and layout (e.g. `raychat data prepare --seed 1` into the run's data directory),
            or the SFT tasks' files that now hold other content (a re-downloaded smoltalk, another word list);
            or another schedule that leaves no step to train after the checkpoint's, or that raises the lr
            after the checkpoint's warmdown began without --allow-rewarm; or a --stop-after at or before the
            checkpoint's step (nothing to train).
    """
    found = resumable_checkpoint(paths.checkpoints, cfg.run.run_name, cfg.run.stage, flags)
    if found is None:
        return
    newest, where, meta = found
    if cfg.run.stage == "sft":  # the same shape from another checkpoint: the run would go on from its own
        refuse_resume(where, changed_options(meta, cfg, ("init_from",), flags), flags)
    if meta["model_config"] != plan.model_config:
        options = ("init_from",) if cfg.run.init_from else SHAPE_OPTIONS
        changed = changed_options(meta, cfg, options, flags) or [
            (f"the model's {k}", v, plan.model_config.get(k))
            for k, v in meta["model_config"].items()
            if v != plan.model_config.get(k)
        ]
        refuse_resume(where, changed, flags)
    rows_made_by = [
        o for o in ROW_OPTIONS.get(cfg.run.stage, ()) if o != "min_fragment" or cfg.data.overflow == "split"
    ]
    refuse_resume(where, changed_options(meta, cfg, rows_made_by, flags), flags)
    schedule_line = schedule_change(meta, cfg, plan, where, flags)
    _check_stop_after(cfg.train.horizon.stop_after, meta["step"], plan.num_iterations, where, flags)
    rows = row_source()
    try:
        state = load_tree(io.BytesIO(read_bytes(paths.storage, f"{newest.path}/state_rank0.npz")))
    except FileNotFoundError:
        raise CheckpointError(
            f"{flags.option('run_name')} {cfg.run.run_name}: the run's checkpoint {where} holds no data state "
            f"(state_rank0.npz), so it cannot be resumed (use {flags.other_run})"
        ) from None
    made_on, now = state["rows"].get(rows.fingerprint_key), rows.fingerprint()
    if not same_stream(made_on, now):
        options = DATA_OPTIONS.get(cfg.run.stage, ())
        changed = changed_options(meta, cfg, [o for o in options if o not in PLACE_OPTIONS], flags)
        changed = changed or changed_options(meta, cfg, options, flags)
        if not changed and made_on is not None:
            _refuse_other_content(cfg, where, made_on, now, flags)
        refuse_resume(where, changed or [("the data", made_on, now)], flags)
    if meta["step"] >= plan.num_iterations:  # finished: no step takes the changes (run_training says so)
        return
    if schedule_line:
        log(schedule_line)
    settings_line = settings_change(meta, cfg, flags)
    if settings_line:
        log(settings_line)


def settings_change(meta: dict, cfg, flags: Flags = COMMANDS) -> str | None:
    """The line telling which of UPDATE_OPTIONS (learning rates, weight decay, clipping, the total batch, FP8,
    compile) that cfg (TrainConfig, RLConfig) has this run sets otherwise than the checkpoint (its meta.json's
    config) was made with, as `flags`
    names them, each with both values; None when none differs. A total batch that changed the horizon is in
    the schedule's line too (schedule_change)."""
    options = to_flat(cfg)  # RLConfig has the optimizer's options, not the batch's, FP8's or compile's
    changed = changed_options(meta, cfg, [o for o in UPDATE_OPTIONS if o in options], flags)
    if not changed:
        return None
    values = ", ".join(f"{name} {shown(was)} -> {shown(now)}" for name, was, now in changed)
    return f"settings changed on resume: {values} (from step {meta['step'] + 1} on; the steps before kept theirs)"


def _refuse_other_content(cfg: TrainConfig, where: str, made_on: dict, now: dict, flags: Flags) -> None:
    """Refuse a stream made with the checkpoint's options whose data changed under the same names: the shards of
    --data-dir (pretraining) or the files the --sft-tasks tasks read (SFT), each named (at most 3).

    Raises ConfigError naming the flag and the changed shards or files."""
    sft = cfg.run.stage == "sft"
    changed = changed_task_files(made_on, now) if sft else changed_shards(made_on, now)
    if not changed:
        return
    names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    holds = "holds" if len(changed) == 1 else "hold"
    if sft:
        flag = flags.option(
            "sft_data" if all(c.startswith(f"task {SFT_DATA}'s ") for c in changed) else "sft_tasks"
        )
        raise ConfigError(
            f"{flag}: {names} now {holds} other content than when the run's checkpoint "
            f"{where} was made (another sha256): the run would go on with other conversations (use "
            f"{flags.other_run}, or restore the task data the run was made on)"
        )
    raise ConfigError(
        f"{flags.option('data_dir')}: {names} of {cfg.data.data_dir} now {holds} other documents than when the "
        f"run's checkpoint {where} was made (same names and layout, another sha256) (use {flags.other_run}, or "
        "restore the data the run was made on)"
    )


def _check_stop_after(stop_after: int, step: int, num_iterations: int, where: str, flags: Flags) -> None:
    """Refuse a --stop-after at or before the resume step `step` (the checkpoint's at `where`): the run would
    train nothing and end as if it had stopped there.

    Raises ConfigError naming --stop-after (as `flags` does), the resume step and the values allowed."""
    if stop_after == -1 or stop_after > step:
        return
    name = flags.option("stop_after")
    allowed = (
        f"a step in {step + 1}..{num_iterations}, or -1 (run to the end)"
        if step < num_iterations
        else f"none, the run has trained all {plural(num_iterations, 'step')} (leave {name} out)"
    )
    resumes = (
        f"the run resumes from its checkpoint {where} (step {step}) and goes on at step {step + 1}"
        if step < num_iterations
        else f"the run's checkpoint {where} is at step {step}, its last"
    )
    raise ConfigError(
        f"{name} {stop_after}: {resumes}, so it would stop before training a step; allowed: {allowed}"
    )


def resumable_checkpoint(checkpoints: CheckpointManager, run_name: str, stage: str, flags: Flags = COMMANDS):
    """(the Checkpoint, its URI, its meta) of the newest committed checkpoint of the run `checkpoints` manages,
    checked to be one a `stage` run can resume: every file its commit marker lists is there with its size and
    it is of `stage`; None when the run has none. Errors name the options as `flags` does.

    Raises:
        CheckpointError: a file of the checkpoint is missing or of another size (named).
        ConfigError: the checkpoint is of another stage (one line naming --run-name and both stages).
        ValueError: the storage root cannot be read (naming --storage-path and why: raychat.storage.why).
    """
    storage = checkpoints.storage
    try:
        newest = checkpoints.newest()
    except OSError as e:
        raise ValueError(
            f"{flags.option('storage_path')}: cannot read {storage.uri}: {why(e, storage)}"
        ) from e
    if newest is None:
        return None
    where = storage.uri_of(newest.path)
    try:
        verify_stored(storage, newest.path)
    except CheckpointError as e:
        raise CheckpointError(
            f"{flags.option('run_name')} {run_name}: {e}: this run would resume from it (remove that checkpoint to "
            f"resume from the one before, or use {flags.other_run})"
        ) from None
    meta = json.loads(read_bytes(storage, f"{newest.path}/meta.json"))
    if meta.get("stage") != stage:
        raise ConfigError(
            f"{flags.option('run_name')}: the run's checkpoint {where} is a {meta.get('stage')} checkpoint, this "
            f"run is {stage} (use {flags.other_run})"
        )
    return newest, where, meta


def schedule_change(meta: dict, cfg: TrainConfig, plan: Plan, where: str, flags: Flags) -> str | None:
    """The line telling how the lr of the first step this run trains (the checkpoint's step s done: step s + 1
    as the step lines count, from 1) changes when this run's schedule (plan.num_iterations, cfg's lr schedule)
    is not the checkpoint's (its meta's plan and config); None when it is the same, or the checkpoint holds no
    plan. Its steps count from 1, as the step lines and the plan do. The options are named as `flags` does.

    Raises:
        ConfigError: the horizon changed to s steps or fewer (nothing to train); or s is in the checkpoint's
            warmdown and this run's schedule would take the lr above its value there, without --allow-rewarm.
    """
    step, was_steps = meta["step"], meta.get("plan", {}).get("num_iterations")
    now = cfg.train.lr_schedule
    try:
        was = from_dict(TrainConfig, meta["config"]).train.lr_schedule
    except (KeyError, TypeError, ValueError):
        was = now
    ratios = ("warmup_ratio", "warmdown_ratio", "final_lr_frac")
    old = (was_steps, *(getattr(was, r) for r in ratios))
    new = (plan.num_iterations, *(getattr(now, r) for r in ratios))
    if was_steps is None or old == new:
        return None
    changed = (
        changed_options(meta, cfg, SCHEDULE_OPTIONS, flags)
        or changed_options(meta, cfg, BATCH_OPTIONS, flags)
        or [("the horizon", was_steps, plan.num_iterations)]
    )
    names, made_with, asks_for = _values(changed)
    what = f"{names}: the run's checkpoint {where} (step {step}) was made with {made_with}, this run asks for {asks_for}"
    if plan.num_iterations <= step and plan.num_iterations != was_steps:
        raise ConfigError(
            f"{what}: {plural(plan.num_iterations, 'step')} instead of {was_steps} leave nothing to train after "
            f"step {step} (ask for more than {plural(step, 'step')}, or use {flags.other_run})"
        )
    lr_was, lr_now = lr_multiplier(step, *old), lr_multiplier(step, *new)
    began, peak = warmdown_start(was_steps, was.warmdown_ratio), lr_peak_from(step, *new)
    if step >= began and peak > lr_was and not now.allow_rewarm:
        raise ConfigError(
            f"{what}: its lr warmdown began at step {began + 1} and is at multiplier {lr_was:.4g}; this run's "
            f"schedule would raise it to {peak:.4g} ({flags.option('allow_rewarm')} to re-warm on purpose, or the "
            "checkpoint's settings to finish the warmdown)"
        )
    starts = f"{began + 1} -> {warmdown_start(plan.num_iterations, now.warmdown_ratio) + 1}"
    return (
        f"lr schedule changed on resume ({names}: {made_with} -> {asks_for}): {was_steps} -> "
        f"{plan.num_iterations} steps, warmdown from step {starts}; lr multiplier of step {step + 1} (the first "
        f"this run trains): {lr_was:.4g} -> {lr_now:.4g}"
    )


def changed_options(meta: dict, cfg, options, flags: Flags) -> list[tuple[str, object, object]]:
    """(its name as `flags` gives it, the checkpoint's value, this run's) of each of `options` whose value differs
    from the config
    (of cfg's class: TrainConfig, RLConfig) a checkpoint's meta.json holds; none when that config is absent or
    unreadable."""
    try:
        was = to_flat(from_dict(type(cfg), meta["config"]))
    except (KeyError, TypeError, ValueError):
        return []
    now = to_flat(cfg)
    return [(flags.option(o), was[o], now[o]) for o in options if was[o] != now[o]]


def _values(changed: list[tuple[str, object, object]]) -> tuple[str, str, str]:
    """(the names, the checkpoint's values, this run's) of changed_options's list, each joined by ", "."""
    names = ", ".join(name for name, _, _ in changed)
    was, now = (", ".join(shown(c[i]) for c in changed) for i in (1, 2))
    return names, was, now


def refuse_resume(where: str, changed: list[tuple[str, object, object]], flags: Flags) -> None:
    """Raise ConfigError naming each option of `changed` (none: return) with both values and `flags`' resume
    hint."""
    if not changed:
        return
    names, was, now = _values(changed)
    raise ConfigError(
        f"{names}: the run's checkpoint {where} was made with {was}, this run asks for {now} {flags.resume_hint}"
    )


@dataclass(frozen=True)
class TrainingResult:
    """What a training run left: its newest committed checkpoint (a local path or URI; None when nothing was
    committed) and that checkpoint's metrics (the step's stats and evaluations)."""

    checkpoint: str | None
    metrics: dict


def run_training(
    cfg: TrainConfig,
    spec,
    callbacks=(),
    dry_run: bool = False,
    flags: Flags = COMMANDS,
    data_lines: Sequence[str] = (),
) -> TrainingResult | None:
    """Run (or resume) training of `spec` on the current Ray cluster; returns its TrainingResult.

    callbacks: raychat.train.trainer.Callback objects every worker runs (pickled to the workers).
    dry_run: make every check before Ray, print the plan and return None (nothing started or written).
    flags: how the refusals and the finished line name the options (Flags; the speedrun's name its own).
    data_lines: the stage's lines of the plan, after its horizon (raychat.train.plan.print_plan).
    A run whose checkpoint is at its last step logs one line saying so and returns its result without starting
    Ray (finished_result). Any other run trains under the run's lease (raychat.lease: <run>/lease.json, from
    before Ray starts until it returns or raises).
    Raises ValueError (before Ray starts) for a reference that names nothing, a root that is not writable, an
    --init-from trained with another tokenizer (check_tokenizer), a run directory whose newest checkpoint this
    run cannot resume (check_resume), or a run another live driver trains (raychat.lease.LeaseHeld); LeaseLost
    (a ValueError) when another start took the lease over while this run was not renewing it; RunGaveUp
    (raychat.log), one line naming the run and the checkpoint a new start resumes from, when the worker group
    failed once more than --max-failures allows (Ray Train restarts it from the newest committed checkpoint until
    then: gave_up, the failure logged in full above it), when Ray Train's controller failed (not retried:
    controller_gave_up, logged in full above it too), or when a step's loss or gradient norm was not finite
    (not retried: stopped_on_fault, its __cause__ the NonFiniteError).
    """
    paths = resolve_paths(cfg, writable=False)
    cfg = paths.config(cfg)
    tokenizer = Tokenizer.load(paths.tokenizer_path)
    check_tokenizer(paths, tokenizer)
    plan = make_plan(cfg, tokenizer.vocab_size)
    check_resume(cfg, paths, plan, lambda: spec.row_source(cfg, tokenizer, 0, 1), flags=flags)
    if dry_run:
        print_plan(cfg, plan, flags.option, data_lines)
        return None
    if (done := finished_result(paths, plan.num_iterations)) is not None:
        log(finished_line(done.checkpoint, plan.num_iterations, flags.option("num_iterations")))
        return done
    check_writable(paths.storage)  # creates the root: only once the inputs are known to be good
    with RunLease(paths.storage, paths.checkpoints.run_path, other_run=flags.other_run):
        return _train(cfg, spec, callbacks, paths, plan, flags, data_lines)


def _train(
    cfg: TrainConfig,
    spec,
    callbacks,
    paths: RunPaths,
    plan: Plan,
    flags: Flags,
    data_lines: Sequence[str] = (),
) -> TrainingResult:
    """run_training's part after the checks, under the run's lease: the plan printed, Ray Train run; its
    layout and placement refusals name the options as `flags` does. A worker group failure past --max-failures
    (gave_up), a controller failure (controller_gave_up) and a non-finite step (stopped_on_fault) are raised as
    RunGaveUp, the local Ray cluster this run started stopped first (_stop_own_cluster); Ctrl-C as
    KeyboardInterrupt of one line (interrupted: the checkpoint a new start resumes from), which Ray Train ended
    in a bare SystemExit(1): no line, exit status 1; SIGTERM once Ray is up as Ctrl-C (raychat.sigterm:
    SigtermAsSigint: Ray Train's controller stops the worker group), raised as Terminated of that line, where
    Ray's native handler aborted the driver (exit status -6) with the workers still training; SIGTERM while Ray
    starts (under raychat.sigterm.terminating: raychat.cli) as Terminated of that line too, once ray.init returned
    and the local Ray it started is shut down (it ended in exit status 15 with no line, was lost while the run
    trained on, or met Ray's native handler), and Ctrl-C then as KeyboardInterrupt of that line (a bare
    "interrupted" before). data_lines: as run_training's."""
    print_plan(cfg, plan, flags.option, data_lines)
    mark("plan_printed")
    c = cfg.layout
    started = not ray.is_initialized()
    run, stop_after = f"{cfg.run.stage} run {cfg.run.run_name!r}", cfg.train.horizon.stop_after
    try:
        line, capacity = start_or_connect(
            c.num_workers, c.cpus_per_worker, spec.data_cpus, c.use_gpu, flags.option
        )
    except (Terminated, KeyboardInterrupt) as e:  # SIGTERM, Ctrl-C while Ray started (init_keeping_handler)
        _stop_own_cluster(started)
        raise type(e)(interrupted(run, paths.checkpoints, plan.num_iterations, stop_after, flags)) from None
    mark("ray_connected")
    with SigtermAsSigint() as sigterm:  # after ray.init: Ray's native SIGTERM handler aborted the process
        log(line)
        accum = elastic_grad_accum(cfg, plan.total_batch_size)
        if len(accum) > 1:
            log(
                "elastic: "
                + ", ".join(
                    f"{plural(w, 'worker')} x {plural(k, 'accumulation step')}" for w, k in accum.items()
                )
            )
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "train": to_dict(cfg),
                "plan": plan.to_dict(),
                "checkpoints": paths.checkpoints,
                "spec": spec,
                "callbacks": list(callbacks),
                "progress_bar": sys.stdout.isatty(),
            },
            scaling_config=scaling_config(cfg),
            torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
            run_config=RunConfig(
                name=cfg.run.run_name,
                **paths.storage.ray_train_storage(),
                failure_config=failure_config(c),
            ),
        )
        try:
            fitted = fit(trainer, cfg, capacity, flags)
        except (SystemExit, Terminated):  # Ray Train's SIGINT handler aborted the run (Ctrl-C or SIGTERM)
            _stop_own_cluster(started)
            stopped = Terminated if sigterm.received else KeyboardInterrupt
            raise stopped(
                interrupted(run, paths.checkpoints, plan.num_iterations, stop_after, flags)
            ) from None
        except WorkerGroupError as e:  # Ray Train retried --max-failures times (failure_config)
            failed, error = failed_worker(e)
            _stop_own_cluster(started)
            checkpoint = newest_uri(paths.checkpoints)
            raise gave_up(run, failed, error, c.max_failures + 1, c.max_failures, flags, checkpoint, e) from e
        except ControllerError as e:  # the controller's own failure (fit raised a placement timeout's line)
            _stop_own_cluster(started)
            retries = placement_attempts(c)[1]
            raise controller_gave_up(run, e, retries, newest_uri(paths.checkpoints)) from e
    fault = getattr(fitted, "return_value", None)  # rank 0's NonFiniteError, returned
    uri = newest_uri(paths.checkpoints)
    if isinstance(fault, NonFiniteError):
        _stop_own_cluster(started)
        raise stopped_on_fault(run, fault, cfg.optim, uri, flags) from fault
    newest = paths.checkpoints.newest()
    meta = json.loads(read_bytes(paths.storage, f"{newest.path}/meta.json")) if newest else {}
    result = TrainingResult(uri, meta.get("metrics", {}))
    log(f"final checkpoint: {uri}")
    log(f"final metrics: {json.dumps({k: v for k, v in result.metrics.items() if k != 'samples'})}")
    try:
        logged = read_logged(paths.storage, f"{paths.checkpoints.run_path}/metrics.jsonl")
    except OSError:  # the curve is in the metrics sink's file only: no line, the run itself is done
        logged = []
    kept = {c.step: paths.checkpoints.uri(c.step) for c in paths.checkpoints.committed()}
    if line := held_out_line(logged, kept, flags):
        log(line)
    if newest and (
        line := stopped_early_line(newest.step, plan.num_iterations, cfg.train.horizon.stop_after, flags)
    ):
        log(line)
    return result


def held_out_line(logged: list[dict], kept: dict[int, str], flags: Flags = COMMANDS) -> str | None:
    """The line after a run's final metrics that names the step of its best held-out BPB: "held-out BPB: <key>
    best B at step S, E at the end (step L); ..." for each "*val_bpb" of `logged` (the run's metrics.jsonl
    rows, oldest first) measured at two steps or more ("val_bpb" left out when it is one task's alone: the
    same numbers), then, when one rose after its best step, what that means and where that step's weights
    are: the checkpoint of `kept` (step -> uri: the run's committed checkpoints) that holds it, or that none
    does (--checkpoint-every and --keep-checkpoints named as `flags` names them). None: no BPB measured twice.
    """
    keys = list(dict.fromkeys(k for row in logged for k in row if k.endswith("val_bpb")))
    if len(keys) == 2 and "val_bpb" in keys:
        keys.remove("val_bpb")
    parts, rose = [], []
    for key in keys:
        curve = [(row["step"], row[key]) for row in logged if row.get(key) is not None and "step" in row]
        if len(curve) < 2:
            continue
        best_step, best = min(curve, key=lambda c: (c[1], -c[0]))  # of equal values the latest: nothing rose
        last_step, last = curve[-1]
        if best_step == last_step:
            parts.append(f"{key} best {best:.4f} at the end (step {last_step})")
            continue
        parts.append(f"{key} best {best:.4f} at step {best_step}, {last:.4f} at the end (step {last_step})")
        rose.append((key, best_step))
    if not parts:
        return None
    line = "held-out BPB: " + "; ".join(parts)
    if not rose:
        return line
    key, step = next((r for r in rose if r[0] == "val_bpb"), rose[0])
    where = (
        f"checkpoint {kept[step]} holds step {step}"
        if step in kept
        else f"no checkpoint of step {step} is kept ({flags.option('checkpoint_every')}, "
        f"{flags.option('keep_checkpoints')})"
    )
    return (
        f"{line}: {key} rose after step {step} while training went on: the model learned its training data "
        f"rather than what carries over to held-out data (overfitting: fewer steps or more data); {where}"
    )


def stopped_early_line(
    step: int, num_iterations: int, stop_after: int, flags: Flags = COMMANDS
) -> str | None:
    """The last line of a run that --stop-after ended at `step` before its last step (`num_iterations`): that it
    is not finished and how to go on (the options named as `flags` does); None for a run that reached its end."""
    if stop_after == -1 or step >= num_iterations:
        return None
    name = flags.option("stop_after")
    return (
        f"stopped at step {step} of {num_iterations} ({name} {stop_after}): the run is not finished; the same "
        f"command without {name} (or with a later one) resumes it to step {num_iterations}"
    )


def _stop_own_cluster(started: bool) -> None:
    """Shut down the local Ray cluster this run started (`started`) before its last line: Ray forwards its
    workers' log lines for seconds after, which would follow the line the run ends with."""
    if started:
        ray.shutdown()


def newest_uri(checkpoints: CheckpointManager) -> str | None:
    """The URI of the run's newest committed checkpoint (None: none was committed)."""
    newest = checkpoints.newest()
    return checkpoints.storage.uri_of(newest.path) if newest else None


def failed_worker(error: WorkerGroupError) -> tuple[str, BaseException]:
    """(what failed, its error) of a worker group failure: a worker whose process was lost (Ray Train's health
    check of it failed: a kill, a lost node; its error is the health check's, e.g. ActorDiedError) before one
    whose training function raised (as a lost rank's DDP peers do), the lowest rank first."""
    failures = error.worker_failures
    lost = {r: e.health_check_failure for r, e in failures.items() if hasattr(e, "health_check_failure")}
    if lost:
        return f"worker rank {min(lost)} was lost", lost[min(lost)]
    if failures:
        return f"worker rank {min(failures)} failed", failures[min(failures)]
    return "the worker group failed", error


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (Ray's errors carry a long traceback or actor description)."""
    return (str(error).strip().splitlines() or [""])[0]


def error_line(error: BaseException) -> str:
    """An exception in one line, as the runs' last lines name it: its type and first_line ("ActorDiedError:
    The actor died unexpectedly before finishing this task.")."""
    return f"{type(error).__name__}: {first_line(error)}"


def gave_up(
    run: str,
    failed: str,
    error: BaseException,
    failures: int,
    allowed: int,
    flags: Flags,
    checkpoint: str | None,
    full: BaseException | None = None,
    log: Callable[[str], None] = log,
) -> RunGaveUp:
    """Log `full` (default `error`: what ended the run, with every rank's or the actor's traceback) in full
    through `log`, then return the RunGaveUp to raise, of one line: `run` ("rl run 't'") gave up, `failed`
    ("worker rank 1 was lost"), `error`'s type and first line, failure `failures` where --max-failures (as
    `flags` names it) allows `allowed`, and the newest committed `checkpoint` the run resumes from when started
    again (None: it starts over)."""
    log_in_full(run, error if full is None else full, log)
    option = flags.option("max_failures")
    return RunGaveUp(
        f"{run} gave up: {failed} ({error_line(error)}), failure {failures} where "
        f"{option} {allowed} allows {plural(allowed, 'failure')}; started again (a higher {option} survives more), "
        f"{resumes(checkpoint)}"
    )


def log_in_full(run: str, full: BaseException | str, log: Callable[[str], None] = log) -> None:
    """Log what ended `run` in full, above the one line it ends in: an error as "<type>: <message>" (a Ray error's
    message holds the worker's or actor's traceback), or a traceback's text as it is."""
    text = full if isinstance(full, str) else f"{type(full).__name__}: {full}"
    log(f"{run}: the failure that ended it, in full:\n{text}")


def interrupted(
    run: str,
    checkpoints: CheckpointManager,
    num_iterations: int,
    stop_after: int = -1,
    flags: Flags = COMMANDS,
) -> str:
    """The line of a run (`run`: "pretrain run 'r'") stopped by Ctrl-C or SIGTERM, and what starting it again
    does: resume from the newest committed checkpoint of `checkpoints`; or, where that checkpoint is at the
    last step (`num_iterations`), or at the --stop-after step (-1: none) that ended the run, what is left of
    it (a run trains on for a few steps while Ray Train stops it: a short one can reach its end). The options
    are named as `flags` does."""
    newest = checkpoints.newest()
    checkpoint = checkpoints.storage.uri_of(newest.path) if newest else None
    if newest and newest.step >= num_iterations:
        return (
            f"{run} was stopped after its last step: its checkpoint {checkpoint} is at step {newest.step} of "
            f"{num_iterations}, so the run is finished (started again, it has no step left to train)"
        )
    if newest and stop_after != -1 and newest.step >= stop_after:
        done = stopped_early_line(newest.step, num_iterations, stop_after, flags)
        return f"{run} was stopped after its checkpoint {checkpoint}: {done}"
    return f"{run} stopped before its last step; the same command starts it again: {resumes(checkpoint)}"


def resumes(checkpoint: str | None) -> str:
    """What a run does when started again: resume from its newest committed `checkpoint`, or (None) start over."""
    if checkpoint:
        return f"it resumes from its newest committed checkpoint {checkpoint}"
    return "it starts over (no checkpoint was committed)"


# The learning rates of the optimizers (OptimSection, of TrainConfig and RLConfig alike).
LR_OPTIONS = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr")


def stopped_on_fault(
    run: str, fault: NonFiniteError, optim, checkpoint: str | None, flags: Flags
) -> RunGaveUp:
    """The RunGaveUp of a run (`run`: "sft run 's'") that stopped on `fault`, a non-finite loss or gradient norm
    (never retried: the same step would meet it again), in one line: the step, what was non-finite, the
    learning rates to lower (`optim`: the run's OptimSection, each named as `flags` does; a resume may change
    them) and the newest committed `checkpoint` a new start resumes from (the last good one; None: it starts
    over)."""
    lrs = ", ".join(f"{flags.option(k)} {shown(getattr(optim, k))}" for k in LR_OPTIONS)
    return RunGaveUp(
        f"{run} stopped at step {fault.step}: its {fault.what} was {fault.value}, so that update was skipped and "
        f"the run not retried (the same step would fail again); lower the learning rates (now {lrs}) and start "
        f"it again: {resumes(checkpoint)}"
    )


def stopped_on_error(
    run: str,
    step: int,
    failed: str,
    error: BaseException,
    why: str,
    fix: str,
    checkpoint: str | None,
    full: BaseException | str | None = None,
    log: Callable[[str], None] = log,
) -> RunGaveUp:
    """Log `full` (default `error`: the Ray error with the actor's traceback, or a traceback's text) in full
    through `log`, then return the RunGaveUp of a run that stopped on an error it does not retry (the same
    inputs would raise it again), of one line: `run` stopped at `step`, `failed` ("rollout actor 1 raised in its
    rollout of prompts [3, 7]"), `error`'s type and first line, not retried (`why`), `fix` (what to do first)
    and the newest committed `checkpoint` a new start resumes from (None: it starts over)."""
    log_in_full(run, error if full is None else full, log)
    return RunGaveUp(
        f"{run} stopped at step {step}: {failed} ({error_line(error)}), not retried "
        f"({why}); {fix} and start it again: {resumes(checkpoint)}"
    )


def controller_gave_up(
    run: str,
    error: ControllerError,
    retries: int,
    checkpoint: str | None,
    log: Callable[[str], None] = log,
) -> RunGaveUp:
    """Log `error` (Ray Train's ControllerError: the controller's own failure, not a worker's) in full through
    `log`, then return the RunGaveUp of one line: `run` gave up, the controller's own error (its type
    and first line), retried `retries` times (failure_config: 0 for a fixed-size run, whose controller
    failures --max-failures does not count) and the newest committed `checkpoint` a new start resumes from."""
    log_in_full(run, error, log)
    cause = error.controller_failure
    retried = f"retried {plural(retries, 'time')}" if retries else "not retried"
    return RunGaveUp(
        f"{run} gave up: Ray Train's controller failed ({error_line(cause)}), "
        f"{retried}; started again, {resumes(checkpoint)}"
    )


def finished_line(checkpoint: str, steps: int, horizon: str) -> str:
    """The line of a run whose `checkpoint` is at its last step, `steps`; `horizon` names the option that trains
    it longer (pretrain's and sft's --num-iterations, rl's --steps, as Flags name them)."""
    return (
        f"finished: the run's checkpoint {checkpoint} is at step {steps}, the last of its {plural(steps, 'step')}; "
        f"nothing to train ({horizon} above {steps} trains it longer)"
    )


def finished_result(paths: RunPaths, num_iterations: int) -> TrainingResult | None:
    """The TrainingResult of a run whose newest committed checkpoint is at its last step, num_iterations
    (check_resume found it to be one this run resumes): there is nothing to train, so no Ray to start; None when
    the run has no checkpoint or steps left."""
    newest = paths.checkpoints.newest()
    if newest is None or newest.step != num_iterations:
        return None
    meta = json.loads(read_bytes(paths.storage, f"{newest.path}/meta.json"))
    return TrainingResult(paths.storage.uri_of(newest.path), meta.get("metrics", {}))


def placement_attempts(layout) -> tuple[float, int]:
    """(seconds one placement attempt of the worker group waits, controller failures allowed after it):
    a fixed-size run waits --schedule-timeout-s once and a timeout ends it; an elastic run (--min-workers)
    waits ELASTIC_ATTEMPT_S at a time, so that after a lost node its next attempt can take the workers there
    are, and gives up after about --schedule-timeout-s in all: ceil(timeout / attempt) attempts."""
    timeout = layout.schedule_timeout_s
    if not layout.min_workers:
        return timeout, 0
    attempt = min(timeout, ELASTIC_ATTEMPT_S)
    return attempt, math.ceil(timeout / attempt) - 1


def failure_config(layout) -> FailureConfig:
    """Ray Train's failure budget, every limit explicit (Ray's controller limit defaults to -1, retry forever):
    --max-failures worker-group failures (an application error, a lost node) are retried from the last
    checkpoint; controller failures (the worker group not placed in time: Ray Train's
    WorkerGroupStartupTimeoutError) are retried only as placement_attempts allows, so a request that cannot be
    scheduled ends the run within about --schedule-timeout-s."""
    _, retries = placement_attempts(layout)
    return FailureConfig(max_failures=layout.max_failures, controller_failure_limit=retries)


def fit(trainer: TorchTrainer, cfg: TrainConfig, capacity: Capacity, flags: Flags = COMMANDS):
    """trainer.fit() with the placement bounded by --schedule-timeout-s (Ray Train's worker group start timeout,
    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, which Ray Train passes from this process to its controller), the
    workers polled every HEALTH_CHECK_INTERVAL_S (unless RAY_TRAIN_HEALTH_CHECK_INTERVAL_S is set) and,
    while the group waits for nodes, a line every few seconds saying what it waits for and for how long.

    Raises:
        ValueError: the worker group was not placed in time: one line naming the options as `flags` does and
            the missing resource (raychat.capacity.missing_resources), or the GPU workers could not use CUDA.
        ray.train.TrainingFailedError: any other failure, once the budget of failure_config is spent (a
            WorkerGroupError: past --max-failures; a ControllerError: retried as placement_attempts allows;
            _train raises either as RunGaveUp).
    """
    c = cfg.layout
    os.environ[WORKER_GROUP_START_TIMEOUT_ENV] = f"{placement_attempts(c)[0]:g}"
    os.environ.setdefault(HEALTH_CHECK_INTERVAL_ENV, f"{HEALTH_CHECK_INTERVAL_S:g}")
    # Ray Data's detached stats actor lives on the node of whoever first runs a dataset and never ends: made
    # here, it is on the driver's node, not on a worker node the autoscaler must be able to remove when idle
    # (tests/cluster/test_autoscaling.py saw a worker node kept forever by it).
    get_or_create_stats_actor()
    bundle = worker_bundle(c.cpus_per_worker, c.use_gpu)
    what = f"{plural(c.num_workers, 'worker')} x {', '.join(f'{k} {v:g}' for k, v in bundle.items())}"
    reporter = WaitReporter(what, placement_state).start()
    try:
        mark("fit_called")
        result = trainer.fit()
        mark("fit_returned")
        return result
    except TrainingFailedError as e:
        text = str(e)
        if "WorkerGroupStartupTimeoutError" in text or "worker group startup timed out" in text:
            missing = missing_resources(bundle, read_capacity()) or "room on the nodes that are up"
            raise ValueError(
                f"{layout_flags(c.num_workers, c.cpus_per_worker, c.use_gpu, flags.option)} ({_describe(bundle)} "
                f"each): not placed within {flags.option('schedule_timeout_s')} {c.schedule_timeout_s:g}; "
                f"missing: {missing}"
            ) from None
        if c.use_gpu and ("CUDA" in text or "NCCL" in text or "nccl" in text):
            raise ValueError(
                f"{flags.option('use_gpu')}: the workers were placed on GPU nodes but CUDA is not usable there: "
                f"{_cuda_line(text)}"
            ) from None
        raise
    finally:
        reporter.stop()


def _describe(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"


def _cuda_line(text: str) -> str:
    """The first line of a worker's error that names CUDA or NCCL (the error itself, not the traceback)."""
    lines = [ln.strip() for ln in text.splitlines() if "CUDA" in ln or "NCCL" in ln or "nccl" in ln]
    return next((ln for ln in lines if "Error" in ln), lines[0] if lines else text.splitlines()[-1])


def config_from(args: argparse.Namespace, defaults: TrainConfig, section: str) -> TrainConfig:
    """The command's TrainConfig: flags > the preset's `section` layers (train; train + sft for SFT) >
    `defaults`."""
    return from_args(args, TrainConfig, section, base=defaults, where=f"{section} settings")

"""Sections of the pretraining / SFT configuration (`raychat pretrain`, `raychat sft`) and TrainConfig.

TrainConfig: run / model / optim / data / layout / train (batch, horizon, lr_schedule, eval, checkpoint,
logging). Every leaf is a --flag of its flat name (raychat.config.schema); presets set the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raychat.config.schema import (
    SEED_MAX,
    ConfigError,
    Section,
    flag_name,
    option,
    owned_choices,
    parse_task_spec,
    section,
    shown,
)

STAGES = ("pretrain", "sft", "rl")
# How long a request may wait for the cluster to hold it (a cold GPU node of a cloud autoscaler: minutes;
# docs/deployment.md) before the run ends FAILED: --schedule-timeout-s of training, RL and serving.
SCHEDULE_TIMEOUT_S = 600.0


@dataclass
class RunSection(Section):
    """What run this is, where it writes, where it starts from."""

    run_name: str = option(
        "pretrain", "run name; running again with the same name and storage resumes", kind="run_name"
    )
    storage_path: str = option("runs/checkpoints", "where checkpoints go (local dir, NFS, s3://, gs://)")
    stage: str = option("pretrain", "what the run trains (set by the command)", STAGES, flag=False)
    init_from: str = option(
        "", "checkpoint to start from (SFT, required: a pretraining one, or named explicitly, one of any stage to "
        "fine-tune further; RL, required: an SFT one, or named explicitly, one of any stage, e.g. a pretraining one "
        "for RL from a base model): a checkpoint dir, a run dir, <run dir>/latest, a run name under "
        "--storage-path, or latest (the newest checkpoint of the stage before there); its stage and step are "
        "printed first", kind="reference",
    )  # fmt: skip
    seed: int = option(0, "seed for init, data order and sampling", ge=0, le=SEED_MAX)
    tracker: str = option(
        "none",
        "also log every step to TensorBoard event files or W&B (offline)",
        owned_choices("raychat.metrics_sink", "TRACKERS"),
    )


@dataclass
class ModelSection(Section):
    """The model's shape (one knob, depth, derives the rest) and how it runs."""

    depth: int = option(4, "transformer layers; width, heads and horizon derive from it", positive=True)
    aspect_ratio: int = option(
        64, "width = depth * aspect_ratio, rounded up to a multiple of head_dim", positive=True
    )
    head_dim: int = option(64, "attention head dimension", positive=True)
    kv_group: int = option(1, "query heads per KV head (GQA when > 1)", positive=True)
    seq_len: int = option(
        256, "T: tokens per row seen by the model (rows hold T+1 for the label shift)", positive=True
    )
    document_masking: bool = option(False, "attend only within a document; positions restart per document")
    fp8: bool = option(False, "FP8 Linear layers through torchao (GPU; emulated on CPU)")
    fp8_recipe: str = option(
        "tensorwise", "torchao float8 recipe", owned_choices("raychat.train.fp8", "FP8_RECIPES")
    )
    compile: bool = option(False, "torch.compile the model")

    def __post_init__(self):
        """Raises ConfigError: an odd --head-dim, or a --kv-group that does not divide the query heads (the
        checks of raychat.model.ModelConfig.from_depth, here so that a submitted stage is refused before it is
        submitted; an --init-from run's shape is its checkpoint's, checked against these by the run)."""
        super().__post_init__()
        if self.head_dim % 2:
            raise ConfigError(
                f"--head-dim must be even (RoPE rotates pairs of dimensions), got {self.head_dim}"
            )
        depth, ratio, head_dim, group = self.depth, self.aspect_ratio, self.head_dim, self.kv_group
        width = math.ceil(depth * ratio / head_dim) * head_dim  # as ModelConfig.from_depth
        heads = width // head_dim
        if heads % group:
            allowed = ", ".join(str(g) for g in range(1, heads + 1) if heads % g == 0)
            raise ConfigError(
                f"{flag_name('kv_group')} {group} does not divide the {heads} query heads (width {width}: "
                f"{flag_name('depth')} {depth} x {flag_name('aspect_ratio')} {ratio} = {depth * ratio} rounded up "
                f"to a multiple of {flag_name('head_dim')} {head_dim}; {width} / {head_dim} = {heads}); allowed: "
                f"{allowed}"
            )


@dataclass
class OptimSection(Section):
    """Muon for hidden matrices, AdamW for the rest (raychat.train.optim.build_optimizers), and clipping."""

    matrix_lr: float = option(0.02, "Muon learning rate for hidden weight matrices", ge=0)
    embedding_lr: float = option(
        0.2, "AdamW learning rate for the token embedding, x (width / 768) ** -0.5 (nanochat's scaling, as the "
        "other AdamW lrs; the plan prints the result)", ge=0,
    )  # fmt: skip
    unembedding_lr: float = option(0.004, "AdamW learning rate for lm_head, x (width / 768) ** -0.5", ge=0)
    scalar_lr: float = option(0.02, "AdamW learning rate for norm weights, x (width / 768) ** -0.5", ge=0)
    weight_decay: float = option(0.0, "Muon weight decay (of the hidden matrices; AdamW's is 0)", ge=0)
    grad_clip: float = option(1.0, "clip the global grad norm to this (0 = off)", ge=0)
    ns_dtype: str = option(
        "auto",
        "dtype of Muon's Newton-Schulz iteration; auto = bfloat16 where the device has native bf16 matmul "
        "(CUDA compute capability >= 8.0, CPUs with AVX512-BF16), else float32 (printed with the plan)",
        owned_choices("raychat.train.muon", "NS_DTYPES"),
    )


@dataclass
class DataSection(Section):
    """Where the rows come from."""

    data_dir: str = option(
        "runs/data", "parquet shards + manifest from `raychat data prepare`: a directory or a run name under "
        "--storage-path (given --storage-path and not this: the run 'data' there)",
    )  # fmt: skip
    tokenizer_path: str = option(
        "runs/tokenizer", "directory holding tokenizer.json, or a run name under --storage-path (given "
        "--storage-path and not this: the run 'tokenizer' there)",
    )  # fmt: skip
    buffer_size: int = option(256, "documents buffered by the best-fit packer", positive=True)
    overflow: str = option(
        "crop", "pretraining packer, a document that fits nowhere: crop (discard its tail, nanochat) or split "
        "(its tail goes back into the buffer as a new BOS-prefixed document)", owned_choices("raychat.data.loader.packing", "OVERFLOW_POLICIES"),
    )  # fmt: skip
    min_fragment: int = option(
        32, "split: a tail shorter than this many tokens is dropped (and counted)", positive=True
    )
    sft_tasks: str = option(
        "calculator:4000,chatterbot,spelling:2000",
        "SFT mixture: task[:examples],... (examples >= 1) of "
        + ", ".join(owned_choices("raychat.tasks.registry", "TASK_NAMES"))
        + " (humaneval: eval only); '' = none, with --sft-data (your own conversations)",
        blank_ok=True,  # parse_task_spec names what a blank mixture lacks
    )
    sft_data: str = option(
        "", "your own conversations: PATH[,PATH...], each a .jsonl/.parquet file of {\"messages\": [...]} records "
        "or a directory of them, on a path every node mounts; added to the --sft-tasks mixture as the task "
        "'sft-data' (--sft-tasks '' trains on them alone); held out for sft-data_val_bpb: the test.jsonl / "
        "test-* files beside them, else --sft-test-size of them (README: Your own conversations)",
    )  # fmt: skip
    sft_test_size: float = option(
        0.05, "--sft-data with no test file: the conversations held out (never trained on), carved off in a "
        "fixed seeded order: a fraction in (0, 1) of them (rounded up), a whole count >= 1, or 0 for none",
        ge=0,
    )  # fmt: skip
    task_data_dir: str = option(
        "", "directory of the hub tasks' files (smoltalk, gsm8k, mmlu, arc-*, humaneval; layouts: "
        "raychat.tasks.hub_data); '' = $RAYCHAT_TASK_DATA, else runs/task_data",
    )  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        names = owned_choices("raychat.tasks.registry", "TASK_NAMES")
        parse_task_spec(self.sft_tasks, "--sft-tasks", names, empty_ok=bool(self.sft_data.strip()))
        if "://" in self.sft_data:
            raise ConfigError(
                f"--sft-data must be local or NFS paths (every worker reads the files), got {self.sft_data!r}"
            )
        if self.sft_test_size >= 1 and not self.sft_test_size.is_integer():
            raise ConfigError(
                "--sft-test-size must be a fraction in (0, 1), a whole count >= 1 or 0, got "
                f"{shown(self.sft_test_size)}"
            )


@dataclass
class LayoutSection(Section):
    """The Ray Train worker group."""

    num_workers: int = option(2, "Ray Train workers (DDP ranks); with --min-workers, the most", positive=True)
    min_workers: int = option(
        0,
        "elastic: when nodes are lost the run goes on from its last checkpoint on as few as this many "
        "workers, and grows back to --num-workers when they return; 0 = fixed at --num-workers",
        ge=0,
    )
    cpus_per_worker: float = option(0.5, "CPUs each worker reserves (leave room for Ray Data)", gt=0)
    use_gpu: bool = option(False, "one GPU per worker, nccl, bf16 autocast")
    placement_strategy: str = option(
        "PACK", "where the workers go (Ray's placement group strategies): PACK fills a node first, SPREAD puts "
        "them on different nodes where it can", ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    )  # fmt: skip
    max_failures: int = option(1, "worker failures survived by restarting from the last checkpoint", ge=0)
    schedule_timeout_s: float = option(
        SCHEDULE_TIMEOUT_S, "seconds the worker group may wait to be placed (nodes the autoscaler adds "
        "included: a cold GPU node takes minutes) before the run ends FAILED naming the missing resource", gt=0,
    )  # fmt: skip
    peak_flops: float = option(-1.0, "peak FLOP/s of one device for MFU (> 0); -1 = known GPUs only")

    def __post_init__(self):
        super().__post_init__()
        if self.peak_flops != -1 and not self.peak_flops > 0:
            raise ConfigError(
                f"--peak-flops must be > 0 (FLOP/s) or -1 (known GPUs only), got {shown(self.peak_flops)}"
            )
        if self.min_workers > self.num_workers:
            raise ConfigError(
                f"--min-workers must be 0 (fixed at --num-workers) or 1..{self.num_workers} (elastic, at most "
                f"--num-workers {self.num_workers}), got {self.min_workers}"
            )

    @property
    def worker_range(self) -> tuple[int, int]:
        """(fewest, most) workers the run may train on: (num_workers, num_workers) unless elastic."""
        return (self.min_workers or self.num_workers), self.num_workers


@dataclass
class BatchSection(Section):
    """Rows per micro-batch and tokens per optimizer step (gradient accumulation follows from both)."""

    device_batch_size: int = option(8, "rows per micro-batch per worker", positive=True)
    total_batch_size: int = option(
        -1,
        "tokens per optimizer step over all workers, a multiple of --device-batch-size x --seq-len x "
        "--num-workers; -1 = power law in data size",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.total_batch_size != -1 and self.total_batch_size <= 0:
            raise ConfigError(
                f"--total-batch-size must be positive or -1 (auto), got {self.total_batch_size}"
            )


@dataclass
class HorizonSection(Section):
    """How long to train: a step count, or one derived from a FLOPs budget or a tokens-per-parameter ratio."""

    num_iterations: int = option(
        -1, "optimizer steps; -1 = derive from target_flops or target_param_data_ratio"
    )
    stop_after: int = option(
        -1, "stop (with a checkpoint) after this step, keeping the full schedule; resume later (-1 = run to "
        "the end)",
    )  # fmt: skip
    target_flops: float = option(-1.0, "training FLOPs budget (used when num_iterations is -1)")
    target_param_data_ratio: float = option(
        20.0, "tokens per parameter (Chinchilla 20) when no other horizon", gt=0
    )

    def __post_init__(self):
        super().__post_init__()
        if self.num_iterations != -1 and self.num_iterations < 1:
            raise ConfigError(f"--num-iterations must be >= 1 or -1 (derive), got {self.num_iterations}")
        if self.target_flops != -1 and not self.target_flops > 0:
            raise ConfigError(f"--target-flops must be > 0 or -1 (not used), got {shown(self.target_flops)}")
        if self.stop_after != -1 and self.stop_after < 1:
            raise ConfigError(
                f"--stop-after must be >= 1 (a step) or -1 (run to the end), got {self.stop_after}"
            )
        if self.num_iterations != -1 and self.stop_after > self.num_iterations:
            raise ConfigError(
                f"--stop-after {self.stop_after} is beyond the run's last step (--num-iterations "
                f"{self.num_iterations}): the run would end at {self.num_iterations} without stopping early"
            )


@dataclass
class LRScheduleSection(Section):
    """The learning-rate schedule: linear warmup, constant, linear warmdown to a fraction of the peak."""

    warmup_ratio: float = option(0.0, "fraction of steps of linear warmup", ge=0)
    warmdown_ratio: float = option(0.4, "fraction of steps of linear decay at the end", ge=0)
    final_lr_frac: float = option(
        0.0, "lr the warmdown reaches after the last step, as a fraction of the peak (0..1)", ge=0, le=1
    )
    allow_rewarm: bool = option(
        False, "resume with a schedule (e.g. a longer --num-iterations) that raises the lr again after the "
        "checkpoint's warmdown began; without it such a resume is refused",
    )  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.warmup_ratio + self.warmdown_ratio <= 1:
            raise ConfigError(
                f"--warmup-ratio {shown(self.warmup_ratio)} + --warmdown-ratio {shown(self.warmdown_ratio)} must "
                "lie in [0, 1]: both are fractions of the run's steps, and the warmup ends before the warmdown starts"
            )


@dataclass
class EvalSection(Section):
    """Validation loss (BPB), task accuracy and greedy samples during training."""

    eval_every: int = option(
        50, "steps between validation evaluations (and at the end; 0 = only at the end)", ge=0
    )
    eval_tokens: int = option(
        65536, "validation tokens per evaluation (over all workers); SFT: eval_tokens // 32 held-out "
        "conversations of each task (at least 64), packed", positive=True,
    )  # fmt: skip
    eval_examples: int = option(64, "task examples per accuracy evaluation (SFT)", positive=True)
    sample_every: int = option(0, "steps between greedy samples (0 = only at the end)", ge=0)


@dataclass
class CheckpointSection(Section):
    """How often checkpoints are committed and how many are kept."""

    checkpoint_every: int = option(
        100, "steps between checkpoints (and at the end; 0 = only at the end)", ge=0
    )
    keep_checkpoints: int = option(2, "checkpoints kept (the newest)", positive=True)


@dataclass
class LoggingSection(Section):
    """How often a step's log line is printed."""

    log_every: int = option(1, "steps between log lines", positive=True)


@dataclass
class TrainSection(Section):
    """The optimization: batch, horizon, lr schedule, evaluation, checkpoints, logging."""

    batch: BatchSection = section(BatchSection)
    horizon: HorizonSection = section(HorizonSection)
    lr_schedule: LRScheduleSection = section(LRScheduleSection)
    eval: EvalSection = section(EvalSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    logging: LoggingSection = section(LoggingSection)


@dataclass
class TrainConfig(Section):
    """Pretraining or SFT on Ray Train (`raychat pretrain`, `raychat sft`)."""

    run: RunSection = section(RunSection)
    model: ModelSection = section(ModelSection)
    optim: OptimSection = section(OptimSection)
    data: DataSection = section(DataSection)
    layout: LayoutSection = section(LayoutSection)
    train: TrainSection = section(TrainSection)

    def grad_accum_steps(self, total_batch_size: int, workers: int | None = None) -> int:
        """Micro-batches per step on `workers` workers (default --num-workers); raises ConfigError when the
        sizes don't divide."""
        rows, seq = self.train.batch.device_batch_size, self.model.seq_len
        workers = workers or self.layout.num_workers
        per_micro = rows * seq * workers
        if total_batch_size % per_micro:
            count = flag_name("num_workers")
            if workers != self.layout.num_workers:  # one world size of an elastic run
                count = f"workers ({flag_name('min_workers')}..{count})"
            fewest, most = self.layout.worker_range
            every = rows * seq * math.lcm(*range(fewest, most + 1))  # divides on every world size
            below = total_batch_size // every * every
            nearest = f"{below} or {below + every}" if below else f"{every}"
            raise ConfigError(
                f"{flag_name('total_batch_size')} {total_batch_size} is not a multiple of "
                f"{flag_name('device_batch_size')} x {flag_name('seq_len')} x {count} = {rows} x {seq} x "
                f"{workers} = {per_micro}; allowed: a multiple of {every}, e.g. {nearest}"
            )
        return total_batch_size // per_micro


def elastic_grad_accum(cfg: TrainConfig, total_batch_size: int) -> dict[int, int]:
    """{workers: micro-batches per step} for every world size the run may train on (one entry unless
    --min-workers makes it elastic): the total batch, and so the optimization, stays the same on each.

    Raises:
        ConfigError: the total batch does not divide by device_batch_size x seq_len x workers for one of them.
    """
    fewest, most = cfg.layout.worker_range
    return {w: cfg.grad_accum_steps(total_batch_size, w) for w in range(fewest, most + 1)}


def check_batch(cfg: TrainConfig) -> None:
    """A given total batch divides into device_batch_size x seq_len x workers for every worker count the run may
    train on (elastic_grad_accum); an automatic one (-1) is rounded to such a multiple (raychat.train.plan).
    The speedrun checks each stage's before its first stage, `raychat submit` a submitted stage's before it
    submits it.

    Raises:
        ConfigError: naming --total-batch-size and the product it is not a multiple of."""
    total = cfg.train.batch.total_batch_size
    if total > 0:
        cfg.grad_accum_steps(total)  # --num-workers first, as the run's plan (raychat.train.plan) checks it
        elastic_grad_accum(cfg, total)


# The SFT command's own defaults (on top of TrainConfig's, under the preset and the flags).
SFT_DEFAULTS = {"run_name": "sft", "stage": "sft", "document_masking": True}

# {stage: {option: why the stage does not use it}}: the command refuses these given as flags, naming the flag
# and why (raychat.config.flags.add_flags); a preset's values for them (its train section, shared with
# pretraining) are not flags and stay as they are.
_SHAPE = "SFT takes the model's shape from --init-from's checkpoint"
_PRETRAIN_DATA = "SFT's data are its --sft-tasks conversations (pretraining's shards and packer are not read)"
_SFT_TASKS = "pretraining reads --data-dir's shards (the tasks are SFT's data)"
UNUSED_FLAGS = {
    "pretrain": {
        "sft_tasks": _SFT_TASKS,
        "task_data_dir": _SFT_TASKS,
        "sft_data": _SFT_TASKS,
        "sft_test_size": _SFT_TASKS,
        "eval_examples": "pretraining evaluates BPB and greedy samples, no task accuracy",
    },
    "sft": {
        **dict.fromkeys(("depth", "aspect_ratio", "head_dim", "kv_group"), _SHAPE),
        "document_masking": "SFT always masks documents (each conversation attends only to itself)",
        **dict.fromkeys(("data_dir", "buffer_size", "overflow", "min_fragment"), _PRETRAIN_DATA),
    },
}

"""Training configuration: one dataclass, presets in YAML (jobs/presets/<name>.yaml), flags override.

Every field becomes a `--flag` of `raychat pretrain` / `raychat sft` with the help text below.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PRESET_DIR = Path(__file__).resolve().parents[3] / "jobs" / "presets"


def _f(default, help: str, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # run
    run_name: str = _f("pretrain", "run name; running again with the same name and storage resumes")
    storage_path: str = _f("runs/checkpoints", "where checkpoints go (local dir, NFS, s3://, gs://)")
    stage: str = _f("pretrain", "what rows to train on", ["pretrain", "sft"])
    data_dir: str = _f("runs/data", "parquet shards + manifest from `raychat data prepare`")
    tokenizer_path: str = _f("runs/tokenizer", "directory holding tokenizer.json")
    init_from: str = _f("", "checkpoint directory to start from (SFT starts from a pretraining checkpoint)")
    seed: int = _f(0, "seed for init, data order and sampling")
    # model
    depth: int = _f(4, "transformer layers; width, heads and horizon derive from it")
    aspect_ratio: int = _f(64, "width = depth * aspect_ratio, rounded up to a multiple of head_dim")
    head_dim: int = _f(64, "attention head dimension")
    kv_group: int = _f(1, "query heads per KV head (GQA when > 1)")
    seq_len: int = _f(256, "T: tokens per row seen by the model (rows hold T+1 for the label shift)")
    document_masking: bool = _f(False, "attend only within a document; positions restart per document")
    # batch and horizon
    device_batch_size: int = _f(8, "rows per micro-batch per worker")
    total_batch_size: int = _f(-1, "tokens per optimizer step over all workers; -1 = power law in data size")
    num_iterations: int = _f(-1, "optimizer steps; -1 = derive from target_flops or target_param_data_ratio")
    stop_after: int = _f(
        -1, "stop (with a checkpoint) after this step, keeping the full schedule; resume later"
    )
    target_flops: float = _f(-1.0, "training FLOPs budget (used when num_iterations is -1)")
    target_param_data_ratio: float = _f(20.0, "tokens per parameter (Chinchilla 20) when no other horizon")
    # optimizer (Muon for hidden matrices, AdamW for the rest)
    matrix_lr: float = _f(0.02, "Muon learning rate for hidden weight matrices")
    embedding_lr: float = _f(0.2, "AdamW learning rate for the token embedding")
    unembedding_lr: float = _f(0.004, "AdamW learning rate for lm_head")
    scalar_lr: float = _f(0.02, "AdamW learning rate for norm weights")
    weight_decay: float = _f(0.0, "Muon weight decay")
    warmup_ratio: float = _f(0.0, "fraction of steps of linear warmup")
    warmdown_ratio: float = _f(0.4, "fraction of steps of linear decay at the end")
    final_lr_frac: float = _f(0.0, "lr at the end as a fraction of the peak")
    grad_clip: float = _f(1.0, "clip the global grad norm to this (0 = off)")
    # precision and speed
    fp8: bool = _f(False, "FP8 Linear layers through torchao (GPU; emulated on CPU)")
    fp8_recipe: str = _f(
        "tensorwise", "torchao float8 recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
    )
    compile: bool = _f(False, "torch.compile the model")
    # evaluation, checkpoints, logging
    eval_every: int = _f(50, "steps between validation BPB evaluations (and at the end)")
    eval_tokens: int = _f(65536, "validation tokens per evaluation (over all workers)")
    sample_every: int = _f(0, "steps between greedy samples (0 = only at the end)")
    checkpoint_every: int = _f(100, "steps between checkpoints (and at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept (the newest)")
    log_every: int = _f(1, "steps between log lines")
    peak_flops: float = _f(-1.0, "peak FLOP/s of one device for MFU; -1 = known GPUs only")
    # data pipeline
    buffer_size: int = _f(256, "documents buffered by the best-fit packer")
    sft_tasks: str = _f("calculator:4000,chatterbot,spelling:2000", "SFT mixture: task[:examples],...")
    eval_examples: int = _f(64, "task examples per accuracy evaluation (SFT)")
    # cluster
    num_workers: int = _f(2, "Ray Train workers (DDP ranks)")
    cpus_per_worker: float = _f(0.5, "CPUs each worker reserves (leave room for Ray Data)")
    use_gpu: bool = _f(False, "one GPU per worker, nccl, bf16 autocast")
    max_failures: int = _f(1, "worker failures survived by restarting from the last checkpoint")

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed values for any bad setting."""
        for name in (
            "depth",
            "seq_len",
            "device_batch_size",
            "num_workers",
            "aspect_ratio",
            "head_dim",
            "kv_group",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}"
                )
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {choices}, got {getattr(self, f.name)!r}"
                )
        for name in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(
                f"--head-dim must be even (RoPE rotates pairs of dimensions), got {self.head_dim}"
            )
        if self.total_batch_size not in (-1,) and self.total_batch_size <= 0:
            raise ValueError(f"--total-batch-size must be positive or -1 (auto), got {self.total_batch_size}")
        if not 0 <= self.warmup_ratio + self.warmdown_ratio <= 1:
            raise ValueError("--warmup-ratio + --warmdown-ratio must lie in [0, 1]")

    def grad_accum_steps(self, total_batch_size: int) -> int:
        """Micro-batches per step; raises ValueError when the sizes don't divide."""
        per_micro = self.device_batch_size * self.seq_len * self.num_workers
        if total_batch_size % per_micro:
            raise ValueError(
                f"--total-batch-size {total_batch_size} is not a multiple of device_batch_size x seq_len x "
                f"num_workers = {self.device_batch_size} x {self.seq_len} x {self.num_workers} = {per_micro}"
            )
        return total_batch_size // per_micro


def power_law_batch_size(data_tokens: float, tokens_per_micro_step: int) -> int:
    """Tokens per optimizer step B = 2^round(log2(2^19 * (D / 1e10) ** 0.383)), at least one micro-step.

    The exponent is the data-size scaling of the optimal batch size reported in "Power Lines"
    (Bergsma et al. 2025); the anchor (2^19 tokens at 10B tokens) is nanochat's d20 setting.
    """
    b = 2**19 * (max(data_tokens, 1.0) / 1e10) ** 0.383
    b = 2 ** round(math.log2(b))
    return max(b, tokens_per_micro_step)


def load_preset(name_or_path: str, stage: str = "pretrain") -> dict:
    """Read a preset YAML (a name in jobs/presets/ or a path) into a dict of TrainConfig fields: its `train`
    section, with the `sft` section on top when stage == "sft".

    Raises:
        FileNotFoundError: listing the presets that exist.
        ValueError: a key that is not a TrainConfig field.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no preset {name_or_path!r}; known presets: {known}")
    data = yaml.safe_load(path.read_text()) or {}
    section = dict(data.get("train", data))
    if stage == "sft":
        section.update(data.get("sft", {}))
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(section) - names
    if unknown:
        raise ValueError(f"{path}: unknown train settings {sorted(unknown)}")
    return section


STAGE_DEFAULTS = {"pretrain": {}, "sft": {"run_name": "sft", "stage": "sft", "document_masking": True}}


def add_config_flags(parser: argparse.ArgumentParser, stage: str = "pretrain") -> None:
    """One --flag per TrainConfig field (default None = keep the preset's value).

    Precedence: flags > the preset (its train section, plus its sft section for SFT) > the stage's defaults.
    """
    parser.add_argument(
        "--preset",
        default="cpu",
        help="preset name in jobs/presets/ (cpu, gpu8, cluster) or a YAML path (default: cpu); 'none' = no preset",
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name == "stage":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = STAGE_DEFAULTS[stage].get(f.name, f.default)
        help = f"{f.metadata['help']} (default: {default!r} unless the preset sets it)"
        if f.type in ("bool", bool):
            parser.add_argument(flag, default=None, action=argparse.BooleanOptionalAction, help=help)
        else:
            typ = {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__
            ]
            parser.add_argument(flag, default=None, type=typ, choices=f.metadata.get("choices"), help=help)


def config_from_args(args: argparse.Namespace, stage: str = "pretrain") -> TrainConfig:
    values = dict(STAGE_DEFAULTS[stage])
    if args.preset and args.preset != "none":
        values.update(load_preset(args.preset, stage))
    values["stage"] = stage
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg

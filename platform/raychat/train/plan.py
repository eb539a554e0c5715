"""The run's derived sizes (a pure function of the config and the vocabulary), printed before training.

Every derived number (width, heads, parameters, FLOPs per token, batch, grad accumulation, steps, tokens,
tokens per parameter) is in Plan and printed by print_plan, followed by the settings the run trains with
(settings_lines: learning rates as applied, schedule, regularization, precision, evaluation and checkpoints) and
what the step lines' MFU is measured against (mfu_line).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raychat.checkpoint import read_meta
from raychat.checkpoint_manager import described
from raychat.config import ConfigError, TrainConfig
from raychat.config.schema import flag_name, shown
from raychat.log import plural
from raychat.model import GPT, ModelConfig
from raychat.train.optim import lr_multiplier, peak_lrs_text, planned_ns_choice


class ShapesOnly(torch.overrides.TorchFunctionMode):
    """Build modules on the meta device with their random initializers skipped (Tensor.normal_ / uniform_
    return the tensor as it is): meta tensors hold no values anyway, and those initializers' meta kernels
    import torch._dynamo (1.0-1.2 s of a job driver's start here: bench/results/job_startup_cluster.md).
    """

    SKIPPED = frozenset({"normal_", "uniform_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SKIPPED:  # torch.nn.init.normal_(tensor=...), Tensor.normal_
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


# Dense bf16 peak FLOP/s of one device (for MFU), from the vendors' data sheets (half the "with sparsity"
# figure), looked up by peak_flops_of: the most specific model first.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12, "H200": 989e12,
              "A100": 312e12, "L4": 121e12, "A10G": 70e12}  # fmt: skip


def peak_flops_of(device_name: str) -> float | None:
    """PEAK_FLOPS of the first key that `device_name` (torch.cuda.get_device_name) holds as whole words, e.g.
    "NVIDIA H100 80GB HBM3" -> the H100 SXM's, "NVIDIA H100 PCIe" -> its own; None for another GPU. A key
    only matched as a substring: "L4" took "NVIDIA L40S" (3x the L4's peak) and "H100" the PCIe card."""
    for key, flops in PEAK_FLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return flops
    return None


@dataclass(frozen=True)
class Plan:
    model_config: dict  # raychat.model.ModelConfig.to_dict()
    num_params: int
    scaling_params: int  # without the token embedding
    flops_per_token: int  # forward + backward, raychat.model.GPT.flops_per_token
    horizon: str  # which setting chose the steps: num_iterations | target_flops | target_param_data_ratio
    total_batch_size: int  # tokens per optimizer step over all workers
    grad_accum: int  # micro-batches per step per worker
    num_iterations: int
    tokens: int
    tokens_per_param: float
    total_flops: float
    # the power-law batch before it was rounded to whole micro-steps (0: --total-batch-size was given)
    auto_batch_size: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def power_law_batch_size(data_tokens: float, tokens_per_micro_step: int) -> int:
    """Tokens per optimizer step B = 2^round(log2(2^19 * (D / 1e10) ** 0.383)), at least one micro-step.

    The exponent is the data-size scaling of the optimal batch size reported in "Power Lines"
    (Bergsma et al. 2025); the anchor (2^19 tokens at 10B tokens) is nanochat's d20 setting.
    """
    b = 2**19 * (max(data_tokens, 1.0) / 1e10) ** 0.383
    b = 2 ** round(math.log2(b))
    return max(b, tokens_per_micro_step)


def round_to_micro_steps(tokens: int, tokens_per_micro_step: int) -> int:
    """The multiple of tokens_per_micro_step (device_batch_size x seq_len x workers) nearest to `tokens`
    (halves round up), at least one: the automatic batch fits any number of workers (3, 6, 12, ...)."""
    return max(1, (2 * tokens + tokens_per_micro_step) // (2 * tokens_per_micro_step)) * tokens_per_micro_step


def make_plan(cfg: TrainConfig, vocab_size: int) -> Plan:
    """The derived sizes of a run. An automatic total batch size is rounded to whole micro-steps
    (round_to_micro_steps) of every world size the run may train on (lcm of --min-workers..--num-workers);
    raises ConfigError when an explicit --total-batch-size does not divide, the model is too large for a
    tensor's size to be computed, or --seq-len is longer than an --init-from checkpoint's max_seq_len."""
    m, h, batch = cfg.model, cfg.train.horizon, cfg.train.batch
    if cfg.run.init_from:
        model_config = ModelConfig(**read_meta(cfg.run.init_from)["model_config"])
        check_seq_len(m.seq_len, model_config.max_seq_len, f"the --init-from checkpoint {cfg.run.init_from}")
    else:
        model_config = ModelConfig.from_depth(
            m.depth, vocab_size, m.seq_len, m.aspect_ratio, m.head_dim, m.kv_group
        )
    try:
        with torch.device("meta"), ShapesOnly():
            model = GPT(model_config)
    except RuntimeError as e:  # torch: "Storage size calculation overflowed with sizes=[...]"
        raise ConfigError(
            f"--depth {m.depth}, --aspect-ratio {m.aspect_ratio}: a model {model_config.n_embd} wide and "
            f"{model_config.n_layer} deep cannot be built ({e})"
        ) from None
    n_params = model.num_params()
    scaling_params = model.num_params(exclude_embedding=True)
    flops_per_token = model.flops_per_token(m.seq_len)
    per_micro = batch.device_batch_size * m.seq_len * cfg.layout.num_workers
    # an elastic run (--min-workers) trains on every world size in its range: the automatic batch must divide
    # by each of them
    per_round = (
        batch.device_batch_size
        * m.seq_len
        * math.lcm(*range(cfg.layout.worker_range[0], cfg.layout.num_workers + 1))
    )
    if h.num_iterations > 0:
        horizon, data_tokens = "num_iterations", None
    elif h.target_flops > 0:
        horizon, data_tokens = "target_flops", h.target_flops / flops_per_token
    else:
        horizon, data_tokens = "target_param_data_ratio", h.target_param_data_ratio * scaling_params
    auto = 0
    if batch.total_batch_size > 0:
        total_batch = batch.total_batch_size
    else:
        auto = power_law_batch_size(data_tokens or h.num_iterations * per_micro * 8, per_micro)
        total_batch = round_to_micro_steps(auto, per_round)
    grad_accum = cfg.grad_accum_steps(total_batch)
    num_iterations = h.num_iterations if h.num_iterations > 0 else max(1, round(data_tokens / total_batch))
    tokens = num_iterations * total_batch
    return Plan(
        model_config=model_config.to_dict(),
        num_params=n_params,
        scaling_params=scaling_params,
        flops_per_token=flops_per_token,
        horizon=horizon,
        total_batch_size=total_batch,
        grad_accum=grad_accum,
        num_iterations=num_iterations,
        tokens=tokens,
        tokens_per_param=tokens / scaling_params,
        total_flops=tokens * flops_per_token,
        auto_batch_size=auto,
    )


def check_seq_len(seq_len: int, max_seq_len: int, checkpoint: str, option: str = "--seq-len") -> None:
    """Refuse rows longer than the max_seq_len of the checkpoint a run starts from: the run would train positions
    past it while its checkpoints keep that max_seq_len, so serving and evaluation never use them. The one
    check of this for every command: `raychat sft` / `pretrain --init-from` (make_plan) and the speedrun's
    SFT before its first stage (raychat.speedrun.check_stages).

    Args:
        checkpoint: how the line names that checkpoint ("the --init-from checkpoint <path>"; the speedrun's
            "the pretraining checkpoint (train.seq_len)"). option: how it names --seq-len (the speedrun:
            "sft.seq_len").
    Raises:
        ConfigError: "<option> <seq_len>: <checkpoint> has max_seq_len <max_seq_len> (...); allowed:
            1..<max_seq_len>".
    """
    if seq_len > max_seq_len:
        raise ConfigError(
            f"{option} {seq_len}: {checkpoint} has max_seq_len {max_seq_len} (its checkpoints keep it: serving "
            f"and evaluation stop there); allowed: 1..{max_seq_len}"
        )


def init_from_line(checkpoint: str) -> str:
    """ "init from: <checkpoint> (<stage> checkpoint, step <step>)" of the resolved --init-from (`latest` is
    named as the checkpoint it found), printed first by SFT, pretraining from a checkpoint and RL."""
    return f"init from: {described(checkpoint)}"


def print_plan(cfg: TrainConfig, p: Plan, option=flag_name, data_lines: Sequence[str] = ()) -> None:
    """The plan's lines to stdout: the sizes, the stage's data_lines after the horizon (SFT's epochs:
    raychat.train.sft.epochs_line), settings_lines and mfu_line (its flag named by `option`:
    raychat.train.launch.Flags.option)."""
    m = p.model_config
    if cfg.run.init_from:
        print(init_from_line(cfg.run.init_from))
    print(
        f"model: depth {m['n_layer']} width {m['n_embd']} heads {m['n_head']} (kv {m['n_kv_head']}) "
        f"head_dim {m['head_dim']} mlp {m['intermediate_size']} vocab {m['vocab_size']}"
    )
    print(f"parameters: {p.num_params:,} ({p.scaling_params:,} without the embedding)")
    print(
        f"FLOPs per token: {p.flops_per_token:,} (training: 6 x parameters without the embedding + attention)"
    )
    print(
        f"batch: {p.total_batch_size:,} tokens/step = {plural(cfg.layout.num_workers, 'worker')} x "
        f"{plural(cfg.train.batch.device_batch_size, 'row')} x {plural(cfg.model.seq_len, 'token')} x "
        f"{plural(p.grad_accum, 'accumulation step')}"
    )
    if p.auto_batch_size:
        (fewest, most), rows = cfg.layout.worker_range, cfg.train.batch.device_batch_size
        seq = cfg.model.seq_len
        w = math.lcm(*range(fewest, most + 1))  # an elastic run's batch divides on each of its world sizes
        workers = plural(w, "worker") if fewest == most else f"{w} (the lcm of {fewest}..{most} workers)"
        change = "kept" if p.auto_batch_size == p.total_batch_size else f"rounded to {p.total_batch_size:,}"
        print(
            f"  (automatic: power law {p.auto_batch_size:,} tokens, {change}: the nearest multiple of "
            f"{workers} x {plural(rows, 'row')} x {plural(seq, 'token')} = {w * rows * seq:,})"
        )
    print(
        f"horizon ({p.horizon}): {plural(p.num_iterations, 'step')}, {p.tokens:,} tokens, "
        f"{p.tokens_per_param:.2f} tokens per parameter (without the embedding), {p.total_flops:.3g} FLOPs"
    )
    for line in data_lines:
        print(line)
    print(
        f"optimizer: Muon for the hidden matrices, {planned_ns_choice(cfg.optim.ns_dtype, cfg.layout.use_gpu)}; "
        "AdamW for the embedding, lm_head and norms"
    )
    for line in settings_lines(cfg, p):
        print(line)
    print(mfu_line(cfg, option))


def mfu_line(cfg: TrainConfig, option=flag_name) -> str:
    """What the step lines' `mfu` (FLOPs per token x tok/s / (peak FLOP/s of one device x workers)) divides by,
    said once here rather than as a bare `n/a` on every step: --peak-flops, else the data-sheet peak of a known
    GPU (PEAK_FLOPS), else nothing (a CPU's peak is unknown) and how to give one. --peak-flops is named by
    `option`."""
    flag, peak = option("peak_flops"), cfg.layout.peak_flops
    if peak > 0:
        return f"mfu: over {flag} {shown(peak)} FLOP/s a device"
    how = f"give {flag}, the peak FLOP/s of one worker's device, to get it"
    if cfg.layout.use_gpu:
        return (
            f"mfu: over the dense bf16 peak of a known GPU ({', '.join(PEAK_FLOPS)}); n/a on another: {how}"
        )
    return f"mfu: n/a on CPU (a CPU has no known peak FLOP/s): {how}"


def schedule_line(cfg: TrainConfig, n: int) -> str:
    """The plan's line of the lr schedule over `n` steps (raychat.train.optim.lr_multiplier): the warmup from its
    first step's multiplier, the warmdown to final_lr_frac, which the schedule reaches after the last step, and
    the multiplier that last step trains at ("warmdown 1 step (0.4)" of a 2-step run read as a step below the
    peak; both trained at it)."""
    s = cfg.train.lr_schedule
    ratios = (s.warmup_ratio, s.warmdown_ratio, s.final_lr_frac)
    warmup, warmdown = round(s.warmup_ratio * n), round(s.warmdown_ratio * n)
    start = f" from {lr_multiplier(0, n, *ratios):.4g} x peak" if warmup else ""
    last = f"{lr_multiplier(n - 1, n, *ratios):.4g} x peak"
    end = (
        f" to {s.final_lr_frac:g} x peak after the last step, which trains at"
        if warmdown
        else ": the last step trains at"
    )
    return (
        f"schedule: lr warmup {plural(warmup, 'step')} ({s.warmup_ratio:g} of {n:,}){start}, constant, warmdown "
        f"{plural(warmdown, 'step')} ({s.warmdown_ratio:g}){end} {last}"
    )


def settings_lines(cfg: TrainConfig, p: Plan) -> list[str]:
    """The lines of the plan that say what the run trains with, whichever of flag, preset or default set it: the
    peak learning rates as the optimizers apply them (AdamW's scaled by adamw_lr_scale), the schedule in steps,
    weight decay and clipping, precision, and how often it logs, evaluates and checkpoints."""
    o, t, n = cfg.optim, cfg.train, p.num_iterations
    fp8 = "off"
    if cfg.model.fp8:
        fp8 = f"{cfg.model.fp8_recipe} (torchao{'' if cfg.layout.use_gpu else ', emulated on CPU'})"
    every = t.eval.eval_every
    evals = f"every {plural(every, 'step')} and at the end" if every else "at the end only"
    keep = t.checkpoint.keep_checkpoints
    saves = t.checkpoint.checkpoint_every
    return [
        f"lr (peak): {peak_lrs_text(o, p.model_config['n_embd'])}",
        schedule_line(cfg, n),
        f"regularization: Muon weight decay {o.weight_decay:g}, "
        + (f"grad clipping at global norm {o.grad_clip:g}" if o.grad_clip else "no grad clipping"),
        f"precision: {'bf16 autocast on GPU' if cfg.layout.use_gpu else 'float32 on CPU'}, FP8 {fp8}, "
        f"torch.compile {'on' if cfg.model.compile else 'off'}",
        f"cadence: a log line every {plural(t.logging.log_every, 'step')}; evaluation {evals}; checkpoint "
        + (f"every {plural(saves, 'step')} and at the end" if saves else "at the end only")
        + f", the newest {keep} kept",
    ]

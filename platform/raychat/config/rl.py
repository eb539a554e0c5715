"""The RL configuration (`raychat rl`): run, optim and checkpoint (training's sections with RL's defaults), model
(how the learner runs it: FP8, compile, as in training), task, rollout, objective, asynchrony, layout, eval.

The flags are training's: --init-from, --storage-path, --preset; RL's old --checkpoint, --out and --config stay
one release as deprecated aliases (RLConfig.DEPRECATED; --config: raychat.commands.rl).
"""

from __future__ import annotations

from dataclasses import dataclass

from raychat.cli_parser import did_you_mean
from raychat.config.schema import (
    ConfigError,
    Section,
    label,
    option,
    owned_choices,
    owned_literal,
    section,
    shown,
)
from raychat.config.train import SCHEDULE_TIMEOUT_S, CheckpointSection, OptimSection, RunSection


@dataclass
class RLModelSection(Section):
    """How the learner runs the model: the options of the same names in training's ModelSection (the shape
    comes from the checkpoint)."""

    fp8: bool = option(False, "FP8 Linear layers in the learner through torchao (GPU; emulated on CPU)")
    fp8_recipe: str = option(
        "tensorwise", "torchao float8 recipe", owned_choices("raychat.train.fp8", "FP8_RECIPES")
    )
    compile: bool = option(False, "torch.compile the learner's model")


@dataclass
class TaskSection(Section):
    """The task the prompts, rewards and held-out problems come from."""

    task: str = option(
        "calculator", "task the prompts and rewards come from: "
        f"{' or '.join(owned_choices('raychat.tasks.registry', 'REWARD_TASKS'))} (math problems whose reward is 1 "
        "when the number after a completion's last #### is the answer)",
    )  # fmt: skip
    task_examples: int = option(10_000, "training prompts (train split)", ge=1)
    max_operand: int = option(
        999,
        "calculator: operands are drawn from 0..max_operand (at most 10**9, so a product stays within the "
        "engine calculator's bound of 10**18 and every call gets its result)",
        ge=1,
        le=10**9,
    )
    task_data_dir: str = option(
        "", "directory of the hub tasks' files (smoltalk, gsm8k, mmlu, arc-*, humaneval; layouts: "
        "raychat.tasks.hub_data); '' = $RAYCHAT_TASK_DATA, else runs/task_data",
    )  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        rewarded = owned_choices("raychat.tasks.registry", "REWARD_TASKS")
        if self.task in rewarded:
            return
        flag = label(TaskSection, "task")
        if self.task not in owned_choices("raychat.tasks.registry", "TASK_NAMES"):
            close = did_you_mean(self.task, rewarded)
            hint = f" (did you mean {close}?)" if close else ""
            raise ConfigError(f"{flag} must be one of {list(rewarded)}, got {self.task!r}{hint}")
        why = (
            "has no checker to score a completion with"
            if self.task in owned_choices("raychat.tasks.registry", "UNGRADED")
            else "has no train split to take prompts from"
            if self.task in owned_choices("raychat.tasks.registry", "EVAL_ONLY")
            else "has answers that are not numbers after #### (sft trains on it, raychat eval measures it)"
        )
        raise ConfigError(
            f"{flag} {self.task}: rl rewards only {' and '.join(rewarded)}, math problems whose reward is 1 when the "
            f"number after a completion's last #### is the answer; {self.task} {why}"
        )


@dataclass
class RolloutSection(Section):
    """Rollouts: learner steps, prompts and samples (the advantage group) per step, sampling."""

    steps: int = option(50, "learner steps (policy versions published)", ge=1)
    prompts_per_step: int = option(8, "prompts per learner step", ge=1)
    samples_per_prompt: int = option(
        8, "G: samples per prompt (the advantage group; reward minus the group's mean is 0 for G = 1)", ge=2
    )
    max_tokens: int = option(48, "completion budget per sample, tokens (sampled + tool output)", ge=1)
    temperature: float = option(
        1.0, "rollout sampling temperature (>= 1e-5: below it decoding is greedy, every sample alike)", gt=0
    )
    max_slots: int = option(
        64, "KV-cache rows each rollout actor decodes at once (serve's --max-slots): its share of a step's "
        "prompts x --samples-per-prompt, or of an evaluation's prompts x --eval-samples, beyond this is "
        "generated in batches of whole prompts; an actor's KV cache is at most this x the model's max_seq_len "
        "x bytes per token", ge=1,
    )  # fmt: skip


@dataclass
class ObjectiveSection(Section):
    """The policy-gradient loss: advantage scaling, normalization over the step, ratio clipping, micro-batches."""

    normalization: str = option(
        "token", "loss normalization over the step", owned_choices("raychat.rl.objective", "NORMALIZATIONS")
    )
    scale_by_std: bool = option(False, "divide advantages by the group's reward std (GRPO); off = Dr. GRPO")
    constant_length: int = option(-1, "denominator length for --normalization constant; -1 = --max-tokens")
    clip_eps: float = option(0.2, "importance-ratio clip epsilon (async mode)", gt=0)
    micro_batch_size: int = option(16, "sequences per learner forward/backward", ge=1)

    def __post_init__(self):
        super().__post_init__()
        if self.constant_length != -1 and self.constant_length < 1:
            raise ConfigError(f"--constant-length must be >= 1 or -1, got {self.constant_length}")


@dataclass
class AsyncSection(Section):
    """How far rollouts may run ahead of the learner (sync, or off-policy by a bounded lag)."""

    mode: str = option(
        "sync",
        "sync: on-policy; async: rollouts run ahead of the learner",
        owned_choices("raychat.rl.loop", "MODES"),
    )
    max_staleness: int = option(
        1, "async: rollouts use weights at most this many versions old (k >= 1)", ge=1
    )


@dataclass
class RLLayoutSection(Section):
    """Placement: learner and rollout actors in one placement group."""

    rollout_workers: int = option(2, "rollout actors (each holds an engine)", ge=1)
    learner_workers: int = option(1, "learner actors (DDP; gloo on CPU, nccl on GPU)", ge=1)
    cpus_per_rollout: float = option(0.5, "CPUs each rollout actor reserves", gt=0)
    cpus_per_learner: float = option(0.5, "CPUs each learner actor reserves", gt=0)
    use_gpu: bool = option(False, "one GPU per rollout and learner actor")
    weight_sync: str = option(
        "object_store",
        "object_store: one ray.put, every rollout gets it; collective: broadcast",
        owned_choices("raychat.rl.sync", "WEIGHT_SYNCS"),
    )
    max_restarts: int = option(
        3, "restarts of a dead rollout actor (its training or evaluation prompts are re-issued)", ge=0
    )
    max_failures: int = option(
        1, "failures of a learner or of weight sync survived by restarting every actor and resuming from the "
        "newest committed checkpoint (the steps after it are redone); 0 = the first one ends the run", ge=0,
    )  # fmt: skip
    schedule_timeout_s: float = option(
        SCHEDULE_TIMEOUT_S, "seconds the placement group of learners and rollout actors may wait to be placed "
        "(nodes the autoscaler adds included) before the run ends FAILED naming the missing resource", gt=0,
    )  # fmt: skip
    deadline_factor: float = option(
        1.0, "multiplies every deadline the driver waits for an actor's call (its start, a checkpoint's restore "
        "or save, a rollout or evaluation chunk, a learner step, a weight sync) before it restarts the actors as "
        "hung: raise it on slower hardware than the deadlines assume", gt=0, le=1000,
    )  # fmt: skip


@dataclass
class RLEvalSection(Section):
    """pass@k evaluation on held-out prompts."""

    eval_every: int = option(
        10, "steps between pass@k evaluations on held-out prompts (and at step 0 and the end; 0 = only at step 0 "
        "and the end)", ge=0,
    )  # fmt: skip
    eval_examples: int = option(64, "held-out (test split) prompts per evaluation", ge=1)
    eval_samples: int = option(
        8,
        "samples per held-out prompt; pass@k for k = 1..this; above 1 at an --eval-temperature above 0",
        ge=1,
    )
    eval_temperature: float = option(
        1.0, "sampling temperature of the evaluation; 0 (below 1e-5) = greedy, with --eval-samples 1: pass@1 "
        "only", ge=0,
    )  # fmt: skip


@dataclass
class RLConfig(Section):
    """RL of a chat checkpoint (`raychat rl`)."""

    DEPRECATED = {"checkpoint": "init_from", "out": "storage_path"}  # RL's flags before issue 25, one release

    run: RunSection = section(RunSection, run_name="rl", storage_path="runs/rl", stage="rl")
    model: RLModelSection = section(RLModelSection)
    optim: OptimSection = section(
        OptimSection, matrix_lr=0.0002, embedding_lr=0.001, unembedding_lr=0.001, scalar_lr=0.001
    )
    task: TaskSection = section(TaskSection)
    rollout: RolloutSection = section(RolloutSection)
    objective: ObjectiveSection = section(ObjectiveSection)
    asynchrony: AsyncSection = section(AsyncSection)
    layout: RLLayoutSection = section(RLLayoutSection)
    eval: RLEvalSection = section(RLEvalSection)
    checkpoint: CheckpointSection = section(CheckpointSection, checkpoint_every=10)

    def __post_init__(self):
        super().__post_init__()
        samples = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if samples < self.layout.learner_workers:
            raise ConfigError(
                f"--prompts-per-step x --samples-per-prompt = {samples} samples a step cannot feed "
                f"--learner-workers {self.layout.learner_workers} (each needs at least one)"
            )

        r = self.rollout
        if r.prompts_per_step > self.task.task_examples:
            raise ConfigError(
                f"--prompts-per-step {r.prompts_per_step} exceeds --task-examples {self.task.task_examples}: a "
                "step's prompts would repeat (one prompt in several groups); raise --task-examples or lower "
                "--prompts-per-step"
            )
        if r.samples_per_prompt > r.max_slots:
            raise ConfigError(
                f"--samples-per-prompt {r.samples_per_prompt} exceeds --max-slots {r.max_slots}: a prompt's "
                "samples are decoded together; raise --max-slots or lower --samples-per-prompt"
            )
        e, greedy_below = self.eval, owned_literal("raychat.engine.sampling", "TEMPERATURE_EPS")
        if r.temperature < greedy_below:  # gt=0 let 1e-6 through
            raise ConfigError(
                f"--temperature must be >= {greedy_below:g}, got {shown(r.temperature)}: below it the engine decodes "
                "greedily, so a prompt's --samples-per-prompt samples would be identical and every advantage 0"
            )
        if e.eval_samples > 1 and e.eval_temperature < greedy_below:  # as raychat eval's --samples
            raise ConfigError(
                f"--eval-samples {e.eval_samples} needs an --eval-temperature above 0 (at least {greedy_below:g}), "
                f"got {shown(e.eval_temperature)}: greedy decoding writes the same completion every time (e.g. "
                "--eval-temperature 1; or --eval-samples 1)"
            )
        if e.eval_samples > r.max_slots:
            raise ConfigError(
                f"--eval-samples {e.eval_samples} exceeds --max-slots {r.max_slots}: a held-out prompt's samples "
                "are decoded together; raise --max-slots or lower --eval-samples"
            )
        t = self.layout
        if t.weight_sync == "collective" and not t.use_gpu and t.learner_workers > 1:
            raise ConfigError(
                f"--weight-sync collective on CPU (gloo) needs --learner-workers 1, got {t.learner_workers}: "
                "ray.util.collective's gloo group is the torch.distributed default group of each process, "
                "which the learners' DDP group already is (use --weight-sync object_store)"
            )

    @property
    def denominator_length(self) -> int:
        """L of the constant normalization."""
        length = self.objective.constant_length
        return self.rollout.max_tokens if length == -1 else length

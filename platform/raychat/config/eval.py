"""Configurations of the commands that read a finished checkpoint: `raychat eval` (EvalConfig, a preset's
`eval` section) and `raychat export` (ExportConfig) take --checkpoint as any reference
raychat.checkpoint_manager resolves (`latest`: the newest checkpoint of any stage under --storage-path) and write
<storage-path>/<run-name>/; `raychat chat` (ChatConfig) talks to one checkpoint (the same references, no `latest` search)."""

from __future__ import annotations

from dataclasses import dataclass

from raychat.config.schema import (
    SEED_MAX,
    ConfigError,
    Section,
    option,
    owned_choices,
    owned_literal,
    parse_task_spec,
)
from raychat.config.serve import KV_DTYPE_HELP

DEVICES = ("cpu", "cuda")
# eval's and export's root for --checkpoint latest, a run name and --data-dir's run name when --storage-path is not given
CHECKPOINTS_ROOT = "runs/checkpoints"
CHATCORE = "chatcore"  # --tasks chatcore[:N]: the six chat evals of the report card (raychat.eval.cli)
CHECKPOINT_HELP = (
    "the checkpoint: a checkpoint dir, a run dir, <run dir>/latest (paths, s3:// or gs://), a run name "
    "under --storage-path, or latest (the newest checkpoint there) (required)"
)


def output_root_help(what: str) -> str:
    """--storage-path's help of eval and export, whose outputs (`what`) go beside the checkpoint's run when
    neither --storage-path nor --run-name is given (raychat.checkpoint_manager.output_place)."""
    return (
        "storage root (a directory, s3:// or gs://) where --checkpoint latest and a run name are looked up and "
        f"{what} go: <storage-path>/<run-name>/; not given: {CHECKPOINTS_ROOT} for the look-up, and {what} go "
        "beside the checkpoint's run (the directory that holds its run dir)"
    )


def run_name_help(what: str, file: str, kind: str) -> str:
    """--run-name's help of eval (kind "eval", its `file` eval.json) and export (kind "hf"): the default name
    output_place gives."""
    return (
        f"run name: {what} go to <storage-path>/<run-name>/{file}; not given: the checkpoint's run and step, "
        f"<run>-{kind}-step<step> (a directory not named checkpoint_<step>: <its name>-{kind})"
    )


@dataclass
class EvalConfig(Section):
    """Validation BPB, held-out task accuracy and the report card (raychat.eval.report_card) of one
    checkpoint; JSON to stdout and to <storage-path>/<run-name>/eval.json, the card's markdown table to stderr
    and to <storage-path>/<run-name>/report_card.md."""

    checkpoint: str = option("", CHECKPOINT_HELP, kind="reference")
    storage_path: str | None = option(None, output_root_help("the results"))
    run_name: str | None = option(None, run_name_help("the results", "eval.json", "eval"), kind="run_name")
    data_dir: str = option(
        "runs/data", "shards whose validation shard BPB is measured on: a directory or a run name under "
        f"--storage-path (not given: {CHECKPOINTS_ROOT}); not given: the data of the speedrun whose --out holds "
        "the checkpoint (<out>/data, beside its checkpoints/ and rl/), else the run 'data' under a given "
        "--storage-path, else this",
    )  # fmt: skip
    eval_tokens: int = option(
        65536, "validation tokens for BPB on the validation shard of --data-dir; 0 = no BPB (val_bpb null in "
        "the JSON): only --tasks and the report card are measured and --data-dir is not read", ge=0,
    )  # fmt: skip
    tasks: str = option(
        "calculator:64", "held-out tasks for accuracy: task[:examples],... of "
        f"{', '.join(owned_choices('raychat.tasks.registry', 'EVAL_TASK_NAMES'))} ('' = none; examples: the first "
        "N of the test split, default all: calculator's and spelling's in --seed's order, a hub task's in its fixed "
        "one); chatcore[:examples] = the report card's six chat "
        "evals (a task whose files are missing: 'n/a: no data', not an error)",
        blank_ok=True,
    )  # fmt: skip
    task_data_dir: str = option(
        "", "directory of the hub tasks' files (smoltalk, gsm8k, mmlu, arc-*, humaneval; layouts: "
        "raychat.tasks.hub_data); '' = $RAYCHAT_TASK_DATA, else the task_data/ of the speedrun whose --out "
        "holds the checkpoint, else runs/task_data",
    )  # fmt: skip
    core_bundle: str = option(
        "", "the CORE eval bundle directory (core.yaml, eval_meta_data.csv, eval_data/); '' = "
        "<task data dir>/eval_bundle; none there: the CORE cell says 'n/a: no data'",
    )  # fmt: skip
    core_max_per_task: int = option(
        -1, "CORE items per task after nanochat's shuffle: a positive integer, or -1 = all", ge=-1
    )
    device_batch_size: int = option(8, "rows per forward pass (BPB)", positive=True)
    max_tokens: int | None = option(
        None, "completion budget of every generative task's examples, tokens (tool output included); not given: "
        "each task's own, the report card's (gsm8k, humaneval 512 as nanochat's chat_eval; spelling, calculator "
        "128: room for any gold answer); the budget is recorded with each score",
        positive=True,
    )  # fmt: skip
    samples: int = option(
        1, "completions per item of a generative task (gsm8k, humaneval, spelling, calculator); above 1: pass@k for "
        "k = 1..this (Chen et al.'s unbiased estimator), at a --temperature above 0; categorical tasks are scored "
        "greedily whatever this", positive=True,
    )  # fmt: skip
    temperature: float = option(
        0.0, "sampling temperature of the generative tasks' completions (seeded by --seed); 0 (below 1e-5) = "
        "greedy, nanochat's chat_eval and the report card's", ge=0,
    )  # fmt: skip
    device: str = option("cpu", "where the model runs", DEVICES)
    seed: int = option(
        0, "seed of calculator's and spelling's held-out examples (a hub task's order is fixed: nanochat's seed 42) "
        "and of the sampling at a --temperature above 0", ge=0, le=SEED_MAX,
    )  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        names = (*owned_choices("raychat.tasks.registry", "EVAL_TASK_NAMES"), CHATCORE)
        training_only = set(owned_choices("raychat.tasks.registry", "TASK_NAMES")) - set(names)
        for item in self.tasks.split(","):
            name = item.partition(":")[0].strip()
            if name in training_only:  # chatterbot: no held-out split; smoltalk: no checker
                raise ConfigError(
                    f"--tasks: {name!r} is a training task, with no held-out split and checker to measure accuracy "
                    f"with; tasks: {', '.join(names)}"
                )
        given = [name for name, _ in parse_task_spec(self.tasks, "--tasks", names, empty_ok=True)]
        twice = sorted({name for name in given if given.count(name) > 1})
        if twice:  # one accuracy per task: a second count would silently replace the first
            raise ConfigError(f"--tasks: {', '.join(map(repr, twice))} given twice; name each task once")
        if self.samples > 1 and self.temperature < owned_literal(
            "raychat.engine.sampling", "TEMPERATURE_EPS"
        ):
            raise ConfigError(
                f"--samples {self.samples} needs a --temperature above 0: greedy decoding writes the same "
                "completion every time (e.g. --temperature 0.8; or --samples 1)"
            )
        if (
            self.core_max_per_task == 0
        ):  # the bundle loader reads 0 as "all": a run meant to skip CORE ran all of it
            raise ConfigError("--core-max-per-task must be -1 (all) or a positive integer, got 0")


@dataclass
class ExportConfig(Section):
    """A checkpoint as a Hugging Face directory (Qwen3 layout) at <storage-path>/<run-name>/ or --out; with
    neither flag, beside the checkpoint's run (<run>-hf-step<step>/), as eval's results."""

    checkpoint: str = option("", CHECKPOINT_HELP, kind="reference")
    storage_path: str | None = option(None, output_root_help("the files"))
    run_name: str | None = option(None, run_name_help("the files", "", "hf"), kind="run_name")
    out: str | None = option(
        None,
        "output directory (local, s3://bucket/prefix or gs://bucket/prefix); not given: <storage-path>/<run-name>",
    )


@dataclass
class ChatConfig(Section):
    """A conversation with one checkpoint in the terminal: interactive, or one answer with --prompt."""

    checkpoint: str = option(
        "",
        "the checkpoint: a checkpoint dir, a run dir or <run dir>/latest (paths, s3:// or gs://) (required)",
    )
    prompt: str | None = option(
        None, "one-shot (also -p): answer this prompt and exit; not given: an interactive session"
    )
    system: str | None = option(None, "system message placed before the first user turn; not given: none")
    temperature: float = option(0.6, "sampling temperature; 0 = greedy", ge=0)
    top_k: int = option(50, "sample among the k most likely tokens; 0 = off", ge=0)
    top_p: float | None = option(None, "nucleus mass in (0, 1]; not given: off", gt=0, le=1)
    max_tokens: int | None = option(
        None, "completion tokens per reply; it must fit in the model's context with the prompt (else an error at "
        "start), and older exchanges are dropped to keep room for it; not given: 256, or until the context is full",
        positive=True,
    )  # fmt: skip
    seed: int | None = option(None, "sampling seed; not given: a fresh one", ge=0, le=SEED_MAX)
    device: str = option(
        "auto", "where the model runs (auto: cuda when there is one, else cpu)", ("auto", *DEVICES)
    )
    kv_dtype: str = option("model", KV_DTYPE_HELP, owned_choices("raychat.engine.runner", "KV_DTYPES"))

"""The parser of every `raychat` command, built from light code only (the config classes and argparse), so
`raychat <command> --help` imports neither torch nor Ray. Each parser sets `func` to "module:function", the
code that runs the command, which raychat.cli imports only when the command runs."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re

from raychat.cli_parser import OneLineParser
from raychat.config import (
    SFT_DEFAULTS,
    ChatConfig,
    EvalConfig,
    ExportConfig,
    RLConfig,
    ServeConfig,
    TrainConfig,
    add_flags,
    from_args,
    from_dict,
    to_flat,
)
from raychat.config.data import PrepareConfig, TokenizerConfig
from raychat.config.eval import CHATCORE, CHECKPOINTS_ROOT
from raychat.config.presets import SPEEDRUN_PRESET_HELP
from raychat.config.schema import owned_choices, owned_literal
from raychat.config.train import UNUSED_FLAGS, check_batch
from raychat.ops.jobs import DEFAULT_ADDRESS, STAGES, SUBMIT_CHOICES
from raychat.ops.k8s import CHECKPOINTS_MOUNT, ENTRYPOINT_NUM_GPUS, IMAGE, STORAGE_ROOT

# the canaries of raychat.data.replay.inspect_batch.canary_conversations (tests/unit/test_cli.py keeps them equal)
CANARIES = ("short", "empty", "tool_use", "unicode", "code", "overlong", "overlong_turn")

PREPARE_EPILOG = """examples:
  raychat data prepare                                   # default corpus (needs: make corpus-deps) -> runs/data
  raychat data prepare --source ~/my_texts --num-shards 8
  raychat data prepare --source fineweb-edu --num-shards 4 --out runs/fineweb
  raychat data prepare --storage-path /mnt/shared/runs   # -> /mnt/shared/runs/data, for a cluster's jobs

sources:
  debian-docs   Python 3.11 docs (Debian python3.11-doc, PSF-2.0, reST cleaned to text) + WordNet 3.0 glosses
                (Debian wordnet-base); ~21 MB of text. Install: sudo apt-get install -y python3.11-doc wordnet-base
  fineweb-edu   karpathy/fineweb-edu-100b-shuffle on the Hugging Face hub (ODC-By 1.0), ~94 MB a shard
  climbmix      karpathy/climbmix-400b-shuffle on the Hugging Face hub (NVIDIA ClimbMix, CC BY-NC 4.0)
  DIR           a folder: *.txt/*.md/*.rst = one document per file, *.jsonl = a "text" field per line,
                *.parquet = a `text` column; other files, empty and invalid-UTF-8 documents, links to folders
                (not followed) and broken links are counted skips

hub sources only: --url-pattern, --workers (parallel downloads); local sources only: --rows-per-shard. Each is
refused with the other kind of source.

output: DIR/shard_00000.parquet ... (one `text` column, zstd, row groups of 1024); the LAST shard is the
validation shard; DIR/manifest.json lists every shard with its sha256, and the skipped counts by reason.
"""

INSPECT_BATCH_DESCRIPTION = """\
`raychat inspect-batch`: the batch of a training step rebuilt from its replay record, or canary samples
token by token, exactly as the trainer would see them.

With --run RUN_DIR --step S: the replay records of optimizer step S (raychat.data.replay.records, written by the
training loop under RUN_DIR/replay/) are read, every row is rebuilt from the data alone (raychat.data.replay.rebuild:
documents re-read from the shards, or conversations re-rendered) and its input_ids / labels / loss_mask /
position_ids (/ segment_ids) hashes are compared with the recorded ones. One line per row lists its
segments: pretraining `shard:row_group:row[doc_offset:+length]@row_offset decision(tail)`, e.g.
`shard_00000.parquet:0:357[0:+65]@0 crop(325)`, SFT `sample_id+length@row_offset`. Exit status 1
when anything differs. --row R then prints row R of the listing token by token (pos, id, text, seg, position,
label; label "-" where loss_mask is False; seg "-" without document masking): the tensors the trainer built for
it. --data-dir / --tokenizer point at the data if it moved since the run (an SFT run's --data-dir: its
--task-data-dir); a shard of the step that is not there (moved, or the wrong --data-dir) is an error naming --data-dir (exit 2).

Without --run, the canaries (or, with --sft-data, your own conversations: the first --examples of them,
each headed by its file and line, rendered, truncated to --row-len and padded to a row as SFT trains on them):

For each canary (short text, empty fields, multi-turn tool use, Unicode, code, an over-long conversation
and a packed multi-sample row) the conversation is rendered by the chat template, truncated to the row
length, packed (one per row; the "packed" canary puts several samples in one row by best fit) and passed
through raychat.masks.make_batch. One line per row position:

    pos  id  text  role  seg  position  visible  label

text/label are the decoded token and target (repr); role comes from the template; seg/position are
segment_ids/position_ids; visible is the range of keys the position may attend to (from the
document mask: causal AND same segment); label is "-" where loss_mask is False. The row's last token is
only a label (rows hold T+1 tokens).

Tokenizer: --tokenizer PATH (a tokenizer.json or its directory). Without it, a small BPE tokenizer
(vocabulary up to --vocab-size) is trained on the fly on the canary texts, so the command runs anywhere;
its token boundaries then differ from a real run's, the masks and rules do not.
"""


def speedrun(subparsers) -> None:
    parser = subparsers.add_parser(
        "speedrun",
        help="the main job: data -> tokenizer -> pretrain -> eval -> SFT -> RL -> report",
        description="Run the whole pipeline on a local Ray cluster (started in-process) or the cluster in "
        "RAY_ADDRESS. Stages whose outputs exist are reused; the pretraining run resumes from its last "
        "checkpoint. Writes <out>/report.md.",
    )
    parser.add_argument("--preset", default="cpu", help=f"{SPEEDRUN_PRESET_HELP} (default: cpu)")
    parser.add_argument(
        "--out",
        default="runs",
        help="output directory (default: runs): data/, tokenizer/, checkpoints/{base,sft}/, rl/, report.md; "
        "the same paths the other commands default to",
    )
    parser.add_argument(
        "--num-iterations",
        type=int,
        default=None,
        help="pretraining's steps (the preset's train.num_iterations; SFT's and RL's stay the preset's "
        "sft.num_iterations and rl.steps); not given: the preset's",
    )
    add_token_file_flag(parser)
    parser.set_defaults(func="raychat.speedrun:main")


def data(subparsers) -> None:
    parser = subparsers.add_parser(
        "data", help="prepare pretraining text shards", description="Data commands."
    )
    sub = parser.add_subparsers(dest="data_command", metavar="<subcommand>", required=True)
    p = sub.add_parser(
        "prepare",
        help="corpus -> parquet text shards + manifest.json",
        description="Turn a corpus into parquet text shards (FineWeb-Edu layout) and a manifest.",
        epilog=PREPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, PrepareConfig, preset="none")
    p.set_defaults(func="raychat.data.corpus.prepare:run")


def tokenizer(subparsers) -> None:
    parser = subparsers.add_parser("tokenizer", help="train the BPE tokenizer")
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="<action>", required=True)
    train = sub.add_parser(
        "train",
        help="train byte-level BPE (rustbpe, GPT-4 split pattern) on the training shards",
        description="Train byte-level BPE on the training shards, save tokenizer.json (served by tiktoken "
        "with the chat special tokens), and report bytes per token on train and validation text.",
    )
    add_flags(train, TokenizerConfig, preset="none")
    train.set_defaults(func="raychat.tokenizer_cli:main")


# pretrain's and sft's --help: the defaults it shows are not all a run's
PRESET_DEFAULTS = (
    "The defaults shown below are the flags' own: the preset (--preset, default cpu) sets many of them, and a "
    "flag overrides both; the plan printed first, and by --dry-run, shows the values the run uses."
)


def pretrain(subparsers) -> None:
    parser = subparsers.add_parser(
        "pretrain",
        help="pretrain the base model on Ray Train (DDP)",
        description="Pretrain on packed parquet shards with Ray Train. Sizes derive from --depth; every derived "
        "number is printed first. Running again with the same --run-name and --storage-path resumes. "
        f"{PRESET_DEFAULTS}",
    )
    add_flags(parser, TrainConfig, defaults=TrainConfig(), preset="cpu", unused=UNUSED_FLAGS["pretrain"])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the derived sizes and exit (for a run that would resume: its resume check first, e.g. the lr "
        "at the resume step under a new --num-iterations)",
    )
    add_token_file_flag(parser)
    parser.set_defaults(func="raychat.train.pretrain:main")


def sft(subparsers) -> None:
    parser = subparsers.add_parser(
        "sft",
        help="supervised fine-tuning of a pretrained checkpoint into a chat model",
        description="Fine-tune on packed conversations (--sft-tasks, and your own: --sft-data) with the pretraining "
        "Trainer on Ray Train. "
        "Needs --init-from: a pretraining checkpoint dir, its run (dir or name under --storage-path), or `latest` "
        "(the newest pretraining checkpoint under --storage-path); a checkpoint of another stage (SFT, RL) named "
        "explicitly is fine-tuned further (the `init from:` line names its stage). The model's shape is the "
        "checkpoint's and the data are --sft-tasks and --sft-data: the shape and pretraining-data flags are "
        f"refused. Running again with the same --run-name resumes. {PRESET_DEFAULTS}",
    )  # fmt: skip
    add_flags(
        parser,
        TrainConfig,
        defaults=from_dict(TrainConfig, SFT_DEFAULTS),
        preset="cpu",
        unused=UNUSED_FLAGS["sft"],
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the inputs, print the derived sizes and exit (for a run that would resume: its resume check "
        "first, as for pretrain)",
    )
    add_token_file_flag(parser)
    parser.set_defaults(func="raychat.train.sft:main")


def rl(subparsers) -> None:
    parser = subparsers.add_parser(
        "rl",
        help="reinforcement learning of a chat checkpoint on a task (rollout actors + learner on Ray)",
        description="GRPO-style RL: rollout actors sample --samples-per-prompt completions per prompt with tool "
        "use, Task.reward scores them, advantages are reward minus the group mean, the learner takes a "
        "policy-gradient step over sampled tokens only, and the new weights are published to every rollout "
        "actor: one optimizer step a step, at constant learning rates, with no reference model, KL term or "
        "entropy bonus (README: RL for OpenRLHF and verl users). Writes "
        "STORAGE_PATH/RUN_NAME/{config.yaml,metrics.jsonl,checkpoint_<step>}; running again with "
        "the same --storage-path and --run-name resumes (--checkpoint, --out and --config: deprecated aliases of "
        "--init-from, --storage-path and --preset). Example: raychat rl --init-from runs/checkpoints/sft/latest "
        "--task calculator --steps 50",
    )
    add_flags(parser, RLConfig, preset="none", preset_aliases=("--config",))
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the inputs (and a run to resume: its resume check), print the plan and exit (nothing started "
        "or written)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    add_token_file_flag(parser)
    parser.set_defaults(func="raychat.rl.cli:main")


def eval_(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="a checkpoint's BPB, task accuracy and report card (chat evals, ChatCORE, CORE with --core-bundle)",
        description="Evaluate one checkpoint: BPB on the validation shard of --data-dir (--eval-tokens 0: no BPB, "
        "and --data-dir is not read: a chat checkpoint scored without the pretraining data) and greedy accuracy on "
        "the held-out split of --tasks, and the report card. Prints the JSON on stdout and the card's table on "
        "stderr, and writes them to <storage-path>/<run-name>/eval.json and report_card.md (not given: beside the "
        "checkpoint's run, <run>-eval-step<step>/). "
        "Example: raychat eval --checkpoint latest --storage-path runs/checkpoints --tasks calculator:64",
    )
    add_flags(parser, EvalConfig, preset="none")
    parser.set_defaults(func="raychat.eval.cli:main")


def report(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="draw the loss and validation curves of run directories from their metrics.jsonl",
        description="Draw the curves of each RUN_DIR (a pretrain, sft or rl run directory, <storage-path>/"
        "<run-name>, on a local or mounted filesystem) from its metrics.jsonl, as the speedrun's report draws a "
        "stage's: left, the training loss per step (and its smoothed value); right, the validation BPB at each "
        "evaluation (val_bpb and every <task>_val_bpb) or, for an RL run, the rollouts' mean reward per step "
        "and the held-out pass@1. Writes RUN_DIR/curves.png (PNG, 1100 x 396 pixels), replacing an older one, "
        "and one line per directory: `wrote RUN_DIR/curves.png (N steps, FIRST..LAST)`. A directory with no "
        "metrics.jsonl or no step in it is an error line naming it (exit status 2), as is one whose curves.png "
        "cannot be written, and an s3:// or gs:// URI (with the command that copies it here); the others are still drawn. Example: raychat report runs/checkpoints/longer",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory holding a metrics.jsonl")
    p.set_defaults(func="raychat.report:main")


def chat(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a checkpoint (interactive, or one-shot with -p)")
    add_flags(p, ChatConfig, preset=None)
    p.add_argument("-p", dest="prompt", default=None, help="the same as --prompt")
    p.set_defaults(func="raychat.chat.cli:run_chat")


def port_number(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1-65535, got {port}")
    return port


def at_least(low: float, kind=int, high: float | None = None):
    """An argparse type: `kind`(text), refused below `low` or above `high` (in one line, naming the flag)."""
    allowed = f">= {low}" if high is None else f"{low}..{high}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        if not (value >= low and (high is None or value <= high)):  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def bind_host(text: str) -> str:
    """An argparse type: an IPv4/IPv6 address or a host name of RFC 1123 labels (letters, digits, inner
    hyphens, 1-63 characters each, 253 in all), refused in one line otherwise; the name is not resolved."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be blank")
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    name = text.removesuffix(".")
    if not (0 < len(name) <= 253 and all(HOST_LABEL.fullmatch(label) for label in name.split("."))):
        raise argparse.ArgumentTypeError(
            f"must be an IP address (127.0.0.1, 0.0.0.0, ::) or a host name (letters, digits, '-', '.'), got {text!r}"
        )
    return text


SUBMISSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def submission_id(text: str) -> str:
    """An argparse type: a job's submission id, 1-128 letters, digits, '.', '_' or '-', not starting with a
    punctuation mark. Ray takes any string, but the id becomes the job's log file name on the head node
    (job-driver-<id>.log) and a segment of the Jobs REST URLs, where '/', spaces and '..' break both."""
    if not SUBMISSION_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, got {text!r}"
        )
    return text


# A container image reference: [registry[:port]/]path[:tag][@digest], no spaces (the OCI distribution grammar,
# loosened: the registry decides the rest)
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


def image_ref(text: str) -> str:
    """An argparse type: a container image reference (letters, digits, '.', '_', '-', '/', ':', '@', '+'), refused
    in one line otherwise (a space or a blank would reach the cluster as a pod that never pulls)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be blank")
    if not IMAGE_REF.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be a container image reference, e.g. rayproject/ray:2.54.0-py311 or "
            f"registry:5000/raychat@sha256:..., got {text!r}"
        )
    return text


class RefusingParser(OneLineParser):
    """The parser that reads a submitted stage's words (StageArgs): the stage's own command line's rules (whole
    flag names only, the same "did you mean" hints), but an error raises ValueError(message) instead of exiting,
    so that StageArgs names the stage in its line."""

    def error(self, message: str):
        raise ValueError(message)


# stage -> (its config class, its preset section, its defaults), as the stage's own code builds its config
STAGE_CONFIGS = {
    "data": (PrepareConfig, "data", {}),
    "tokenizer": (TokenizerConfig, "tokenizer", {}),
    "pretrain": (TrainConfig, "pretrain", {}),
    "sft": (TrainConfig, "sft", SFT_DEFAULTS),
    "rl": (RLConfig, "rl", {}),
    "eval": (EvalConfig, "eval", {}),
    "export": (ExportConfig, "export", {}),
}


def shared_output(stage: str, args: argparse.Namespace, config) -> list[tuple[str, str]]:
    """(flag, path) of what a submitted stage writes under: speedrun's --out; --out when given, and but for
    data (whose --out replaces it) --storage-path, which the others read even then; else --storage-path (eval's and
    export's, not given: its look-up root for `latest` or a run name, else none: it writes beside the checkpoint)."""
    if stage == "speedrun":
        return [("--out", args.out)]
    root = (config.run if hasattr(config, "run") else config).storage_path
    if (
        stage in ("eval", "export") and not root and "/" not in config.checkpoint
    ):  # latest or a run name: looked up there
        root = CHECKPOINTS_ROOT
    storage = ("--storage-path", root)
    out = getattr(config, "out", None)
    if not out:
        return [storage]
    return [("--out", out)] if stage == "data" else [("--out", out), storage]


_RUN_OR_PATH = "a directory every node mounts (e.g. {flag} {root}/<run>) or a run name under --storage-path"
_REFERENCE = "an absolute path, s3:// / gs://, a run name under --storage-path or latest"
# the stages' inputs that the job opens as storage (raychat.storage.run_directory,
# raychat.checkpoint_manager.find_checkpoint), which refuse a relative path there: leaf -> what they take
JOB_INPUTS = {
    "data_dir": _RUN_OR_PATH,
    "tokenizer_path": _RUN_OR_PATH,
    "init_from": _REFERENCE,
    "checkpoint": _REFERENCE,
}


def job_inputs(config) -> list[tuple[str, str, str]]:
    """(flag, value, what it takes) of `config`'s JOB_INPUTS given as a path: a value without '/' (a run name
    under --storage-path, `latest`) or with a scheme is left out, as the job takes it."""
    flat, found = to_flat(config), []
    for leaf, what in JOB_INPUTS.items():
        value, flag = flat.get(leaf), "--" + leaf.replace("_", "-")
        if isinstance(value, str) and ("/" in value or value in (".", "..")):
            found.append((flag, value, what.format(flag=flag, root=STORAGE_ROOT)))
    return found


def check_shared_paths(stage: str, args: argparse.Namespace, config=None) -> None:
    """Refuse a submitted stage whose output path (the default `runs...` of every preset but cluster and gpu8)
    or input path (job_inputs: --data-dir, --tokenizer-path, --init-from, --checkpoint; each path of --sft-data)
    is relative: the job runs in Ray's temporary copy of the checkout, where the job itself refuses it
    (raychat.storage.check_not_in_job_copy), but only after the job (a RayJob's whole cluster) started.

    Raises ValueError naming the flag, its value and what it takes."""
    outputs = [
        (flag, path, f"storage every node mounts (e.g. {flag} {STORAGE_ROOT}) or s3:// / gs://")
        for flag, path in shared_output(stage, args, config)
    ]
    own = to_flat(config).get("sft_data", "") if config is not None else ""
    files = [
        (
            "--sft-data",
            path.strip(),
            "files every node mounts: absolute paths (e.g. --sft-data /mnt/data/mine.jsonl)",
        )
        for path in own.split(",")
    ]
    for flag, path, what in outputs + (job_inputs(config) if config is not None else []) + files:
        if path and "://" not in path and not path.startswith(("/", "~")):
            default = "" if getattr(args, flag[2:].replace("-", "_"), None) else " (the default: not given)"
            raise ValueError(
                f"{flag} {path!r}{default} is relative: a job runs in a temporary copy of the checkout that Ray "
                f"deletes; give {what}"
            )


def task_data_note(stage: str, config, env_items: list[str] | None = None) -> str | None:
    """The note `raychat submit` and `raychat k8s submit` print for a stage that reads the task data directory
    (sft, rl: their hub tasks' files; eval: those of --tasks and the CORE bundle, unless --core-bundle names it)
    when that directory is not an absolute path: --task-data-dir not given (and no absolute RAYCHAT_TASK_DATA among
    `env_items`, --env's KEY=VALUE) is the node's $RAYCHAT_TASK_DATA, else runs/task_data, which in a job is
    Ray's temporary copy of the checkout, uploaded without runs/. None when the stage reads none of it or
    reads it from an absolute path."""
    flat = to_flat(config)
    spec = {"sft": "sft_tasks", "rl": "task", "eval": "tasks"}.get(stage)
    if spec is None:
        return None
    local = owned_choices("raychat.tasks.registry", "LOCAL_TASKS")
    names = [item.partition(":")[0].strip() for item in flat[spec].split(",")]
    hub = [
        "the chat evals (chatcore)" if name == CHATCORE else name
        for name in dict.fromkeys(names)
        if name and name not in local
    ]
    reads = [f"the files of {', '.join(hub)}"] if hub else []
    if stage == "eval" and not flat["core_bundle"]:
        reads.append("the CORE bundle (eval_bundle/)")
    variable = owned_literal("raychat.tasks.hub_data", "TASK_DATA_ENV")
    env = dict(item.partition("=")[::2] for item in env_items or ()).get(variable, "")
    given = flat["task_data_dir"]
    if not reads or os.path.isabs(given or env):
        return None
    if given:
        where = f"--task-data-dir {given!r}, relative: in"
    elif env:
        where = f"--env {variable}={env}, relative: in"
    else:
        where = f"--task-data-dir not given: ${variable} of the node it runs on, else runs/task_data in"
    missing = "what is not there scores 'n/a: no data'" if stage == "eval" else "the job fails without them"
    return (
        f"stage {stage} reads {' and '.join(reads)} from the task data directory, {where} the job's temporary "
        f"copy of the checkout, uploaded without runs/ ({missing}); to read them from storage every node mounts "
        f"give --task-data-dir, e.g. --task-data-dir {CHECKPOINTS_MOUNT}/task_data"
    )


class StageArgs(argparse.Action):
    """The words after a submitted stage (nargs REMAINDER), parsed by the stage's own parser as the command
    line is, then built into the stage's config (STAGE_CONFIGS: a shipped preset, each value's range and
    the config's own checks, output and input paths every node can reach: check_shared_paths, and for pretrain
    and sft the batch arithmetic: raychat.config.train.check_batch), so that an unknown flag, a bad value, an
    unknown shipped preset, a relative path (--storage-path, --data-dir, ...) or a --total-batch-size that
    --num-workers does not divide fails here, in one line naming the stage, not after the job's cluster starts. `command`, and a stage given -h/--help,
    are passed on unparsed; a preset given as a file and values checked against the cluster's files (paths,
    checkpoints) are left to the job. Stores the words without a leading "--" (argparse keeps it in a
    REMAINDER)."""

    def __call__(self, parser, namespace, values, option_string=None):
        words, stage = values[1:] if values[:1] == ["--"] else values, namespace.stage
        setattr(namespace, self.dest, words)
        if stage not in PARSERS or {"-h", "--help"} & set(words):
            return
        check = RefusingParser(prog="raychat")
        PARSERS[stage](check.add_subparsers(dest="command"))
        try:
            args = check.parse_args([stage, *words])
            preset = getattr(args, "preset", None) or ""
            if stage == "speedrun":
                check_shared_paths(stage, args)
            if stage in STAGE_CONFIGS and "/" not in preset and not preset.endswith((".yaml", ".yml")):
                cls, section, defaults = STAGE_CONFIGS[stage]
                base = from_dict(cls, defaults) if defaults else None
                config = from_args(args, cls, section, base=base, where=f"{section} settings")
                check_shared_paths(stage, args, config)
                if isinstance(config, TrainConfig):
                    check_batch(config)
                note = task_data_note(stage, config, getattr(namespace, "env", None))
                namespace.stage_notes = [note] if note else []
        except (ValueError, FileNotFoundError) as e:
            parser.exit(
                2, f"{parser.prog}: error: stage {stage}: {e} (`raychat {stage} --help` lists its flags)\n"
            )


def serve(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a checkpoint: streaming chat page + OpenAI-compatible API",
        description="Start the chat app (FastAPI ingress + autoscaled engine replicas) on Ray Serve and print "
        "the URL of the chat page. Endpoints: / (page), /chat/completions (SSE), /v1/chat/completions, "
        "/v1/completions, /v1/models, /v1/models/{model}, /health. Metrics (TTFT, tokens, prefix cache hits) are "
        "on this Ray node's Prometheus port, whose URL it prints, not on --port.",
    )
    add_flags(p, ServeConfig, preset="none")
    p.add_argument(
        "--host",
        type=bind_host,
        default="127.0.0.1",
        help="HTTP bind address (0.0.0.0 to expose: then an API key, or --allow-unauthenticated, is required; "
        "--backend vllm checks no key: --allow-unauthenticated) (default: 127.0.0.1, this machine only)",
    )
    p.add_argument(  # ServeConfig's allow_unauthenticated (from_args reads it by name; None: the preset's)
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="serve a --host beyond loopback without an API key (every route open to anyone who reaches it)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port, 1-65535 (default: 8000)")
    p.add_argument(
        "--proxy-location",
        choices=("EveryNode", "HeadOnly", "Disabled"),
        default="EveryNode",
        help="where Serve runs HTTP proxies (default: EveryNode; HeadOnly = one proxy, on the head node)",
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a new local one)"
    )
    add_token_file_flag(p)
    p.add_argument(
        "--no-block",
        action="store_true",
        help="return once the app is up (only with --address: a local cluster ends with this process)",
    )
    p.add_argument(
        "--backend",
        choices=("raychat", "vllm"),
        default="raychat",
        help="raychat = raychat's engine on --checkpoint (default); vllm = Ray Serve LLM + vLLM on --hf-dir "
        "(GPUs; needs the vLLM environment: constraints-vllm.txt)",
    )
    p.add_argument("--hf-dir", default="", help="with --backend vllm: the directory `raychat export` wrote")
    p.set_defaults(func="raychat.serve.cli:main")


def export(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a checkpoint to the Hugging Face layout (Qwen3)",
        description="Write config.json, model.safetensors, the tokenizer and the chat template of a checkpoint "
        "to <storage-path>/<run-name>/ (or --out; with neither --storage-path nor --run-name: beside the "
        "checkpoint's run, <run>-hf-step<step>/). Example: raychat export --checkpoint latest",
    )
    add_flags(p, ExportConfig, preset=None)
    p.set_defaults(func="raychat.export.hf:main")


# inspect-batch prints a row's (T, T) attention mask as built for training: 16 Ki tokens is ~1 GiB of bool
# intermediates (a --row-len of 100,000 took 17.5 GB and got training beside it OOM-killed)
INSPECT_MAX_ROW_LEN = 16384


def inspect_batch(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect-batch",
        help="rebuild a training step's batch from its replay record (--run, --step), or print canary SFT "
        "samples per token",
        description=INSPECT_BATCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--run", default="", help="a run directory (<storage-path>/<run-name>) with replay records"
    )
    p.add_argument(
        "--step", type=at_least(1), default=None, help="with --run: the optimizer step to rebuild (from 1)"
    )
    p.add_argument(
        "--row",
        type=at_least(0),
        default=None,
        help="with --run and --step: also print that row of the step (0-based, in the listing's order) token "
        "by token: input_ids, labels, loss_mask, segment_ids, position_ids; not given: the listing only",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="with --run: the shards (an SFT run: its hub task files, --task-data-dir), if not where the run read them",
    )
    p.add_argument(
        "--tokenizer", default="", help="tokenizer.json or its directory (canaries: default trains a small one; "
        "--run: default the run's)",
    )  # fmt: skip
    p.add_argument(
        "--row-len",
        type=at_least(2, high=INSPECT_MAX_ROW_LEN),
        default=128,
        help=f"row length T+1 in tokens, 2..{INSPECT_MAX_ROW_LEN} (default 128)",
    )
    p.add_argument(
        "--vocab-size",
        type=at_least(265),
        default=512,
        help="vocabulary of the on-the-fly tokenizer (>= 265) (default 512)",
    )
    p.add_argument(
        "--canary",
        action="append",
        choices=[*CANARIES, "packed"],
        help="canary to print (repeatable; default: all)",
    )
    p.add_argument(
        "--sft-data",
        default="",
        help="instead of the canaries, your conversations (a `raychat sft --sft-data` value: files of "
        '{"messages": [...]} records, checked as sft checks them), rendered and padded to a row as SFT '
        "trains on them, each headed by its file and line",
    )
    p.add_argument(
        "--examples",
        type=at_least(1),
        default=None,
        help="with --sft-data: how many of the conversations to print, from the first (default 4)",
    )
    p.set_defaults(func="raychat.data.replay.inspect_batch:run")


def add_connection_flags(p: argparse.ArgumentParser, default=None) -> None:
    """--address and --token-file; `default` argparse.SUPPRESS on a subcommand whose parent takes them too."""
    p.add_argument(
        "--address",
        default=default,
        help=f"dashboard URL (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, else {DEFAULT_ADDRESS})",
    )
    add_token_file_flag(p, default)


def add_token_file_flag(p: argparse.ArgumentParser, default=None) -> None:
    """--token-file of every command that connects to a Ray cluster (raychat.ray_token)."""
    p.add_argument(
        "--token-file",
        default=default,
        help="Ray auth token file (default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token)",
    )


def submit(subparsers) -> None:
    p = subparsers.add_parser(
        "submit",
        help="submit a stage as a Ray job and follow its logs",
        usage=f"raychat submit [options] {{{','.join(SUBMIT_CHOICES)}}} [stage args...]",
        description="Submit `python jobs/<stage>.py ARGS` as a Ray job. raychat's options come BEFORE the "
        "stage; everything after the stage goes to the stage unchanged. Exit code: 0 SUCCEEDED, 1 FAILED, 2 bad "
        "input (refused before submission), 3 STOPPED, 4 unreachable/unauthorized.",
    )
    p.add_argument("stage", choices=SUBMIT_CHOICES)
    p.add_argument(
        "stage_args",
        nargs=argparse.REMAINDER,
        action=StageArgs,
        help="everything after the stage is passed to it unchanged (parsed here first by the stage's parser)",
    )
    add_connection_flags(p)
    p.add_argument("--working-dir", help="checkout to upload (default: this raychat checkout)")
    p.add_argument(
        "--python",
        default="python",
        help="the job's Python on the cluster for a stage (not for `command`): a command or absolute path "
        "with raychat's dependencies, normally the Python that runs Ray there (default: `python` on the "
        "head's PATH)",
    )
    p.add_argument("--pip", action="append", help="pip requirement for the job's env (repeatable)")
    p.add_argument(
        "--pip-project",
        action="store_true",
        help="pip-install pyproject's dependencies (not torch) in the job",
    )
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help="environment variable for the job")
    p.add_argument("--num-cpus", type=at_least(0, float), help="CPUs reserved for the entrypoint (driver)")
    p.add_argument("--num-gpus", type=at_least(0, float), help="GPUs reserved for the entrypoint (driver)")
    p.add_argument(
        "--job-id",
        type=submission_id,
        help="submission id: letters, digits, '.', '_', '-' (default: generated by Ray, raysubmit_...)",
    )
    p.add_argument("--no-wait", action="store_true", help="print the job id and return once accepted")
    p.set_defaults(func="raychat.ops.submit:cmd_submit", stage_notes=[])


def jobs(subparsers) -> None:
    j = subparsers.add_parser("jobs", help="list, stop or show the logs of Ray jobs")
    add_connection_flags(j)  # before the subcommand, as `raychat submit` takes them, or after it
    jsub = j.add_subparsers(dest="jobs_command", metavar="<list|stop|logs>", required=True)
    for name, help_ in (("list", "list jobs"), ("stop", "stop a job"), ("logs", "print a job's logs")):
        q = jsub.add_parser(name, help=help_)
        add_connection_flags(q, default=argparse.SUPPRESS)
        if name != "list":
            q.add_argument("job_id")
        if name == "logs":
            q.add_argument(
                "--follow", action="store_true", help="follow until the job ends; exit code = status"
            )
        q.set_defaults(func="raychat.ops.submit:cmd_jobs")


def k8s(subparsers) -> None:
    p = subparsers.add_parser("k8s", help="KubeRay: generate k8s/base, submit a stage as a RayJob")
    sub = p.add_subparsers(dest="k8s_command", metavar="<generate|submit>", required=True)
    g = sub.add_parser(
        "generate",
        help="(re)write k8s/base and the overlays' kustomization from the code and serve/chat.yaml",
    )
    g.add_argument("--repo", help="checkout to write into (default: this raychat checkout)")
    g.add_argument("--check", action="store_true", help="exit 1 if k8s/ differs from the generated files")
    g.set_defaults(func="raychat.ops.k8s_cli:cmd_generate")
    s = sub.add_parser(
        "submit",
        help="create a RayJob for a stage",
        usage=f"raychat k8s submit [options] {{{','.join(STAGES)}}} [stage args...]",
        description="Create a RayJob running `python jobs/<stage>.py ARGS` on its own autoscaling cluster. "
        "Options come before the stage; everything after the stage goes to the stage unchanged.",
    )
    s.add_argument("stage", choices=STAGES)
    s.add_argument("stage_args", nargs=argparse.REMAINDER, action=StageArgs)
    s.add_argument(
        "--namespace", default="default", help="Kubernetes namespace of the RayJob (default: default)"
    )
    s.add_argument("--name", help="RayJob name (default raychat-<stage>-<YYYYmmdd-HHMMSS>-<6 hex>)")
    s.add_argument(
        "--image",
        type=image_ref,
        default=IMAGE,
        help=f"container image with raychat installed (default {IMAGE})",
    )
    s.add_argument(
        "--ttl", type=int, default=3600, help="seconds to keep the finished RayJob's cluster (default 3600)"
    )
    s.add_argument("--retries", type=int, default=1, help="backoffLimit: retries of a failed job (default 1)")
    gpus = ", ".join(f"{n:g} for {stage}" for stage, n in ENTRYPOINT_NUM_GPUS.items())
    s.add_argument(
        "--num-gpus",
        type=at_least(0, float),
        help=f"GPUs reserved for the entrypoint (driver): entrypointNumGpus (default: the base's, {gpus}, else 0)",
    )
    s.add_argument(
        "--num-cpus", type=at_least(0, float), help="CPUs reserved for the entrypoint (driver) (default 0)"
    )
    s.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    s.add_argument("--context", help="kubeconfig context")
    s.add_argument("--dry-run", action="store_true", help="print the RayJob YAML instead of creating it")
    s.set_defaults(func="raychat.ops.k8s_cli:cmd_submit", stage_notes=[])


def grafana(subparsers) -> None:
    p = subparsers.add_parser("grafana", help="Grafana: write raychat's dashboard, provision a Grafana")
    sub = p.add_subparsers(dest="grafana_command", metavar="<provision|dashboard>", required=True)
    q = sub.add_parser("provision", help="upload the Prometheus data source and the Ray + raychat dashboards")
    q.add_argument("--url", help="Grafana URL (default $GRAFANA_URL)")
    q.add_argument("--token", help="Grafana service-account token (default $GRAFANA_TOKEN)")
    q.add_argument(
        "--prometheus-url",
        help="Prometheus URL as Grafana's server sees it (a new data source: default http://127.0.0.1:9090; "
        "an existing one keeps its URL and settings unless this is given)",
    )
    q.add_argument(
        "--ray-temp-dir",
        help="Ray's temp dir holding session_latest (default Ray's: $RAY_TMPDIR/ray, else $TMPDIR/ray, else "
        "/tmp/ray)",
    )
    q.add_argument("--no-ray-dashboards", action="store_true", help="upload only raychat's dashboard")
    q.set_defaults(func="raychat.ops.grafana:cmd_provision")
    d = sub.add_parser("dashboard", help="(re)write raychat.json from build_dashboard()")
    d.add_argument("--check", action="store_true", help="exit 1 if the file differs from build_dashboard()")
    d.set_defaults(func="raychat.ops.grafana:cmd_dashboard")


# command -> the function that adds its parser (raychat.cli.COMMANDS holds the same commands, in this order)
PARSERS = {
    "speedrun": speedrun,
    "data": data,
    "tokenizer": tokenizer,
    "pretrain": pretrain,
    "sft": sft,
    "rl": rl,
    "eval": eval_,
    "report": report,
    "chat": chat,
    "serve": serve,
    "export": export,
    "inspect-batch": inspect_batch,
    "submit": submit,
    "jobs": jobs,
    "k8s": k8s,
    "grafana": grafana,
}

"""Supervised fine-tuning: the Trainer fed with packed conversations of a task mixture (--sft-tasks, and a
user's own conversations: --sft-data, the task 'sft-data').

Components: SFTRows (raychat.data.loader.sft_rows: the rank's share of the global mixture stream) for training,
with replay records of every step (raychat.train.replay_recorder); for every mixture task with a held-out split,
validation BPB on its packed test conversations ("<task>_val_bpb", and "val_bpb" over all of them) and, on
rank 0, greedy accuracy on --eval-examples of them ("<task>_accuracy"). Document masking is on.
`raychat sft --init-from <pretraining checkpoint>` (or `jobs/sft.py`; `--init-from latest`: the newest pretraining
checkpoint under --storage-path); the checkpoint's meta.stage is "sft".
"""

from __future__ import annotations

from pathlib import Path

from raychat.checkpoint import read_meta
from raychat.config import SFT_DEFAULTS, ConfigError, TrainConfig, from_dict
from raychat.config.schema import shown
from raychat.data.loader.sft_rows import RowFit, SFTRows, none_fits, row_fit, run_epochs, validation_rows
from raychat.eval.bpb import bpb_coverage
from raychat.log import log, plural
from raychat.model import ModelConfig
from raychat.ray_token import token_for
from raychat.tasks import Task
from raychat.tasks.hub_data import task_data_dir
from raychat.tasks.registry import (
    HUB_TASKS,
    check_data,
    graded,
    held_out,
    make_task,
    mixture_tasks,
    parse_mixture,
)
from raychat.tasks.sft_data import SFT_DATA, SPLIT_SEED, SFTDataRead, absolute, read_sft_data, sft_data_split
from raychat.tokenizer import Tokenizer
from raychat.train.launch import COMMANDS, Flags, config_from, resolve_paths, run_training
from raychat.train.plan import make_plan
from raychat.train.replay_recorder import ReplayRecorder
from raychat.train.validators import AccuracyValidator, BPBValidator, MeanBPBValidator


class SFT:
    """SFT's train spec (raychat.train.launch). --sft-data's files are read and checked once per process (the
    driver's checks, each worker's row source and validators: raychat.tasks.sft_data.read_sft_data)."""

    data_cpus = 0.0  # no Ray Data: conversations are rendered in the workers

    def __init__(self, seq_len_flag: str = "--seq-len"):
        self.seq_len_flag = seq_len_flag  # the workers' skip lines name it (Flags.option: the speedrun's key)

    def own_data(self, cfg: TrainConfig) -> SFTDataRead | None:
        """cfg's --sft-data conversations, as this process read and checked them (None: no --sft-data).

        Raises:
            ValueError: as raychat.tasks.sft_data.read_sft_data.
        """
        return read_sft_data(cfg.data.sft_data) if cfg.data.sft_data else None

    def row_source(self, cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int) -> SFTRows:
        d, own = cfg.data, self.own_data(cfg)
        tasks = mixture_tasks(d.sft_tasks, "train", cfg.run.seed, d.task_data_dir, own or "", d.sft_test_size)
        return SFTRows(
            tasks, cfg.run.seed, tokenizer, cfg.model.seq_len + 1, rank, world, seq_len_flag=self.seq_len_flag
        )

    def validators(self, cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int, device, autocast):
        bpb = []
        for name, task in validation_tasks(cfg, validation_size(cfg), self.own_data(cfg)):
            rows = validation_rows(task, tokenizer, cfg.model.seq_len + 1)
            bpb.append(BPBValidator(
                f"{name}_val_bpb", {k: v[rank::world] for k, v in rows.items()}, tokenizer,
                cfg.train.batch.device_batch_size, True, device, autocast,
            ))  # fmt: skip
        out = [*bpb, MeanBPBValidator("val_bpb", bpb)] if bpb else []
        if rank == 0:
            n, seed = cfg.train.eval.eval_examples, cfg.run.seed
            out += [
                AccuracyValidator(
                    f"{m}_accuracy",
                    make_task(m, "test", None, seed, data_dir=cfg.data.task_data_dir),
                    tokenizer,
                    n,
                )
                for m in held_out_names(cfg)
                if graded(m)
            ]
        return out


def epochs_line(cfg: TrainConfig, tokenizer: Tokenizer) -> str:
    """ "sft data: the run's R rows of T+1 tokens hold ~K conversations: ~E epochs of its mixture's N training
    conversations (~C a row)": how many times the run (cfg resolved: its plan's steps x total batch / seq_len
    rows) goes through its mixture (the global stream: rank 0 of 1), as
    raychat.data.loader.sft_rows.run_epochs counts them; past one epoch, that the same conversations repeat
    and what a held-out BPB that rises while the loss falls then means (SFT on few conversations: the model
    memorizes them). A line of the plan, after its horizon."""
    plan = make_plan(cfg, tokenizer.vocab_size)
    rows = SFT().row_source(cfg, tokenizer, 0, 1)
    n, run_rows = len(rows.mixture), plan.num_iterations * plan.total_batch_size // cfg.model.seq_len
    epochs, per_row = run_epochs(rows, run_rows)
    line = (
        f"sft data: the run's {plural(run_rows, 'row')} of {cfg.model.seq_len + 1} tokens hold "
        f"~{round(per_row * run_rows):,} conversations: ~{epochs:.3g} epochs of its mixture's "
        f"{plural(n, 'training conversation')} (~{per_row:.3g} a row)"
    )
    if epochs > 1:
        line += (
            ": from the second epoch on the same conversations repeat, so a held-out val_bpb that rises while "
            "the loss falls is the model memorizing them"
        )
    return line


def held_out_names(cfg: TrainConfig) -> list[str]:
    """The --sft-tasks tasks that have a test split, each once, in the mixture's order."""
    names = parse_mixture(cfg.data.sft_tasks, empty_ok=True)
    return list(dict.fromkeys(name for name, _ in names if held_out(name)))


def validation_tasks(cfg: TrainConfig, size: int, own: SFTDataRead | None = None) -> list[tuple[str, Task]]:
    """[(name, held-out task)] of what SFT measures BPB on ("<name>_val_bpb"), at most `size` conversations each:
    held_out_names' test splits, then --sft-data's held-out conversations ("sft-data") where it has some
    (raychat.tasks.sft_data; own: its conversations read already, None: read here)."""
    d = cfg.data
    tasks = [
        (name, make_task(name, "test", size, cfg.run.seed, data_dir=d.task_data_dir))
        for name in held_out_names(cfg)
    ]
    if d.sft_data:
        test = sft_data_split(own or d.sft_data, d.sft_test_size, size).test
        tasks += [(SFT_DATA, test)] if test is not None else []
    return tasks


def validation_size(cfg: TrainConfig) -> int:
    """Held-out conversations of each task that SFT's validators measure BPB on."""
    return max(64, cfg.train.eval.eval_tokens // 32)


def sft_defaults() -> TrainConfig:
    return from_dict(TrainConfig, SFT_DEFAULTS)


def load_init_tokenizer(tokenizer_path: str, init_from: str, flags: Flags = COMMANDS) -> Tokenizer:
    """The tokenizer at --tokenizer-path. Raises FileNotFoundError when there is none, naming the option and the
    tokenizer that always fits: the --init-from checkpoint's own copy (its directory; a remote checkpoint's
    tokenizer.json copied here) rather than a new one (`raychat tokenizer train` makes another vocabulary); the
    options named as `flags` names them. Where `flags` lays out tokenizer_path (Flags.laid_out: the speedrun's
    --out), the fix is the checkpoint's tokenizer.json copied to `tokenizer_path`."""
    try:
        return Tokenizer.load(tokenizer_path)
    except FileNotFoundError:
        tok, start = flags.option("tokenizer_path"), flags.option("init_from")
        checkpoint = f"the {start} checkpoint" if start.startswith("--") else start
        if "tokenizer_path" in flags.laid_out:
            copy = f"its tokenizer.json copied to {tokenizer_path}"
        elif "://" in init_from:
            copy = "a local copy of its tokenizer.json"
        else:
            copy = f"its copy: {tok} {init_from}"
        raise FileNotFoundError(
            f"{tok}: no tokenizer at {tokenizer_path}: give {checkpoint}'s tokenizer, {copy}"
        ) from None


def sft(cfg: TrainConfig, callbacks=(), dry_run: bool = False, flags: Flags = COMMANDS):
    """Run (or resume) SFT of cfg.run.init_from on the current Ray cluster; returns its
    raychat.train.launch.TrainingResult (None with `dry_run`: every check, then the plan printed). flags: how the
    refusals and the finished line name the options (raychat.train.launch.Flags).

    Raises:
        ValueError (before Ray starts): no --init-from, or one that names no committed checkpoint; a hub
            task of --sft-tasks whose file is missing under --task-data-dir (one line naming it), a bad record
            of its files (its file, line and field: raychat.tasks.registry.check_data) or of --sft-data's
            (raychat.tasks.sft_data.sft_data_split), an --sft-test-size that leaves nothing to train on; a
            ConfigError naming --seq-len when no training conversation fits a row (check_training_rows), or
            naming --sft-data when none of its training conversations does (check_own_rows: some that do not
            fit are a warning line); a held-out task none of whose conversations fits a row
            (check_validation_rows); or as run_training (a run directory whose newest checkpoint this run
            cannot resume).
    """
    if not cfg.run.init_from:
        raise ValueError("--init-from: required: a pretraining checkpoint, its run (name or dir), or latest")
    data_dir = check_task_files(cfg)
    values = {"stage": "sft", "document_masking": True, "task_data_dir": data_dir}
    if cfg.data.sft_data:
        values["sft_data"] = absolute(cfg.data.sft_data)
    cfg = from_dict(TrainConfig, values, base=cfg)
    spec = SFT(
        flags.option("seq_len")
    )  # --sft-data read once: the line, the checks and the resume check's row source share it
    if own := spec.own_data(cfg):
        log(sft_data_line(cfg, own))
    paths = resolve_paths(cfg, writable=False)
    tokenizer = load_init_tokenizer(paths.tokenizer_path, paths.init_from, flags)
    own_fit = own_row_fit(cfg, tokenizer, own)
    check_training_rows(cfg, tokenizer, paths.init_from, own_fit)
    check_own_rows(cfg, tokenizer, paths.init_from, own_fit, flags)
    if held_out := check_validation_rows(cfg, own, tokenizer):
        log(held_out)
    epochs = epochs_line(paths.config(cfg), tokenizer)
    return run_training(cfg, spec, [ReplayRecorder(), *callbacks], dry_run, flags, [epochs])


def check_task_files(cfg: TrainConfig) -> str:
    """Check that every hub task of --sft-tasks has its train files under --task-data-dir, and each with a
    held-out split its test files, every record in them included
    (raychat.tasks.registry.check_data); returns --task-data-dir resolved (hub_data.task_data_dir: the workers
    run elsewhere). raychat.speedrun makes this check before its first stage.

    Raises:
        ValueError: as check_data, naming --sft-tasks.
    """
    data_dir = str(task_data_dir(cfg.data.task_data_dir))
    names = [name for name, _ in parse_mixture(cfg.data.sft_tasks, empty_ok=True)]
    check_data(names, ("train",), data_dir)
    check_data([n for n in names if held_out(n)], ("test",), data_dir)
    return data_dir


def own_row_fit(cfg: TrainConfig, tokenizer: Tokenizer, own: SFTDataRead | None = None) -> RowFit | None:
    """--sft-data's training conversations rendered as the row source renders them, in rows of --seq-len + 1
    tokens (raychat.data.loader.sft_rows.row_fit; own: as validation_tasks), once for check_training_rows and
    check_own_rows; None without --sft-data.

    Raises:
        ValueError: as raychat.tasks.sft_data.sft_data_split."""
    d = cfg.data
    if not d.sft_data:
        return None
    return row_fit(sft_data_split(own or d.sft_data, d.sft_test_size).train, tokenizer, cfg.model.seq_len + 1)


def check_training_rows(
    cfg: TrainConfig, tokenizer: Tokenizer, init_from: str, own_fit: RowFit | None
) -> None:
    """Refuse, before Ray starts, a training mixture none of whose conversations fits a row of --seq-len + 1
    tokens, not even its most recent exchange: every worker's row source would skip them all (and raise, after
    Ray and the worker group had started). A conversation that fits once its oldest exchanges are truncated, or
    that is skipped while others fit, is left to the row source (raychat.data.loader.sft_rows.SFTRows). The
    tasks are built as the row source builds them (--sft-data's first: rendered already, own_fit: own_row_fit,
    None without --sft-data; then the generated ones, then the hub tasks, whose files are read only while
    nothing before them fits).

    Raises:
        ConfigError: "--seq-len T: none of the N training conversations (--sft-tasks, --sft-data) fits a row of
            T+1 tokens, ...: they hold A..B tokens, and keeping one needs a row of S+1: --seq-len S..M keeps
            some" (M: the --init-from checkpoint's max_seq_len), or, when S is above M, that shorter
            conversations are needed.
    """
    d, seq_len = cfg.data, cfg.model.seq_len
    names = parse_mixture(d.sft_tasks, empty_ok=bool(d.sft_data))
    if own_fit is not None and own_fit.none_fit is None:
        return  # one of --sft-data's conversations fits
    tasks = (
        make_task(name, "train", n, cfg.run.seed, data_dir=d.task_data_dir)
        for name, n in sorted(names, key=lambda task: task[0] in HUB_TASKS)
    )
    found = none_fits(tasks, tokenizer, seq_len + 1, own_fit.none_fit if own_fit else None)
    if found is None:
        return
    sources = ", ".join(flag for flag, on in (("--sft-tasks", names), ("--sft-data", d.sft_data)) if on)
    line = (
        f"--seq-len {seq_len}: none of the {plural(found.conversations, 'training conversation')} ({sources}) "
        f"fits a row of {seq_len + 1} tokens, not even its most recent exchange: they hold "
        f"{found.shortest:,}..{found.longest:,} tokens, and keeping one needs a row of {found.fewest:,}"
    )
    raise ConfigError(
        line + keeping_one(found.fewest, init_from, "--seq-len", f"the --init-from checkpoint {init_from}")
    )


def keeping_one(fewest: int, init_from: str, seq_len: str, checkpoint: str) -> str:
    """What ends a line saying that keeping one conversation needs a row of `fewest` tokens: ": --seq-len S..M
    keeps some" (S = fewest - 1; M: the max_seq_len of `init_from`, the checkpoint SFT starts from), or, S above
    M, that shorter conversations are needed. seq_len, checkpoint: how the line names --seq-len and that
    checkpoint."""
    need, most = fewest - 1, max_seq_len(init_from)
    if need <= most:
        return f": {seq_len} {need}..{most} keeps some"
    return (
        f" ({seq_len} {need}), above {checkpoint}'s max_seq_len {most} (allowed: 1..{most}): shorter "
        "conversations are needed"
    )


def max_seq_len(init_from: str) -> int:
    """The max_seq_len of checkpoint `init_from` (its meta's model_config)."""
    return ModelConfig(**read_meta(init_from)["model_config"]).max_seq_len


def check_own_rows(
    cfg: TrainConfig, tokenizer: Tokenizer, init_from: str, own_fit: RowFit | None, flags: Flags = COMMANDS
) -> None:
    """--sft-data's training conversations against rows of --seq-len + 1 tokens, in the driver before Ray starts
    (after check_training_rows: some conversation of the mixture fits), so that the user's own data is never
    dropped silently while the other tasks of the mixture train. Every one of them is rendered as the row source
    renders it (own_fit: own_row_fit, None without --sft-data). None fits, not even its most
    recent exchange: refused. Some longer than a row: one warning line, how many of them will be skipped and how
    many shortened (oldest exchanges dropped), and the --seq-len that keeps them all whole, or, past the
    max_seq_len of `init_from` (the checkpoint SFT starts from), how many that max_seq_len keeps whole. Lines
    name the options as `flags` does (the speedrun: its preset's keys).

    Raises:
        ConfigError: "--sft-data <value>: none of its N training conversations fits a row of T+1 tokens
            (--seq-len T), not even its most recent exchange (training would skip them all and learn from
            --sft-tasks alone): they hold A..B tokens, and keeping one needs a row of S+1" and what
            keeping_one says.
    """
    d, seq_len, fit = cfg.data, cfg.model.seq_len, own_fit
    if fit is None:
        return
    n, over = len(fit.lengths), fit.shortened + fit.skipped
    if not over:
        return
    data, seq, start = flags.option("sft_data"), flags.option("seq_len"), flags.option("init_from")
    checkpoint = f"the {start} checkpoint {init_from}" if start.startswith("--") else f"{start} {init_from}"
    if (found := fit.none_fit) is not None:
        raise ConfigError(
            f"{data} {d.sft_data}: none of its {plural(n, 'training conversation')} fits a row of {seq_len + 1} "
            f"tokens ({seq} {seq_len}), not even its most recent exchange (training would skip them all and learn "
            f"from {flags.option('sft_tasks')} alone): they hold {found.shortest:,}..{found.longest:,} tokens, and "
            f"keeping one needs a row of {found.fewest:,}"
            + keeping_one(found.fewest, init_from, seq, checkpoint)
        )
    skipped = f"{fit.skipped:,} will be skipped (too long even without their oldest exchanges)"
    shortened = f"{fit.shortened:,} {'' if fit.skipped else 'will be '}shortened (oldest exchanges dropped)"
    what = " and ".join(text for k, text in ((fit.skipped, skipped), (fit.shortened, shortened)) if k)
    line = (
        f"warning: {data} {d.sft_data}: {over:,} of its {plural(n, 'training conversation')} "
        f"{'is' if over == 1 else 'are'} longer than a row of {seq_len + 1} tokens ({seq} {seq_len}): "
        f"{what}; they hold up to {max(fit.lengths):,} tokens"
    )
    need, most = max(fit.lengths) - 1, max_seq_len(init_from)
    if need <= most:
        log(f"{line}: {seq} {need} keeps them all whole")
        return
    line += f": keeping them all whole needs {seq} {need}, above {checkpoint}'s max_seq_len {most}"
    if seq_len < most:
        line += f": {seq} {most} keeps {sum(k <= most + 1 for k in fit.lengths):,} of the {n:,} whole"
    log(line)


def check_validation_rows(
    cfg: TrainConfig, own: SFTDataRead | None = None, tokenizer: Tokenizer | None = None
) -> str | None:
    """What every worker's validators build first (SFT.validators), built here to fail in one line, not in each
    worker after Ray started: each held-out task's packed conversations (own: as validation_tasks; tokenizer:
    the run's, None: loaded here). Returns the line that says what sft-data_val_bpb scores, as the validators
    score it (raychat.eval.bpb.bpb_coverage), "sft data: sft-data_val_bpb scores 1 held-out conversation: 2
    tokens, 5 bytes"; None when there is none (no --sft-data, or none held out).

    Raises:
        ValueError: "--sft-tasks: task <name>'s held-out conversations (N) fill no row of <T+1> tokens: ..." (a
            longer --seq-len or shorter conversations in its test split keep some), or as resolve_paths.
    """
    tasks = validation_tasks(cfg, validation_size(cfg), own)
    if not tasks:
        return None
    tokenizer = tokenizer or Tokenizer.load(resolve_paths(cfg, writable=False).tokenizer_path)
    line = None
    for name, task in tasks:
        try:
            rows = validation_rows(task, tokenizer, cfg.model.seq_len + 1)
        except ValueError as e:
            flag = "--sft-data" if name == SFT_DATA else "--sft-tasks"
            raise ValueError(
                f"{flag}: {e} (a longer --seq-len, up to the --init-from checkpoint's max_seq_len, or shorter "
                "held-out conversations keep some)"
            ) from None
        if name == SFT_DATA:
            conversations, tokens, n_bytes = bpb_coverage(rows, tokenizer.token_bytes(), tokenizer.bos_id)
            line = (
                f"sft data: {SFT_DATA}_val_bpb scores {plural(conversations, 'held-out conversation')}: "
                f"{plural(tokens, 'token')}, {plural(n_bytes, 'byte')}"
            )
    return line


def sft_data_line(cfg: TrainConfig, own: SFTDataRead | None = None) -> str:
    """The line that says how --sft-data splits: how many conversations are trained on, how many held out
    and from where (its test files, or carved off by --sft-test-size); own: as validation_tasks.

    Raises:
        ValueError: as raychat.tasks.sft_data.sft_data_split (a bad record, a missing file: one line)."""
    d = cfg.data
    split = sft_data_split(own or d.sft_data, d.sft_test_size)
    line = f"sft data: --sft-data: {plural(len(split.train), 'conversation')} to train on, "
    if split.test is None:
        return line + "none held out (--sft-test-size 0: no sft-data_val_bpb)"
    held = f"{len(split.test):,} held out for sft-data_val_bpb"
    if split.carved:
        total = len(split.train) + len(split.test)
        return f"{line}{held} (--sft-test-size {shown(d.sft_test_size)} of {total:,}, in seed {SPLIT_SEED}'s order)"
    files = ", ".join(Path(f).name for f in split.test.source_files)
    return f"{line}{held} (from {files})"


def main(args) -> int:
    """`raychat sft` (its parser: raychat.commands.sft); the Ray auth token as `raychat pretrain`'s
    (raychat.train.pretrain.main)."""
    with token_for(None, args.token_file):
        sft(config_from(args, sft_defaults(), "sft"), dry_run=args.dry_run)
    return 0

"""`raychat speedrun`: the main job, end to end on a local (or connected) Ray cluster.

  data prepare -> tokenizer -> pretrain (Ray Train, DDP) -> validation BPB vs the unigram baseline
  -> samples -> SFT (calculator accuracy before/after) -> RL (pass@1 before/after)
  -> the report card (raychat.eval.report_card: CORE of the base checkpoint, the chat evals of the SFT and RL
     checkpoints, where their data is on this machine; each stage's wall time and tokens/s) -> report.md
  -> the command (and URL) that serves the chat page

Stages whose outputs already exist are skipped (the run is resumable: run the same command again). A stage
that did its work records its wall time and figures in the run's report state (raychat.report: <out>/stages.json,
as it finishes); a later invocation that reuses the stage's output reports those, marked reused (pretraining's
too when the invocation that committed its final checkpoint was stopped before recording it: stage_started).

A bad preset is refused before the first stage, not when the stage that reads it starts (after data
preparation and tokenizer training): check_stages makes every check of a stage's start that needs no earlier
stage's output, its refusals naming the preset's keys (speedrun_flags): the total batch of pretraining and of SFT
against device_batch_size x seq_len x workers (every worker count of an elastic run), the model's shape
(make_plan with the preset's tokenizer.vocab_size), SFT's seq_len against pretraining's (the max_seq_len of the
checkpoint SFT starts from), the files of the SFT mixture's hub tasks and of RL's task under their
task_data_dir and every record in them, the records of the report card's chat evals whose files are there,
sft_data's records, RL's max_tokens below pretraining's seq_len (the SFT checkpoint's
max_seq_len, which must also hold a prompt), and on the local cluster a run starts (no Ray connected, no RAY_ADDRESS) the
layout of each stage; then, under the lease on --out, that the storage roots under it can be written
(check_roots). What needs an earlier stage's output stays where the stage starts: pretraining's shards and
validation rows (the data stage), the plan it prints (its parameters, FLOPs, a derived horizon and automatic
batch count the trained tokenizer's vocabulary, which a small corpus leaves below the preset's vocab_size; the
batch arithmetic and the shape checks do not need it), SFT's training rows of sft_data and held-out rows (the
tokenizer: raychat.train.sft.check_own_rows, check_validation_rows), the resolution of the checkpoint SFT and
RL start from and every check that reads it (its tokenizer, its model: RL's max_tokens after the task's
longest prompt, as `raychat rl` checks it), the resume
checks of a run an earlier invocation left, a reused tokenizer trained for another vocabulary, and the layout
on a connected cluster (what it can become is read once connected).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ray

from raychat.checkpoint import load_model
from raychat.checkpoint_manager import COMMIT_FILE, committed_checkpoints
from raychat.config import ConfigError, RLConfig, SpeedrunConfig, TrainConfig, from_dict, to_dict
from raychat.config.data import PrepareConfig
from raychat.config.presets import preset_section
from raychat.config.schema import flatten, leaves
from raychat.config.speedrun import StageConfigError
from raychat.config.train import check_batch
from raychat.data.corpus.prepare import prepare, prepare_kwargs
from raychat.data.corpus.shards import list_shards
from raychat.eval.bpb import unigram_bpb
from raychat.eval.report_card import CHAT_TASKS, checkpoint_row, format_markdown, no_data_lines
from raychat.eval.tasks import task_accuracy
from raychat.lease import RunLease, output_lease
from raychat.log import log, plural
from raychat.metrics_sink import read_jsonl
from raychat.ray_token import token_for
from raychat.report import (
    STATE_FILE,
    file_id,
    mark_start,
    read_state,
    recover_record,
    restore_state,
    run_total,
    settle_stage,
    write_report,
)
from raychat.rl.actors import check_layout
from raychat.rl.cli import check_generation_length, short_eval_split_warning
from raychat.rl.loop import RLRun, check_train_split, rl_tasks
from raychat.sigterm import Terminated
from raychat.storage import check_writable, open_storage
from raychat.tasks.registry import check_data, check_present_data, graded, held_out, make_task, parse_mixture
from raychat.tasks.sft_data import sft_data_split
from raychat.tokenizer import Tokenizer
from raychat.tokenizer_cli import iter_texts, train_tokenizer
from raychat.train.launch import Flags
from raychat.train.layout import (
    check_local_layout,
    local_cluster_capacity,
    start_or_connect,
    starts_local_cluster,
)
from raychat.train.plan import check_seq_len, make_plan
from raychat.train.pretrain import Pretraining, pretrain
from raychat.train.sft import SFT, check_task_files, sft


def banner(title: str):
    log(f"\n=== {title} " + "=" * max(0, 90 - len(title)))
    return time.perf_counter()


def newest_checkpoint(storage_path: str, run_name: str):
    """A local run's newest committed checkpoint (raychat.checkpoint_manager.committed_checkpoints'; None: none)."""
    storage = open_storage(storage_path)
    found = committed_checkpoints(storage, storage.run_path(run_name))
    return found[-1] if found else None


def newest_commit(storage_path: str, run_name: str) -> str | None:
    """file_id of the commit marker of a local run's newest committed checkpoint (None: it has none)."""
    newest = newest_checkpoint(storage_path, run_name)
    return file_id(Path(newest.path) / COMMIT_FILE) if newest else None


@contextlib.contextmanager
def stage_started(
    state: dict, out_dir: Path, stage: str, storage_path: str, run_name: str
) -> Iterator[str | None]:
    """Around a training stage: first record it (raychat.report.recover_record) when the invocation that last
    started it was stopped after committing the local run's newest checkpoint but before recording it, from that
    checkpoint (its commit marker's committed_at, its meta.json's metrics, samples left out), then mark this
    invocation's start (mark_start); yields newest_commit (None: no checkpoint yet). A stage that raises having
    committed nothing (a refusal, a Ctrl-C before its first checkpoint) leaves stages.json as it was."""
    path = Path(out_dir) / STATE_FILE
    saved = path.read_bytes() if path.exists() else None
    newest = newest_checkpoint(storage_path, run_name)
    before = newest_commit(storage_path, run_name)
    if newest:
        meta = json.loads((Path(newest.path) / "meta.json").read_text())
        figures = {k: v for k, v in meta.get("metrics", {}).items() if k != "samples"}
        recover_record(state, out_dir, stage, before, newest.commit.get("committed_at"), figures)
    mark_start(state, out_dir, stage, before, time.time())
    try:
        yield before
    except BaseException:
        if newest_commit(storage_path, run_name) == before:
            restore_state(out_dir, saved)
        raise


def out_lease(out: str) -> RunLease:
    """The speedrun's lease on its --out `out` (a local directory): <out>/lease.json (raychat.lease), so that two
    speedruns of one --out never prepare data, train a tokenizer or train into it at once; its refusal says to
    use another --out. The training stages' own leases (<out>/checkpoints/base/lease.json, ...) are other files,
    taken inside it."""
    return output_lease(out, "--out")


def run_speedrun(preset: str, out: str, num_iterations: int | None = None) -> dict:
    """Every stage of the speedrun of `preset` under `out` (module doc); returns its report (report.md's dict).

    The preset and --out are checked first, then every stage's settings that need no earlier stage's output
    (check_stages); then the speedrun holds its lease on --out (out_lease) until it returns or raises, and
    checks first that the stages' storage roots under it can be written (check_roots). Raises ValueError as each stage's command; raychat.lease.LeaseHeld, before any stage,
    while another speedrun of the same --out holds its lease."""
    try:
        config = SpeedrunConfig.from_preset(preset, out, num_iterations)
    except StageConfigError as e:
        raise named_by_keys(e, preset, e.stage) from e
    check_stages(config, preset)
    with out_lease(config.out):
        check_roots(config)
        return _run_stages(preset, config)


def check_stages(config: SpeedrunConfig, preset: str) -> None:
    """Every check of a stage's start that needs no earlier stage's output (module doc), made before the first
    stage (nothing under --out is read or written); its refusals name the keys of `preset` (speedrun_flags).

    Raises:
        ValueError (ConfigError for a setting): one line: a pretraining or SFT total_batch_size that is not a multiple of device_batch_size
            x seq_len x workers (for every worker count of an elastic run: elastic_grad_accum); a model that
            cannot be built (make_plan); an SFT seq_len above pretraining's; an RL max_tokens that leaves no
            room for a prompt in it (check_rl_max_tokens); an RL prompts_per_step above its task's train split
            (raychat.rl.loop.check_train_split); a hub task of sft_tasks or RL's task
            whose files are missing under its task_data_dir, or a bad record of them, of the report card's chat
            evals ("report card: <file> line <n>: ...") or of sft_data (raychat.tasks.registry.check_data,
            check_present_data, raychat.tasks.sft_data.sft_data_split); on the local cluster a
            run would start (raychat.train.layout.starts_local_cluster), a stage's layout it cannot hold.
    """
    local = starts_local_cluster()
    cfg = config.pretrain
    with stage_keys(preset, "pretrain", ValueError):
        check_batch(cfg)
        make_plan(cfg, config.tokenizer.vocab_size)
        if local:
            check_local_layout(
                *_layout(cfg), Pretraining.data_cpus, cfg.layout.use_gpu, _option(preset, "pretrain")
            )
    if config.sft:
        sft_cfg = config.sft
        with stage_keys(preset, "sft", ValueError, config.sft_keys):
            check_sft_seq_len(sft_cfg, cfg, preset, config.sft_keys)
            check_batch(sft_cfg)
            check_task_files(sft_cfg)
            # the report card's chat evals of the SFT and RL checkpoints: the files here (the rest: "n/a: no data")
            check_present_data([name for name, _ in CHAT_TASKS.values()], "test", sft_cfg.data.task_data_dir)
            if sft_cfg.data.sft_data:  # read once per process: the SFT stage splits what this read
                sft_data_split(sft_cfg.data.sft_data, sft_cfg.data.sft_test_size)
            if local:
                option = _option(preset, "sft", config.sft_keys)
                check_local_layout(*_layout(sft_cfg), SFT.data_cpus, sft_cfg.layout.use_gpu, option)
    if config.sft and config.rl:  # RL runs after SFT only
        rl = config.rl
        with stage_keys(preset, "rl", ValueError):
            check_data([rl.task.task], ("train", "test"), rl.task.task_data_dir, "--task")
            check_train_split(rl, rl_tasks(rl), _option(preset, "rl"))
            check_rl_max_tokens(rl, cfg, preset)
            if local:
                check_layout(rl, local_cluster_capacity(), _option(preset, "rl"))


def _layout(cfg: TrainConfig) -> tuple[int, float]:
    return cfg.layout.num_workers, cfg.layout.cpus_per_worker


def _option(preset: str, stage: str, sft_keys: frozenset[str] | None = None):
    return speedrun_flags(preset, stage, sft_keys).option


def check_sft_seq_len(
    sft_cfg: TrainConfig, pretrain_cfg: TrainConfig, preset: str, sft_keys: frozenset[str] | None = None
) -> None:
    """SFT's seq_len is at most pretraining's: the max_seq_len of the pretraining checkpoint SFT starts from
    (raychat.train.plan.check_seq_len, made before that checkpoint exists, naming the preset's keys;
    `sft_keys` as speedrun_flags takes them).

    Raises:
        ConfigError: "sft.seq_len 128: the pretraining checkpoint (train.seq_len) has max_seq_len 64 (...);
            allowed: 1..64"."""
    sft_key, train_key = _option(preset, "sft", sft_keys)("seq_len"), _option(preset, "pretrain")("seq_len")
    check_seq_len(
        sft_cfg.model.seq_len, pretrain_cfg.model.seq_len, f"{STARTS_FROM['sft']} ({train_key})", sft_key
    )


def check_rl_max_tokens(rl_cfg: RLConfig, pretrain_cfg: TrainConfig, preset: str) -> None:
    """RL's max_tokens leaves room for a prompt (a token at least) in the max_seq_len of the SFT checkpoint RL
    starts from, pretraining's seq_len (SFT keeps its init's). The check of the task's longest prompt needs the
    trained tokenizer: it is `raychat rl`'s, made as the RL stage starts (run_rl_stage).

    Raises:
        ConfigError: naming the preset's keys, both values and the most max_tokens could be."""
    max_tokens, seq_len = rl_cfg.rollout.max_tokens, pretrain_cfg.model.seq_len
    if max_tokens >= seq_len:
        rl_key, seq_key = _option(preset, "rl"), _option(preset, "pretrain")("seq_len")
        raise ConfigError(
            f"{rl_key('max_tokens')} {max_tokens}: RL starts from the SFT checkpoint, whose max_seq_len is {seq_key} "
            f"{seq_len}, which must hold prompt and completion; allowed: 1..{seq_len - 1} (at most {seq_len} less "
            f"the longest {rl_key('task')} {rl_cfg.task.task} prompt's tokens: checked as RL starts)"
        )


def check_roots(config: SpeedrunConfig) -> None:
    """The storage roots of the stages that run (<out>/checkpoints, <out>/rl) can be written: each is created
    and a probe file written and deleted (raychat.storage.check_writable), before the first stage.

    Raises:
        ValueError: "--out: <root> is not writable: <why>"."""
    stages = [config.pretrain, config.sft, config.rl if config.sft else None]
    for root in dict.fromkeys(c.run.storage_path for c in stages if c):
        check_writable(open_storage(root), OUT_OPTIONS["storage_path"])


SPEEDRUN_SHARD_OPTIONS = "data.num_shards, or a smaller data.rows_per_shard"  # the preset's keys


def _run_stages(preset: str, config: SpeedrunConfig) -> dict:
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_cfg, tok_cfg, cfg = config.data, config.tokenizer, config.pretrain
    data_dir, tok_dir = Path(data_cfg.output_dir()), Path(tok_cfg.output_dir())
    report: dict = {"preset": preset, "timings_s": {}, "reused": []}
    state = read_state(out_dir)
    t_all = time.perf_counter()

    def settle(stage, t0, figures, output, ran):
        return settle_stage(report, state, out_dir, stage, time.perf_counter() - t0, figures, output, ran)

    t0 = banner("1/6 data: corpus -> parquet shards")
    reused = (data_dir / "manifest.json").exists()
    if reused:
        manifest = json.loads((data_dir / "manifest.json").read_text())
        log(reused_data_line(manifest, data_dir, preset, data_cfg))
    else:
        manifest = prepare(**prepare_kwargs(data_cfg), shard_options=SPEEDRUN_SHARD_OPTIONS)
    data = {k: manifest.get(k) for k in ("source", "license", "documents", "bytes")}
    report["data"] = settle("data", t0, data, file_id(data_dir / "manifest.json"), not reused)

    t0 = banner("2/6 tokenizer: byte-level BPE")
    reused = (tok_dir / "tokenizer.json").exists()
    if reused:
        tokenizer = Tokenizer.load(tok_dir)
        log(reused_tokenizer_line(tokenizer, tok_dir, preset, tok_cfg.vocab_size))
        figures = {"vocab_size": tokenizer.vocab_size}
    else:
        figures = train_tokenizer(
            tok_cfg.data_dir,
            str(tok_dir),
            tok_cfg.vocab_size,
            tok_cfg.max_chars,
            options=("tokenizer.vocab_size", "tokenizer.max_chars"),
        )
    report["tokenizer"] = settle("tokenizer", t0, figures, file_id(tok_dir / "tokenizer.json"), not reused)

    t0 = banner("3/6 pretrain on Ray Train")
    with stage_started(state, out_dir, "pretrain", cfg.run.storage_path, cfg.run.run_name) as before:
        with stage_keys(preset, "pretrain"):
            result = pretrain(cfg, flags=speedrun_flags(preset, "pretrain"))
    after = newest_commit(cfg.run.storage_path, cfg.run.run_name)
    report["pretrain"] = settle(
        "pretrain", t0, {k: v for k, v in result.metrics.items() if k != "samples"}, after, after != before
    )
    report["samples"] = result.metrics.get("samples", [])
    report["checkpoint"] = result.checkpoint

    t0 = banner("4/6 evaluation: BPB vs unigram baseline")
    report["unigram_bpb"] = unigram_baseline(data_dir, tok_dir)
    log(
        f"validation BPB {report['pretrain'].get('val_bpb', float('nan')):.4f} "
        f"vs unigram baseline {report['unigram_bpb']:.4f}"
    )
    report["timings_s"]["eval"] = time.perf_counter() - t0

    final = report["checkpoint"]
    if not config.sft:
        log(
            "SFT and RL: not run: the preset sets no positive num_iterations for SFT (its sft section's, else "
            "its train section's; RL follows SFT)"
        )
    elif not config.rl:
        log("RL: not run: the preset's rl section sets no positive steps")
    if config.sft:
        t0 = banner("5/6 SFT on Ray Train (same loop, packed conversations)")
        run = config.sft.run
        before = newest_commit(run.storage_path, run.run_name)
        with stage_keys(preset, "sft", sft_keys=config.sft_keys):
            flags = speedrun_flags(preset, "sft", config.sft_keys)
            figures, final = run_sft_stage(config.sft, report["checkpoint"], flags)
        after = newest_commit(run.storage_path, run.run_name)
        record = state.get("sft", {})
        if after != before or record.get("output") != after:  # "before SFT" of this invocation's report
            figures = with_accuracy_before(figures, report["checkpoint"], config.sft)
        report["sft"] = settle("sft", t0, figures, after, after != before)
    if config.rl and report.get("sft"):
        t0 = banner("6/6 RL: rollout actors + learner")
        run = config.rl.run
        before = newest_commit(run.storage_path, run.run_name)
        with stage_keys(preset, "rl"):
            figures, final = run_rl_stage(config.rl, final, cfg, speedrun_flags(preset, "rl"), preset)
        after = newest_commit(run.storage_path, run.run_name)
        report["rl"] = settle("rl", t0, figures, after, after != before)
    if report["reused"]:
        log(f"reused (figures and wall times of the invocation that ran them): {', '.join(report['reused'])}")
    report["final_checkpoint"] = final
    stages = {"pretrain": cfg, "sft": config.sft, "rl": config.rl}
    curves = {
        name: Path(c.run.storage_path) / c.run.run_name / "metrics.jsonl" for name, c in stages.items() if c
    }
    t0 = banner("report card: CORE of the base checkpoint, chat evals of the chat checkpoints")
    report["report_card"] = report_card(config, report, curves)
    report["timings_s"]["report_card"] = time.perf_counter() - t0
    report["timings_s"]["invocation"] = time.perf_counter() - t_all
    report["timings_s"]["total"] = run_total(report["timings_s"])
    report["train_config"] = to_dict(cfg)
    path = write_report(out_dir, report, curves)
    print(f"\nreport: {path}\nfinal checkpoint: {final}")
    for line in next_steps(final):
        print(line)
    return report


def invoked_as() -> str:
    """How to type this raychat again: `raychat` when it was not started by its script or that script is the
    `raychat` on PATH, else the script's path as typed (`.venv/bin/raychat` in a shell whose PATH lacks .venv/bin,
    as the README's quick start runs it)."""
    script = sys.argv[0]
    if Path(script).name != "raychat":
        return "raychat"
    on_path = shutil.which("raychat")
    return "raychat" if on_path and Path(on_path).resolve() == Path(script).resolve() else script


def next_steps(final: str) -> list[str]:
    """The speedrun's last lines: the commands that chat with and serve its final checkpoint."""
    raychat = invoked_as()
    return [
        f"chat with it:  {raychat} chat --checkpoint {final}",
        f"serve it:      {raychat} serve --checkpoint {final}   -> chat page at http://127.0.0.1:8000/",
    ]


def reused_data_line(manifest: dict, data_dir: Path, preset: str, cfg: PrepareConfig) -> str:
    """The line saying that the speedrun reuses the shards in `data_dir` (`manifest`: their manifest.json), and
    what of them differs from what `preset` asks for (`cfg`: its source, number of train shards and seed): a
    speedrun reuses whatever data its --out holds."""
    shards = manifest.get("shards") or []
    train = len(shards) - (1 if manifest.get("validation_shard") else 0)
    have = {"source": manifest.get("source"), "train shards": train, "seed": manifest.get("seed")}
    asked = {"source": cfg.source, "train shards": cfg.num_shards, "seed": cfg.seed}
    line = f"using existing shards in {data_dir}: {plural(train, 'train shard')} of {have['source']}"
    differ = [
        f"{key} {have[key]} where it asks for {asked[key]}"
        for key in have
        if have[key] is not None and asked[key] is not None and have[key] != asked[key]
    ]
    if not differ:
        return line
    return f"{line}, reused although --preset {preset} asks for other data: {', '.join(differ)} (use another --out to prepare the preset's)"


def reused_tokenizer_line(tokenizer: Tokenizer, tok_dir: Path, preset: str, asked: int) -> str:
    """The line saying that the speedrun reuses `tokenizer` (the one in tok_dir) where `preset` asks for a
    vocabulary of `asked` tokens: its vocabulary, and the preset's when they differ.

    Raises:
        ConfigError: the tokenizer was trained for another vocabulary size than `asked` (it records the size it
            was asked for: Tokenizer.asked_vocab_size; a small corpus can leave the vocabulary below that size,
            which is no mismatch).
    """
    was = tokenizer.asked_vocab_size
    if was not in (None, asked):
        raise ConfigError(
            f"--preset {preset}: the tokenizer in {tok_dir} was trained for a vocabulary of {was} tokens, the "
            f"preset asks for {asked} {speedrun_flags(preset, 'pretrain').resume_hint}"
        )
    line = f"using existing tokenizer in {tok_dir}: vocabulary {tokenizer.vocab_size}"
    if tokenizer.vocab_size == asked:
        return line
    if was is None:  # saved before tokenizers recorded the size they were trained for
        return f"{line}, the preset asks for {asked}: reused (use another --out to train one for {asked})"
    return f"{line} (asked {asked}: the corpus supports no more)"


def median_tokens_per_s(metrics_file: Path, key: str) -> float | None:
    """The median over a stage's steps of `key` in its metrics.jsonl (the median skips the warm-up step)."""
    values = sorted(x[key] for x in read_jsonl(metrics_file) if isinstance(x.get(key), (int, float)))
    return values[len(values) // 2] if values else None


def report_card(config: SpeedrunConfig, report: dict, metrics_files: dict[str, Path]) -> dict:
    """{"rows": {stage: row}, "markdown": table} of the run's checkpoints (raychat.eval.report_card): base, and
    SFT and RL when they ran; tokens/s: the median step's training tokens/s (all workers) for pretraining and
    SFT, rollout completion tokens/s for RL."""
    data_dir = config.sft.data.task_data_dir if config.sft else None
    examples = config.sft.train.eval.eval_examples if config.sft else None
    stages = {"base": ("pretrain", report["checkpoint"], False, "tokens_per_s")}
    if report.get("sft"):
        stages["sft"] = ("sft", report["sft"]["checkpoint"], True, "tokens_per_s")
    if report.get("rl"):
        stages["rl"] = ("rl", report["rl"]["checkpoint"], True, "rollout_tokens_per_s")
    rows = {}
    for name, (stage, checkpoint, chat, key) in stages.items():
        path = metrics_files.get(stage)
        rows[name] = checkpoint_row(
            checkpoint, chat, data_dir, max_problems=examples, log=log, stage=name,
            wall_s=report["timings_s"].get(stage),
            tokens_per_s=median_tokens_per_s(path, key) if path and path.exists() else None,
        )  # fmt: skip
    for line in no_data_lines(rows, data_dir):
        log(line)
    markdown = format_markdown(rows)
    log(markdown)
    return {"rows": rows, "markdown": markdown}


def accuracy_task(cfg: TrainConfig) -> str | None:
    """The task whose held-out accuracy the speedrun reports before and after SFT: the first graded task of
    the SFT mixture (calculator in the cpu and tiny presets, mmlu in gpu8 and cluster), or None when the
    mixture has none (then no accuracy is reported)."""
    return next(
        (name for name, _ in parse_mixture(cfg.data.sft_tasks) if held_out(name) and graded(name)), None
    )


def held_out_accuracy(checkpoint: str, cfg: TrainConfig, task: str) -> float:
    """Greedy accuracy of `checkpoint` on the held-out examples of `task` that SFT's own validator scores
    (raychat.train.sft: make_task(task, "test") in the run's seed's order, the first --eval-examples)."""
    model, tokenizer, _ = load_model(checkpoint)
    examples = make_task(task, "test", None, cfg.run.seed, data_dir=cfg.data.task_data_dir)
    return task_accuracy(model, tokenizer, examples, cfg.train.eval.eval_examples)


def run_sft_stage(cfg: TrainConfig, base_checkpoint: str, flags: Flags) -> tuple[dict, str]:
    """SFT (`cfg`) from the pretraining checkpoint (resumed, or nothing to do when complete; its lines name the
    options as `flags` does); its figures: the final metrics and, when the mixture has a graded task
    (accuracy_task), that task's held-out accuracy after SFT (the loop's final evaluation)."""
    result = sft(from_dict(TrainConfig, {"init_from": base_checkpoint}, base=cfg), flags=flags)
    checkpoint = result.checkpoint
    figures = {k: v for k, v in result.metrics.items() if k != "samples"}
    figures |= {"eval_examples": cfg.train.eval.eval_examples, "checkpoint": checkpoint}
    task = accuracy_task(cfg)
    if task:
        figures |= {"accuracy_task": task, "accuracy_after": result.metrics[f"{task}_accuracy"]}
    return figures, checkpoint


def with_accuracy_before(figures: dict, base_checkpoint: str, cfg: TrainConfig) -> dict:
    """SFT's figures with the base checkpoint's accuracy on the same held-out examples (nothing to add when
    the SFT mixture has no graded task)."""
    task = figures.get("accuracy_task")
    if task is None:
        return figures
    before = held_out_accuracy(base_checkpoint, cfg, task)
    log(
        f"{task} accuracy: {before:.3f} before SFT, {figures['accuracy_after']:.3f} after "
        f"({plural(figures['eval_examples'], 'held-out problem')})"
    )
    return {**figures, "accuracy_before": before}


def connect(cfg: TrainConfig, preset: str) -> None:
    """Connect to the cluster pretraining (`cfg`, of `preset`) runs on, or start it
    (raychat.train.layout.start_or_connect; its refusals name the preset's keys: train.num_workers), unless a
    stage has: a finished pretraining or SFT run starts none."""
    if not ray.is_initialized():
        c, option = cfg.layout, speedrun_flags(preset, "pretrain").option
        log(start_or_connect(c.num_workers, c.cpus_per_worker, Pretraining.data_cpus, c.use_gpu, option)[0])


def run_rl_stage(
    cfg: RLConfig, checkpoint: str, pretrain_cfg: TrainConfig, flags: Flags, preset: str
) -> tuple[dict, str]:
    """RL (`cfg`) from the SFT checkpoint, on pretraining's cluster (connect: `pretrain_cfg` of `preset`);
    pass@1 on held-out problems before and after. Its lines name the options as `flags` does. Before its lease
    and any actor, `raychat rl`'s checks of its resume (RLRun) and of its max_tokens against the longest prompt
    and the checkpoint's max_seq_len (raychat.rl.cli.check_generation_length; its --flags named by the preset's
    keys through stage_keys, as _run_stages calls it).

    Raises ConfigError as those checks."""
    cfg = from_dict(RLConfig, {"init_from": checkpoint}, base=cfg)
    run = RLRun(cfg, flags=flags)
    check_generation_length(cfg, run.tasks)
    resuming = run.resume_changes if run.finished() is None else None
    for line in [resuming, short_eval_split_warning(cfg, run.tasks, flags.option)]:
        if line:
            log(line)
    if run.finished() is None:
        with run.lease():  # before connect: a run another driver trains is refused before Ray starts
            try:
                connect(pretrain_cfg, preset)
            except (Terminated, KeyboardInterrupt) as e:  # SIGTERM, Ctrl-C while Ray started
                raise type(e)(run.interrupted_line()) from None
            summary = run.run()
    else:
        summary = run.run()
    final = summary["checkpoint"]  # the newest committed (raychat.checkpoint_manager)
    if summary["already_complete"]:  # nothing was trained or evaluated now
        return {"summary": f"already complete ({final})", **summary}, final
    before, after = summary["evals"][0], summary["evals"][-1]
    line = (
        f"{plural(cfg.rollout.steps, 'step')}, pass@1 on {plural(len(run.tasks['test']), 'held-out problem')} "
        f"{before['pass@1']:.3f} -> "
        f"{after['pass@1']:.3f}, learner wait {summary['learner_wait_frac']:.2f}, {summary['wall_s']:.0f} s"
    )
    log(f"RL: {line}")
    return {
        "summary": line,
        "pass@1_before": before["pass@1"],
        "pass@1_after": after["pass@1"],
        **summary,
    }, final


def unigram_baseline(data_dir: Path, tok_dir: Path, max_chars: int = 20_000_000) -> float:
    tok = Tokenizer.load(tok_dir)
    train_files, val_file = list_shards(data_dir)
    train = tok.encode_batch(list(iter_texts(train_files, max_chars)), prepend_bos=True, num_threads=2)
    val = tok.encode_batch(list(iter_texts([val_file], max_chars)), prepend_bos=True, num_threads=2)
    return unigram_bpb(train, val, tok.token_bytes())


# What a speedrun stage's lines call the options its --out lays out (a run by its name: "run base"), and the
# checkpoint SFT and RL start from.
OUT_OPTIONS = {"storage_path": "--out", "data_dir": "--out", "tokenizer_path": "--out", "run_name": "run"}
STARTS_FROM = {"sft": "the pretraining checkpoint", "rl": "the SFT checkpoint"}
OTHER_OUT = "another --out"  # how the speedrun's refusals say to start another speedrun


def speedrun_flags(preset: str, stage: str, sft_keys: frozenset[str] | None = None) -> Flags:
    """How the lines of the speedrun's `stage` (pretrain, sft, rl) name what its user sets
    (raychat.train.launch.Flags): pretraining's num_iterations by --num-iterations, what --out lays out as in
    OUT_OPTIONS, the checkpoint SFT and RL start from as in STARTS_FROM, any other option by the key of `preset`
    that sets it, <section>.<key> ("train.depth", "sft.num_iterations", "rl.steps"; SFT's settings are the train
    section's with its own section's over them: `sft_keys`, the flat names its sft section sets, as
    SpeedrunConfig.sft_keys holds them, read with the preset once; None: read from `preset`); another run is
    another --out, and this one resumes with the same --preset; OUT_OPTIONS are laid out (Flags.laid_out)."""
    section = {"pretrain": "train", "rl": "rl"}.get(stage, "sft")
    own = sft_keys if stage == "sft" else frozenset()
    if own is None:
        section_values = preset_section(preset, "sft")
        try:
            own = frozenset(flatten(TrainConfig, section_values))
        except ConfigError:  # an unknown key: the error being named says so; name by the keys as written
            own = frozenset(section_values)

    def option(name: str) -> str:
        if stage == "pretrain" and name == "num_iterations":
            return "--num-iterations"
        if name == "init_from" and stage in STARTS_FROM:
            return STARTS_FROM[stage]
        if name in OUT_OPTIONS:
            return OUT_OPTIONS[name]
        return f"{'train' if stage == 'sft' and name not in own else section}.{name}"

    return Flags(option, OTHER_OUT, "the same --preset", laid_out=frozenset(OUT_OPTIONS))


_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
_STAGE_CONFIGS = {"pretrain": TrainConfig, "sft": TrainConfig, "rl": RLConfig}


def named_by_keys(
    error: ValueError, preset: str, stage: str, sft_keys: frozenset[str] | None = None
) -> ValueError:
    """`error` (a configuration error of the speedrun's `stage`: pretrain, sft, rl) with every --flag of that
    stage's options in its message named as the speedrun names them (speedrun_flags, of `sft_keys`: the
    preset's key, "train.min_workers"); `error` itself when it names none."""
    options, option = leaves(_STAGE_CONFIGS[stage]), speedrun_flags(preset, stage, sft_keys).option

    def named(flag: re.Match) -> str:
        name = flag.group(1).replace("-", "_")
        return option(name) if name in options else flag.group(0)

    message = str(error)
    if stage in STARTS_FROM:  # not "the the pretraining checkpoint checkpoint"
        message = message.replace("the --init-from checkpoint", STARTS_FROM[stage])
    message = _FLAG.sub(named, message)
    return error if message == str(error) else ConfigError(message)


@contextlib.contextmanager
def stage_keys(
    preset: str, stage: str, errors: type[ValueError] = ConfigError, sft_keys: frozenset[str] | None = None
):
    """Within: a ConfigError (a bad setting found while the stage plans or starts: a total batch that does not
    divide, a --seq-len the model cannot hold...), or any of `errors` (check_stages: ValueError, the one-line
    refusals of task files and layouts), is raised again naming the preset's keys (named_by_keys, of
    `sft_keys`)."""
    try:
        yield
    except errors as e:
        named = named_by_keys(e, preset, stage, sft_keys)
        if named is e:
            raise
        raise named from e


def main(args) -> int:
    """`raychat speedrun` (its parser: raychat.commands.speedrun); the Ray auth token as `raychat pretrain`'s
    (raychat.train.pretrain.main).

    Raises ValueError as each stage's command, its refusals naming the speedrun's flags and the preset's keys
    (speedrun_flags)."""
    with token_for(None, args.token_file):
        run_speedrun(args.preset, args.out, args.num_iterations)
    return 0

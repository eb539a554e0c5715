"""`raychat rl`: RL of a chat checkpoint on a task (raychat.rl.loop.RLRun) on a local or given Ray cluster.

--init-from is any reference raychat.checkpoint_manager resolves (`latest`: the newest SFT checkpoint under
--storage-path; an s3:// or gs:// one is fetched by every actor that loads it); --storage-path is any storage
root (a directory, NFS, s3://, gs://) the run's checkpoints are committed to. Both, the files of a hub
--task, and a run to resume (raychat.rl.loop.check_resume), are checked before Ray starts. A cluster with token
authentication (--address) gets the token of --token-file (else $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH,
~/.ray/auth_token), as `raychat serve` does."""

from __future__ import annotations

import argparse
import json
import os
import sys

import ray

from raychat.capacity import local_capacity, start_local_cluster
from raychat.chat_template import render_for_completion
from raychat.checkpoint import check_model, read_meta, read_tokenizer
from raychat.checkpoint_manager import commit_of, find_checkpoint
from raychat.config import ConfigError, RLConfig, TrainConfig, from_args, from_dict
from raychat.config.flags import given
from raychat.config.schema import flag_name
from raychat.log import plural
from raychat.ray_token import check_gcs_address, token_for
from raychat.rl.actors import check_layout
from raychat.rl.loop import RLRun, layout_line
from raychat.sigterm import Terminated, init_keeping_handler
from raychat.storage import check_writable, open_storage
from raychat.tasks.registry import check_data
from raychat.train.layout import local_cores
from raychat.train.optim import peak_lrs_text, planned_ns_choice
from raychat.train.plan import init_from_line


def resolve_inputs(cfg: RLConfig) -> RLConfig:
    """--storage-path absolute (or its URI), --init-from the checkpoint it names; --task's files checked.

    Raises ValueError naming the flag: no --init-from, or one that names nothing (a `latest` that finds no SFT
    checkpoint under --storage-path also says where sft's runs are: LATEST_HINT); a hub --task whose train or
    test file is missing under --task-data-dir, or holds a bad record (raychat.tasks.registry.check_data); CheckpointError naming the
    file: an --init-from that could not load (raychat.checkpoint.check_model; of a remote one, its sizes and
    meta.json)."""
    if not cfg.run.init_from:
        raise ValueError(
            "--init-from: required: a chat (SFT) checkpoint, its run (dir or name), or latest (the newest SFT one)"
        )
    check_data([cfg.task.task], ("train", "test"), cfg.task.task_data_dir, "--task")
    storage = open_storage(cfg.run.storage_path)
    try:
        init_from = find_checkpoint(cfg.run.init_from, storage, "--init-from", stages=("sft",))
    except ValueError as e:
        if cfg.run.init_from.strip() == "latest" and "no committed sft checkpoint" in str(e):
            raise ValueError(f"{e}; {LATEST_HINT}") from None
        raise
    check_model(init_from)
    return from_dict(RLConfig, {"init_from": init_from, "storage_path": storage.uri}, base=cfg)


# `raychat rl --init-from latest` searches rl's --storage-path (runs/rl), which holds RL runs; sft's runs are
# under its own (runs/checkpoints) unless both stages were given one root (raychat submit's chain)
SFT_STORAGE = TrainConfig().run.storage_path
LATEST_HINT = (
    f"latest searches rl's --storage-path, and raychat sft writes its runs under its own (default {SFT_STORAGE}): "
    f"give the SFT run, e.g. --init-from {SFT_STORAGE}/sft/latest (the speedrun's), or give sft and rl one "
    "--storage-path"
)


def check_generation_length(cfg: RLConfig, tasks: dict) -> None:
    """Refuse a --max-tokens that does not fit after the longest prompt of `tasks` ({"train", "test": Task},
    rendered as the rollout actors render them) within the --init-from model's max_seq_len: the engine
    cut such completions short at max_seq_len without a word (a prompt that filled it failed in an actor,
    after Ray started). Of a remote --init-from only meta.json and tokenizer.json are read.

    Raises:
        ConfigError: naming --max-tokens, the longest prompt, the checkpoint's max_seq_len and the allowed range.
    """
    max_seq_len = read_meta(cfg.run.init_from)["model_config"]["max_seq_len"]
    longest = longest_prompt(read_tokenizer(cfg.run.init_from), tasks)
    check_generation_room(
        cfg,
        longest,
        max_seq_len,
        f"the --init-from checkpoint {cfg.run.init_from} has max_seq_len {max_seq_len}",
    )


def longest_prompt(tokenizer, tasks: dict) -> int:
    """Tokens of the longest prompt of `tasks` ({"train", "test": Task}) rendered as the rollout actors render
    them (raychat.chat_template.render_for_completion of a conversation's messages but its last)."""
    return max(
        len(render_for_completion(tokenizer, task[i]["messages"][:-1]))
        for task in tasks.values()
        for i in range(len(task))
    )


def check_generation_room(cfg: RLConfig, longest: int, max_seq_len: int, model: str) -> None:
    """Refuse a --max-tokens above max_seq_len - `longest` (the longest prompt's tokens); `model` names where
    max_seq_len comes from ("the --init-from checkpoint X has max_seq_len 64").

    Raises:
        ConfigError: naming --max-tokens, the longest prompt, `model` and the allowed range.
    """
    room, max_tokens = max_seq_len - longest, cfg.rollout.max_tokens
    if max_tokens > room:
        allowed = f"1..{room}" if room >= 1 else "none: that prompt alone fills max_seq_len"
        raise ConfigError(
            f"--max-tokens {max_tokens}: the longest --task {cfg.task.task} prompt has {longest} tokens and "
            f"{model}, which must hold prompt and completion; allowed: {allowed}"
        )


def short_eval_split_warning(cfg: RLConfig, tasks: dict, option=flag_name) -> str | None:
    """A warning line when --eval-examples is above the number of problems of --task's test split (a hub task's
    file; `tasks`: {"train", "test": Task}): pass@k was over the split's problems without a word, and the
    speedrun's line counted --eval-examples held-out problems. None otherwise. `option` names a config field as
    the command's lines do."""
    have, asked = len(tasks["test"]), cfg.eval.eval_examples
    if have >= asked:
        return None
    return (
        f"warning: {option('eval_examples')} {asked}: --task {cfg.task.task}'s test split has {have} problems; "
        f"pass@k is over those {have}"
    )


def check_flags_used(args: argparse.Namespace, cfg: RLConfig) -> None:
    """Refuse a flag typed for a mode the run is not in, which changed nothing without a word: --max-staleness or
    --clip-eps in --mode sync (on-policy: every sample is the current policy's, its ratio 1, nothing clipped),
    --constant-length without --normalization constant. A preset's values for them stay accepted.

    Raises:
        ConfigError: naming the flag, the mode it needs and the run's.
    """
    typed = given(args, RLConfig)
    mode, normalization = cfg.asynchrony.mode, cfg.objective.normalization
    for name in ("max_staleness", "clip_eps"):
        if name in typed and mode == "sync":
            raise ConfigError(
                f"{flag_name(name)} {typed[name]}: used only with --mode async; this run is --mode sync (on-policy: "
                f"every sample comes from the current weights, its importance ratio 1, nothing to clip): add "
                f"--mode async, or leave {flag_name(name)} out"
            )
    if "constant_length" in typed and normalization != "constant":
        raise ConfigError(
            f"--constant-length {typed['constant_length']}: used only with --normalization constant; this run's "
            f"is {normalization}: add --normalization constant, or leave --constant-length out"
        )


def config_for(args: argparse.Namespace) -> RLConfig:
    """The command's RLConfig: flags > --preset (its rl section, or the whole file) > defaults."""
    return from_args(args, RLConfig, "rl", where="rl settings")


def base_model_warning(checkpoint: str) -> str | None:
    """A warning line when `checkpoint` (the resolved --init-from) is a pretraining checkpoint: RL samples
    chat-template turns, which only SFT teaches, so a base model's rewards are all but certain to be 0 (it was
    accepted without a word); None for any other stage's checkpoint. Raises as commit_of does."""
    if commit_of(checkpoint).get("stage") != "pretrain":
        return None
    return (
        f"warning: --init-from {checkpoint} is a pretraining checkpoint, not fine-tuned for chat: RL samples "
        "chat-template turns (and calculator calls) that SFT teaches, so expect no reward; give an SFT checkpoint "
        "(raychat sft --init-from this one makes one)"
    )


def main(args) -> int:
    """`raychat rl` (its parser: raychat.commands.rl). Without a cluster to connect to (--address,
    RAY_ADDRESS) it starts a local one of this machine's cores (raychat.train.layout.local_cores), with the
    dashboard as pretraining's (its metrics service discovery for Prometheus), after checking that the layout
    fits it; a run already at its --steps says so in one line and starts none (RLRun.run). Any other run takes
    its lease (RLRun.lease) before Ray starts: while another live driver trains it, one line and exit 2.
    A run with steps left prints plan_line, optimizer_line and run_dir_line first; --dry-run makes every check
    but the storage root's write probe, prints them and exits 0: no lease, no Ray, nothing written."""
    local = not ray.is_initialized() and not (args.address or os.environ.get("RAY_ADDRESS"))
    try:
        check_gcs_address(args.address)
        cfg = resolve_inputs(config_for(args))
        check_flags_used(args, cfg)
        run = RLRun(cfg)  # the resume check (raychat.rl.loop.check_resume), before Ray starts
        check_generation_length(cfg, run.tasks)
        if local:  # a cluster of this machine never grows: refuse now what it could never place
            check_layout(cfg, local_capacity(local_cores()))
        if not args.dry_run:  # creates the root
            check_writable(open_storage(cfg.run.storage_path))
    except (ValueError, FileNotFoundError) as e:
        print(f"raychat rl: error: {e}", file=sys.stderr)
        return 2
    print(init_from_line(cfg.run.init_from))
    if run.resume_changes and run.finished() is None:
        print(run.resume_changes)
    for warning in [base_model_warning(cfg.run.init_from), short_eval_split_warning(cfg, run.tasks)]:
        if warning:
            print(warning, file=sys.stderr)
    if run.finished() is None:
        print(plan_line(cfg, run))
        print(optimizer_line(cfg, read_meta(cfg.run.init_from)["model_config"]["n_embd"]))
        print(run_dir_line(run))
    if args.dry_run:
        if run.finished() is not None:
            run.run()  # its finished line, without Ray
        return 0
    if run.finished() is not None:  # a finished run needs no cluster, nor the lease
        summary = run.run()
    else:
        with run.lease():  # before Ray starts: a second start of the run is refused in one line
            summary = _run_on_ray(run, args, local)
    print(json.dumps(summary, default=str))
    return 0


def plan_line(cfg: RLConfig, run: RLRun) -> str:
    """What `run` would do, in one line (`raychat rl --dry-run`): its steps from where it resumes, each step's
    rollouts and their budget, its evaluations, checkpoints and layout, e.g. "plan: steps 1..50 of 8 prompts x
    8 samples = 64 rollouts a step, at most 48 tokens each at --temperature 1; pass@1..8 on 64 held-out problems
    at step 0 and every 10 steps and at the end; a checkpoint every 10 steps and at the end (the newest 2 kept);
    1 learner x {CPU: 0.5} + 2 rollout actors x {CPU: 0.5}"."""
    r, c = cfg.rollout, cfg.checkpoint
    newest = run.checkpoints.newest()
    start = newest.step if newest else 0
    resuming = f" (resuming from {run.checkpoints.uri(start)})" if newest else ""
    k = run.dispatcher.eval_samples
    evals = f"pass@1{f'..{k}' if k > 1 else ''} on {plural(len(run.tasks['test']), 'held-out problem')} "
    return (
        f"plan: steps {start + 1}..{r.steps}{resuming} of {plural(r.prompts_per_step, 'prompt')} x "
        f"{plural(r.samples_per_prompt, 'sample')} = {r.prompts_per_step * r.samples_per_prompt} rollouts a step, "
        f"at most {r.max_tokens} tokens each at --temperature {r.temperature:g}; {evals}"
        f"{'' if newest else 'at step 0 and '}{_when(cfg.eval.eval_every)}; a checkpoint "
        f"{_when(c.checkpoint_every)} (the newest {c.keep_checkpoints} kept); {layout_line(cfg)}"
    )


def optimizer_line(cfg: RLConfig, width: int) -> str:
    """The learner's optimizer as it applies the flags to a model of `width` (n_embd): its peak lrs as training's
    plan prints them (raychat.train.optim.peak_lrs_text), the Newton-Schulz dtype, constant (RL has no
    schedule), weight decay and clipping, e.g. "optimizer: Muon 0.0002 for the hidden matrices; AdamW x 3.464 (=
    (width 64 / 768) ** -0.5): embedding 0.003464, lm_head 0.003464, norms 0.003464; Newton-Schulz in float32 on
    cpu (requested); constant lrs (no warmup or decay); Muon weight decay 0, grad clipping at global norm 1"."""
    o = cfg.optim
    ns = planned_ns_choice(o.ns_dtype, cfg.layout.use_gpu)
    clip = f"grad clipping at global norm {o.grad_clip:g}" if o.grad_clip else "no grad clipping"
    return (
        f"optimizer: {peak_lrs_text(o, width)}; {ns}; constant lrs (no warmup or decay); Muon weight decay "
        f"{o.weight_decay:g}, {clip}"
    )


def run_dir_line(run: RLRun) -> str:
    """Where `run` writes and how it resumes, e.g. "run dir: /home/me/runs/rl/rl (config.yaml, metrics.jsonl:
    a line a step, checkpoint_<step>; rollouts are not kept; the same command resumes from the newest
    checkpoint)"."""
    return (
        f"run dir: {run.run_dir} (config.yaml, metrics.jsonl: a line a step, checkpoint_<step>; rollouts are not "
        "kept; the same command resumes from the newest checkpoint)"
    )


def _when(every: int) -> str:
    """When an --eval-every / --checkpoint-every of `every` steps comes due (0: only at the end)."""
    return (
        "at the end" if every == 0 else "every step" if every == 1 else f"every {every} steps and at the end"
    )


def _run_on_ray(run: RLRun, args, local: bool) -> dict:
    """run.run() on the cluster of --address / RAY_ADDRESS, or on a local one started here (and shut down after).
    SIGTERM while Ray starts raises Terminated of run's interrupted line once ray.init returned (its Ray then shut
    down: raychat.sigterm.init_keeping_handler)."""
    started = not ray.is_initialized()
    try:
        if started:
            try:
                with token_for(args.address, args.token_file):
                    if local:
                        init_keeping_handler(start_local_cluster, num_cpus=local_cores())
                    else:
                        init_keeping_handler(ray.init, address=args.address)
            except (Terminated, KeyboardInterrupt) as e:  # SIGTERM (raychat.sigterm.terminating), Ctrl-C
                raise type(e)(run.interrupted_line()) from None
        return run.run()
    finally:
        if started:
            ray.shutdown()

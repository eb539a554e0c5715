"""Bad input to the cluster stages fails before any work starts, in one line naming the flag and what was found,
and leaves what is already in storage as it was (issue 12, "Bad input"): a storage path that is not writable
(pretrain, sft, eval, export, data prepare; pretraining and the tokenizer check their --data-dir first),
a `latest` that resolves to nothing, a preset that does not exist, an unreachable cluster, a task spec that
does not parse, an RL task without its files, a run whose newest checkpoint this run cannot resume (pretraining,
SFT, RL). (A wrong
token needs a cluster: tests/cluster/test_stage_jobs.py.)

Each command runs in this process through raychat.cli.main, so "before any work" is checkable: Ray was never
started, and every file under the storage root has the bytes and modification time it had before.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import ray
import torch
import yaml
from safetensors.torch import load_file, save_file
from support.fake_dashboard import RAY_VERSION, FakeDashboard
from support.serve_helpers import tiny_model_and_tokenizer, write_tiny_checkpoint

from raychat import checkpoint_manager
from raychat.capacity import start_failure
from raychat.checkpoint import save_model
from raychat.checkpoint_manager import commit_directory
from raychat.cli import main as raychat_main
from raychat.config import RLConfig, from_dict, preset_values, to_dict
from raychat.data.corpus.shards import write_manifest, write_shards
from raychat.data.loader import sft_rows
from raychat.lease import RunLease
from raychat.model import GPT, ModelConfig
from raychat.ops import submit
from raychat.ports import free_ports
from raychat.speedrun import reused_tokenizer_line, speedrun_flags
from raychat.storage import open_storage
from raychat.tasks import loaders, spelling
from raychat.tasks.sft_data import forget_read
from raychat.tokenizer import Tokenizer
from raychat.train import launch, sft
from raychat.train.checkpointer import Checkpointer
from raychat.train.layout import local_cores
from raychat.train.optim import build_optimizers
from raychat.train.step import autocast_for


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {
        p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def root(tmp_path, small_tokenizer) -> Path:
    """A storage root holding a tokenizer, a data dir and a pretraining run with one committed checkpoint, but
    no SFT run."""
    r = tmp_path / "runs"
    small_tokenizer.save(r / "tokenizer")
    (r / "data").mkdir()
    (r / "data" / "manifest.json").write_text('{"shards": []}\n')
    _pretrained_with(small_tokenizer, r / "pretrain" / "checkpoint_000004")
    return r


def _pretrained_with(tokenizer: Tokenizer, directory: Path, seed: int = 0, stage: str = "pretrain") -> Path:
    """A committed model-only checkpoint (checkpoint_<step>) of `stage`: a random 2-layer model over
    `tokenizer` (SFT's --tokenizer-path)."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                            head_dim=16, intermediate_size=128, max_seq_len=256))  # fmt: skip
    step = int(directory.name.removeprefix("checkpoint_"))
    save_model(directory, model, tokenizer, {"step": step, "stage": stage}, commit=True)
    return directory


def _fails_in_one_line(argv: list[str], capsys) -> str:
    rc = raychat_main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, out + err  # bad input: every command's exit status 2
    assert not ray.is_initialized(), "Ray was started before the input was checked"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


NOT_A_DIR = "{file}/runs"  # a path below a regular file: no directory can be created there


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["pretrain", "--preset", "tiny", "--storage-path", NOT_A_DIR,
          "--data-dir", "{root}/prepared", "--tokenizer-path", "{root}/tokenizer"], "--storage-path"),
        (["sft", "--preset", "tiny", "--storage-path", NOT_A_DIR, "--init-from", "{root}/pretrain",
          "--tokenizer-path", "{root}/tokenizer"], "--storage-path"),
        (["eval", "--storage-path", NOT_A_DIR, "--checkpoint", "{root}/pretrain", "--data-dir", "{root}/data"],
         "--data-dir"),
        (["export", "--storage-path", NOT_A_DIR, "--checkpoint", "{root}/pretrain/latest"], "--storage-path"),
        (["data", "prepare", "--source", "{root}/texts", "--num-shards", "1", "--storage-path", NOT_A_DIR],
         "--storage-path"),
    ],
)  # fmt: skip
def test_a_storage_path_that_is_not_writable(argv, flag, root, tmp_path, capsys):
    """Pretraining and data prepare check their input before the root (so a failed check creates no root): they
    get good input."""
    (tmp_path / "file").write_text("x")
    _good_input(root)
    before = _snapshot(root)
    argv = [a.format(root=root, file=tmp_path / "file") for a in argv]
    line = _fails_in_one_line(argv, capsys)
    assert f"error: {flag}: " in line, line
    assert _snapshot(root) == before


GOOD_TEXT = "a b c d " * 10


def _too_little_text(root: Path) -> Path:
    """root/small: prepared data whose validation shard (4 short documents) fills no row of 65 tokens."""
    entries = write_shards(["a b c d"] * 8, root / "small", num_shards=2, log=lambda *_: None)
    write_manifest(root / "small", {"source": "test", "shards": entries})
    return root / "small"


def _good_input(root: Path) -> None:
    """root/prepared: prepared data (its validation shard fills a row of the tiny preset's 65 tokens); root/texts:
    a source for `data prepare`."""
    entries = write_shards([GOOD_TEXT] * 8, root / "prepared", num_shards=2, log=lambda *_: None)
    write_manifest(root / "prepared", {"source": "test", "shards": entries})
    (root / "texts").mkdir()
    for i in range(4):
        (root / "texts" / f"{i}.txt").write_text(f"document {i}")


def test_a_validation_shard_too_small_for_one_row_stops_pretraining_before_ray(root, capsys):
    """Every rank's validator packs the validation shard into rows of --seq-len + 1 first: with too little
    text each failed in turn after Ray started (54 s here), with tracebacks and exit 1."""
    small = _too_little_text(root)
    argv = ["pretrain", "--preset", "tiny", "--storage-path", str(root), "--run-name", "p", "--data-dir",
            str(small), "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    before = _snapshot(root)
    why = (
        f"--data-dir: the validation shard {small}/shard_00001.parquet holds too little text for one row of 65 "
        "tokens (4 documents): prepare more text (a larger validation shard) or use a shorter sequence length"
    )
    assert (
        _fails_in_one_line(argv, capsys)
        == f"raychat pretrain: error: {why}  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert raychat_main([*argv, "--dry-run"]) == 0  # the dry run says it where the run prints its data line
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("data:")] == [
        f"data: not ready; the run would refuse it: {why}"
    ]
    assert _snapshot(root) == before and not (root / "p").exists()


@pytest.mark.parametrize(
    "data, want",
    [
        ("{root}/missing", "--data-dir: {root}/missing/manifest.json not found: give --data-dir a directory "
         "`raychat data prepare` wrote, or run `raychat data prepare --out {root}/missing` first"),
        ("{root}/data", "--data-dir: {root}/data/manifest.json: needs >= 2 shards with the last one split='val', "
         "got []"),
    ],
)  # fmt: skip
def test_pretraining_data_that_is_not_prepared(data, want, root, capsys):
    """Checked in the driver, before Ray: each worker would otherwise fail on it in turn, with tracebacks. The
    dry run printed no data line at all; it plans without the data (exit 0) and says in one line what the run
    would refuse them with."""
    argv = ["pretrain", "--preset", "tiny", "--storage-path", "{root}", "--run-name", "p", "--data-dir", data,
            "--tokenizer-path", "{root}/tokenizer"]  # fmt: skip
    argv, want = [a.format(root=root) for a in argv], want.format(root=root)
    before = _snapshot(root)
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat pretrain: error: {want}  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert raychat_main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("data:")] == [
        f"data: not ready; the run would refuse it: {want}"
    ]
    assert "\nmodel: depth 1 width 64" in out  # the plan follows
    assert _snapshot(root) == before and not (root / "p").exists()


def test_a_truncated_train_shard_stops_pretraining_before_ray(root, capsys):
    """A train shard cut short (an interrupted copy of the data directory) passed every check before Ray, and
    each Train worker failed on it in turn with ArrowInvalid naming no file: the driver reads every listed
    shard's footer first (pretrain.validation_shard)."""
    _good_input(root)
    shard = root / "prepared" / "shard_00000.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    argv = ["pretrain", "--preset", "tiny", "--storage-path", str(root), "--run-name", "p", "--data-dir",
            f"{root}/prepared", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    before = _snapshot(root)
    why = (
        f"--data-dir: {shard}: not a readable parquet file (Parquet magic bytes not found in footer. Either the "
        "file is corrupted or this is not a parquet file.)"
    )
    assert (
        _fails_in_one_line(argv, capsys)
        == f"raychat pretrain: error: {why}  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before and not (root / "p").exists()


def test_a_folder_of_documents_given_as_data_dir_is_told_to_be_prepared_first(tmp_path, capsys):
    """A user's own folder of texts given to --data-dir was told to run `raychat data prepare --out` that folder,
    which refuses it (not an earlier data directory); it is prepare's --source. Shards of a prepare that did not
    finish (no manifest) are not documents, nor is what a folder below holds (a storage root's runs hold .md
    files): those keep the old advice."""
    docs = tmp_path / "my_texts"
    docs.mkdir()
    (docs / "a.jsonl").write_text('{"text": "a document"}\n')
    argv = ["tokenizer", "train", "--data-dir", str(docs), "--out", str(tmp_path / "tok")]
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat tokenizer train: error: --data-dir: {docs}/manifest.json not found: {docs} holds documents, not "
        f"the shards `raychat data prepare` writes: run `raychat data prepare --source {docs} --out DIR` and give "
        "--data-dir DIR  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    half = tmp_path / "half"
    (half / "run").mkdir(parents=True)
    (half / "shard_00000.parquet").write_bytes(b"")
    (half / "run" / "report_card.md").write_text("# a run's report card")
    argv = ["tokenizer", "train", "--data-dir", str(half), "--out", str(tmp_path / "tok")]
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat tokenizer train: error: --data-dir: {half}/manifest.json not found: give --data-dir a directory "
        f"`raychat data prepare` wrote, or run `raychat data prepare --out {half}` first  (RAYCHAT_DEBUG=1 shows "
        "the traceback)"
    )
    assert not (tmp_path / "tok").exists()


def test_pretraining_without_a_tokenizer_names_the_flag_and_the_command_that_trains_one(
    root, tmp_path, capsys
):
    """Prepared data but no tokenizer: the run said `no tokenizer at ... (train one with `raychat tokenizer
    train`)`, which writes runs/tokenizer, not the path the run reads; --dry-run with a preset that sets no
    vocabulary said `no tokenizer.json in ... (--tokenizer-path)`, and nothing of what to do."""
    _good_input(root)
    missing = tmp_path / "no-tokenizer"
    argv = ["pretrain", "--storage-path", str(root), "--run-name", "p", "--data-dir", f"{root}/prepared",
            "--tokenizer-path", str(missing)]  # fmt: skip
    want = (
        f"raychat pretrain: error: --tokenizer-path: no tokenizer.json in {missing}: give --tokenizer-path a "
        f"directory `raychat tokenizer train` wrote, or run `raychat tokenizer train --data-dir {root}/prepared "
        f"--out {missing}` first"
    )
    before = _snapshot(root)
    assert (
        _fails_in_one_line([*argv, "--preset", "tiny"], capsys)
        == f"{want}  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    preset = tmp_path / "mine.yaml"  # a user's preset: a train section, no tokenizer section
    preset.write_text("train:\n  depth: 2\n  seq_len: 64\n")
    assert _fails_in_one_line([*argv, "--preset", str(preset), "--dry-run"], capsys) == (
        f"{want} (or, to size the plan without one, a --preset whose tokenizer section sets vocab_size)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before and not (root / "p").exists() and not missing.exists()


def test_a_new_storage_root_is_not_created_for_a_run_that_fails_its_checks(root, tmp_path, capsys):
    """The root a run would create (--storage-path of a directory that does not exist yet) is created only once
    the inputs passed their checks: unprepared data leaves nothing behind."""
    new_root = tmp_path / "new-root"
    argv = ["pretrain", "--preset", "tiny", "--storage-path", str(new_root), "--run-name", "p",
            "--data-dir", f"{root}/missing", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    line = _fails_in_one_line(argv, capsys)
    assert f"--data-dir: {root}/missing/manifest.json not found" in line, line
    assert not new_root.exists()


def test_a_total_batch_that_does_not_divide_names_the_flags_as_typed(tmp_path, capsys):
    """It named `device_batch_size x seq_len x num_workers`, which are no flags. The tiny preset: 4 rows x 64
    tokens x 2 workers = 512 a micro-step; 1000 // 512 = 1, so 512 or 1024."""
    argv = ["pretrain", "--preset", "tiny", "--storage-path", str(tmp_path), "--total-batch-size", "1000",
            "--dry-run"]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        "raychat pretrain: error: --total-batch-size 1000 is not a multiple of --device-batch-size x --seq-len x "
        "--num-workers = 4 x 64 x 2 = 512; allowed: a multiple of 512, e.g. 512 or 1024  (RAYCHAT_DEBUG=1 shows "
        "the traceback)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--source", "{tmp}/nope"], "--source {tmp}/nope: no such directory; give debian-docs, fineweb-edu, "
         "climbmix or a directory of documents"),
        (["--source", "fineweb"], "--source fineweb: no such directory; give debian-docs, fineweb-edu, climbmix or a "
         "directory of documents"),
        (["--source", "{tmp}/texts/a.txt"], "--source {tmp}/texts/a.txt: a file; give debian-docs, fineweb-edu, "
         "climbmix or a directory of documents"),
        (["--source", "{tmp}/texts", "--num-shards", "2", "--rows-per-shard", "5"],
         "give --num-shards or --rows-per-shard for a local source, not both"),
        (["--source", "{tmp}/empty"], "--source {tmp}/empty: no usable documents: it holds no text (documents are "
         ".txt, .md and .rst files, .jsonl lines and .parquet rows)"),
        (["--source", ""], "--source must not be blank, got '' (default: 'debian-docs')"),
        (["--source", "climbmix", "--num-shards", "7000"], "--num-shards must be in [1, 6542] for --source climbmix (its train "
         "shards come before its validation shard 6542), got 7000"),
    ],
)  # fmt: skip
def test_data_prepare_checks_its_input_before_it_creates_the_root(argv, want, tmp_path, capsys):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("one document")
    (tmp_path / "empty").mkdir()
    new_root = tmp_path / "new-root"
    argv = ["data", "prepare", *(a.format(tmp=tmp_path) for a in argv), "--storage-path", str(new_root)]
    assert _fails_in_one_line(argv, capsys) == f"raychat data prepare: error: {want.format(tmp=tmp_path)}"
    assert not new_root.exists()


def test_a_parquet_file_of_another_text_type_is_named_with_its_source_flag(tmp_path, capsys):
    """It read "i.parquet: the `text` column holds int64 ...": a name within a folder no flag was said to give."""
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "src" / "i.parquet")
    assert _fails_in_one_line(["data", "prepare", "--source", str(tmp_path / "src"), "--out", str(tmp_path / "d")],
                              capsys) == (
        f"raychat data prepare: error: --source {tmp_path}/src: i.parquet: the `text` column holds int64, not "
        "strings (string or UTF-8 binary)"
    )  # fmt: skip
    assert not (tmp_path / "d").exists()


def test_a_mistyped_source_name_is_not_read_as_a_folder(tmp_path, capsys):
    """`--source fineweb` logged "loading documents from folder fineweb", then refused it as "not a directory (and
    not one of the named sources)", naming none of them."""
    assert raychat_main(["data", "prepare", "--source", "fineweb", "--out", str(tmp_path / "d")]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "raychat data prepare: error: --source fineweb: no such directory; give debian-docs, "
                              "fineweb-edu, climbmix or a directory of documents\n")  # fmt: skip


@pytest.mark.parametrize(
    "argv, error",
    [
        (["tokenizer", "train", "--data-dir", "{root}/prepared", "--vocab-size", "300"], "raychat tokenizer train: error"),
        (["data", "prepare", "--source", "{root}/texts", "--num-shards", "1"], "raychat data prepare: error"),
        (["export", "--checkpoint", "pretrain"], "raychat export: error"),
        (["eval", "--checkpoint", "pretrain", "--data-dir", "{root}/prepared"], "raychat eval: error"),
    ],
)  # fmt: skip
def test_a_run_directory_that_a_link_leads_out_of_the_root(argv, error, root, tmp_path, capsys):
    """Nothing is written through root/link, which leads to a directory outside the root."""
    _good_input(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    argv = [a.format(root=root) for a in argv] + ["--storage-path", str(root), "--run-name", "link"]
    line = _fails_in_one_line(argv, capsys)
    assert line.startswith(
        f"{error}: --run-name: {root}/link is not below the storage root {root}: a symbolic link on the way "
        f"leads to {outside.resolve()}: refused"
    ), line
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    "argv, want",
    [
        (["sft", "--preset", "tiny", "--storage-path", "{root}", "--init-from", "latest"],
         "--init-from: latest: no committed pretrain checkpoint under {root} ({root} holds: data/, tokenizer/)"),
        (["rl", "--preset", "tiny", "--storage-path", "{root}", "--init-from", "latest"],
         "--init-from: latest: no committed sft checkpoint under {root} ({root} holds: data/, pretrain/, "
         "tokenizer/)"),
        (["eval", "--preset", "tiny", "--storage-path", "{root}", "--checkpoint", "{root}/sft/latest"],
         "--checkpoint: {root}/sft does not exist ({root} holds: data/, pretrain/, tokenizer/)"),
        (["export", "--storage-path", "{root}", "--checkpoint", "sft"],
         "--checkpoint: {root}/sft does not exist ({root} holds: data/, pretrain/, tokenizer/)"),
    ],
)  # fmt: skip
def test_a_latest_that_resolves_to_nothing(argv, want, root, capsys):
    if argv[0] == "sft":  # a root with no pretraining run at all
        root = root.parent / "other"
        root.mkdir()
        (root / "data").mkdir()
        (root / "tokenizer").mkdir()
    before = _snapshot(root)
    line = _fails_in_one_line([a.format(root=root) for a in argv], capsys)
    assert want.format(root=root) in line, line
    assert _snapshot(root) == before


@pytest.mark.parametrize(
    "argv, want",
    [
        (["export", "--storage-path", "{root}", "--checkpoint", "pretrain", "--run-name", ".."],
         "--run-name: '..' is not a run name"),
        (["export", "--storage-path", "{root}", "--checkpoint", "pretrain", "--run-name", "../escape"],
         "--run-name: '../escape' is not a run name"),
        (["export", "--storage-path", "{root}", "--checkpoint", "pretrain", "--run-name", "pretrain"],
         "--run-name: {root}/pretrain holds a training run's checkpoints, which an export there would replace"),
        (["eval", "--storage-path", "{root}", "--checkpoint", "pretrain", "--run-name", ".hidden"],
         "--run-name: '.hidden' is not a run name"),
        (["pretrain", "--preset", "tiny", "--storage-path", "{root}", "--run-name", "a/b"],
         "--run-name: 'a/b' is not a run name"),
        (["sft", "--preset", "tiny", "--storage-path", "{root}", "--init-from", "..", "--run-name", "s"],
         "--init-from: '..' is not a run name"),
        (["rl", "--preset", "tiny", "--storage-path", "{root}", "--init-from", "pretrain", "--run-name", ""],
         "--run-name: '' is not a run name"),
        (["data", "prepare", "--preset", "tiny", "--storage-path", "{root}", "--run-name", ".."],
         "--run-name: '..' is not a run name"),
    ],
)  # fmt: skip
def test_a_run_name_that_would_leave_its_run_directory(argv, want, root, capsys):
    """The one run-name rule, checked before anything is read or written: nothing under or beside the root
    changes (an export to '' once replaced the whole root)."""
    before = _snapshot(root.parent)
    line = _fails_in_one_line([a.format(root=root) for a in argv], capsys)
    assert want.format(root=root) in line, line
    assert _snapshot(root.parent) == before


CKPT = "{root}/pretrain/checkpoint_000004"


def _not_earlier(output: str, earlier: str, directory: str, holds: str, flag: str = "--run-name") -> str:
    held = f"{directory} holds: {holds}"
    return f"{output} would replace {directory}, which is not {earlier} ({held}); choose another {flag}"


@pytest.mark.parametrize(
    "argv, want",
    [
        (["export", "--checkpoint", CKPT, "--out", CKPT],
         f"--out: {CKPT} is a checkpoint, which an export there would replace; choose another --out"),
        (["export", "--checkpoint", CKPT, "--out", "{root}/tokenizer"],
         "--out: " + _not_earlier("an export", "an earlier export", "{root}/tokenizer", "tokenizer.json", "--out")),
        (["export", "--checkpoint", CKPT, "--out", "{root}/texts"],
         "--out: " + _not_earlier("an export", "an earlier export", "{root}/texts", "0.txt, 1.txt, 2.txt, 3.txt",
                                  "--out")),
        (["tokenizer", "train", "--data-dir", "{root}/prepared", "--storage-path", "{root}/pretrain", "--run-name",
          "checkpoint_000004"],
         f"--run-name: {CKPT} is a checkpoint, which a tokenizer there would replace; choose another --run-name"),
        (["tokenizer", "train", "--data-dir", "{root}/prepared", "--out", CKPT],
         f"--out: {CKPT} is a checkpoint, which a tokenizer there would replace; choose another --out"),
        (["tokenizer", "train", "--data-dir", "{root}/prepared", "--storage-path", "{root}", "--run-name", "pretrain"],
         "--run-name: {root}/pretrain holds a training run's checkpoints, which a tokenizer there would replace; "
         "choose another --run-name"),
        (["tokenizer", "train", "--data-dir", "{root}/prepared", "--storage-path", "{root}", "--run-name", "prepared"],
         "--run-name: " + _not_earlier("a tokenizer", "an earlier tokenizer", "{root}/prepared",
                                       "manifest.json, shard_00000.parquet, shard_00001.parquet")),
        (["data", "prepare", "--source", "{root}/texts", "--out", CKPT],
         f"--out: {CKPT} is a checkpoint, which prepared data there would replace; choose another --out"),
        (["data", "prepare", "--source", "{root}/texts", "--storage-path", "{root}", "--run-name", "pretrain"],
         "--run-name: {root}/pretrain holds a training run's checkpoints, which prepared data there would "
         "replace; choose another --run-name"),
        (["data", "prepare", "--source", "{root}/texts", "--storage-path", "{root}", "--run-name", "tokenizer"],
         "--run-name: " + _not_earlier("prepared data", "an earlier data directory", "{root}/tokenizer",
                                       "tokenizer.json")),
        (["data", "prepare", "--source", "{root}/texts", "--out", "{root}/proj"],
         "--out: " + _not_earlier("prepared data", "an earlier data directory", "{root}/proj",
                                  "manifest.json, precious.txt", "--out")),
    ],
)  # fmt: skip
def test_a_stage_refuses_an_output_directory_of_another_kind(argv, want, root, capsys):
    """export, tokenizer train and data prepare write only into nothing, an empty directory or their own earlier
    output: never a checkpoint, a run's checkpoints, another stage's directory or the user's files (a foreign
    manifest.json's files were once deleted as stale shards)."""
    _good_input(root)
    (root / "proj").mkdir()
    (root / "proj" / "precious.txt").write_text("precious\n")
    (root / "proj" / "manifest.json").write_text('{"shards": [{"file": "precious.txt"}]}\n')
    before = _snapshot(root)
    line = _fails_in_one_line([a.format(root=root) for a in argv], capsys)
    command = " ".join(argv[:2]) if argv[0] in ("data", "tokenizer") else argv[0]
    suffix = "" if argv[0] == "data" else "  (RAYCHAT_DEBUG=1 shows the traceback)"
    assert line == f"raychat {command}: error: {want.format(root=root)}{suffix}"
    assert _snapshot(root) == before


def test_a_stage_replaces_its_own_earlier_output(root, capsys):
    """Re-running data prepare replaces its shards (a stale one is deleted); tokenizer train replaces its
    tokenizer."""
    _good_input(root)
    prepare = ["data", "prepare", "--source", f"{root}/texts", "--storage-path", str(root), "--run-name", "d"]
    assert raychat_main([*prepare, "--num-shards", "2"]) == 0
    assert sorted(p.name for p in (root / "d").iterdir())[-1] == "shard_00002.parquet"
    assert raychat_main([*prepare, "--num-shards", "1"]) == 0
    assert sorted(p.name for p in (root / "d").iterdir()) == ["manifest.json", "shard_00000.parquet",
                                                               "shard_00001.parquet"]  # fmt: skip
    (root / "d" / "manifest.json").unlink()  # a run of prepare that stopped before its manifest
    assert raychat_main([*prepare, "--num-shards", "1"]) == 0
    assert (root / "d" / "manifest.json").is_file()
    train = ["tokenizer", "train", "--data-dir", f"{root}/prepared", "--vocab-size", "300"]
    assert raychat_main([*train, "--storage-path", str(root), "--run-name", "tokenizer"]) == 0
    assert Tokenizer.load(root / "tokenizer").vocab_size <= 300


LEFTOVER = "0123456789abcdef"  # the 16 hex of raychat.atomic's temporaries


@pytest.mark.parametrize(
    "kept, leftover",
    [
        ([], f".shard_00000.parquet.{LEFTOVER}.tmp"),  # the first run, killed writing or downloading a shard
        (["shard_00000.parquet"], f".shard_00001.parquet.{LEFTOVER}.tmp"),  # a rerun (its manifest goes first)
        (["shard_00000.parquet", "shard_00001.parquet"], f".manifest.json.{LEFTOVER}.tmp"),  # killed at the end
    ],
)  # fmt: skip
def test_data_prepare_killed_mid_write_does_not_block_the_next_run(kept, leftover, root, capsys):
    """A kill leaves raychat.atomic's temporary beside the files (and no manifest: it is removed before the
    shards are written); the next prepare into that directory was refused as 'not an earlier data directory'.
    Another directory's leftover is no licence: beside a user's file it is refused and nothing is touched."""
    _good_input(root)
    prepare = ["data", "prepare", "--source", f"{root}/texts", "--num-shards", "1", "--out", f"{root}/d"]
    assert raychat_main(prepare) == 0
    done = sorted(p.name for p in (root / "d").iterdir())
    for name in set(done) - set(kept):
        (root / "d" / name).unlink()
    (root / "d" / leftover).write_bytes(b"PAR1")
    assert raychat_main(prepare) == 0
    assert sorted(p.name for p in (root / "d").iterdir()) == done  # the leftover is gone
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("mine\n")
    (root / "mine" / leftover).write_bytes(b"PAR1")
    before = _snapshot(root)
    line = _fails_in_one_line(prepare[:-1] + [f"{root}/mine"], capsys)
    assert f"which is not an earlier data directory ({root}/mine holds: {leftover}, notes.txt)" in line, line
    assert _snapshot(root) == before


@pytest.mark.parametrize("rewrite", [False, True])
def test_tokenizer_train_killed_mid_save_does_not_block_the_next_run(rewrite, root):
    """A kill while tokenizer.json is saved leaves its temporary (raychat.atomic) alone, or beside the earlier
    tokenizer.json (a rerun): the next `tokenizer train` to that --run-name was refused as 'not an earlier
    tokenizer'."""
    _good_input(root)
    train = ["tokenizer", "train", "--data-dir", f"{root}/prepared", "--vocab-size", "300",
             "--storage-path", str(root), "--run-name", "tok"]  # fmt: skip
    if rewrite:
        assert raychat_main(train) == 0
    else:
        (root / "tok").mkdir()
    (root / "tok" / f".tokenizer.json.{LEFTOVER}.tmp").write_text('{"pattern": ')
    assert raychat_main(train) == 0
    assert sorted(p.name for p in (root / "tok").iterdir()) == ["tokenizer.json"]
    assert Tokenizer.load(root / "tok").vocab_size <= 300


def test_data_prepare_deletes_only_its_own_shards(root, tmp_path):
    """prepare() called directly (no directory check): a manifest that is not raychat's deletes nothing, and
    raychat's deletes only the shard names prepare writes."""
    from raychat.data.corpus.prepare import FORMAT, prepare

    _good_input(root)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.txt").write_text("outside\n")
    for name in ("precious.txt", "shard_00007.parquet"):
        (out / name).write_text(name)
    listed = [
        {"file": f}
        for f in ("precious.txt", "../outside.txt", "sub/shard_00009.parquet", "shard_00007.parquet")
    ]
    (out / "manifest.json").write_text(json.dumps({"shards": listed}))
    prepare(str(root / "texts"), out, num_shards=1, log=lambda *_: None)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "precious.txt", "shard_00000.parquet",
                                                      "shard_00001.parquet", "shard_00007.parquet"]  # fmt: skip
    (out / "manifest.json").write_text(json.dumps({"format": FORMAT, "shards": listed}))
    prepare(str(root / "texts"), out, num_shards=1, log=lambda *_: None)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "precious.txt", "shard_00000.parquet",
                                                      "shard_00001.parquet"]  # fmt: skip
    assert (out / "precious.txt").read_text() == "precious.txt"
    assert (tmp_path / "outside.txt").read_text() == "outside\n"


def test_a_core_bundle_that_is_not_there_is_an_error_not_an_empty_cell(root, capsys):
    """An explicit --core-bundle that does not exist, or holds no core.yaml, used to give CORE "n/a: no data"
    after the whole run."""
    _good_input(root)
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "pretrain", "--data-dir", f"{root}/prepared"]
    line = _fails_in_one_line([*argv, "--core-bundle", f"{root}/nope"], capsys)
    assert line == (
        f"raychat eval: error: --core-bundle {root}/nope: not a directory (give the CORE bundle's directory: "
        "core.yaml, eval_meta_data.csv, eval_data/; or leave the flag out)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    # a directory without core.yaml (the task data directory, say) was read as "no bundle": CORE "n/a: no data"
    (root / "task_data" / "eval_bundle").mkdir(parents=True)
    for bundle, why in [
        ("task_data/eval_bundle", "no core.yaml there"),
        ("task_data", "no core.yaml there"),
    ]:
        if bundle == "task_data":
            (root / "task_data" / "eval_bundle" / "core.yaml").write_text("icl_tasks: []\n")
            why += f"; the bundle is {root}/task_data/eval_bundle"
        line = _fails_in_one_line([*argv, "--core-bundle", f"{root}/{bundle}"], capsys)
        assert line == (
            f"raychat eval: error: --core-bundle {root}/{bundle}: {why} (give the CORE bundle's directory: "
            "core.yaml, eval_meta_data.csv, eval_data/; or leave the flag out)  (RAYCHAT_DEBUG=1 shows the traceback)"
        )
    assert not list(root.glob("*eval*"))  # no results: neither eval/ nor <run>-eval-step<step>/


@pytest.mark.parametrize("stage", ["pretrain", "sft", "rl", "eval", "serve"])
def test_a_preset_that_does_not_exist(stage, root, capsys):
    before = _snapshot(root)
    line = _fails_in_one_line(
        [stage, "--preset", "nosuch", "--storage-path", str(root)][: 3 if stage == "serve" else 5], capsys
    )
    assert "--preset: no preset 'nosuch'; known presets: ['cluster', 'cpu', 'gpu8', 'tiny']" in line, line
    assert _snapshot(root) == before


def test_an_unreachable_cluster(monkeypatch, capsys):
    """Nothing listens on the port: `raychat submit` exits 4 with one line naming --address."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")  # a token, so the one error is the address
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    rc = raychat_main(
        ["submit", "--address", url, "pretrain", "--preset", "tiny", "--storage-path", "/mnt/runs"]
    )
    err = capsys.readouterr().err
    assert rc == 4, err
    assert err.startswith(f"raychat submit: error: --address: cannot reach the Ray dashboard at {url}: "), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "reply, answered",
    [
        (
            (200, b"# HELP ray_node_cpu_utilization Total CPU usage\n"),
            "HTTP 200, b'# HELP ray_node_cpu_utilization Total CP'",
        ),
        ((404, b"Not Found"), "HTTP 404, b'Not Found'"),
        ((200, {"status": "ok"}), 'HTTP 200, b\'{"status": "ok"}\''),
        ((500, b"Internal Server Error"), "HTTP 500, b'Internal Server Error'"),
        ((405, b"Method Not Allowed"), "HTTP 405, b'Method Not Allowed'"),
    ],
    ids=["metrics-port", "404", "other-json", "500", "405"],
)
def test_an_address_that_is_not_a_ray_dashboard(monkeypatch, capsys, reply, answered):
    """--address at something that answers HTTP but is not a Ray dashboard (a node's metrics port: Prometheus
    text) said "Expecting value: line 1 column 1 (char 0)", exit 2 (a 404 blamed the Ray version, other JSON a
    traceback, an HTTP error such as 500 or 405 requests' "500 Server Error: ..."); one line naming --address,
    what answered and what the address should be, exit 4 as another address that does not answer."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    with FakeDashboard({"/api/version": reply}) as fake:
        line = (
            f"--address {fake.url} is not a Ray dashboard: GET /api/version answered {answered} (a dashboard "
            "answers Ray's version as JSON); give the Ray dashboard's address, http://<head>:8265\n"
        )
        assert raychat_main(["jobs", "list", "--address", fake.url]) == 4
        assert capsys.readouterr().err == f"raychat jobs: error: {line}"
        assert raychat_main(["submit", "--address", fake.url, "command", "true"]) == 4
        assert capsys.readouterr().err == f"raychat submit: error: {line}"


def test_a_ray_dashboard_is_taken(monkeypatch, capsys):
    """The same reply as a Ray 2.60 dashboard's /api/version: a client (the check above does not refuse it)."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    with FakeDashboard({"/api/version": (200, RAY_VERSION)}) as fake:
        assert submit.make_client(fake.url).get_address() == fake.url


def test_a_submitted_eval_says_where_its_job_looks_for_task_data(monkeypatch, capsys):
    """docs/deployment.md's eval step (no --task-data-dir): a note line before anything else, then on as before
    (tests/unit/test_cli.py::test_a_submitted_stage_that_reads_task_data_from_the_jobs_copy_gets_a_note)."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    stage = [
        "eval",
        "--preset",
        "tiny",
        "--storage-path",
        "/mnt/runs",
        "--run-name",
        "eval",
        "--checkpoint",
        "latest",
    ]
    assert raychat_main(["submit", "--address", url, *stage]) == 4
    note, error = capsys.readouterr().err.splitlines()
    assert note.startswith(
        "raychat submit: note: stage eval reads the CORE bundle (eval_bundle/) from the task data directory, "
        "--task-data-dir not given: $RAYCHAT_TASK_DATA of the node it runs on, else runs/task_data in the job's "
        "temporary copy of the checkout"
    ), note
    assert error.startswith("raychat submit: error: --address: cannot reach the Ray dashboard at "), error


def test_the_address_flag_wins_over_ray_address_variables(monkeypatch, capsys):
    """--address names the cluster even with RAY_API_SERVER_ADDRESS / RAY_ADDRESS set: Ray's Jobs client put
    those in its place, so `jobs stop --address http://B` stopped a job on the cluster in RAY_ADDRESS."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    flag, env = (f"http://127.0.0.1:{port}" for port in free_ports(2))
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", env)
    monkeypatch.setenv("RAY_ADDRESS", env)
    assert raychat_main(["jobs", "list", "--address", flag]) == 4
    assert capsys.readouterr().err == (
        f"raychat jobs: error: --address: cannot reach the Ray dashboard at {flag}: Failed to connect to Ray at "
        f"address: {flag}.\n"
    )  # was "... at {flag}: Failed to connect to Ray at address: {env}."
    assert os.environ["RAY_ADDRESS"] == env  # the variables are left as they were


def test_jobs_takes_the_connection_flags_before_its_subcommand_too(monkeypatch, capsys):
    """`raychat jobs --address URL --token-file F list`, the order `raychat submit` takes them in, was refused
    with "argument <list|stop|logs>: invalid choice: 'URL'"; after the subcommand they win."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    before, after = (f"http://127.0.0.1:{port}" for port in free_ports(2))
    assert raychat_main(["jobs", "--address", before, "logs", "some-job"]) == 4
    assert capsys.readouterr().err.startswith(
        f"raychat jobs: error: --address: cannot reach the Ray dashboard at {before}: "
    )
    assert raychat_main(["jobs", "--address", before, "list", "--address", after]) == 4
    assert capsys.readouterr().err.startswith(
        f"raychat jobs: error: --address: cannot reach the Ray dashboard at {after}: "
    )
    assert raychat_main(["jobs", "--token-file", "/nonexistent/token", "stop", "--address", after, "j"]) == 2
    assert (
        capsys.readouterr().err
        == "raychat jobs: error: --token-file: token file /nonexistent/token does not exist\n"
    )


def test_serve_and_rl_refuse_a_dashboard_url_as_address(tmp_path, capsys):
    """`raychat serve/rl --address http://HEAD:8265` (the URL submit and jobs take): one line naming --address,
    before Ray starts or anything is written (Ray's error said "It looks like you set RAY_ADDRESS to an HTTP
    address", over three lines)."""
    url = "http://127.0.0.1:8265"
    line = (
        f"--address {url} is a Ray dashboard URL (what `raychat submit` and `raychat jobs` take); this command "
        "connects to the cluster's GCS: give HOST:PORT, e.g. 127.0.0.1:6379 (what `ray start --address` takes)"
    )
    assert (
        raychat_main(["serve", "--checkpoint", str(tmp_path / "ckpt"), "--address", url, "--no-block"]) == 2
    )
    assert capsys.readouterr().err == f"raychat serve: error: {line}  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    argv = [
        "rl",
        "--preset",
        "tiny",
        "--storage-path",
        str(tmp_path / "runs"),
        "--init-from",
        str(tmp_path / "sft"),
    ]
    assert raychat_main([*argv, "--address", url.replace("http", "HTTPS")]) == 2
    assert capsys.readouterr().err == f"raychat rl: error: {line.replace('http', 'HTTPS', 1)}\n"
    assert not ray.is_initialized() and list(tmp_path.iterdir()) == []


def test_an_unreachable_address_from_a_variable_or_the_default_is_named_so(monkeypatch, capsys):
    """Without --address the line names where the address came from: the variable, or the default that the
    docs' chain (`raychat submit data prepare ...`, no --address) reaches (it named --address, not given)."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    env = f"http://127.0.0.1:{free_ports(1)[0]}"
    monkeypatch.setenv("RAY_ADDRESS", env)
    assert raychat_main(["jobs", "list"]) == 4
    assert capsys.readouterr().err == (
        f"raychat jobs: error: RAY_ADDRESS: cannot reach the Ray dashboard at {env}: Failed to connect to Ray at "
        f"address: {env}.\n"
    )
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(
        submit, "DEFAULT_ADDRESS", env
    )  # nothing listens there (8265 may be a cluster's here)
    assert raychat_main(["jobs", "list"]) == 4
    assert capsys.readouterr().err == (
        "raychat jobs: error: --address (not given, and neither RAY_API_SERVER_ADDRESS nor RAY_ADDRESS is set: the "
        f"default): cannot reach the Ray dashboard at {env}: Failed to connect to Ray at address: {env}.\n"
    )


def test_a_gcs_address_nothing_listens_on(monkeypatch, capsys):
    """A GCS address (HOST:PORT) with nothing behind it: one line naming --address at once, exit 4 (was a 35 s
    wait in Ray's GCS client, then its RpcError traceback, exit 1)."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token handed to Ray's GCS client in this process
    address = f"127.0.0.1:{free_ports(1)[0]}"
    assert raychat_main(["jobs", "list", "--address", address]) == 4
    assert capsys.readouterr().err == (
        f"raychat jobs: error: --address: cannot reach the Ray cluster's GCS at {address}: [Errno 111] "
        "Connection refused\n"
    )


def test_a_working_dir_that_is_not_a_directory(tmp_path, capsys):
    """`submit --working-dir /nonexistent command echo` reached Ray, whose error named no flag; refused first
    (before the cluster is asked: there is none here), naming --working-dir."""
    missing, a_file = tmp_path / "nonexistent", tmp_path / "file"
    a_file.write_text("")
    for path, why in ((missing, "no such directory"), (a_file, "not a directory")):
        assert raychat_main(["submit", "--working-dir", str(path), "command", "echo"]) == 2
        assert capsys.readouterr().err == (
            f"raychat submit: error: --working-dir {path}: {why} (the checkout the job runs in)\n"
        )


def test_an_address_ray_cannot_parse_and_a_token_file_that_is_not_a_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    assert raychat_main(["submit", "--address", "notaurl", "command", "true"]) == 2
    assert capsys.readouterr().err == (
        "raychat submit: error: --address notaurl: Invalid address format: notaurl; give the Ray dashboard's address, "
        "e.g. http://HEAD:8265\n"
    )
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    for path, why in [("/dev/null", "is not a regular file"), (str(tmp_path / "nope"), "does not exist")]:
        assert raychat_main(["submit", "--address", url, "--token-file", path, "command", "true"]) == 2
        assert capsys.readouterr().err == f"raychat submit: error: --token-file: token file {path} {why}\n"


@pytest.mark.parametrize("stage", ["pretrain", "sft", "speedrun"])
def test_the_training_stages_take_a_token_file_and_check_it_first(stage, tmp_path, capsys):
    """pretrain, sft and speedrun connect to RAY_ADDRESS's cluster with --token-file's token, as rl and serve do
    (tests/cluster/test_submit.py::test_pretrain_takes_the_token_file_of_ray_address): a file that is not there
    is refused first, in one line, before any other input is read or Ray starts."""
    missing = tmp_path / "nope"
    assert _fails_in_one_line([stage, "--token-file", str(missing)], capsys) == (
        f"raychat {stage}: error: --token-file: token file {missing} does not exist  (RAYCHAT_DEBUG=1 shows the "
        "traceback)"
    )  # was "unrecognized arguments: --token-file"


def test_a_half_written_checkpoint_is_never_loaded(root, tmp_path, capsys):
    """A crash mid-save left checkpoint_000009 (newer, weights truncated, no commit marker): `pretrain` and
    `latest` still name the committed checkpoint_000004, and naming the half-written one is refused."""
    half = root / "pretrain" / "checkpoint_000009"
    half.mkdir()
    good = root / "pretrain" / "checkpoint_000004" / "model.safetensors"
    (half / "model.safetensors").write_bytes(good.read_bytes()[:100])
    (half / "meta.json").write_text('{"step": 9, "stage": "pretrain"}')
    before = _snapshot(root)
    line = _fails_in_one_line(["eval", "--storage-path", str(root), "--checkpoint", str(half)], capsys)
    assert f"--checkpoint: checkpoint {half} is not committed (no commit.json)" in line, line
    assert (
        raychat_main(
            ["export", "--storage-path", str(root), "--checkpoint", "latest", "--out", str(tmp_path / "hf")]
        )
        == 0
    )
    assert f"exported {root}/pretrain/checkpoint_000004 " in capsys.readouterr().out
    assert _snapshot(root) == before


@pytest.mark.parametrize("command", ["chat", "eval", "sft"])
def test_an_hf_export_given_as_a_checkpoint_is_named_as_one_not_as_a_half_written_save(command, root, capsys):
    """`raychat export`'s directory has model.safetensors and no commit marker: it was called a save that did
    not finish, which sent the user looking for a broken export."""
    assert (
        raychat_main(["export", "--storage-path", str(root), "--run-name", "hf", "--checkpoint", "latest"])
        == 0
    )
    capsys.readouterr()
    hf = root / "hf"
    flag = "--init-from" if command == "sft" else "--checkpoint"
    argv = [command, flag, str(hf)] + ([] if command == "chat" else ["--storage-path", str(root)])
    line = _fails_in_one_line(argv + (["-p", "hi"] if command == "chat" else []), capsys)
    assert (
        f"{flag}: {hf} is a Hugging Face export (config.json, model.safetensors: raychat export), not a raychat "
        "checkpoint: give the checkpoint it was exported from, or load it with transformers"
    ) in line, line


def test_a_validation_shard_too_small_for_one_row_is_named_not_a_numpy_error(root, capsys):
    """A small corpus (`data prepare --source DIR`) whose validation shard cannot fill one row of the model's
    sequence length: eval (and every training rank's validator) failed with numpy's 'need at least one array
    to stack'."""
    small = _too_little_text(root)
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "pretrain", "--data-dir", str(small)]
    line = _fails_in_one_line(argv + ["--tasks", ""], capsys)
    assert line == (
        f"raychat eval: error: --data-dir: the validation shard {small}/shard_00001.parquet holds too "
        "little text for "
        "one row of 257 tokens (4 documents): prepare more text (a larger validation shard) or use a shorter "
        "sequence length  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert not list(root.glob("*eval*"))  # no results: neither eval/ nor <run>-eval-step<step>/


@pytest.mark.parametrize("tasks", ["", "calculator:2"])
def test_eval_of_a_model_with_nan_weights_is_refused_before_anything_is_written(tasks, root, capsys):
    """A diverged run's checkpoint (NaN weights): eval wrote `"val_bpb": NaN` (not JSON: jq and JSON.parse
    reject it) to stdout and eval.json, and with a generative task died in a RuntimeError traceback."""
    ckpt = _pretrained_with(Tokenizer.load(root / "tokenizer"), root / "diverged" / "checkpoint_000002")
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"].fill_(float("nan"))
    save_file(weights, ckpt / "model.safetensors")
    (ckpt / "commit.json").unlink()
    commit_directory(ckpt, 2, "pretrain")
    entries = write_shards(
        ["the json module encodes objects. " * 40] * 8, root / "text", 2, log=lambda *_: None
    )
    write_manifest(root / "text", {"source": "test", "shards": entries})
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "diverged", "--data-dir", f"{root}/text",
            "--tasks", tasks, "--eval-tokens", "16"]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat eval: error: --checkpoint {ckpt}: the model's validation loss is nan (its logits are not "
        "finite: NaN or inf in the weights, e.g. a diverged run); nothing evaluated or written  (RAYCHAT_DEBUG=1 "
        "shows the traceback)"
    )
    assert not list(root.glob("*eval*"))  # no results: neither eval/ nor <run>-eval-step<step>/


def test_eval_refuses_to_write_its_results_into_another_stages_directory(root, capsys):
    """eval.json in an export made `raychat export` refuse its own directory ever after (likewise data
    prepare and tokenizer train); a training run's directory is no place for them either."""
    assert (
        raychat_main(["export", "--storage-path", str(root), "--run-name", "hf", "--checkpoint", "latest"])
        == 0
    )
    entries = write_shards(
        ["the json module encodes objects. " * 20] * 8, root / "text", 2, log=lambda *_: None
    )
    write_manifest(root / "text", {"source": "test", "shards": entries})
    capsys.readouterr()
    before = _snapshot(root)
    for run, want in [
        ("hf", "eval results would replace {d}, which is not an earlier eval's results ({d} holds: "
               "chat_template.jinja, config.json, generation_config.json, model.safetensors, "),
        ("pretrain", "{d} holds a training run's checkpoints, which eval results there would replace; choose "
                     "another --run-name"),
        ("tokenizer", "eval results would replace {d}, which is not an earlier eval's results ({d} holds: "
                      "tokenizer.json"),
    ]:  # fmt: skip
        argv = ["eval", "--storage-path", str(root), "--checkpoint", "pretrain", "--data-dir", f"{root}/text",
                "--tasks", "", "--eval-tokens", "16", "--run-name", run]  # fmt: skip
        line = _fails_in_one_line(argv, capsys)
        assert line.startswith(f"raychat eval: error: --run-name: {want.format(d=root / run)}"), line
    assert _snapshot(root) == before
    assert (
        raychat_main(["export", "--storage-path", str(root), "--run-name", "hf", "--checkpoint", "latest"])
        == 0
    )  # still its own
    for _ in range(2):  # a new directory, then eval's own earlier results
        assert raychat_main(argv[:-1] + ["ev"]) == 0
    (root / "ev" / ".eval.json.5f3a09be12c4d7e8.tmp").write_text("{")  # a write killed half-way
    assert raychat_main(argv[:-1] + ["ev"]) == 0
    assert sorted(p.name for p in (root / "ev").iterdir()) == ["eval.json", "report_card.md"]  # leftover gone


@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_an_init_from_whose_weights_are_damaged_is_refused_before_ray(stage, root, capsys):
    """Bytes overwritten at the committed size: the sizes match, the header does not parse; every worker (or
    RL actor) would fail on it, so the driver names it first."""
    ckpt = root / "pretrain" / "checkpoint_000004"
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    line = _fails_in_one_line(
        [stage, "--preset", "tiny", "--storage-path", str(root), "--init-from", str(ckpt)], capsys
    )
    want = (
        f"raychat {stage}: error: checkpoint {ckpt}: model.safetensors is not a readable safetensors file (Error "
        "while deserializing header: header too large)"
    )
    assert line == (want if stage == "rl" else f"{want}  (RAYCHAT_DEBUG=1 shows the traceback)")


TASKS = "calculator, chatterbot, spelling, smoltalk, gsm8k, mmlu, arc-easy, arc-challenge, humaneval"
EVAL_TASKS = "calculator, spelling, gsm8k, mmlu, arc-easy, arc-challenge, humaneval, chatcore"


@pytest.mark.parametrize(
    "argv, want",
    [
        (["sft", "--sft-tasks", ""], "--sft-tasks: '': no task; the form is name[:count],...; tasks: {tasks}"),
        (["sft", "--sft-tasks", "calculator:-5"],
         "--sft-tasks: 'calculator:-5': the count must be a positive integer; the form is name[:count],...; "
         "tasks: {tasks}"),
        (["sft", "--sft-tasks", "calculator:abc"],
         "--sft-tasks: 'calculator:abc': the count must be a positive integer; the form is name[:count],...; "
         "tasks: {tasks}"),
        (["sft", "--sft-tasks", "spelling,calculator:0"],
         "--sft-tasks: 'calculator:0': the count must be a positive integer; the form is name[:count],...; "
         "tasks: {tasks}"),
        (["sft", "--sft-tasks", "calculatr:10"],
         "--sft-tasks: 'calculatr:10': unknown task 'calculatr'; the form is name[:count],...; tasks: {tasks}"),
        (["eval", "--tasks", "calculator:x"],
         "--tasks: 'calculator:x': the count must be a positive integer; the form is name[:count],...; "
         "tasks: {eval_tasks}"),
        (["eval", "--tasks", "calculator:-1"],
         "--tasks: 'calculator:-1': the count must be a positive integer; the form is name[:count],...; "
         "tasks: {eval_tasks}"),
        (["eval", "--tasks", "calculatr:4"],
         "--tasks: 'calculatr:4': unknown task 'calculatr'; the form is name[:count],...; tasks: {eval_tasks}"),
        (["eval", "--tasks", "calculator:4,chatterbot"],
         "--tasks: 'chatterbot' is a training task, with no held-out split and checker to measure accuracy with; "
         "tasks: {eval_tasks}"),
        (["eval", "--tasks", "chatcore:x"],
         "--tasks: 'chatcore:x': the count must be a positive integer; the form is name[:count],...; "
         "tasks: {eval_tasks}"),
    ],
)  # fmt: skip
def test_a_task_spec_that_does_not_parse(argv, want, root, capsys):
    """Checked as the config is built: a worker once met '' (TaskMixture needs at least one task) or a count
    of -5 after Ray had started, and 'abc' failed on int() without naming the flag. eval's list named chatterbot
    and smoltalk, which it then refused (no held-out split, no checker); it names the tasks it measures."""
    flags = ["--init-from", f"{root}/pretrain"] if argv[0] == "sft" else ["--checkpoint", f"{root}/pretrain"]
    argv = [argv[0], "--storage-path", str(root), *flags, *argv[1:]]
    line = _fails_in_one_line(argv, capsys)
    assert (
        line
        == f"raychat {argv[0]}: error: {want.format(tasks=TASKS, eval_tasks=EVAL_TASKS)}  (RAYCHAT_DEBUG=1 shows "
        "the traceback)"
    )


def test_core_max_per_task_zero_is_refused_not_read_as_all(root, capsys):
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "pretrain", "--core-max-per-task", "0"]
    assert _fails_in_one_line(argv, capsys) == (
        "raychat eval: error: --core-max-per-task must be -1 (all) or a positive integer, got 0  (RAYCHAT_DEBUG=1 "
        "shows the traceback)"
    )


def test_rl_on_a_task_without_its_files(root, tmp_path, capsys):
    """RL checks its task's files before Ray starts (it once did so in the run, 15 s after Ray started)."""
    write_tiny_checkpoint(root / "sft" / "checkpoint_000001", stage="sft")
    empty = tmp_path / "task_data"
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--init-from", "sft", "--run-name", "r",
            "--task", "gsm8k", "--task-data-dir", str(empty)]  # fmt: skip
    line = _fails_in_one_line(argv, capsys)
    assert line == (
        f"raychat rl: error: --task: task 'gsm8k' (train split): no data file at {empty}/gsm8k/main/train-*.parquet "
        f"or {empty}/openai--gsm8k/main/train/*.parquet (download: hf download openai/gsm8k "
        f"--repo-type dataset --local-dir {empty}/gsm8k; the directory: --task-data-dir or $RAYCHAT_TASK_DATA)"
    )
    assert not (root / "r").exists()


GSM8K_GOOD = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}) + "\n"
GSM8K_BAD = json.dumps({"question": "What is 2 + 3?", "answer": "five"}) + "\n"
NO_FINAL = "answer has no final '#### <number>'"


@pytest.mark.parametrize(
    "argv, bad, want",
    [
        (  # the calculator's conversations fit a row, so gsm8k's train file was first read in the workers
            ["sft", "--preset", "tiny", "--storage-path", "{root}", "--init-from", "pretrain", "--tokenizer-path",
             "{root}/tokenizer", "--run-name", "mine", "--sft-tasks", "calculator:8,gsm8k"],
            "gsm8k/main/train.jsonl", f"--sft-tasks: {{file}} line 2: {NO_FINAL} (1 of 3 records is bad)",
        ),
        (  # read in the driver before, but after the init checkpoint, and naming no flag
            ["rl", "--preset", "tiny", "--storage-path", "{root}", "--init-from", "sft", "--run-name", "r",
             "--task", "gsm8k"],
            "gsm8k/main/test.jsonl", f"--task: {{file}} line 2: {NO_FINAL} (1 of 3 records is bad)",
        ),
        (  # the report card's ARC-Easy was read after the model loaded; its missing files stay "n/a: no data"
            ["eval", "--storage-path", "{root}", "--checkpoint", "sft", "--eval-tokens", "0", "--tasks", "chatcore"],
            "ai2_arc/ARC-Easy/test.jsonl",
            "--tasks chatcore: {file} line 2: answerKey 'E' not in labels ['A', 'B'] (1 of 3 records is bad)",
        ),
    ],
    ids=["sft", "rl", "eval-chatcore"],
)  # fmt: skip
def test_a_bad_record_of_a_hub_task_is_refused_before_ray_starts(argv, bad, want, root, tmp_path, capsys):
    """Every record of a hub task's files in the task data directory is checked in the driver before Ray
    starts (raychat.tasks.registry.check_data), by every stage that reads them: not when a worker, an actor
    or the report card first builds the task."""
    data = tmp_path / "task_data"
    arc = {"question": "Which is red?", "choices": {"text": ["Mars", "Venus"], "label": ["A", "B"]},
           "answerKey": "A"}  # fmt: skip
    good = {
        "gsm8k/main/train.jsonl": GSM8K_GOOD,
        "gsm8k/main/test.jsonl": GSM8K_GOOD,
        "ai2_arc/ARC-Easy/test.jsonl": json.dumps(arc) + "\n",
    }
    record = GSM8K_BAD if bad.startswith("gsm8k") else json.dumps({**arc, "answerKey": "E"}) + "\n"
    for name, text in good.items():  # the bad file: good, bad, good
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text(text + (record + text if name == bad else ""))
    write_tiny_checkpoint(root / "sft" / "checkpoint_000001", stage="sft")
    before = _snapshot(root)
    argv = [a.replace("{root}", str(root)) for a in argv] + ["--task-data-dir", str(data)]
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat {argv[0]}: error: {want.format(file=data / bad)}"
        + ("" if argv[0] == "rl" else "  (RAYCHAT_DEBUG=1 shows the traceback)")
    )
    assert _snapshot(root) == before


def test_sft_on_own_conversations_with_one_bad_record(root, tmp_path, capsys):
    """A user's conversations (smoltalk's layout) with one bad line among good ones: it was read in the workers,
    after Ray started, and failed there as `message 1: role must be one of [...]` with no file or line, retried
    to the failure budget (tests/unit/test_own_conversations.py has each kind of bad record)."""
    d = tmp_path / "task_data" / "smol-smoltalk" / "data"
    d.mkdir(parents=True)
    good = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
    (d / "test.jsonl").write_text(good)
    (d / "train.jsonl").write_text(good + '{"messages": [{"role": "user", "content": "x"}, {"role": "bot", '
                                   '"content": "y"}]}\n' + good)  # fmt: skip
    before = _snapshot(root)
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--init-from", "pretrain", "--tokenizer-path",
            f"{root}/tokenizer", "--run-name", "mine", "--sft-tasks", "smoltalk", "--task-data-dir",
            str(tmp_path / "task_data")]  # fmt: skip
    line = _fails_in_one_line(argv, capsys)
    assert line == (
        f"raychat sft: error: --sft-tasks: {d}/train.jsonl line 2: messages[1]: role must be one of ['system', "
        "'user', 'assistant', 'tool'], got 'bot' (1 of 3 records is bad)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before
    # good records, but no held-out conversation fits a row of the tiny preset's 65 tokens: it failed in each
    # worker after Ray started ("need at least one array to stack"), retried to the failure budget
    (d / "train.jsonl").write_text(good)
    (d / "test.jsonl").write_text(good.replace('"Hi"', json.dumps("Hi " * 100)))
    assert _fails_in_one_line(argv, capsys) == (
        "raychat sft: error: --sft-tasks: task smoltalk's held-out conversations (1) fill no row of 65 tokens: the "
        "last exchange of each is longer (a longer --seq-len, up to the --init-from checkpoint's max_seq_len, or "
        "shorter held-out conversations keep some)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before
    # eval has no accuracy to measure on them (README: the run's smoltalk_val_bpb does)
    argv = ["eval", "--checkpoint", f"{root}/pretrain", "--storage-path", str(root), "--tasks", "smoltalk",
            "--eval-tokens", "0", "--task-data-dir", str(tmp_path / "task_data")]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat eval: error: --tasks: 'smoltalk' is a training task, with no held-out split and checker to "
        f"measure accuracy with; tasks: {EVAL_TASKS}  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before


def test_sft_data_with_a_calculator_call_left_unanswered(root, tmp_path, capsys):
    """A conversation whose assistant ends on a calculator call with no tool reply trained the model to end its
    turn (or go on) right after <|python_end|>, where the engine forces the call's result at inference: refused
    before Ray in one line naming the file, line and part (tests/unit/test_own_conversations.py has each
    case)."""
    mine = tmp_path / "mine.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    call = [{"type": "text", "text": "Let me. "}, {"type": "python", "text": "7*12"}]
    bad = {"messages": [{"role": "user", "content": "7*12?"}, {"role": "assistant", "content": call}]}
    mine.write_text("".join(json.dumps(r) + "\n" for r in (good, bad, good)))
    before = _snapshot(root)
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--init-from", "pretrain", "--tokenizer-path",
            f"{root}/tokenizer", "--run-name", "mine", "--sft-tasks", "", "--sft-data", str(mine)]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat sft: error: --sft-data: {mine} line 2: messages[1].content[1]: the python call '7*12' ends the "
        "conversation with no result after it: at inference the engine answers a call with its result right "
        'after it and the assistant goes on, so give the result right after the call, as the next message {"role": '
        '"tool", "content": RESULT} (or a {"type": "python_output", "text": RESULT} part), then the assistant\'s '
        "reply (1 of 3 records is bad)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before


# ---- resuming a run whose newest checkpoint this run cannot resume ---------------------------------------
class ReachedRay(Exception):
    """Raised where the driver would start Ray: every check before it passed."""


@pytest.fixture
def driver(monkeypatch):
    """run(argv) -> the arguments of the driver's check_resume for `raychat <argv>` (cfg, paths, plan, row
    source), the command stopped where it would start Ray."""
    seen, check = {}, launch.check_resume

    def capture(*args, **kwargs):
        seen["args"] = args
        check(*args, **kwargs)

    def reached(*args, **kwargs):
        raise ReachedRay

    monkeypatch.setattr(launch, "check_resume", capture)
    monkeypatch.setattr(launch, "start_or_connect", reached)

    def run(argv: list[str]):
        with pytest.raises(ReachedRay):
            raychat_main(argv)
        return seen["args"]

    return run


def _commit_step(cfg, paths, plan, row_source, step: int = 2) -> Path:
    """Checkpoint `step` as a world of one worker of this run writes and commits it."""
    d = Path(paths.checkpoints.path(step))
    model = GPT(ModelConfig(**plan.model_config))
    tokenizer = Tokenizer.load(cfg.data.tokenizer_path)
    Checkpointer(cfg.run.stage, to_dict(cfg), tokenizer, {"plan": plan.to_dict()}).write(
        d, 0, 1, step, model, build_optimizers(model, cfg.optim), {"rows": row_source().state_dict()}
    )
    commit_directory(d, step, cfg.run.stage)
    return d


@pytest.fixture
def pretrained(root, driver, capsys) -> tuple[list[str], Path]:
    """(the argv of a tiny pretraining run "p1", its committed checkpoint_000002), checked to resume."""
    entries = write_shards([GOOD_TEXT] * 8, root / "prepared", num_shards=2, log=lambda *_: None)
    write_manifest(root / "prepared", {"source": "test", "shards": entries})
    argv = ["pretrain", "--preset", "tiny", "--storage-path", str(root), "--run-name", "p1",
            "--data-dir", f"{root}/prepared", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    d = _commit_step(*driver(argv))
    driver([*argv, "--num-iterations", "6"])  # the same settings, a longer run: resumes
    capsys.readouterr()
    return argv, d


HINT = "(use another --run-name, or the same settings to resume)  (RAYCHAT_DEBUG=1 shows the traceback)"


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--depth", "2"], "--depth: the run's checkpoint {d} was made with 1, this run asks for 2"),
        (["--depth", "2", "--seq-len", "32"],
         "--depth, --seq-len: the run's checkpoint {d} was made with 1, 64, this run asks for 2, 32"),
        (["--seed", "5"], "--seed: the run's checkpoint {d} was made with 0, this run asks for 5"),
        # the packer's settings make the rows of the same documents: the run would go on with other rows
        (["--overflow", "split"], "--overflow: the run's checkpoint {d} was made with 'crop', this run asks for 'split'"),
        (["--buffer-size", "8"], "--buffer-size: the run's checkpoint {d} was made with 16, this run asks for 8"),
        (["--document-masking"],
         "--document-masking: the run's checkpoint {d} was made with False, this run asks for True"),
    ],
)  # fmt: skip
def test_resuming_with_other_settings(flags, want, pretrained, capsys):
    """Checked in the driver before Ray starts: the workers once failed on it (size mismatch, or the data state
    of another stream) until --max-failures, then a long traceback."""
    argv, d = pretrained
    line = _fails_in_one_line([*argv, "--num-iterations", "6", *flags], capsys)
    assert line == f"raychat pretrain: error: {want.format(d=d)} {HINT}"


# The driver of `raychat pretrain ARGV` (argv), stopped where it starts Ray until it gets SIGTERM.
_HOLDER = """
import sys, time
from raychat.cli import main
from raychat.train import launch
def hold(*args, **kwargs):
    print("holding the run", flush=True)
    time.sleep(120)
launch.start_or_connect = hold
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_start_of_a_running_run_is_refused_before_ray_starts(pretrained, driver, tmp_path, capsys):
    """Two `raychat pretrain` of one run at once both resumed from its checkpoint and committed checkpoints,
    metrics.jsonl and pruning into the same directory (every step twice in metrics.jsonl). The second now gets
    one line naming the lease, its holder and what to do; nothing under the root changes. Once the first is
    stopped (SIGTERM, as `raychat jobs stop` sends), its lease is gone and the run starts."""
    argv, d = pretrained
    argv = [*argv, "--num-iterations", "6"]
    root = Path(argv[argv.index("--storage-path") + 1])
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(launch.__file__).parents[2]), *sys.path])}
    first = subprocess.Popen(
        [sys.executable, str(script), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in first.stdout:
            lines.append(line)
            if line == "holding the run\n":
                break
        assert lines[-1:] == ["holding the run\n"], "".join(lines)
        holder = json.loads((root / "p1" / "lease.json").read_text())
        before = _snapshot(root)
        line = _fails_in_one_line(argv, capsys)
        assert _snapshot(root) == before
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started_at"]))
        assert line == (
            f"raychat pretrain: error: the run is already running: {root}/p1/lease.json is held by pid "
            f"{first.pid} on {socket.gethostname()}, started {started}, renewed 0 s ago "
            f"({shlex.join([str(script), *argv])}); wait for it to end, or use another "
            "--run-name; if that process is gone, the lease is taken over at once on its own host, else once "
            "it is 120 s without renewal  (RAYCHAT_DEBUG=1 shows the traceback)"
        )
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 128 + signal.SIGTERM
        # the run's line, as once it trains (raychat.sigterm.terminating): it had none while Ray started
        assert first.stderr.read().strip().splitlines()[-1] == (
            "raychat pretrain: terminated (SIGTERM): pretrain run 'p1' stopped before its last step; the same "
            f"command starts it again: it resumes from its newest committed checkpoint {d}"
        )
    finally:
        first.kill()
        first.wait()
    assert not (root / "p1" / "lease.json").exists()
    driver(argv)  # the run starts (reaches Ray) and releases its lease on the way out
    assert not (root / "p1" / "lease.json").exists()


def test_ctrl_c_while_ray_starts_ends_in_the_runs_line(pretrained, monkeypatch, capsys):
    """Ctrl-C while the local Ray started (init_keeping_handler raises KeyboardInterrupt once ray.init returned)
    ended in a bare "raychat pretrain: interrupted", where SIGTERM at the same moment named the checkpoint the
    same command resumes from (measured: SIGINT to a tiny run's process group 1.5 s after its plan)."""
    argv, d = pretrained

    def ctrl_c(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "start_or_connect", ctrl_c)
    root = Path(argv[argv.index("--storage-path") + 1])
    assert raychat_main([*argv, "--num-iterations", "6"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "raychat pretrain: interrupted: pretrain run 'p1' stopped before its last step; the same command starts "
        f"it again: it resumes from its newest committed checkpoint {d}"
    )
    assert not (root / "p1" / "lease.json").exists()


def _speedrun_inputs(out: Path, small_tokenizer: Tokenizer) -> Path:
    """`out` holding a speedrun's data and tokenizer (saved as before tokenizers recorded the vocabulary size
    they were trained for): its data and tokenizer stages reuse them."""
    Tokenizer(small_tokenizer.pattern, small_tokenizer.mergeable_ranks).save(out / "tokenizer")
    entries = write_shards(
        [GOOD_TEXT * 8] * 8, out / "data", num_shards=2, log=lambda *_: None
    )  # rows of 257
    write_manifest(out / "data", {"source": "test", "shards": entries})
    return out


@pytest.fixture
def speedrun_out(tmp_path, small_tokenizer, driver, capsys) -> tuple[Path, Path]:
    """(an --out of a tiny speedrun stopped in pretraining, its committed checkpoints/base/checkpoint_000002):
    its data, and a tokenizer saved as before tokenizers recorded the vocabulary size they were trained for."""
    out = _speedrun_inputs(tmp_path / "out", small_tokenizer)
    argv = ["pretrain", "--preset", "tiny", "--storage-path", f"{out}/checkpoints", "--run-name", "base",
            "--data-dir", f"{out}/data", "--tokenizer-path", f"{out}/tokenizer"]  # fmt: skip
    d = _commit_step(*driver(argv))
    capsys.readouterr()
    return out, d


def test_a_speedrun_after_a_preset_change_names_its_own_flags(speedrun_out, capsys):
    """A speedrun of another preset on the same --out was refused with "(use another --run-name, ...)", and
    naming --depth, --head-dim and --seq-len: flags the speedrun does not have (the preset sets them); and it
    reused the data (2 shards of another source where the preset asks for 7) and the tokenizer of 512 tokens
    where the preset asks for 4096 without a word."""
    out, d = speedrun_out
    before = _snapshot(out)
    assert raychat_main(["speedrun", "--preset", "cpu", "--out", str(out)]) == 2
    stdout, err = capsys.readouterr()
    assert not ray.is_initialized()
    assert err == (
        f"raychat speedrun: error: train.depth, train.head_dim, train.seq_len: the run's checkpoint {d} was made "
        "with 1, 32, 64, this run asks for 4, 64, 256 (use another --out, or the same --preset to resume)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert (
        f"using existing shards in {out}/data: 2 train shards of test, reused although --preset cpu asks for "
        "other data: source test where it asks for debian-docs, train shards 2 where it asks for 7 (use "
        "another --out to prepare the preset's)\n"
    ) in stdout
    vocab = Tokenizer.load(out / "tokenizer").vocab_size
    assert vocab < 4096
    assert (
        f"using existing tokenizer in {out}/tokenizer: vocabulary {vocab}, the preset asks for 4096: reused (use "
        "another --out to train one for 4096)\n"
    ) in stdout
    assert _snapshot(out) == before


def test_a_speedrun_names_the_preset_key_of_sft_it_cannot_resume_with(speedrun_out, driver, tmp_path, capsys):
    """A speedrun whose preset's SFT is shorter than its run's checkpoint was refused naming --num-iterations, which
    in the speedrun sets pretraining's, and counted "1 steps"."""
    out, _ = speedrun_out
    argv = ["speedrun", "--preset", "tiny", "--out", str(out)]
    _commit_step(*driver(argv), step=4)  # pretraining finished
    sft = _commit_step(*driver(argv), step=2)  # SFT (the tiny preset's 2 steps) finished
    assert sft == out / "checkpoints" / "sft" / "checkpoint_000002"
    preset = yaml.safe_load(resources.files("raychat").joinpath("presets/tiny.yaml").read_text())
    preset["sft"]["num_iterations"] = 1
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(preset))
    capsys.readouterr()
    line = _fails_in_one_line(
        ["speedrun", "--preset", str(tmp_path / "short.yaml"), "--out", str(out)], capsys
    )
    assert line == (
        f"raychat speedrun: error: sft.num_iterations: the run's checkpoint {sft} (step 2) was made with 2, this "
        "run asks for 1: 1 step instead of 2 leave nothing to train after step 2 (ask for more than 2 steps, or "
        "use another --out)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_a_speedrun_refuses_a_tokenizer_trained_for_another_vocabulary(speedrun_out, small_tokenizer, capsys):
    """A tokenizer that records the size it was trained for (512, the tiny preset's) is refused where the
    preset asks for another; one that came out smaller than asked, on a small corpus, is no mismatch."""
    out, _ = speedrun_out
    small_tokenizer.save(out / "tokenizer")
    before = _snapshot(out)
    line = _fails_in_one_line(["speedrun", "--preset", "cpu", "--out", str(out)], capsys)
    assert line == (
        f"raychat speedrun: error: --preset cpu: the tokenizer in {out}/tokenizer was trained for a vocabulary of "
        "512 tokens, the preset asks for 4096 (use another --out, or the same --preset to resume)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(out) == before
    assert small_tokenizer.asked_vocab_size == 512 and small_tokenizer.vocab_size < 512
    assert Tokenizer.load(out / "tokenizer").asked_vocab_size == 512
    line = reused_tokenizer_line(small_tokenizer, out / "tokenizer", "tiny", 512)
    assert line == (
        f"using existing tokenizer in {out}/tokenizer: vocabulary {small_tokenizer.vocab_size} (asked 512: the "
        "corpus supports no more)"
    )


def test_a_second_speedrun_of_one_out_is_refused_before_any_stage(tmp_path, small_tokenizer, driver, capsys):
    """Two `raychat speedrun --out X` at once: only the training stages took leases, so both prepared data and
    trained a tokenizer into X before the second was refused at pretraining. The speedrun holds <out>/lease.json
    from before its data stage: the second is refused in one line, before any stage, nothing under X changed.
    Once released, a speedrun takes it, its pretraining stage takes the run's own lease inside it (reaching Ray),
    and both are gone on the way out (here an exception)."""
    out = _speedrun_inputs(tmp_path / "out", small_tokenizer)
    argv = ["speedrun", "--preset", "tiny", "--out", str(out)]
    storage = open_storage(str(out))
    with RunLease(
        storage, storage.path, command="raychat speedrun --out X", other_run="another --out"
    ) as held:
        before, started = _snapshot(out), held.holder.started_at
        assert raychat_main(argv) == 2
        assert _snapshot(out) == before
    stdout, err = capsys.readouterr()
    assert not ray.is_initialized() and "=== 1/6" not in stdout, stdout
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    # renewed 0 or 1 s ago: the checks before the speedrun's lease take a moment
    err = re.sub(r"renewed \d+ s ago", "renewed N s ago", err)
    assert err == (
        f"raychat speedrun: error: the run is already running: {out}/lease.json is held by pid {os.getpid()} on "
        f"{socket.gethostname()}, started {started}, renewed N s ago (raychat speedrun --out X); wait for it to "
        "end, or use another --out; if that process is gone, the lease is taken over at once on its own host, "
        "else once it is 120 s without renewal  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert not (out / "lease.json").exists()
    driver(argv)  # data and tokenizer reused; pretraining takes checkpoints/base/lease.json and reaches Ray
    assert "=== 3/6 pretrain" in capsys.readouterr().out
    assert not (out / "lease.json").exists() and not (out / "checkpoints" / "base" / "lease.json").exists()


@pytest.mark.parametrize(
    "command, names",
    [("pretrain", "--num-workers 2 x --cpus-per-worker 99"), ("speedrun", "train.num_workers 2 x train.cpus_per_worker 99")],
)  # fmt: skip
def test_a_layout_the_local_cluster_cannot_hold_is_named_as_its_command_sets_it(
    command, names, tmp_path, small_tokenizer, monkeypatch, capsys
):
    """A worker larger than this machine, refused before the local Ray cluster starts (layout.start_or_connect).
    In the speedrun it named --num-workers and --cpus-per-worker, flags the speedrun does not have: its
    preset's train section sets them."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = _speedrun_inputs(tmp_path / "out", small_tokenizer)
    preset = yaml.safe_load(resources.files("raychat").joinpath("presets/tiny.yaml").read_text())
    preset["train"]["cpus_per_worker"] = 99
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(preset))
    argv = {
        "pretrain": ["pretrain", "--preset", "tiny", "--cpus-per-worker", "99", "--storage-path", str(out),
                     "--run-name", "base", "--data-dir", f"{out}/data", "--tokenizer-path", f"{out}/tokenizer"],
        "speedrun": ["speedrun", "--preset", str(tmp_path / "big.yaml"), "--out", str(out)],
    }[command]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat {command}: error: {names}: one worker needs 99 CPUs, the largest node has {local_cores() + 1}  "
        "(RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_resuming_on_other_documents_under_the_same_names_and_layout(root, driver, pretrained, capsys):
    """`raychat data prepare --seed 1` into the run's --data-dir (or other shards of the same names and layout):
    the fingerprint held no content, so the run resumed on other documents without a word. A checkpoint
    written before it held the content (none in its data state) resumes on the names, layout and seed."""
    argv, d = pretrained
    entries = write_shards(["e f g h " * 10] * 8, root / "prepared", num_shards=2, log=lambda *_: None)
    write_manifest(root / "prepared", {"source": "test", "shards": entries})
    line = _fails_in_one_line(argv, capsys)
    assert line == (
        f"raychat pretrain: error: --data-dir: shard_00000.parquet of {root}/prepared now holds other documents "
        f"than when the run's checkpoint {d} was made (same names and layout, another sha256) (use another "
        "--run-name, or restore the data the run was made on)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )

    legacy = [*argv[:6], "p0", *argv[7:]]
    cfg, paths, plan, row_source = driver(legacy)
    state = row_source().state_dict()
    del state["corpus"]["content"]
    _commit_step(cfg, paths, plan, lambda: SimpleNamespace(state_dict=lambda: state))
    driver(legacy)  # resumes


def test_resuming_with_another_horizon_logs_the_lr_at_the_resume_step(pretrained, driver, capsys):
    """The tiny preset's 4 steps warm down from step 3 (round(0.4 x 4) = 2 steps, counted from 1 as the step
    lines), whose multiplier is still 1; 6 steps warm down from step 5: step 3, the first after the checkpoint
    of step 2, stays at 1. A warmdown ratio of 0.8 starts it at step 2: step 3 drops to (4 - 2) / 3 = 0.6667."""
    argv, d = pretrained
    driver([*argv, "--num-iterations", "6"])
    out = capsys.readouterr().out
    assert (
        "lr schedule changed on resume (--num-iterations: 4 -> 6): 4 -> 6 steps, warmdown from step 3 -> 5; "
        "lr multiplier of step 3 (the first this run trains): 1 -> 1\n"
    ) in out
    driver([*argv, "--warmdown-ratio", "0.8"])
    out = capsys.readouterr().out
    assert (
        "lr schedule changed on resume (--warmdown-ratio: 0.4 -> 0.8): 4 -> 4 steps, warmdown from step 3 -> 2; "
        "lr multiplier of step 3 (the first this run trains): 1 -> 0.6667\n"
    ) in out
    driver(argv)  # the checkpoint's schedule: no line
    assert "lr schedule" not in capsys.readouterr().out


@pytest.mark.parametrize("steps, counted", [(2, "2 steps"), (1, "1 step")])
def test_resuming_with_a_horizon_at_or_before_the_checkpoint(steps, counted, pretrained, capsys):
    """The run once resumed into an empty loop and reported the checkpoint as its result, nothing trained (and
    counted "1 steps")."""
    argv, d = pretrained
    line = _fails_in_one_line([*argv, "--num-iterations", str(steps)], capsys)
    assert line == (
        f"raychat pretrain: error: --num-iterations: the run's checkpoint {d} (step 2) was made with 4, this run "
        f"asks for {steps}: {counted} instead of 4 leave nothing to train after step 2 (ask for more than 2 "
        "steps, or use another --run-name)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


@pytest.mark.parametrize("stop_after", [2, 1])
def test_resuming_with_stop_after_at_or_before_the_checkpoint(stop_after, pretrained, driver, capsys):
    """The run resumed into an empty loop (exit 0, no step trained), and --dry-run printed its plan."""
    argv, d = pretrained
    want = (
        f"raychat pretrain: error: --stop-after {stop_after}: the run resumes from its checkpoint {d} (step 2) and "
        "goes on at step 3, so it would stop before training a step; allowed: a step in 3..4, or -1 (run to the "
        "end)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _fails_in_one_line([*argv, "--stop-after", str(stop_after)], capsys) == want
    assert _fails_in_one_line([*argv, "--stop-after", str(stop_after), "--dry-run"], capsys) == want
    driver([*argv, "--stop-after", "3"])  # a step after the checkpoint's: resumes


def test_stop_after_on_a_finished_run(pretrained, driver, capsys):
    argv, _ = pretrained
    argv = [*argv, "--run-name", "p4"]
    d = _commit_step(*driver(argv), step=4)
    capsys.readouterr()
    assert _fails_in_one_line([*argv, "--stop-after", "4"], capsys) == (
        f"raychat pretrain: error: --stop-after 4: the run's checkpoint {d} is at step 4, its last, so it would "
        "stop before training a step; allowed: none, the run has trained all 4 steps (leave --stop-after out)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_a_finished_run_says_so_without_starting_ray(root, pretrained, driver, capsys):
    """Pretraining (and SFT) run again at their last step started Ray (about 60 s) to resume into an empty loop."""
    argv, _ = pretrained
    argv = [*argv, "--run-name", "p5"]
    d = _commit_step(*driver(argv), step=4)
    capsys.readouterr()
    assert raychat_main(argv) == 0  # the driver fixture's start_or_connect raises ReachedRay
    assert capsys.readouterr().out.endswith(
        f"finished: the run's checkpoint {d} is at step 4, the last of its 4 steps; nothing to train "
        "(--num-iterations above 4 trains it longer)\n"
    )
    sft = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s6", "--init-from",
           f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    d = _commit_step(*driver(sft), step=2)
    capsys.readouterr()
    assert raychat_main(sft) == 0
    assert capsys.readouterr().out.endswith(
        f"finished: the run's checkpoint {d} is at step 2, the last of its 2 steps; nothing to train "
        "(--num-iterations above 2 trains it longer)\n"
    )
    driver([*sft, "--num-iterations", "3", "--allow-rewarm"])  # a longer run: on to Ray


def test_a_run_of_one_step_counts_one_step(root, pretrained, driver, capsys):
    """A finished run of one step said "the last of its 1 steps" and "all 1 steps"."""
    argv, _ = pretrained
    argv = [*argv, "--run-name", "p7", "--num-iterations", "1"]
    d = _commit_step(*driver(argv), step=1)
    capsys.readouterr()
    assert raychat_main(argv) == 0
    assert capsys.readouterr().out.endswith(
        f"finished: the run's checkpoint {d} is at step 1, the last of its 1 step; nothing to train "
        "(--num-iterations above 1 trains it longer)\n"
    )
    assert _fails_in_one_line([*argv, "--stop-after", "1"], capsys) == (
        f"raychat pretrain: error: --stop-after 1: the run's checkpoint {d} is at step 1, its last, so it would "
        "stop before training a step; allowed: none, the run has trained all 1 step (leave --stop-after out)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)"
    )


@pytest.mark.parametrize("step, lr", [(3, "0.5"), (4, "0")])
def test_resuming_in_the_warmdown_with_a_longer_horizon(step, lr, pretrained, driver, capsys):
    """After a checkpoint of step 3 of 4, step 4 is halfway down the warmdown (progress (4 - 3) / 2); after one
    of step 4 (a finished run) the schedule is at its end, 0; under 6 steps (warmdown from step 5) both are back
    at the peak, 1: refused unless --allow-rewarm."""
    argv, _ = pretrained
    argv = [*argv, "--run-name", "p2"]
    d = _commit_step(*driver(argv), step=step)
    capsys.readouterr()
    line = _fails_in_one_line([*argv, "--num-iterations", "6"], capsys)
    assert line == (
        f"raychat pretrain: error: --num-iterations: the run's checkpoint {d} (step {step}) was made with 4, this "
        f"run asks for 6: its lr warmdown began at step 3 and is at multiplier {lr}; this run's schedule would "
        "raise it to 1 (--allow-rewarm to re-warm on purpose, or the checkpoint's settings to finish the "
        "warmdown)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    driver([*argv, "--num-iterations", "6", "--allow-rewarm"])
    assert (
        "lr schedule changed on resume (--num-iterations: 4 -> 6): 4 -> 6 steps, warmdown from step 3 -> 5; "
        f"lr multiplier of step {step + 1} (the first this run trains): {lr} -> 1\n"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, values",
    [("--target-param-data-ratio", ["0.1", "0.2", "0.05", "0.09"]),
     ("--target-flops", ["4.47e9", "8.94e9", "2.235e9", "4.19e9"])],  # shown as typed (was 4470000000.0)
)  # fmt: skip
def test_resuming_with_another_derived_horizon(flag, values, pretrained, driver, capsys):
    """A horizon derived from tokens per parameter or FLOPs follows --num-iterations' rule. The tiny model has
    82,752 parameters without the embedding, 545,664 FLOPs per token, 512 tokens a step: the first values
    give 16 steps (warmdown 6 from step 11, counted from 1; step 13, after the checkpoint of step 12, at
    (16 - 12) / 6), then 32 (warmdown from 20), 8 and 15 (warmdown 6 from step 10: (15 - 12) / 6 = 0.5)."""
    argv, _ = pretrained
    argv = [*argv, "--run-name", "p3", "--num-iterations", "-1"]
    made, longer, shorter, lower = values
    cfg, paths, plan, rows = driver([*argv, flag, made])
    assert plan.num_iterations == 16
    d = _commit_step(cfg, paths, plan, rows, step=12)
    capsys.readouterr()
    what = f"raychat pretrain: error: {flag}: the run's checkpoint {d} (step 12) was made with {made}, this run asks for"
    line = _fails_in_one_line([*argv, flag, longer], capsys)
    assert line == (
        f"{what} {longer}: its lr warmdown began at step 11 and is at multiplier 0.6667; this run's schedule would "
        "raise it to 1 (--allow-rewarm to re-warm on purpose, or the checkpoint's settings to finish the "
        "warmdown)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    line = _fails_in_one_line([*argv, flag, shorter], capsys)
    assert line == (
        f"{what} {shorter}: 8 steps instead of 16 leave nothing to train after step 12 (ask for more than 12 "
        "steps, or use another --run-name)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    driver([*argv, flag, lower])
    assert (
        f"lr schedule changed on resume ({flag}: {made} -> {lower}): 16 -> 15 steps, warmdown from step 11 -> 10; "
        "lr multiplier of step 13 (the first this run trains): 0.6667 -> 0.5\n"
    ) in capsys.readouterr().out


def test_resuming_from_a_checkpoint_that_lost_a_file(pretrained, capsys):
    argv, d = pretrained
    size = (d / "optim.pt").stat().st_size
    (d / "optim.pt").unlink()
    line = _fails_in_one_line(argv, capsys)
    assert line == (
        f"raychat pretrain: error: --run-name p1: checkpoint {d}: optim.pt is missing (committed with {size} "
        "bytes): this run would resume from it (remove that checkpoint to resume from the one before, or use "
        "another --run-name)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_resuming_sft_with_other_tasks_or_another_stage(root, driver, pretrained, capsys):
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s1", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    d = _commit_step(*driver(argv), step=1)  # of its 2 steps: one to resume
    driver(argv)  # the same settings: resumes
    capsys.readouterr()
    line = _fails_in_one_line([*argv, "--sft-tasks", "calculator:300"], capsys)
    assert line == (
        f"raychat sft: error: --sft-tasks: the run's checkpoint {d} was made with 'calculator:200', this run "
        f"asks for 'calculator:300' {HINT}"
    )
    # another directory alone resumes (the stream is the same: the calculator reads no file), so it is not
    # named beside the option that changed the stream (it was: "--sft-tasks, --task-data-dir: ...", where
    # giving the directory back was no use)
    driver([*argv, "--task-data-dir", f"{root}/elsewhere"])
    line = _fails_in_one_line(
        [*argv, "--sft-tasks", "calculator:300", "--task-data-dir", f"{root}/elsewhere"], capsys
    )
    assert line == (
        f"raychat sft: error: --sft-tasks: the run's checkpoint {d} was made with 'calculator:200', this run "
        f"asks for 'calculator:300' {HINT}"
    )
    line = _fails_in_one_line([*argv, "--run-name", "p1"], capsys)
    p1 = pretrained[1]
    assert line == (
        f"raychat sft: error: --run-name: the run's checkpoint {p1} is a pretrain checkpoint, this run is sft "
        "(use another --run-name)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_resuming_sft_on_other_task_data_under_the_same_mixture(
    root, driver, pretrained, monkeypatch, capsys
):
    """A new spelling word list (or a re-downloaded smoltalk, edited chatterbot files): the mixture fingerprint
    held the task names and counts only, so the run resumed on other conversations without a word. Now it holds
    the sha256 of every file the tasks read (the calculator's problems are generated: no file)."""
    words = root.parent / "words"
    words.write_text("\n".join(f"{a}{b}{c}" for a in "abcdefgh" for b in "aeiou" for c in "mnprst") + "\n")
    monkeypatch.setattr(spelling, "DEFAULT_WORDS", str(words))
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s5", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer", "--sft-tasks", "calculator:200,spelling:50"]  # fmt: skip
    d = _commit_step(*driver(argv), step=1)  # of its 2 steps: one to resume
    driver(argv)  # the same word list: resumes
    words.write_text(words.read_text() + "zebra\n")
    spelling.load_words.cache_clear()  # a new process reads the file again
    capsys.readouterr()
    line = _fails_in_one_line(argv, capsys)
    assert line == (
        "raychat sft: error: --sft-tasks: task spelling-train's file words now holds other content than when the "
        f"run's checkpoint {d} was made (another sha256): the run would go on with other conversations (use "
        "another --run-name, or restore the task data the run was made on)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_sft_on_your_own_file_checks_it_splits_it_and_resumes_on_it_alone(
    root, driver, tmp_path, monkeypatch, capsys
):
    """`raychat sft --sft-data mine.jsonl --sft-tasks ''`: the mixture is the file's conversations alone (named
    relative to the working directory, read by absolute path), the driver logs the split, and the file's sha256
    is in the resume check: an edited conversation under the same name refuses the resume, naming --sft-data."""
    mine = tmp_path / "mine.jsonl"
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    mine.write_text(json.dumps({"messages": talk}) + "\n" + "".join(
        json.dumps({"messages": [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i}"}]})
        + "\n" for i in range(19)
    ))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s8", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer", "--sft-data", "mine.jsonl", "--sft-tasks", ""]  # fmt: skip
    cfg, paths, plan, rows = driver(argv)
    assert cfg.data.sft_data == str(mine) and cfg.data.sft_tasks == ""
    assert [t["name"] for t in rows().fingerprint()["mixture"]["tasks"]] == ["sft-data"]
    lines = capsys.readouterr().out.splitlines()
    assert (
        "sft data: --sft-data: 19 conversations to train on, 1 held out for sft-data_val_bpb (--sft-test-size "
        "0.05 of 20, in seed 42's order)"
    ) in lines
    tokens = len(Tokenizer.load(f"{root}/tokenizer").encode("14"))  # the held-out one: 14? -> 14, 2 bytes
    assert f"sft data: sft-data_val_bpb scores 1 held-out conversation: {tokens} tokens, 2 bytes" in lines
    d = _commit_step(cfg, paths, plan, rows, step=1)  # of its 2 steps: one to resume
    driver(argv)  # the same file: resumes
    mine.write_text(mine.read_text().replace("Hello", "Hello there"))
    capsys.readouterr()
    assert _fails_in_one_line(argv, capsys) == (
        "raychat sft: error: --sft-data: task sft-data's file mine.jsonl now holds other content than when the "
        f"run's checkpoint {d} was made (another sha256): the run would go on with other conversations (use "
        "another --run-name, or restore the task data the run was made on)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_sft_data_is_read_once_by_the_driver_and_once_by_each_worker(root, driver, tmp_path, monkeypatch):
    """`raychat sft --sft-data` read and checked every file three times in the driver (the split's log line, the
    held-out rows check, the resume check's row source) and twice in each worker (row source, validators). Now
    once in each process: a spy on the function that reads a data file (located_records) counts the reads."""
    for name, n in (("train.jsonl", 12), ("test.jsonl", 2)):
        (tmp_path / name).write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i}"}]}) + "\n" for i in range(n)))  # fmt: skip
    reads, read, specs, train = [], loaders.located_records, [], sft.run_training
    monkeypatch.setattr(
        loaders, "located_records", lambda path, *a, **kw: reads.append(path) or read(path, *a, **kw)
    )
    monkeypatch.setattr(sft, "run_training", lambda cfg, spec, *a: specs.append(spec) or train(cfg, spec, *a))
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s9", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer", "--sft-data", str(tmp_path / "train.jsonl"),
            "--sft-tasks", ""]  # fmt: skip
    _commit_step(*driver(argv), step=1)  # of its 2 steps: the run below resumes it
    forget_read()  # the run below is a new process
    reads.clear()
    cfg, _, _, _ = driver(argv)
    each_once = [[tmp_path / "train.jsonl"], [tmp_path / "test.jsonl"]]
    assert reads == each_once
    reads.clear()
    forget_read()  # a worker is another process
    worker = ray.cloudpickle.loads(ray.cloudpickle.dumps(specs[-1]))  # as Ray Train hands it to each worker
    tokenizer, cpu = Tokenizer.load(cfg.data.tokenizer_path), torch.device("cpu")
    assert len(worker.row_source(cfg, tokenizer, 0, 1).fingerprint()["mixture"]["tasks"]) == 1
    assert [v.name for v in worker.validators(cfg, tokenizer, 0, 1, cpu, autocast_for(cpu))] == [
        "sft-data_val_bpb", "val_bpb"
    ]  # fmt: skip
    assert reads == each_once


def test_a_speedrun_reads_its_sft_data_once(speedrun_out, driver, tmp_path, monkeypatch):
    """The speedrun read --sft-data's files in its check before the first stage and again when SFT started (in
    the same process): now once (raychat.tasks.sft_data.read_sft_data), counted by a spy on the function that
    reads a data file."""
    out, _ = speedrun_out
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i}"}]}) + "\n" for i in range(12)))  # fmt: skip
    preset = yaml.safe_load(resources.files("raychat").joinpath("presets/tiny.yaml").read_text())
    preset["sft"]["sft_data"] = str(tmp_path / "train.jsonl")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(preset))
    argv = ["speedrun", "--preset", str(tmp_path / "mine.yaml"), "--out", str(out)]
    _commit_step(*driver(argv), step=4)  # pretraining finished: the next invocation reaches SFT's Ray
    forget_read()  # the invocation below is a new process
    reads, read = [], loaders.located_records
    monkeypatch.setattr(
        loaders, "located_records", lambda path, *a, **kw: reads.append(path) or read(path, *a, **kw)
    )
    cfg, _, _, _ = driver(argv)
    assert cfg.run.stage == "sft" and reads == [[tmp_path / "train.jsonl"]]


def _too_long(n: int, words: int) -> list[dict]:
    """n one-exchange conversations whose user message is `words` + i words, answered "ok"."""
    return [
        {
            "messages": [
                {"role": "user", "content": "word " * (words + i)},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for i in range(n)
    ]


def _tokens(tokenizer: Tokenizer, conversation: dict) -> int:
    """A user/assistant conversation's rendered length: its text's tokens, BOS and each message's start and end
    markers (5 markers for one exchange)."""
    messages = conversation["messages"]
    return sum(len(tokenizer.encode(m["content"])) for m in messages) + 1 + 2 * len(messages)


@pytest.mark.parametrize("words", [40, 400])
def test_sft_on_conversations_none_of_which_fits_a_row_is_refused_before_ray(words, root, tmp_path, capsys):
    """Every conversation longer than --seq-len + 1, even its one exchange: each worker's row source skipped them
    all and raised "every SFT sample was dropped by truncation", after Ray and the worker group had started. Now
    the driver refuses in one line: how many, how long, and the --seq-len that keeps some, or, past the
    checkpoint's max_seq_len (256), that shorter conversations are needed."""
    convs = _too_long(20, words)
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    tok = Tokenizer.load(root / "tokenizer")
    lengths = sorted(_tokens(tok, c) for c in convs)
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s11", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer", "--sft-data", str(tmp_path / "mine.jsonl"),
            "--sft-test-size", "0", "--sft-tasks", "", "--seq-len", "32"]  # fmt: skip
    line = _fails_in_one_line(argv, capsys)
    head = (
        "raychat sft: error: --seq-len 32: none of the 20 training conversations (--sft-data) fits a row of 33 "
        f"tokens, not even its most recent exchange: they hold {lengths[0]}..{lengths[-1]} tokens, and keeping "
        f"one needs a row of {lengths[0]}"
    )
    tail = "  (RAYCHAT_DEBUG=1 shows the traceback)"
    if lengths[0] <= 257:
        assert line == f"{head}: --seq-len {lengths[0] - 1}..256 keeps some{tail}"
    else:
        assert line == (
            f"{head} (--seq-len {lengths[0] - 1}), above the --init-from checkpoint {root}/pretrain/checkpoint_000004's "
            f"max_seq_len 256 (allowed: 1..256): shorter conversations are needed{tail}"
        )
    assert (lengths[0] <= 257) == (words == 40)
    assert not (root / "s11").exists()


def _short(n: int) -> list[dict]:
    """n one-exchange conversations "<i>?" answered "<i>": a few tokens each."""
    return [
        {"messages": [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i}"}]}
        for i in range(n)
    ]


def _own_sft(root: Path, mine: Path, run: str, tasks: str) -> list[str]:
    """The argv of `raychat sft` on --sft-data `mine` (none held out) and --sft-tasks `tasks`, rows of 33 tokens."""
    return ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", run, "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer", "--sft-data", str(mine),
            "--sft-test-size", "0", "--sft-tasks", tasks, "--seq-len", "32"]  # fmt: skip


SHORTENED = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}  # fmt: skip


@pytest.mark.parametrize("words", [40, 400])
def test_sft_data_partly_too_long_for_a_row_is_a_warning_before_ray(words, root, driver, tmp_path, capsys):
    """Some of the user's own conversations longer than a row (--seq-len 32: 33 tokens): the workers alone logged
    the ones they skipped. Now the driver says before Ray starts how many of them will be skipped (2 whose one
    exchange is longer than a row) and shortened (1 whose last exchange fits), and the --seq-len that keeps them
    all whole (the longest's length - 1), or, past the checkpoint's max_seq_len 256, how many rows of 257 keep
    whole. The run starts; with only the shortened one too long, it alone is named; conversations that all fit
    say nothing."""
    tok, mine = Tokenizer.load(root / "tokenizer"), tmp_path / "mine.jsonl"
    convs = [*_short(17), *_too_long(2, words), SHORTENED]
    mine.write_text("".join(json.dumps(c) + "\n" for c in convs))
    lengths = [_tokens(tok, c) for c in convs]
    last = SHORTENED["messages"][2:]
    assert max(lengths[:17]) <= 33 < min(lengths[17:]) and _tokens(tok, {"messages": last}) <= 33
    argv = _own_sft(root, mine, "s13", "")
    driver(argv)  # reaches Ray
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    head = (
        f"warning: --sft-data {mine}: 3 of its 20 training conversations are longer than a row of 33 tokens "
        "(--seq-len 32): 2 will be skipped (too long even without their oldest exchanges) and 1 shortened (oldest "
        f"exchanges dropped); they hold up to {max(lengths)} tokens"
    )
    if words == 40:
        assert max(lengths) - 1 <= 256 and warnings == [
            f"{head}: --seq-len {max(lengths) - 1} keeps them all whole"
        ]
    else:
        whole = sum(n <= 257 for n in lengths)
        assert whole == 18 and warnings == [
            f"{head}: keeping them all whole needs --seq-len {max(lengths) - 1}, above the --init-from checkpoint "
            f"{root}/pretrain/checkpoint_000004's max_seq_len 256: --seq-len 256 keeps 18 of the 20 whole"
        ]
    mine.write_text("".join(json.dumps(c) + "\n" for c in [*_short(19), SHORTENED]))
    driver(argv)
    longest = _tokens(tok, SHORTENED)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")] == [
        f"warning: --sft-data {mine}: 1 of its 20 training conversations is longer than a row of 33 tokens "
        f"(--seq-len 32): 1 will be shortened (oldest exchanges dropped); they hold up to {longest} tokens: "
        f"--seq-len {longest - 1} keeps them all whole"
    ]
    mine.write_text("".join(json.dumps(c) + "\n" for c in _short(20)))
    driver(argv)
    assert "warning:" not in capsys.readouterr().out


@pytest.mark.parametrize("words", [40, 400])
def test_sft_data_none_of_which_fits_a_row_is_refused_although_other_tasks_fit(
    words, root, driver, tmp_path, monkeypatch, capsys
):
    """Every one of the user's own conversations longer than a row, even its one exchange, while spelling's fit:
    training ran on spelling alone and skipped all of --sft-data (only the workers logged it). Now refused before
    Ray in one line naming --sft-data, how many, how long, and the --seq-len that keeps some or, past the
    checkpoint's max_seq_len 256, that shorter conversations are needed. With one conversation that fits, the
    run starts (the others in the warning line). Each of them is rendered once for both row checks (they
    rendered each three times: check_training_rows, then check_own_rows twice)."""
    tok, mine = Tokenizer.load(root / "tokenizer"), tmp_path / "mine.jsonl"
    convs = _too_long(20, words)
    mine.write_text("".join(json.dumps(c) + "\n" for c in convs))
    lengths = sorted(_tokens(tok, c) for c in convs)
    argv = _own_sft(root, mine, "s12", "spelling:50")
    rendered, render = [], sft_rows.render_conversation
    monkeypatch.setattr(
        sft_rows,
        "render_conversation",
        lambda t, c, **kw: rendered.append(c["messages"][0]) or render(t, c, **kw),
    )
    line = _fails_in_one_line(argv, capsys)
    own = [c["messages"][0] for c in convs]
    assert sorted(m["content"] for m in rendered if m in own) == sorted(m["content"] for m in own)
    assert len(rendered) == len(own) + 1  # and spelling's first conversation, which fits
    head = (
        f"raychat sft: error: --sft-data {mine}: none of its 20 training conversations fits a row of 33 tokens "
        "(--seq-len 32), not even its most recent exchange (training would skip them all and learn from "
        f"--sft-tasks alone): they hold {lengths[0]}..{lengths[-1]} tokens, and keeping one needs a row of "
        f"{lengths[0]}"
    )
    tail = "  (RAYCHAT_DEBUG=1 shows the traceback)"
    if words == 40:
        assert lengths[0] <= 257 and line == f"{head}: --seq-len {lengths[0] - 1}..256 keeps some{tail}"
    else:
        assert lengths[0] > 257 and line == (
            f"{head} (--seq-len {lengths[0] - 1}), above the --init-from checkpoint "
            f"{root}/pretrain/checkpoint_000004's max_seq_len 256 (allowed: 1..256): shorter conversations are "
            f"needed{tail}"
        )
    assert not (root / "s12").exists()
    mine.write_text("".join(json.dumps(c) + "\n" for c in [*convs[:19], *_short(1)]))
    driver(argv)  # one that fits: reaches Ray
    assert (
        f"warning: --sft-data {mine}: 19 of its 20 training conversations are longer"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("fits", [0, 1])
def test_a_speedrun_names_its_preset_keys_for_sft_data_longer_than_a_row(
    fits, speedrun_out, driver, tmp_path, capsys
):
    """The speedrun's SFT stage makes the same check when it starts (it needs the trained tokenizer), naming the
    preset's keys: sft.sft_data, sft.seq_len (32 here), sft.sft_tasks (spelling:50 fits), and the pretraining
    checkpoint, whose max_seq_len is train.seq_len 64. None fits: refused; one fits: a warning, and SFT starts."""
    out, _ = speedrun_out
    tok, mine = Tokenizer.load(out / "tokenizer"), tmp_path / "mine.jsonl"
    convs = [*_too_long(20 - fits, 40), *_short(fits)]
    mine.write_text("".join(json.dumps(c) + "\n" for c in convs))
    lengths = sorted(_tokens(tok, c) for c in convs)
    preset = yaml.safe_load(resources.files("raychat").joinpath("presets/tiny.yaml").read_text())
    preset["sft"] |= {"sft_data": str(mine), "sft_test_size": 0, "seq_len": 32, "sft_tasks": "spelling:50"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(preset))
    argv = ["speedrun", "--preset", str(tmp_path / "mine.yaml"), "--out", str(out)]
    _commit_step(*driver(argv), step=4)  # pretraining finished: the next invocation starts SFT
    capsys.readouterr()
    base = out / "checkpoints" / "base" / "checkpoint_000004"
    if not fits:
        assert lengths[0] - 1 <= 64 and _fails_in_one_line(argv, capsys) == (
            f"raychat speedrun: error: sft.sft_data {mine}: none of its 20 training conversations fits a row of 33 "
            "tokens (sft.seq_len 32), not even its most recent exchange (training would skip them all and learn "
            f"from sft.sft_tasks alone): they hold {lengths[0]}..{lengths[-1]} tokens, and keeping one needs a row "
            f"of {lengths[0]}: sft.seq_len {lengths[0] - 1}..64 keeps some  (RAYCHAT_DEBUG=1 shows the traceback)"
        )
        assert not (out / "checkpoints" / "sft").exists()
        return
    cfg, _, _, _ = driver(argv)
    assert cfg.run.stage == "sft" and lengths[-1] - 1 > 64
    assert (
        f"warning: sft.sft_data {mine}: 19 of its 20 training conversations are longer than a row of 33 tokens "
        "(sft.seq_len 32): 19 will be skipped (too long even without their oldest exchanges); they hold up to "
        f"{lengths[-1]} tokens: keeping them all whole needs sft.seq_len {lengths[-1] - 1}, above the pretraining "
        f"checkpoint {base}'s max_seq_len 64: sft.seq_len 64 keeps {sum(n <= 65 for n in lengths)} of the 20 whole"
    ) in capsys.readouterr().out.splitlines()


def test_resuming_a_run_whose_checkpoint_has_no_data_state(root, capsys):
    """A committed model-only checkpoint (save_model, as an export of weights would write) under the run: a
    training run cannot resume it; it was "[Errno 2] Failed to open local file .../state_rank0.npz"."""
    d = _pretrained_with(Tokenizer.load(root / "tokenizer"), root / "s2" / "checkpoint_000001", stage="sft")
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s2", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    line = _fails_in_one_line(argv, capsys)
    assert line == (
        f"raychat sft: error: --run-name s2: the run's checkpoint {d} holds no data state (state_rank0.npz), so "
        "it cannot be resumed (use another --run-name)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_a_dry_run_of_a_run_to_resume_makes_its_resume_check(pretrained, capsys):
    """`pretrain --dry-run` printed the plan of any horizon, even one the real run refuses."""
    argv, d = pretrained
    line = _fails_in_one_line([*argv, "--num-iterations", "2", "--dry-run"], capsys)
    assert line.startswith(
        f"raychat pretrain: error: --num-iterations: the run's checkpoint {d} (step 2) was made with 4, this run "
        "asks for 2: 2 steps instead of 4 leave nothing to train after step 2"
    )
    assert raychat_main([*argv, "--num-iterations", "6", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "lr multiplier of step 3 (the first this run trains): 1 -> 1\n" in out and "num_iterations" in out


def test_a_run_resumed_with_other_lrs_says_which_settings_changed(pretrained, capsys):
    """--matrix-lr, --grad-clip, --fp8 ... may change on resume (and now take effect:
    test_train_optim.py::test_a_run_resumed_with_other_lrs_and_weight_decay_trains_with_them), but nothing said
    so; the same settings print no such line."""
    argv, d = pretrained  # tiny: matrix_lr 0.02, grad_clip 1, total_batch_size 512; checkpoint at step 2
    assert raychat_main([*argv, "--num-iterations", "6", "--dry-run"]) == 0
    assert "settings changed" not in capsys.readouterr().out
    changed = ["--matrix-lr", "0.05", "--grad-clip", "0", "--total-batch-size", "1024", "--fp8"]
    assert raychat_main([*argv, "--num-iterations", "6", *changed, "--dry-run"]) == 0
    assert (
        "settings changed on resume: --matrix-lr 0.02 -> 0.05, --grad-clip 1 -> 0, --total-batch-size 512 -> 1024, "
        "--fp8 False -> True (from step 3 on; the steps before kept theirs)\n"
    ) in capsys.readouterr().out


def test_a_finished_run_started_with_other_settings_says_only_that_it_is_finished(pretrained, driver, capsys):
    """A run at its last step started with another --matrix-lr or --warmdown-ratio printed "settings changed on
    resume: --matrix-lr 0.02 -> 0.05 (from step 5 on; ...)" and the lr schedule's line, then that it was finished
    with nothing to train (measured on the tiny speedrun's base run)."""
    argv, _ = pretrained  # tiny: 4 steps
    d = _commit_step(*driver(argv), step=4)
    capsys.readouterr()
    assert raychat_main([*argv, "--matrix-lr", "0.05", "--warmdown-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "changed on resume" not in out
    assert (
        f"finished: the run's checkpoint {d} is at step 4, the last of its 4 steps; nothing to train "
        "(--num-iterations above 4 trains it longer)\n"
    ) in out


def test_resuming_sft_from_another_init_from(root, driver, capsys):
    """Another pretraining checkpoint of the same shape (a newer `latest`, another run): the run once went on
    from its own checkpoint without a word, its result claiming a start it never had."""
    _pretrained_with(Tokenizer.load(root / "tokenizer"), root / "pretrain2" / "checkpoint_000006", seed=1)
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s3", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    d = _commit_step(*driver(argv), step=1)  # of its 2 steps: one to resume
    driver([*argv[:-3], "pretrain", *argv[-2:]])  # the same checkpoint, named by its run
    capsys.readouterr()
    line = _fails_in_one_line([*argv[:-3], "pretrain2", *argv[-2:]], capsys)
    assert line == (
        f"raychat sft: error: --init-from: the run's checkpoint {d} was made with "
        f"'{root}/pretrain/checkpoint_000004', this run asks for '{root}/pretrain2/checkpoint_000006' {HINT}"
    )


@pytest.fixture
def rl_run(root, monkeypatch):
    """(the argv of a tiny RL run "r1" from root/sft, its committed checkpoint_000002), `raychat rl` stopped
    where it would start Ray."""

    def reached(*args, **kwargs):
        raise ReachedRay

    monkeypatch.setattr(ray, "init", reached)
    sft = write_tiny_checkpoint(root / "sft" / "checkpoint_000001", stage="sft")
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--run-name", "r1", "--init-from", "sft",
            "--steps", "4"]  # fmt: skip
    cfg = from_dict(RLConfig, preset_values("tiny", "rl") | {"storage_path": str(root), "run_name": "r1",
                                                            "init_from": str(sft), "steps": 4})  # fmt: skip
    model, tokenizer = tiny_model_and_tokenizer()
    d = root / "r1" / "checkpoint_000002"
    save_model(
        d, model, tokenizer, {"step": 2, "stage": "rl", "version": 2, "config": to_dict(cfg)}, commit=True
    )
    with pytest.raises(ReachedRay):  # the same settings: resumes
        raychat_main(argv)
    return argv, d


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--init-from", "pretrain"],
         "--init-from: the run's checkpoint {d} was made with '{root}/sft/checkpoint_000001', this run asks for "
         "'{root}/pretrain/checkpoint_000004' (use another --run-name, or the same settings to resume)"),
        (["--seed", "1", "--prompts-per-step", "4"],
         "--seed, --prompts-per-step: the run's checkpoint {d} was made with 0, 2, this run asks for 1, 4 (use "
         "another --run-name, or the same settings to resume)"),
        (["--rollout-workers", "2"],  # another sampling seed for the second half of each step's prompts
         "--rollout-workers: the run's checkpoint {d} was made with 1, this run asks for 2 (use another "
         "--run-name, or the same settings to resume)"),
        (["--steps", "1"],
         "--steps: the run's checkpoint {d} is at step 2, this run asks for 1: nothing to train (ask for 2 or "
         "more, or use another --run-name)"),
        (["--run-name", "sft"],
         "--run-name: the run's checkpoint {root}/sft/checkpoint_000001 is a sft checkpoint, this run is rl (use "
         "another --run-name)"),
    ],
)  # fmt: skip
def test_resuming_rl_with_other_settings_or_another_stages_run(flags, want, root, rl_run, capsys):
    """RL resumed any run directory: another --init-from or prompt stream went on from the run's own weights
    and prompts without a word (config.yaml rewritten to the new settings), and an SFT run's directory failed
    after Ray started with `KeyError: 'version'`, config.yaml written into it."""
    argv, d = rl_run
    before = _snapshot(root)
    line = _fails_in_one_line([*argv, *flags], capsys)
    assert line == f"raychat rl: error: {want.format(d=d, root=root)}"
    assert _snapshot(root) == before


def test_a_finished_rl_run_says_so_without_starting_ray(root, rl_run, capsys):
    """rl at its --steps started Ray and every actor to resume into an empty loop. Its summary said `"evals": []`
    although its metrics.jsonl holds them: they are read back from there (a torn last line skipped), and
    `already_complete` says that nothing was trained now (the speedrun's signal)."""
    argv, d = rl_run
    evals = [{"step": 0, "pass@1": 0.25, "pass@2": 0.5}, {"step": 2, "pass@1": 0.5, "pass@2": 0.75}]
    lines = [{"step": 0, "eval": evals[0]}, {"step": 1, "reward_mean": 0.0}, {"step": 2, "reward_mean": 0.5,
             "eval": evals[1]}]  # fmt: skip
    (root / "r1" / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "ev'
    )
    capsys.readouterr()
    assert raychat_main([*argv, "--steps", "2"]) == 0  # the rl_run fixture's ray.init raises ReachedRay
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == (
        f"finished: the run's checkpoint {d} is at step 2, the last of its 2 steps; nothing to train (--steps "
        "above 2 trains it longer)"
    )
    assert json.loads(out[-1]) == {"steps": 2, "start_step": 2, "already_complete": True, "evals": evals,
                                   "run_dir": str(root / "r1"), "checkpoint": str(d)}  # fmt: skip


def test_resuming_rl_with_other_sampling_or_eval_settings_names_each(root, rl_run, capsys):
    """RL resumed with another --temperature, --max-tokens or --eval-samples without a word, the checkpoint's
    values overwritten in config.yaml: a reward or pass@k curve that moved at the resume step had no cause in
    the log. The resume goes on, after one line naming each (the tiny preset's 1, 8, 2 in the checkpoint)."""
    argv, d = rl_run
    capsys.readouterr()
    with pytest.raises(ReachedRay):
        raychat_main([*argv, "--temperature", "0.7", "--max-tokens", "6", "--eval-samples", "4"])
    assert capsys.readouterr().out.splitlines()[1] == (
        f"resuming with other settings than the run's checkpoint {d} was made with: --max-tokens 8 -> 6, "
        "--temperature 1 -> 0.7, --eval-samples 2 -> 4; the steps after 2 use this run's, and pass@k after step 2 "
        "is not measured as before it"
    )
    with pytest.raises(ReachedRay):
        raychat_main([*argv, "--matrix-lr", "1e-3"])
    assert capsys.readouterr().out.splitlines()[1] == (
        f"resuming with other settings than the run's checkpoint {d} was made with: --matrix-lr 0.0002 -> 0.001; the "
        "steps after 2 use this run's"
    )


def test_rl_says_when_its_held_out_split_has_fewer_problems_than_eval_examples(
    root, tmp_path, monkeypatch, capsys
):
    """--eval-examples 64 on a GSM8K test file of 3 problems measured pass@k on those 3 without a word (the
    speedrun's line said "64 held-out problems"); one warning line now says so, and the run goes on."""
    write_tiny_checkpoint(root / "sft" / "checkpoint_000001", stage="sft")
    data = tmp_path / "task_data"
    for split in ("train", "test"):
        (data / "gsm8k" / "main").mkdir(parents=True, exist_ok=True)
        (data / "gsm8k" / "main" / f"{split}.jsonl").write_text(GSM8K_GOOD * 3)

    def reached(*args, **kwargs):
        raise ReachedRay

    monkeypatch.setattr(ray, "init", reached)
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--init-from", "sft", "--run-name", "r",
            "--task", "gsm8k", "--task-data-dir", str(data)]  # fmt: skip
    with pytest.raises(ReachedRay):
        raychat_main([*argv, "--eval-examples", "64"])
    assert capsys.readouterr().err == (
        "warning: --eval-examples 64: --task gsm8k's test split has 3 problems; pass@k is over those 3\n"
    )
    with pytest.raises(ReachedRay):
        raychat_main([*argv, "--eval-examples", "3"])
    assert capsys.readouterr().err == ""


def test_an_rl_dry_run_checks_and_prints_its_plan_without_ray_or_writes(root, rl_run, capsys):
    """rl had no --dry-run (pretrain and sft do): its settings and a resume were checked only by starting it.
    The plan line counts what the run would do from where it resumes; a new run's starts at step 1 with the
    baseline evaluation; a finished run's dry run prints its finished line. Ray is never started (rl_run's
    ray.init raises) and nothing is written."""
    argv, d = rl_run
    before = _snapshot(root)
    capsys.readouterr()
    assert raychat_main([*argv, "--steps", "6", "--eval-every", "2", "--dry-run"]) == 0
    plan, optimizer, run_dir = capsys.readouterr().out.splitlines()[1:]
    assert plan == (
        f"plan: steps 3..6 (resuming from {d}) of 2 prompts x 2 samples = 4 rollouts a step, at most 8 tokens each "
        "at --temperature 1; pass@1..2 on 4 held-out problems every 2 steps and at the end; a checkpoint every step "
        "(the newest 2 kept); 1 learner x {CPU: 0.5} + 1 rollout actor x {CPU: 0.5}"
    )
    assert optimizer.startswith("optimizer: Muon 0.0002 for the hidden matrices; AdamW x ")
    assert "; Newton-Schulz in " in optimizer
    assert run_dir == (
        f"run dir: {root / 'r1'} (config.yaml, metrics.jsonl: a line a step, checkpoint_<step>; rollouts are not "
        "kept; the same command resumes from the newest checkpoint)"
    )
    new = [a if a != "r1" else "r2" for a in argv]
    assert (
        raychat_main(
            [*new, "--eval-every", "0", "--eval-temperature", "0", "--eval-samples", "1", "--dry-run"]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines()[1] == (
        "plan: steps 1..4 of 2 prompts x 2 samples = 4 rollouts a step, at most 8 tokens each at --temperature 1; "
        "pass@1 on 4 held-out problems at step 0 and at the end; a checkpoint every step (the newest 2 kept); "
        "1 learner x {CPU: 0.5} + 1 rollout actor x {CPU: 0.5}"
    )
    assert raychat_main([*argv, "--steps", "2", "--dry-run"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[1].startswith(f"finished: the run's checkpoint {d} is at step 2")
    )
    assert _snapshot(root) == before and not (root / "r2").exists()


def test_an_rl_run_prints_its_plan_and_run_dir_before_ray_starts(root, rl_run, capsys):
    """Only --dry-run printed the plan: a real run started Ray with no word of its rollouts a step, their token
    budget or where its checkpoints go (pretraining prints its plan first); its run directory was named only in
    the summary at the end. rl_run's ray.init raises: the lines come before Ray starts."""
    argv, d = rl_run
    capsys.readouterr()
    with pytest.raises(ReachedRay):
        raychat_main([*argv, "--steps", "5", "--ns-dtype", "float32"])
    assert capsys.readouterr().out.splitlines()[1:] == [
        f"plan: steps 3..5 (resuming from {d}) of 2 prompts x 2 samples = 4 rollouts a step, at most 8 tokens each "
        "at --temperature 1; pass@1..2 on 4 held-out problems every step; a checkpoint every step "
        "(the newest 2 kept); 1 learner x {CPU: 0.5} + 1 rollout actor x {CPU: 0.5}",
        # the test checkpoint's width 64: AdamW x (64 / 768) ** -0.5 = sqrt(12) = 3.464; 0.001 x 3.464 = 0.003464
        "optimizer: Muon 0.0002 for the hidden matrices; AdamW x 3.464 (= (width 64 / 768) ** -0.5): embedding "
        "0.003464, lm_head 0.003464, norms 0.003464; Newton-Schulz in float32 on cpu (requested); constant lrs (no "
        "warmup or decay); Muon weight decay 0, grad clipping at global norm 1",
        f"run dir: {root / 'r1'} (config.yaml, metrics.jsonl: a line a step, checkpoint_<step>; rollouts are not "
        "kept; the same command resumes from the newest checkpoint)",
    ]


def test_rl_names_what_its_init_from_resolved_to_and_takes_eval_every_0(root, rl_run, capsys):
    """rl printed no `init from:` line (sft does), so what `latest` resolved to went unseen; and --eval-every 0 was
    refused (">= 1") while its --checkpoint-every 0, and training's --eval-every 0, mean "only at the end"."""
    argv, _ = rl_run
    capsys.readouterr()
    with pytest.raises(ReachedRay):
        raychat_main([*(a if a != "sft" else "latest" for a in argv), "--eval-every", "0"])
    sft = root / "sft" / "checkpoint_000001"
    assert capsys.readouterr().out.splitlines()[0] == f"init from: {sft} (sft checkpoint, step 0)"


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--cpus-per-rollout", "{big}"],
         "--rollout-workers 1 x --cpus-per-rollout {big}: one of them needs {{CPU: {big}}}; no node type has room: "
         "CPU (need {big}, the most a node has is {n}); largest node type: this machine {{CPU: {n}}}"),
        (["--cpus-per-learner", "{big}"],
         "--learner-workers 1 x --cpus-per-learner {big}: one of them needs {{CPU: {big}}}; no node type has room: "
         "CPU (need {big}, the most a node has is {n}); largest node type: this machine {{CPU: {n}}}"),
        (["--rollout-workers", "{n}", "--cpus-per-rollout", "1"],
         "--learner-workers 1 x --cpus-per-learner 0.5 + --rollout-workers {n} x --cpus-per-rollout 1: together "
         "they need {need} CPU; the cluster can hold at most {n} (a local Ray cluster: this machine {{CPU: {n}}} x 1)"),
    ],
)  # fmt: skip
def test_rl_refuses_a_layout_the_local_cluster_cannot_hold_before_ray_starts(
    flags, want, root, monkeypatch, capsys
):
    """`rl --cpus-per-rollout 5` on 2 cores was refused only once Ray had started, naming five flags."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    write_tiny_checkpoint(root / "sft" / "checkpoint_000001", stage="sft")
    n = local_cores()
    values = {"n": n, "big": n + 3, "need": f"{n + 0.5:g}"}
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--init-from", "sft", "--run-name", "r"]
    before = _snapshot(root)
    line = _fails_in_one_line([*argv, *(f.format(**values) for f in flags)], capsys)
    assert line == f"raychat rl: error: {want.format(**values)}"
    assert _snapshot(root) == before


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--eval-temperature", "0"],  # the tiny preset's --eval-samples 2
         "--eval-samples 2 needs an --eval-temperature above 0 (at least 1e-05), got 0: greedy decoding writes the "
         "same completion every time (e.g. --eval-temperature 1; or --eval-samples 1)"),
        (["--task", "spelling"],
         "--task spelling: rl rewards only calculator and gsm8k, math problems whose reward is 1 when the number "
         "after a completion's last #### is the answer; spelling has answers that are not numbers after #### (sft "
         "trains on it, raychat eval measures it)"),
        (["--task", "smoltalk"],
         "--task smoltalk: rl rewards only calculator and gsm8k, math problems whose reward is 1 when the number "
         "after a completion's last #### is the answer; smoltalk has no checker to score a completion with"),
        (["--task", "humaneval"],
         "--task humaneval: rl rewards only calculator and gsm8k, math problems whose reward is 1 when the number "
         "after a completion's last #### is the answer; humaneval has no train split to take prompts from"),
        (["--task", "calculater"],
         "--task must be one of ['calculator', 'gsm8k'], got 'calculater' (did you mean calculator?)"),
    ],
)  # fmt: skip
def test_rl_refuses_settings_it_cannot_honour_in_one_line(flags, want, root, capsys):
    """rl took --eval-samples 2 at --eval-temperature 0 as one sample without a word (raychat eval refuses
    --samples above 1 at --temperature 0); --task spelling was argparse's "invalid choice: 'spelling' (choose
    from 'calculator', 'gsm8k')", which did not say why the other tasks cannot be rewarded."""
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--init-from", "sft", "--run-name", "r"]
    before = _snapshot(root)
    assert _fails_in_one_line([*argv, *flags], capsys) == f"raychat rl: error: {want}"
    assert _snapshot(root) == before


def test_an_sft_dry_run_makes_the_checks_and_prints_the_plan(root, driver, capsys):
    """`raychat sft --dry-run` was an unknown flag although the README gives SFT's resume check a dry run."""
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s4", "--init-from",
            f"{root}/pretrain", "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    before = _snapshot(root)
    assert raychat_main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        f"init from: {root}/pretrain/checkpoint_000004 (pretrain checkpoint, step 4)\n" in out
        and "horizon (num_iterations): 2 steps" in out
    )
    # 2 steps x 512 tokens / 64 a row: the epochs of calculator:200 (tests/unit/test_sft_overfit.py counts them)
    assert re.search(
        r"^sft data: the run's 16 rows of 65 tokens hold ~\d+ conversations: ~[\d.]+ epochs of its mixture's 200 "
        r"training conversations \(~[\d.]+ a row\)$",
        out,
        re.M,
    )
    assert not ray.is_initialized() and _snapshot(root) == before
    d = _commit_step(*driver(argv))
    capsys.readouterr()
    line = _fails_in_one_line([*argv, "--sft-tasks", "calculator:300", "--dry-run"], capsys)
    assert line == (
        f"raychat sft: error: --sft-tasks: the run's checkpoint {d} was made with 'calculator:200', this run "
        f"asks for 'calculator:300' {HINT}"
    )


def test_sft_of_another_stages_checkpoint_names_its_stage(root, capsys):
    """`sft --init-from <root>/rl --dry-run` planned an RL checkpoint without a word while --help said "SFT: a
    pretraining one": a checkpoint named explicitly is fine-tuned whatever its stage (`latest` takes only
    pretraining ones), and the first line says which stage and step it is."""
    rl = _pretrained_with(Tokenizer.load(root / "tokenizer"), root / "rl" / "checkpoint_000003", stage="rl")
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s7", "--dry-run"]
    assert raychat_main([*argv, "--init-from", "rl"]) == 0
    assert capsys.readouterr().out.startswith(f"init from: {rl} (rl checkpoint, step 3)\n")
    assert raychat_main([*argv, "--init-from", "latest"]) == 0  # the RL checkpoint is the newest one there
    pretrained = root / "pretrain" / "checkpoint_000004"
    assert capsys.readouterr().out.startswith(f"init from: {pretrained} (pretrain checkpoint, step 4)\n")


SFT_DATA = "SFT's data are its --sft-tasks conversations (pretraining's shards and packer are not read)"


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_blank_run_name_of_eval_or_export_is_refused_by_the_parser(command, root, capsys):
    """eval's and export's --run-name may be left out (their output goes beside the checkpoint's run), so a blank
    one is refused as every optional text flag's is, before anything is read or written."""
    before = _snapshot(root)
    with pytest.raises(SystemExit) as e:
        raychat_main([command, "--storage-path", str(root), "--checkpoint", "pretrain", "--run-name", ""])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"raychat {command}: error: argument --run-name: --run-name must be a non-blank string, or 'none' for no "
        f"value; got '' (`raychat {command} --help` lists the flags)\n"
    )
    assert _snapshot(root) == before


@pytest.mark.parametrize(
    "stage, flags, why",
    [
        ("sft", ["--depth", "7"], "SFT takes the model's shape from --init-from's checkpoint"),
        ("sft", ["--kv-group", "2"], "SFT takes the model's shape from --init-from's checkpoint"),
        ("sft", ["--data-dir", "/nonexistent"], SFT_DATA),
        ("sft", ["--buffer-size", "3"], SFT_DATA),
        ("sft", ["--overflow", "split"], SFT_DATA),
        ("sft", ["--no-document-masking"],
         "SFT always masks documents (each conversation attends only to itself)"),
        ("pretrain", ["--sft-tasks", "spelling:5"], "pretraining reads --data-dir's shards (the tasks are SFT's data)"),
        ("pretrain", ["--sft-data", "mine.jsonl"], "pretraining reads --data-dir's shards (the tasks are SFT's data)"),
    ],
)  # fmt: skip
def test_a_flag_the_stage_does_not_use_is_refused_not_ignored(stage, flags, why, root, capsys):
    """`sft --init-from latest --depth 7 --dry-run` planned the checkpoint's depth 1, and --data-dir, --buffer-size
    and --overflow were accepted and never read; the tiny preset, which sets depth, buffer_size and the data
    for pretraining, still runs SFT (a preset's values are not flags)."""
    argv = [stage, "--preset", "tiny", "--storage-path", str(root), "--run-name", "s6", "--dry-run"]
    argv += ["--init-from", "latest"] if stage == "sft" else ["--data-dir", f"{root}/data"]
    with pytest.raises(SystemExit) as e:
        raychat_main([*argv, *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"raychat {stage}: error: argument {flags[0]}: not used: {why} (`raychat {stage} --help` lists the flags)\n"
    )
    if stage == "sft":
        assert raychat_main(argv) == 0
        assert "model: depth 2 " in capsys.readouterr().out  # the checkpoint's, whatever the preset's depth


@pytest.mark.parametrize("where", ["local", "s3"])
def test_sft_from_a_checkpoint_trained_with_another_tokenizer(where, root, driver, tmp_path, capsys, request):
    """A model of the same vocabulary size loads over any tokenizer: SFT once trained a base model on token ids
    that meant other text to it (e.g. after `raychat tokenizer train` rewrote the run's tokenizer). For an
    s3:// --init-from check_tokenizer returned at once; its meta.json is read where it is (the weights are not
    fetched)."""
    other = write_tiny_checkpoint(root / "other" / "checkpoint_000004", stage="pretrain")
    ref, own = "other", other
    if where == "s3":
        ref = request.getfixturevalue("on_s3")(other, "runs/other/checkpoint_000004")
        own = other / "tokenizer.json"
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s5", "--init-from", ref,
            "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    before = _snapshot(root)
    line = _fails_in_one_line(argv, capsys)
    mine, theirs = Tokenizer.load(root / "tokenizer").version, Tokenizer.load(other).version
    named = other if where == "local" else ref
    copy = f"its own copy: {other}" if where == "local" else f"a local copy of {ref}/tokenizer.json"
    assert line == (
        f"raychat sft: error: --tokenizer-path: {root}/tokenizer holds tokenizer {mine}, but the --init-from "
        f"checkpoint {named} was trained with tokenizer {theirs} (give --tokenizer-path the tokenizer it was "
        f"trained with, e.g. {copy})  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _snapshot(root) == before and not (tmp_path / "cache").exists()
    driver([*argv[:-1], str(own)])  # its own tokenizer: on to Ray


@pytest.mark.parametrize("stage", ["sft", "pretrain"])
def test_a_seq_len_longer_than_the_init_from_models_is_refused_before_ray(stage, root, capsys):
    """`sft --seq-len 512` from a model of max_seq_len 256 trained rows of 512 positions (RoPE is computed, so
    nothing failed) and committed checkpoints still saying max_seq_len 256: serving and evaluation never reach
    the positions it trained."""
    ckpt = root / "pretrain" / "checkpoint_000004"
    argv = [stage, "--storage-path", str(root), "--run-name", "s8", "--init-from", "latest"]
    before = _snapshot(root)
    want = (
        f"raychat {stage}: error: --seq-len 512: the --init-from checkpoint {ckpt} has max_seq_len 256 (its "
        "checkpoints keep it: serving and evaluation stop there); allowed: 1..256  (RAYCHAT_DEBUG=1 shows the "
        "traceback)"
    )
    for dry_run in (["--dry-run"], []) if stage == "sft" else (["--dry-run"],):
        assert _fails_in_one_line([*argv, "--seq-len", "512", *dry_run], capsys) == want
    assert _snapshot(root) == before
    assert raychat_main([*argv, "--seq-len", "256", "--dry-run"]) == 0
    assert "x 256 tokens x" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--depth", "7"], "--depth: the --init-from checkpoint {ckpt} has 2, given 7"),
        (["--depth", "2", "--kv-group", "4", "--head-dim", "32"],
         "--head-dim, --kv-group: the --init-from checkpoint {ckpt} has 16, 2, given 32, 4"),
        (["--aspect-ratio", "64"], "--aspect-ratio: the --init-from checkpoint {ckpt} has 32, given 64"),
    ],
)  # fmt: skip
def test_pretraining_from_a_checkpoint_refuses_a_typed_shape_flag_it_would_ignore(flags, want, root, capsys):
    """`pretrain --init-from X --depth 7` planned and trained X's depth 2 without a word; the checkpoint's own
    values typed (and the preset's, which are not typed) are accepted."""
    ckpt = root / "pretrain" / "checkpoint_000004"
    argv = [
        "pretrain",
        "--storage-path",
        str(root),
        "--run-name",
        "p8",
        "--init-from",
        str(ckpt),
        "--dry-run",
    ]
    line = _fails_in_one_line([*argv, *flags], capsys)
    assert line == (
        f"raychat pretrain: error: {want.format(ckpt=ckpt)} (a run from a checkpoint keeps its shape: leave the "
        "flag out, or start from scratch without --init-from)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    same = ["--depth", "2", "--kv-group", "2", "--head-dim", "16", "--aspect-ratio", "32"]
    assert raychat_main([*argv, *same]) == 0
    assert "model: depth 2 width 64 heads 4 (kv 2) head_dim 16" in capsys.readouterr().out


def test_rl_refuses_a_max_tokens_that_does_not_fit_after_its_longest_prompt(root, monkeypatch, capsys):
    """The engine cut every completion at the model's max_seq_len without a word, so a --max-tokens past what
    the longest prompt leaves was a budget never given (and a prompt that filled max_seq_len failed in a
    rollout actor after Ray started)."""

    def reached(*args, **kwargs):
        raise ReachedRay

    monkeypatch.setattr(ray, "init", reached)
    sft = write_tiny_checkpoint(root / "short" / "checkpoint_000001", max_seq_len=64, stage="sft")
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--run-name", "r9", "--init-from", "short"]
    before = _snapshot(root)
    line = _fails_in_one_line([*argv, "--max-tokens", "48"], capsys)
    assert line == (
        f"raychat rl: error: --max-tokens 48: the longest --task calculator prompt has 23 tokens and the "
        f"--init-from checkpoint {sft} has max_seq_len 64, which must hold prompt and completion; allowed: 1..41"
    )
    assert _snapshot(root) == before
    with pytest.raises(ReachedRay):  # the longest prompt + 41 tokens fill max_seq_len: on to Ray
        raychat_main([*argv, "--max-tokens", "41"])


def test_a_local_ray_cluster_that_does_not_start_is_one_line_with_a_hint(root, tmp_path, monkeypatch, capsys):
    """A local cluster that did not start came out of sft as Ray's own error: a raw traceback for its "node
    timed out during startup" (a bare Exception), an errno line naming only a path for a temp dir it could not
    create (the real failure made here: Ray's temp dir under a regular file)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("RAY_TMPDIR", f"{blocker}/ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = [
        "sft",
        "--preset",
        "tiny",
        "--storage-path",
        str(root),
        "--run-name",
        "s10",
        "--init-from",
        "latest",
    ]
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat sft: error: the local Ray cluster did not start: [Errno 20] Not a directory: '{blocker}/ray' "
        "(see Ray's logs under its temp dir, /tmp/ray by default)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_serves_local_ray_cluster_that_does_not_start_is_one_line_with_a_hint(tmp_path, monkeypatch, capsys):
    """`raychat serve` without --address or RAY_ADDRESS starts Ray through start_local_cluster with address=None
    (Ray's choice: a `ray start` cluster of this machine, else a new one), so the same real failure as above
    is the same one line (was Ray's bare errno line). A free --port: a busy one is refused before Ray starts."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("RAY_TMPDIR", f"{blocker}/ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    argv = ["serve", "--checkpoint", str(ckpt), "--port", str(free_ports(1)[0])]
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat serve: error: the local Ray cluster did not start: [Errno 20] Not a directory: '{blocker}/ray' "
        "(see Ray's logs under its temp dir, /tmp/ray by default)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_rays_startup_timeout_gets_the_overload_hint():
    """The exception Ray 2.60 raises when its raylet does not register in time (ray/_private/node.py, a bare
    Exception), as start_local_cluster words it: the hint named no setting ("no setting changes it"), but
    RAY_raylet_start_wait_time_s does (docs/deployment.md)."""
    ray_error = Exception(
        "The current node timed out during startup. This could happen because some of the raylet failed to "
        "startup or the GCS has become overloaded."
    )
    assert start_failure(ray_error) == (
        "the local Ray cluster did not start: The current node timed out during startup. This could happen "
        "because some of the raylet failed to startup or the GCS has become overloaded. (this machine is likely "
        "overloaded: Ray gives its raylet RAY_raylet_start_wait_time_s (default 30) seconds to register; set it "
        "higher (e.g. RAY_raylet_start_wait_time_s=120), retry when the load is lower, or start a cluster with "
        "`ray start --head` and run with RAY_ADDRESS=auto)"
    )


def test_sft_on_an_object_storage_root_does_not_resolve_pretrainings_data_dir(root, driver, s3_env, capsys):
    """`raychat sft --storage-path s3://...` was refused for a flag it never reads and refuses when given
    (`--data-dir: s3://.../data is on object storage`): its default, a run under the remote root, was resolved
    as pretraining resolves it. SFT on object storage could not run at all; pretraining still refuses it."""
    bucket = s3_env.make_bucket()
    s3 = f"s3://{bucket}/runs"
    pafs.copy_files(
        str(root / "pretrain"), f"{bucket}/runs/pretrain", destination_filesystem=s3_env.filesystem()
    )
    argv = ["sft", "--preset", "tiny", "--storage-path", s3, "--run-name", "s", "--init-from", "latest",
            "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    cfg, paths, _, _ = driver(argv)
    assert cfg.run.init_from == paths.init_from == f"{s3}/pretrain/checkpoint_000004"
    assert paths.run_dir == f"{s3}/s"
    line = _fails_in_one_line(["pretrain", "--preset", "tiny", "--storage-path", s3, "--tokenizer-path",
                               f"{root}/tokenizer"], capsys)  # fmt: skip
    assert line == (
        f"raychat pretrain: error: --data-dir: {s3}/data is on object storage; data and the tokenizer are read "
        "as files by every node: give a local or NFS directory  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


@pytest.fixture
def on_s3(s3_env, tmp_path, monkeypatch):
    """put(local checkpoint dir, key) -> the s3:// URI of its copy in a new bucket; the node's checkpoint cache
    is tmp_path/cache, which a check that downloads nothing leaves absent."""
    bucket = s3_env.make_bucket()
    monkeypatch.setattr(checkpoint_manager, "DEFAULT_CACHE", tmp_path / "cache")

    def put(local: Path, key: str) -> str:
        pafs.copy_files(str(local), f"{bucket}/{key}", destination_filesystem=s3_env.filesystem())
        return f"s3://{bucket}/{key}"

    return put


@pytest.mark.parametrize(
    "stage, flags, want",
    [
        ("sft", ["--seq-len", "512"], "--seq-len 512: the --init-from checkpoint {uri} has max_seq_len 256 (its "
         "checkpoints keep it: serving and evaluation stop there); allowed: 1..256"),
        ("pretrain", ["--depth", "7"], "--depth: the --init-from checkpoint {uri} has 2, given 7 (a run from a "
         "checkpoint keeps its shape: leave the flag out, or start from scratch without --init-from)"),
    ],
)  # fmt: skip
def test_the_shape_checks_of_a_remote_init_from_fetch_no_weights(
    stage, flags, want, root, on_s3, tmp_path, capsys
):
    """make_plan's --seq-len check and check_shape_flags read an s3:// --init-from with read_meta, which
    downloaded the whole checkpoint (weights and optimizer state) into the driver's cache to read meta.json."""
    uri = on_s3(root / "pretrain" / "checkpoint_000004", "runs/pretrain/checkpoint_000004")
    argv = [stage, "--storage-path", str(root), "--run-name", "s8", "--init-from", uri, "--dry-run"]
    line = _fails_in_one_line([*argv, *flags], capsys)
    assert line == f"raychat {stage}: error: {want.format(uri=uri)}  (RAYCHAT_DEBUG=1 shows the traceback)"
    assert not (tmp_path / "cache").exists()


def test_a_remote_init_from_with_a_truncated_file_is_refused_before_ray(root, driver, on_s3, s3_env, capsys):
    """resolve_paths checked a local --init-from's files against its commit marker (check_model) and a remote
    one not at all: every worker failed on it in turn, after Ray started."""
    uri = on_s3(root / "pretrain" / "checkpoint_000004", "runs/pretrain/checkpoint_000004")
    key = uri.removeprefix("s3://") + "/model.safetensors"
    size = (root / "pretrain" / "checkpoint_000004" / "model.safetensors").stat().st_size
    with s3_env.filesystem().open_output_stream(key) as f:
        f.write(b"x" * 10)
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s9", "--init-from", uri,
            "--tokenizer-path", f"{root}/tokenizer"]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat sft: error: checkpoint {uri}: model.safetensors has 10 bytes, committed with {size} (truncated "
        "or replaced)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_rl_checks_max_tokens_against_a_remote_init_from(root, on_s3, tmp_path, monkeypatch, capsys):
    """check_generation_length returned at once for an s3:// --init-from: a --max-tokens past what the longest
    prompt leaves went on to Ray. Its meta.json and tokenizer.json are read where they are."""

    def reached(*args, **kwargs):
        raise ReachedRay

    monkeypatch.setattr(ray, "init", reached)
    sft = write_tiny_checkpoint(tmp_path / "short" / "checkpoint_000001", max_seq_len=64, stage="sft")
    uri = on_s3(sft, "runs/short/checkpoint_000001")
    argv = ["rl", "--preset", "tiny", "--storage-path", str(root), "--run-name", "r9", "--init-from", uri]
    line = _fails_in_one_line([*argv, "--max-tokens", "48"], capsys)
    assert line == (
        f"raychat rl: error: --max-tokens 48: the longest --task calculator prompt has 23 tokens and the "
        f"--init-from checkpoint {uri} has max_seq_len 64, which must hold prompt and completion; allowed: 1..41"
    )
    with pytest.raises(ReachedRay):
        raychat_main([*argv, "--max-tokens", "41"])
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "argv, flag, where",
    [
        (["pretrain", "--preset", "tiny", "--storage-path", "{s3}", "--run-name", "p",
          "--data-dir", "{root}/prepared", "--tokenizer-path", "{root}/tokenizer"], "--storage-path", "{s3}"),
        (["export", "--checkpoint", "{root}/pretrain", "--out", "{s3}/hf"], "--out", "{s3}/hf"),
    ],
)  # fmt: skip
def test_an_s3_endpoint_that_does_not_answer_is_named(argv, flag, where, root, monkeypatch, capsys):
    """pretrain and export --out printed pyarrow's `When listing objects under key 'runs/p/' in bucket ...: AWS
    Error NETWORK_CONNECTION ...`, naming neither the flag nor the endpoint (sft, rl, chat, serve named their
    --init-from / --checkpoint but not the endpoint)."""
    _good_input(root)
    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    s3 = "s3://bucket/runs"
    line = _fails_in_one_line([a.format(root=root, s3=s3) for a in argv], capsys)
    assert re.sub(r"after \d+ ms", "after N ms", line) == (
        f"raychat {argv[0]}: error: {flag}: cannot read {where.format(s3=s3)}: cannot connect to the S3 endpoint "
        f"http://127.0.0.1:{port} ($AWS_ENDPOINT_URL): Failed to connect to 127.0.0.1:{port} after N ms: Could not "
        "connect to server  (RAYCHAT_DEBUG=1 shows the traceback)"
    )


def test_sft_without_a_tokenizer_names_the_init_from_checkpoints_copy(root, capsys):
    """`raychat sft --init-from runs-tiny/checkpoints/base` run where `runs/tokenizer` does not exist said `no
    tokenizer at .../runs/tokenizer (train one with raychat tokenizer train)`: no flag named, and a new tokenizer
    would not match the checkpoint. The line names --tokenizer-path and the checkpoint's own copy."""
    ckpt = root / "pretrain" / "checkpoint_000004"
    argv = ["sft", "--preset", "tiny", "--storage-path", str(root), "--run-name", "s", "--init-from", str(ckpt),
            "--tokenizer-path", str(root / "none")]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat sft: error: --tokenizer-path: no tokenizer at {root}/none: give the --init-from checkpoint's "
        f"tokenizer, its copy: --tokenizer-path {ckpt}  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert not (root / "s").exists()


def test_a_missing_sft_tokenizer_is_named_as_the_command_names_its_options(tmp_path):
    """The line hard-coded --tokenizer-path and --init-from, so the speedrun's SFT (its tokenizer laid out by
    --out, the checkpoint it starts from its pretraining's) named flags it has not. Now as the stage's Flags name
    them; a remote --init-from's tokenizer is a local copy of its tokenizer.json."""
    missing, ckpt = str(tmp_path / "none"), str(tmp_path / "ck")
    with pytest.raises(FileNotFoundError) as e:
        sft.load_init_tokenizer(missing, ckpt, speedrun_flags("tiny", "sft"))
    assert str(e.value) == (
        f"--out: no tokenizer at {missing}: give the pretraining checkpoint's tokenizer, its tokenizer.json copied "
        f"to {missing}"
    )
    with pytest.raises(FileNotFoundError) as e:
        sft.load_init_tokenizer(missing, "s3://bucket/runs/base/checkpoint_000004")
    assert str(e.value) == (
        f"--tokenizer-path: no tokenizer at {missing}: give the --init-from checkpoint's tokenizer, a local copy of "
        "its tokenizer.json"
    )

"""HF export: transformers loads the directory on CPU and agrees with raychat on logits, token ids and the
chat template. Needs the test extra's `transformers`; skipped (with the reason) without it."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from raychat.atomic import STAGING_IDLE_S
from raychat.chat_template import render_conversation, render_for_completion
from raychat.checkpoint import save_model
from raychat.checkpoint_manager import output_place
from raychat.cli import main as raychat_main
from raychat.data.corpus.shards import write_manifest, write_shards
from raychat.export import hf as export_hf
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import SPECIAL_TOKENS, Tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")


def _corpus() -> list[str]:
    import argparse as a
    import json as j
    import random as r
    import textwrap as t

    return [inspect.getsource(m) for m in (a, j, r, t)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(_corpus(), vocab_size=600)


@pytest.fixture(scope="module")
def model(tokenizer) -> GPT:
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size + 7,  # padded embedding rows are exported too
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_kv_head=2,  # GQA
        head_dim=16,
        intermediate_size=96,
        max_seq_len=128,
        rope_theta=500.0,
        norm_eps=1e-5,
    )
    m = GPT(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():  # every weight random (norm weights too), so each one is checked
            p.copy_(
                torch.randn(p.shape, generator=gen) * (0.3 if p.ndim > 1 else 0.2)
                + (1.0 if p.ndim == 1 else 0.0)
            )
    return m.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model, tokenizer):
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_model(ckpt, model, tokenizer, {"step": 7}, commit=True)
    out = tmp_path_factory.mktemp("hf")
    rc = export_hf.main(argparse.Namespace(checkpoint=str(ckpt), out=str(out)))
    assert rc == 0
    return out


def test_files_and_config(exported, model, tokenizer):
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert not [n for n in names if n.endswith(".tmp")]
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        64,
        2,
        2,
        16,
    )
    assert cfg["vocab_size"] == tokenizer.vocab_size + 7
    assert cfg["eos_token_id"] == tokenizer.special_id("<|assistant_end|>")
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id]


def test_transformers_logits_match(exported, model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert hf.config.rope_parameters["rope_theta"] == 500.0
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(input_ids=ids).logits.float()
    assert ours.shape == theirs.shape == (2, 40, model.config.vocab_size)
    assert ours.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_generate_with_max_new_tokens_does_not_warn(exported):
    """generation_config.json set max_length, so every generate(max_new_tokens=...) warned "Both
    `max_new_tokens` (=5) and `max_length`(=128) seem to have been set"."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    hf_logger = logging.getLogger("transformers")  # its modules' loggers stop here (no propagation)
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    finally:
        hf_logger.removeHandler(handler)
    assert out.shape == (1, 8)
    assert [m for m in said + [str(w.message) for w in caught] if "max_length" in m] == []


def _random_text(rng: random.Random) -> str:
    pieces = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    pieces += list(" \t\n\r.,;:!?'\"-_()[]{}<>=+*/\\|@#$%^&~`")
    pieces += [
        "é",
        "ß",
        "ü",
        "中文",
        "日本",
        "🙂",
        "👍🏽",
        "’",
        "—",
        "  ",
        "\r\n",
        "\n\n",
        "'s",
        "'LL",
        "123456",
        "def ",
        "self.",
    ]
    pieces += ["<|", "|>", "bos", "<|bo", "user_"]  # fragments of special-token text (never a whole one)
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 120)))


def test_hf_tokenizer_ids_equal_tiktoken(exported, tokenizer):
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    rng = random.Random(0)
    texts = [_random_text(rng) for _ in range(1500)] + _corpus()
    n_tokens = 0
    for text in texts:
        if any(s in text for s in SPECIAL_TOKENS):
            continue
        ours = tokenizer.encode(text)
        assert hf_tok.encode(text, add_special_tokens=False) == ours, repr(text)
        assert hf_tok.decode(ours) == tokenizer.decode(ours)
        n_tokens += len(ours)
    assert n_tokens > 20_000
    for name, idx in tokenizer.special_tokens.items():
        assert hf_tok.convert_tokens_to_ids(name) == idx
    assert hf_tok.encode("a<|user_end|>b", add_special_tokens=False)[1] == tokenizer.special_id(
        "<|user_end|>"
    )


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there! How are you?"}],
    [
        {"role": "system", "content": "You are terse and exact"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 * 7, in words?\nThanks."},
    ],
    [
        {"role": "user", "content": "Compute 12*13 please."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me compute."},
                {"type": "python", "text": "12*13"},
                {"type": "python_output", "text": "156"},
                {"type": "text", "text": "It is 156."},
            ],
        },
        {"role": "user", "content": "Café? 中文 🙂"},
    ],
    [
        {"role": "user", "content": "Use the tool."},
        {"role": "assistant", "content": [{"type": "python", "text": "2**10"}]},
        {"role": "tool", "content": "1024"},
        {"role": "assistant", "content": "1024"},
        {"role": "user", "content": "ok"},
    ],
    [  # a prompt ending with a tool message: the assistant turn stays open after <|output_end|>
        {"role": "user", "content": "Use the tool."},
        {"role": "assistant", "content": [{"type": "python", "text": "2**10"}]},
        {"role": "tool", "content": "1024"},
    ],
]


@pytest.mark.parametrize(
    "conversation", CONVERSATIONS, ids=["one-turn", "system", "python-parts", "tool", "tool-ending"]
)
def test_jinja_template_matches_raychat(exported, tokenizer, conversation):
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    ours = render_for_completion(tokenizer, conversation)
    theirs = hf_tok.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(theirs) == ours
    # a full training conversation (ends with an assistant turn), no generation prompt
    full = [*conversation, {"role": "assistant", "content": "Sure."}]
    theirs = hf_tok.apply_chat_template(full, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert list(theirs) == render_conversation(tokenizer, full).ids


def test_jinja_template_system_ending_in_punctuation(exported, tokenizer):
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    theirs = hf_tok.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(theirs) == render_for_completion(tokenizer, conversation)


def test_export_rejects_small_vocab(tmp_path, tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size - 1, n_layer=1, n_embd=16, n_head=1, n_kv_head=1, head_dim=16,
                      intermediate_size=32, max_seq_len=16)  # fmt: skip
    with pytest.raises(ValueError, match="vocab_size"):
        export_hf.export_hf(GPT(cfg), tokenizer, tmp_path)


@pytest.fixture(autouse=True)
def staging(tmp_path_factory, monkeypatch) -> Path:
    """Every export to object storage here stages under a home of its own, never the developer's
    ~/.cache/raychat/exports (EXPORT_STAGING)."""
    path = tmp_path_factory.mktemp("home") / ".cache" / "raychat" / "exports"
    monkeypatch.setattr(export_hf, "EXPORT_STAGING", path)
    return path


@pytest.fixture
def root(tmp_path, model, tokenizer):
    """A storage root with a committed checkpoint, prepared data, a tokenizer and eval results."""
    r = tmp_path / "runs"
    save_model(
        r / "pretrain" / "checkpoint_000007", model, tokenizer, {"step": 7, "stage": "pretrain"}, commit=True
    )
    entries = write_shards(["a b c d"] * 8, r / "data", num_shards=2, log=lambda *_: None)
    write_manifest(r / "data", {"source": "test", "shards": entries})
    tokenizer.save(r / "tok")
    (r / "ev").mkdir()
    (r / "ev" / "eval.json").write_text("{}\n")
    (r / "ev" / "report_card.md").write_text("| task |\n")
    return r


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    "run, holds",
    [
        ("data", "manifest.json, shard_00000.parquet, shard_00001.parquet"),
        ("tok", "tokenizer.json"),
        ("ev", "eval.json, report_card.md"),
    ],
)
def test_export_refuses_a_run_directory_that_is_not_an_earlier_export(run, holds, root, capsys):
    """Prepared data, a tokenizer (which has a tokenizer.json too) or eval results are never replaced."""
    before = _files(root / run)
    rc = raychat_main(["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--run-name", run])
    assert rc == 2
    assert capsys.readouterr().err == (
        f"raychat export: error: --run-name: an export would replace {root}/{run}, which is not an earlier export "
        f"({root}/{run} holds: {holds}); choose another --run-name  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert _files(root / run) == before


def test_export_replaces_an_earlier_export(root, capsys):
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--run-name", "hf"]
    assert raychat_main(argv) == 0
    first = _files(root / "hf")
    assert sorted(first) == sorted(export_hf.EXPORT_FILES)
    (root / "hf" / "config.json").write_text("{}")  # replaced by the next export
    assert raychat_main(argv) == 0
    assert _files(root / "hf") == first
    assert (
        capsys.readouterr().out.splitlines()[-2]
        == f"exported {root}/pretrain/checkpoint_000007 (step 7) -> {root}/hf"
    )


def test_export_without_storage_path_or_run_name_goes_beside_the_checkpoints_run(
    root, model, tokenizer, tmp_path, monkeypatch, capsys
):
    """As eval's results: <root>/<run>/checkpoint_<step> exports to <root>/<run>-hf-step<step>/, so a second
    checkpoint's export keeps the first and nothing goes to ./runs/checkpoints/hf; --storage-path alone names the
    root, --run-name alone the directory beside the run; latest is looked up in runs/checkpoints."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert raychat_main(["export", "--checkpoint", f"{root}/pretrain/checkpoint_000007"]) == 0
    save_model(
        root / "pretrain" / "checkpoint_000009",
        model,
        tokenizer,
        {"step": 9, "stage": "pretrain"},
        commit=True,
    )
    assert raychat_main(["export", "--checkpoint", f"{root}/pretrain"]) == 0  # its newest: step 9
    assert raychat_main(["export", "--checkpoint", "pretrain", "--storage-path", str(root)]) == 0
    assert raychat_main(["export", "--checkpoint", f"{root}/pretrain", "--run-name", "mine"]) == 0
    outs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("exported")]
    assert outs == [
        f"exported {root}/pretrain/checkpoint_000007 (step 7) -> {root}/pretrain-hf-step7",
        f"exported {root}/pretrain/checkpoint_000009 (step 9) -> {root}/pretrain-hf-step9",
        f"exported {root}/pretrain/checkpoint_000009 (step 9) -> {root}/pretrain-hf-step9",  # replaced
        f"exported {root}/pretrain/checkpoint_000009 (step 9) -> {root}/mine",
    ]
    assert sorted(p.name for p in root.iterdir()) == [
        "data", "ev", "mine", "pretrain", "pretrain-hf-step7", "pretrain-hf-step9", "tok"
    ]  # fmt: skip
    for name in ("pretrain-hf-step7", "pretrain-hf-step9", "mine"):
        assert sorted(_files(root / name)) == sorted(export_hf.EXPORT_FILES)
    assert json.loads((root / "pretrain-hf-step7" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    assert list(work.iterdir()) == []  # no runs/ where the command ran
    # latest: the newest checkpoint under runs/checkpoints (here work/runs/checkpoints), exported beside its run
    save_model(
        work / "runs" / "checkpoints" / "sft" / "checkpoint_000003", model, tokenizer, {"step": 3, "stage": "sft"},
        commit=True,
    )  # fmt: skip
    assert raychat_main(["export", "--checkpoint", "latest"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"exported {work}/runs/checkpoints/sft/checkpoint_000003 (step 3) -> {work}/runs/checkpoints/sft-hf-step3"
    )
    assert sorted(p.name for p in (work / "runs" / "checkpoints").iterdir()) == ["sft", "sft-hf-step3"]
    storage, name, _ = output_place(f"{tmp_path}/my model", None, None, "hf")  # a checkpoint dir of its own
    assert (storage.uri, name) == (str(tmp_path), "my_model-hf")


@pytest.mark.parametrize(
    "out, holds",
    [
        ("pretrain/checkpoint_000007", None),
        ("data", "manifest.json, shard_00000.parquet, shard_00001.parquet"),
        ("tok", "tokenizer.json"),
        ("ev", "eval.json, report_card.md"),
    ],
)
def test_export_refuses_an_out_that_is_not_an_earlier_export(out, holds, root, capsys):
    """--out takes the rule of --run-name: the checkpoint itself, a tokenizer or any other files stay as they are."""
    before = _files(root / out)
    rc = raychat_main(
        ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", f"{root}/{out}"]
    )
    assert rc == 2
    why = (
        f"{root}/{out} is a checkpoint, which an export there would replace"
        if holds is None
        else f"an export would replace {root}/{out}, which is not an earlier export ({root}/{out} holds: {holds})"
    )
    assert capsys.readouterr().err == (
        f"raychat export: error: --out: {why}; choose another --out  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert _files(root / out) == before


def test_export_out_replaces_an_earlier_export(root, tmp_path):
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", str(tmp_path / "hf")]
    assert raychat_main(argv) == 0
    first = _files(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert raychat_main(argv) == 0
    assert _files(tmp_path / "hf") == first


@pytest.mark.parametrize("written", [sorted(export_hf.EXPORT_FILES), ["config.json"]])
def test_export_out_killed_while_writing_is_replaced_by_the_next_export(written, root, tmp_path):
    """A kill during a write leaves the temporary file beside the target (raychat.atomic): the next export
    into that --out was refused as 'not an earlier export', whether the kill hit a re-export or the first one."""
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", str(tmp_path / "hf")]
    assert raychat_main(argv) == 0
    first = _files(tmp_path / "hf")
    for name in set(first) - set(written):
        (tmp_path / "hf" / name).unlink()
    (tmp_path / "hf" / ".model.safetensors.3f9c2a1b0d4e5f67.tmp").write_bytes(b"\0" * 10)
    assert raychat_main(argv) == 0
    assert _files(tmp_path / "hf") == first  # the leftover is gone too
    # still refused: another stage's files beside a temporary file (a tokenizer's, killed while rewriting)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "tok" / ".tokenizer.json.3f9c2a1b0d4e5f67.tmp").write_text("{")
    assert raychat_main(argv[:-1] + [str(tmp_path / "tok")]) == 2
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        ".tokenizer.json.3f9c2a1b0d4e5f67.tmp",
        "tokenizer.json",
    ]


def test_export_out_on_s3_goes_to_the_bucket_not_to_a_local_folder(
    root, s3_env, tmp_path, monkeypatch, capsys
):
    """--out s3://bucket/x passed the checks, then wrote the export into the local folder ./bucket/x and
    printed the URI as where it went; the bucket got an empty x/. It is uploaded there now, as an export to a
    remote --storage-path is."""
    bucket, fs = s3_env.make_bucket(), s3_env.filesystem()
    monkeypatch.chdir(tmp_path)
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", f"s3://{bucket}/x/hf"]
    assert raychat_main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"exported {root}/pretrain/checkpoint_000007 (step 7) -> s3://{bucket}/x/hf"
    )
    assert raychat_main([*argv[:-1], str(tmp_path / "hf")]) == 0  # the same export, local
    local = _files(tmp_path / "hf")
    uploaded = {
        i.base_name: fs.open_input_stream(i.path).read()
        for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/x/hf"))
    }
    assert uploaded == local
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "runs"]  # no ./<bucket>/x/hf, no ./s3:
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert raychat_main(argv) == 0  # an earlier export there is replaced, as locally
    with fs.open_output_stream(f"{bucket}/x/notes.txt") as f:
        f.write(b"mine")
    capsys.readouterr()
    assert raychat_main([*argv[:-1], f"s3://{bucket}/x"]) == 2  # anything else there is kept
    assert capsys.readouterr().err.startswith(
        f"raychat export: error: --out: an export would replace s3://{bucket}/x, which is not an earlier export"
    )
    assert raychat_main([*argv[:-1], f"s3://{bucket}"]) == 2
    assert capsys.readouterr().err == (
        f"raychat export: error: --out: s3://{bucket} is a whole bucket; give s3://{bucket}/<prefix>  "
        "(RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert fs.open_input_stream(f"{bucket}/x/notes.txt").read() == b"mine"


def test_export_to_object_storage_says_how_to_download_it_before_loading(root, s3_env, capsys):
    """The hint after an export to s3:// said `from_pretrained('s3://...')`, which transformers cannot load (it
    reads a local directory or a Hub repo id): it names the download first."""
    bucket = s3_env.make_bucket()
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", f"s3://{bucket}/x/hf"]
    assert raychat_main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"load with: aws s3 cp --recursive s3://{bucket}/x/hf ./hf, then "
        "transformers.AutoModelForCausalLM.from_pretrained('./hf') (transformers does not read s3://)"
    )
    assert export_hf.load_hint("gs://bucket/runs/hf") == (
        "load with: gcloud storage cp -r gs://bucket/runs/hf ., then "
        "transformers.AutoModelForCausalLM.from_pretrained('./hf') (transformers does not read gs://)"
    )
    assert export_hf.load_hint("/mnt/runs/hf") == (
        "load with: transformers.AutoModelForCausalLM.from_pretrained('/mnt/runs/hf')"
    )


def test_export_to_object_storage_deletes_the_staging_a_killed_one_left(root, s3_env, staging):
    """An export to s3:// or gs:// staged in tempfile.TemporaryDirectory: one killed before its upload ended left
    /tmp/tmpXXXX (the whole model) behind for good. It stages under EXPORT_STAGING, and the next export there
    deletes a killed one's staging directory idle for an hour, not a younger one (another export's, running)."""
    killed, running = staging / ".export.0123456789abcdef", staging / ".export.fedcba9876543210"
    for d in (killed, running):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 64)
    hour_ago = time.time() - STAGING_IDLE_S - 60
    for p in (killed / "model.safetensors", killed):
        os.utime(p, (hour_ago, hour_ago))
    bucket = s3_env.make_bucket()
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", f"s3://{bucket}/hf"]
    assert raychat_main(argv) == 0
    assert sorted(p.name for p in staging.iterdir()) == [running.name]  # its own staging is gone too
    assert s3_env.filesystem().get_file_info(f"{bucket}/hf/model.safetensors").size > 0


def test_an_export_to_object_storage_leaves_nothing_in_the_cache(root, s3_env, staging):
    """The exports to s3:// here staged under the developer's ~/.cache/raychat/exports and left that directory
    behind, empty (the export deleted its own staging directory, not EXPORT_STAGING): every test run, and every
    user's export, left it in the home. The tests stage in a home of their own (the `staging` fixture) and an
    export deletes EXPORT_STAGING once it is empty; not while another export stages there."""
    cache = staging.parent
    cache.mkdir(parents=True)  # the checkpoint cache's parent, ~/.cache/raychat
    bucket = s3_env.make_bucket()
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", f"s3://{bucket}/hf"]
    assert raychat_main(argv) == 0
    assert list(cache.iterdir()) == []
    running = staging / ".export.fedcba9876543210"  # another export's, staging now
    running.mkdir(parents=True)
    assert raychat_main(argv) == 0
    assert list(cache.iterdir()) == [staging] and list(staging.iterdir()) == [running]


def test_an_export_to_object_storage_replaces_the_earlier_one_and_uploads_config_json_last(
    root, s3_env, tmp_path, monkeypatch, capsys
):
    """An export to s3:// uploaded its files one by one over the earlier export's: a file the earlier export had
    and the new one lacks (an older export format's) stayed beside the new files, and an upload that ended
    part-way paired the new weights with the old config.json. Now config.json is deleted first and uploaded
    last, after the files the new export lacks are deleted (directly under its prefix only: the sibling key and
    the bucket's are kept); an upload that ended part-way lacks config.json, and the next export replaces it."""
    bucket, fs = s3_env.make_bucket(), s3_env.filesystem()
    for key in (f"{bucket}/notes.txt", f"{bucket}/x/notes.txt"):
        with fs.open_output_stream(key) as f:
            f.write(b"mine")
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", f"s3://{bucket}/x/hf"]

    def remote() -> dict[str, bytes]:
        infos = fs.get_file_info(pafs.FileSelector(f"{bucket}/x/hf"))
        return {i.base_name: fs.open_input_stream(i.path).read() for i in infos}

    assert raychat_main(argv) == 0 and set(remote()) == export_hf.EXPORT_FILES
    real_export = export_hf.export_hf

    def newer_format(model, tokenizer, out):  # a later export format without special_tokens_map.json
        out = real_export(model, tokenizer, out)
        (out / "special_tokens_map.json").unlink()
        return out

    monkeypatch.setattr(export_hf, "export_hf", newer_format)
    assert raychat_main([*argv[:-1], str(tmp_path / "hf")]) == 0  # the same export, local
    local = _files(tmp_path / "hf")
    assert "special_tokens_map.json" not in local
    real_copy, copied, cut = pafs.copy_files, [], ["tokenizer.json"]

    def copy(source, destination, **kwargs):  # records each upload; the connection drops at `cut`
        name = destination.rsplit("/", 1)[-1]
        if name in cut:
            raise OSError("connection reset by peer")
        copied.append(name)
        return real_copy(source, destination, **kwargs)

    monkeypatch.setattr(pafs, "copy_files", copy)
    capsys.readouterr()
    assert raychat_main(argv) == 2  # the weights are up, tokenizer.json is not
    assert "connection reset by peer" in capsys.readouterr().err
    assert "config.json" not in remote() and remote()["model.safetensors"] == local["model.safetensors"]
    copied.clear(), cut.clear()
    assert raychat_main(argv) == 0  # the part-way upload is replaced as an earlier export
    assert remote() == local and copied[-1] == "config.json"
    assert fs.open_input_stream(f"{bucket}/notes.txt").read() == b"mine"
    assert fs.open_input_stream(f"{bucket}/x/notes.txt").read() == b"mine"


def test_export_refuses_weights_changed_in_place(root, tmp_path, capsys):
    """Bytes of model.safetensors overwritten at the same size pass the size and header checks of loading:
    the export used to write the damaged weights as a valid Hugging Face model. Nothing is written to --out."""
    ckpt = root / "pretrain" / "checkpoint_000007"
    weights = bytearray((ckpt / "model.safetensors").read_bytes())
    weights[-8:] = bytes(8)  # the last float32 values of the last tensor: a different model, same size
    (ckpt / "model.safetensors").write_bytes(weights)
    argv = ["export", "--checkpoint", "pretrain", "--storage-path", str(root), "--out", str(tmp_path / "hf")]
    assert raychat_main(argv) == 2
    assert capsys.readouterr().err == (
        f"raychat export: error: checkpoint {ckpt}: model.safetensors differs from its committed sha256 "
        "(corrupted)  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert not (tmp_path / "hf").exists()


def test_export_killed_part_way_leaves_the_earlier_export_whole(root, model, tokenizer, tmp_path):
    """An export into a directory that holds an earlier one, killed (SIGKILL) once it has written its new
    config.json: the directory held the new config.json beside the old weights, which transformers loaded
    without a word. It now holds the earlier export unchanged, and the next export replaces it whole."""
    big = GPT(replace(model.config, n_layer=4, n_embd=512, head_dim=128, intermediate_size=1024))  # 40 MB
    save_model(
        root / "big" / "checkpoint_000009", big, tokenizer, {"step": 9, "stage": "pretrain"}, commit=True
    )
    out = tmp_path / "exports" / "hf"
    argv = ["export", "--storage-path", str(root), "--out", str(out), "--checkpoint"]
    assert raychat_main([*argv, "pretrain"]) == 0
    first = _files(out)
    configs = []
    proc = subprocess.Popen([sys.executable, "-m", "raychat.cli", *argv, "big"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:  # its new config.json, wherever it is
            configs = [
                p for p in out.parent.glob("*hf*/config.json") if p.read_bytes() != first["config.json"]
            ]
            if configs:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait()
    assert configs, "the export ended before its config.json was seen"
    assert _files(out) == first
    assert raychat_main([*argv, "big"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # the killed one's staging dir is gone
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf.config.num_hidden_layers == 4
    assert torch.equal(hf.model.embed_tokens.weight, big.model.embed_tokens.weight)

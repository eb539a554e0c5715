"""`raychat chat` one-shot and interactive against a checkpoint written by raychat.checkpoint.save_model."""

from __future__ import annotations

import io
import shutil
import signal
import subprocess
import sys

import pyarrow.fs as pafs
import pytest
import torch
from support.engine_fixtures import byte_tokenizer, tiny_gpt
from support.serve_process import sigint_as_default

from raychat.chat import cli as chat_cli
from raychat.chat.cli import assistant_message
from raychat.chat_template import render_for_completion
from raychat.checkpoint import save_model
from raychat.cli import main
from raychat.engine import ModelRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    d = tmp_path_factory.mktemp("ckpt")
    save_model(d, model, tok, {"step": 0}, commit=True)
    return d, model, tok


def expected_reply(model, tok, messages, max_tokens):
    (res,) = ModelRunner(model, tok).generate_batch(
        [render_for_completion(tok, messages)], max_tokens=max_tokens, temperature=0.0
    )
    return res


def test_one_shot_streams_greedy_reply(checkpoint, capsys):
    d, model, tok = checkpoint
    rc = main(["chat", "--checkpoint", str(d), "-p", "hi there", "--temperature", "0", "--max-tokens", "6"])
    assert rc == 0
    res = expected_reply(model, tok, [{"role": "user", "content": "hi there"}], 6)
    assert capsys.readouterr().out == res.text + "\n"


def test_interactive_keeps_the_conversation(checkpoint, capsys, monkeypatch):
    d, model, tok = checkpoint
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n/quit\n"))
    assert main(["chat", "--checkpoint", str(d), "--temperature", "0", "--max-tokens", "4"]) == 0
    first_msgs = [{"role": "user", "content": "hello"}]
    first = expected_reply(model, tok, first_msgs, 4)
    second_msgs = [
        *first_msgs,
        assistant_message(tok, first.completion_tokens),
        {"role": "user", "content": "again"},
    ]
    second = expected_reply(model, tok, second_msgs, 4)
    out = capsys.readouterr().out
    assert out == f"you> raychat> {first.text}\nyou> raychat> {second.text}\nyou> "


def test_fit_history_drops_the_oldest_exchanges_first(checkpoint):
    _, _, tok = checkpoint
    system = {"role": "system", "content": "be brief"}
    u = [{"role": "user", "content": f"question {k}"} for k in range(3)]
    a = [{"role": "assistant", "content": f"answer {k}"} for k in range(2)]
    convo = [system, u[0], a[0], u[1], a[1], u[2]]
    length = lambda msgs: len(render_for_completion(tok, msgs))  # noqa: E731
    assert chat_cli.fit_history(tok, convo, 1, length(convo) + 1) == (convo, 0)
    assert chat_cli.fit_history(tok, convo, 1, length(convo)) == ([system, u[1], a[1], u[2]], 2)
    assert chat_cli.fit_history(tok, convo, 1, length([system, u[2]]) + 1) == ([system, u[2]], 4)
    assert chat_cli.fit_history(tok, convo, 1, length([system, u[2]])) is None
    assert chat_cli.fit_history(tok, convo[1:], 0, length(convo[3:]) + 1) == (
        convo[3:],
        2,
    )  # no system prompt
    # --max-tokens 3: the prompt must leave 3 tokens, not 1
    assert chat_cli.fit_history(tok, convo, 1, length(convo) + 3, reply_tokens=3) == (convo, 0)
    assert chat_cli.fit_history(tok, convo, 1, length(convo) + 2, reply_tokens=3) == (
        [system, u[1], a[1], u[2]],
        2,
    )
    assert chat_cli.fit_history(tok, convo, 1, length([system, u[2]]) + 2, reply_tokens=3) is None


def test_interactive_outgrowing_the_context_keeps_the_session(checkpoint, capsys, monkeypatch):
    """The 128-token model: 40 turns used to end the session at the fifth ("prompt has 152 tokens; max_seq_len
    128 leaves no room", exit 2), and one over-long message ended it at once."""
    d, _, tok = checkpoint
    lines = [f"hello there number {i}" for i in range(40)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("x" * 200 + "\n" + "\n".join(lines) + "\n"))
    assert main(["chat", "--checkpoint", str(d), "--temperature", "0", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    n = len(render_for_completion(tok, [{"role": "user", "content": "x" * 200}]))
    assert out.startswith(
        f"you> (not sent: this message has {n} tokens, but the model's context length is 128 tokens and at least "
        f"3 completion tokens must follow ({n} + 3 > 128): at most 125 fit; shorten it)\nyou> raychat> "
    )
    assert out.count("raychat> ") == 40 and out.endswith("you> ")
    assert "(dropped the 2 oldest messages: the conversation outgrew the model's 128 tokens)\n" in out


def test_a_reply_cut_by_the_context_says_so(checkpoint, capsys):
    """A prompt 2 tokens short of the model's 128 leaves room for 2 of the default 256: the reply used to end
    there as if the model had finished."""
    d, model, tok = checkpoint
    prompt = "x" * 122
    msgs = [{"role": "user", "content": prompt}]
    assert len(render_for_completion(tok, msgs)) == 126
    res = expected_reply(model, tok, msgs, 50)
    assert (res.finish_reason, len(res.completion_tokens)) == ("length", 2)
    argv = ["chat", "--checkpoint", str(d), "-p", prompt, "--temperature", "0"]
    assert main(argv) == 0
    assert capsys.readouterr().out == res.text + " [cut: the conversation filled the model's 128 tokens]\n"
    assert main([*argv, "--max-tokens", "1"]) == 0  # --max-tokens ended it, before the context: no mark
    assert capsys.readouterr().out == expected_reply(model, tok, msgs, 1).text + "\n"


def test_max_tokens_beyond_the_context_is_refused_at_start(checkpoint, capsys, monkeypatch):
    """--max-tokens 50 after a 126-token prompt in 128 (as the server's 400: context length, prompt tokens,
    completion tokens); interactively the shortest prompt is an empty message, 4 tokens (<|bos|> <|user_start|>
    <|user_end|> <|assistant_start|>), 14 with the system message "be brief" (+ 8 bytes + "\\n\\n"): refused
    before the first "you> ", nothing read. 126 + 2 = 128 fits."""
    d, model, tok = checkpoint
    argv = ["chat", "--checkpoint", str(d), "--temperature", "0"]
    assert main([*argv, "-p", "x" * 122, "--max-tokens", "50"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "raychat chat: error: --max-tokens: 50 completion tokens requested, but the model's context length is "
        "128 tokens and the prompt has 126 (126 + 50 > 128): at most 2 fit\n"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main([*argv, "--max-tokens", "125"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "raychat chat: error: --max-tokens: 125 completion tokens requested, but the model's context length is "
        "128 tokens and an empty message has 4 (4 + 125 > 128): at most 124 fit\n"
    )
    assert main([*argv, "--max-tokens", "115", "--system", "be brief"]) == 2
    assert capsys.readouterr().err.endswith(
        "an empty message with the system message has 14 (14 + 115 > 128): at most 114 fit\n"
    )
    assert sys.stdin.read() == "hello\n"  # never read: refused at start
    msgs = [{"role": "user", "content": "x" * 122}]
    assert main([*argv, "-p", "x" * 122, "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith(expected_reply(model, tok, msgs, 2).text)


def test_a_prompt_the_context_cannot_hold_is_refused_at_start(checkpoint, capsys, monkeypatch):
    """A -p prompt of 128 tokens in the 128-token model ("x" * 124 + <|bos|> <|user_start|> <|user_end|>
    <|assistant_start|>) leaves no room for a reply: it reached the engine and failed there after the checkpoint
    line, as "prompt has 128 tokens; rows hold max_len 128 tokens in total"; now refused first, naming --prompt
    in the voice of --max-tokens' refusal, and before --max-tokens (the prompt is what does not fit). A system
    message that fills the context leaves an empty message no room: --system (130 bytes + 2 + 4 tokens)."""
    d, _, tok = checkpoint
    argv = ["chat", "--checkpoint", str(d), "--temperature", "0"]
    assert len(render_for_completion(tok, [{"role": "user", "content": "x" * 124}])) == 128
    for extra in ([], ["--max-tokens", "50"]):
        assert main([*argv, "-p", "x" * 124, *extra]) == 2
        assert capsys.readouterr() == (
            "",
            "raychat chat: error: --prompt: the prompt has 128 tokens, but the model's context length is 128 "
            "tokens and at least 1 completion token must follow (128 + 1 > 128): at most 127 fit\n",
        )
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main([*argv, "--system", "y" * 130]) == 2
    assert capsys.readouterr().err == (
        "raychat chat: error: --system: an empty message with the system message has 136 tokens, but the "
        "model's context length is 128 tokens and at least 1 completion token must follow (136 + 1 > 128): at "
        "most 127 fit\n"
    )
    assert sys.stdin.read() == "hello\n"  # never read: refused at start


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    d = tmp_path_factory.mktemp("nan_ckpt")
    save_model(d, model, tok, {"step": 0}, commit=True)
    return d


def test_a_failed_reply_is_an_error_not_an_empty_reply(nan_checkpoint, capsys, monkeypatch):
    """The engine ends a request whose logits are not finite with finish_reason "error": chat used to print an
    empty reply, exit 0, and keep the empty reply in the conversation."""
    assert main(["chat", "--checkpoint", str(nan_checkpoint), "-p", "hi"]) == 1
    got = capsys.readouterr()
    assert got.out == "\n"
    assert got.err == (
        f"checkpoint: {nan_checkpoint} (unknown checkpoint, step 0)\n"
        "raychat chat: error: the reply failed: RuntimeError: non-finite logits (NaN, +inf, or no finite value) from the model\n"
    )
    sent = []
    monkeypatch.setattr(
        chat_cli, "_reply", lambda s, t, messages, p, o, one_shot=False: sent.append(messages)
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", "--checkpoint", str(nan_checkpoint)]) == 0
    assert sent == [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "again"}]]


def test_missing_checkpoint_is_a_clean_error(tmp_path, capsys):
    assert main(["chat", "--checkpoint", str(tmp_path / "nope"), "-p", "x"]) == 2
    assert (
        capsys.readouterr().err
        == f"raychat chat: error: --checkpoint: {tmp_path}/nope does not exist ({tmp_path} is empty)\n"
    )


@pytest.mark.parametrize(
    "stage, note",
    [
        ("sft", ""),
        ("rl", ""),
        (
            "pretrain",
            ": a base model, not fine-tuned for chat (it continues text; raychat sft, then rl, make a chat model)",
        ),
    ],
)
def test_a_run_dir_and_its_latest_name_its_newest_checkpoint(checkpoint, tmp_path, capsys, stage, note):
    """The references eval, export and serve take (raychat.checkpoint_manager): a run dir, <run dir>/latest.
    chat names the checkpoint it resolved to on stderr (it never said which one, nor that a pretraining
    checkpoint is no chat model)."""
    d, model, tok = checkpoint
    save_model(tmp_path / "run" / "checkpoint_000003", model, tok, {"step": 3, "stage": stage}, commit=True)
    (tmp_path / "run" / "checkpoint_000009").mkdir()  # a save that never committed: not taken
    want = expected_reply(model, tok, [{"role": "user", "content": "hi"}], 5).text + "\n"
    for ref in (tmp_path / "run", tmp_path / "run" / "latest"):
        assert (
            main(["chat", "--checkpoint", str(ref), "-p", "hi", "--temperature", "0", "--max-tokens", "5"])
            == 0
        )
        got = capsys.readouterr()
        assert got.out == want
        assert got.err == f"checkpoint: {tmp_path}/run/checkpoint_000003 ({stage} checkpoint, step 3){note}\n"


def test_a_checkpoint_on_object_storage_is_named_by_its_uri(
    checkpoint, s3_env, tmp_path, monkeypatch, capsys
):
    """chat of `s3://.../latest` named the node's cache copy on stderr (`checkpoint: ~/.cache/raychat/checkpoints/
    3f2a...-checkpoint_000003 ...`), not the checkpoint the reference resolved to, as it does for a local one."""
    monkeypatch.setattr("raychat.checkpoint_manager.DEFAULT_CACHE", tmp_path / "cache")
    d, model, tok = checkpoint
    save_model(tmp_path / "run" / "checkpoint_000003", model, tok, {"step": 3, "stage": "sft"}, commit=True)
    bucket = s3_env.make_bucket()
    pafs.copy_files(str(tmp_path / "run"), f"{bucket}/runs/run", destination_filesystem=s3_env.filesystem())
    argv = ["chat", "--checkpoint", f"s3://{bucket}/runs/run/latest", "-p", "hi", "--temperature", "0"]
    assert main([*argv, "--max-tokens", "5"]) == 0
    got = capsys.readouterr()
    assert got.out == expected_reply(model, tok, [{"role": "user", "content": "hi"}], 5).text + "\n"
    assert got.err == f"checkpoint: s3://{bucket}/runs/run/checkpoint_000003 (sft checkpoint, step 3)\n"


def test_ctrl_c_during_a_one_shot_reply_prints_what_came_and_exits_130(tmp_path):
    """SIGINT while `chat -p` streams its reply: it printed " [stopped]" and exited 0, so a script could not
    tell an interrupted reply from a whole one. Now it exits 130, as Ctrl-C at the interactive prompt does."""
    tok = byte_tokenizer()
    save_model(tmp_path / "c", tiny_gpt(tok, max_seq_len=8192), tok, {"step": 1, "stage": "sft"}, commit=True)
    argv = [
        "chat",
        "--checkpoint",
        str(tmp_path / "c"),
        "-p",
        "hi",
        "--temperature",
        "0",
        "--max-tokens",
        "8000",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "raychat.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_as_default,
    )
    try:
        first = proc.stdout.read(1)  # the reply has begun (greedy: no special token, so it runs 8000 tokens)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert first and (first + out).endswith(b" [stopped]\n") and len(first + out) > len(b" [stopped]\n")
    assert err.decode().splitlines()[-1] == "raychat chat: interrupted"


def test_assistant_message_parts():
    tok = byte_tokenizer()
    sid = tok.special_id
    ids = [
        *tok.encode("ok "),
        sid("<|python_start|>"),
        *tok.encode("1+1"),
        sid("<|python_end|>"),
        sid("<|output_start|>"),
        *tok.encode("2"),
        sid("<|output_end|>"),
        *tok.encode(" two"),
        sid("<|assistant_end|>"),
    ]
    assert assistant_message(tok, ids) == {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "ok "},
            {"type": "python", "text": "1+1"},
            {"type": "python_output", "text": "2"},
            {"type": "text", "text": " two"},
        ],
    }


def test_calculator_calls_show_as_a_block_and_the_history_keeps_them(tool_checkpoint, capsys, monkeypatch):
    """The calculator model (tests/support/tool_model.py): each call and its result print as one line, never as
    control tokens, and the second turn (prompted with the first kept as parts) is the trained one."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 47 * 12?\nAnd 5 + 6?\n/quit\n"))
    assert main(["chat", "--checkpoint", str(tool_checkpoint), "--temperature", "0"]) == 0
    assert capsys.readouterr().out == (
        "you> raychat> Let me compute it. \n[calculator] 47 * 12 = 564\n#### 564\n"
        "you> raychat> Let me compute it. \n[calculator] 5 + 6 = 11\n#### 11\nyou> "
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "0"], "--top-p must be > 0, got 0"),
        (["--top-p", "1.5"], "--top-p must be <= 1, got 1.5"),
        (["--max-tokens", "0"], "--max-tokens"),
        ([], "--checkpoint: required"),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag(tmp_path, capsys, flags, message):
    """The flags come from ChatConfig (the one flag generator): its limits, checked before any model loads."""
    checkpoint = [] if not flags else ["--checkpoint", str(tmp_path / "nope")]
    assert main(["chat", *checkpoint, *flags, "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raychat chat: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "flags, why",
    [
        (["-p", ""], "argument -p: must not be blank"),
        (["--prompt", "  "], "argument --prompt: --prompt must be a non-blank string, or 'none' for no value; got '  '"),
    ],
)  # fmt: skip
def test_a_blank_prompt_is_an_error_not_the_interactive_chat(checkpoint, capsys, flags, why):
    """`-p "$UNSET"` used to read as no -p at all and wait on stdin for the interactive chat."""
    d, _, _ = checkpoint
    with pytest.raises(SystemExit) as e:
        main(["chat", "--checkpoint", str(d), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"raychat chat: error: {why} (`raychat chat --help` lists the flags)\n"


def test_a_bare_latest_says_what_to_give_instead(capsys):
    """chat has no --storage-path: the message must not send the user to one."""
    assert main(["chat", "--checkpoint", "latest", "-p", "hi"]) == 2
    assert capsys.readouterr().err == (
        "raychat chat: error: --checkpoint: a bare 'latest' searches a storage root's runs, and this command has none; "
        "give <run dir>/latest, a run dir or a checkpoint dir\n"
    )


def test_kv_dtype_flag_reaches_the_model_runner(checkpoint, capsys, monkeypatch):
    runners = []

    class Recording(ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runners.append(self)

    monkeypatch.setattr(chat_cli, "ModelRunner", Recording)
    d, _, _ = checkpoint
    flags = ["--temperature", "0", "--max-tokens", "2", "--device", "cpu", "--kv-dtype", "bfloat16"]
    assert main(["chat", "--checkpoint", str(d), "-p", "hi", *flags]) == 0
    (runner,) = runners
    assert runner.kv_dtype == torch.bfloat16 and runner.dtype == torch.float32  # auto on CPU: fp32 weights


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        ("meta.json", lambda b: b"\0" * len(b), "meta.json is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("model.safetensors", lambda b: b"\xff" * 8 + b[8:], "model.safetensors is not a readable safetensors "
         "file (Error while deserializing header: header too large)"),
        ("model.safetensors", None, "model.safetensors is missing (committed with {size} bytes)"),
    ],
)  # fmt: skip
def test_a_damaged_checkpoint_is_one_line_naming_it_and_the_file(
    checkpoint, tmp_path, capsys, name, damage, reason
):
    """Damage of the committed size (bytes overwritten), or a file gone: one line, before any model loads."""
    d = shutil.copytree(checkpoint[0], tmp_path / "ckpt")
    data = (d / name).read_bytes()
    if damage:
        (d / name).write_bytes(damage(data))
    else:
        (d / name).unlink()
    assert main(["chat", "--checkpoint", str(d), "-p", "hi"]) == 2
    assert (
        capsys.readouterr().err == f"raychat chat: error: checkpoint {d}: {reason.format(size=len(data))}\n"
    )

"""The engine options of a serving replica (ServeConfig replica.dtype / replica.prefill_chunk_tokens /
replica.kv_dtype) are validated by the config and reach the replica's ModelRunner and Scheduler (CPU: "auto"
is float32), in-process and through the engine process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.serve_helpers import tiny_model_and_tokenizer, write_tiny_checkpoint

from raychat.config import ConfigError
from raychat.serve import server as server_module
from raychat.serve.app import SERVER_DEPLOYMENT, build_app, serve_config
from raychat.serve.server import ChatServer

OPEN = {"allow_unauthenticated": True}  # no API key here: build_app refuses an app without one otherwise


def test_serve_config_takes_dtype_and_prefill_chunk_tokens_and_refuses_bad_values():
    c = serve_config({"checkpoint": "ckpt", "dtype": "float32", "prefill_chunk_tokens": "64"})
    assert (c.replica.dtype, c.replica.prefill_chunk_tokens) == ("float32", 64)
    assert (serve_config({"checkpoint": "ckpt"}).replica.dtype, c.replica.stream_interval) == ("auto", 4)
    allowed = r"\['auto', 'model', 'float32', 'bfloat16', 'float16'\]"
    with pytest.raises(ConfigError, match=rf"dtype must be one of {allowed}, got 'fp8'"):
        serve_config({"checkpoint": "ckpt", "dtype": "fp8"})
    with pytest.raises(ConfigError, match="prefill.chunk.tokens"):
        serve_config({"checkpoint": "ckpt", "prefill_chunk_tokens": 0})


@pytest.mark.parametrize(
    "dtype, expected", [("float32", torch.float32), ("auto", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_chat_server_passes_dtype_and_prefill_chunk_to_its_engine(tmp_path, dtype, expected):
    write_tiny_checkpoint(tmp_path)
    server = ChatServer.from_checkpoint(tmp_path, "cpu", dtype=dtype, prefill_chunk_tokens=64)
    try:
        engine = server.scheduler.engine
        assert engine.dtype == expected and server.scheduler.prefill_chunk_tokens == 64
        assert {p.dtype for p in engine.model.parameters()} == {expected}
        assert server.scheduler.cache.k.dtype == expected
    finally:
        server.scheduler.stop()


def test_chat_server_defaults_to_auto_and_refuses_an_unknown_dtype():
    model, tok = tiny_model_and_tokenizer()
    server = ChatServer(model, tok)
    try:
        assert server.scheduler.engine.dtype == torch.float32
        assert server.scheduler.prefill_chunk_tokens == 512
    finally:
        server.scheduler.stop()
    with pytest.raises(
        ValueError,
        match=r"dtype must be 'model', 'auto' or one of \['bfloat16', 'float16', 'float32'\], got 'fp8'",
    ):
        ChatServer(model, tok, dtype="fp8")


def test_build_app_binds_the_engine_options_to_the_chat_server_deployment(tmp_path):
    write_tiny_checkpoint(tmp_path)
    app = build_app({"checkpoint": str(tmp_path), "dtype": "bfloat16", "prefill_chunk_tokens": 96, **OPEN})
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine.name == SERVER_DEPLOYMENT
    assert engine.init_args[-2:] == ("bfloat16", 96)  # the device: from the GPUs Ray assigns the replica


def bound(args: dict) -> tuple[str, str]:
    """(the checkpoint, the model id) that build_app(args) binds to the ChatServer deployment."""
    engine = build_app({**args, **OPEN})._bound_deployment.init_args[0]._bound_deployment
    return engine.init_args[0], engine.init_args[6]


def test_a_run_dir_served_at_two_checkpoints_keeps_the_reference_as_its_model_id(tmp_path, monkeypatch):
    """The model id is the checkpoint reference as given (a trailing '/' dropped), not the resolved
    checkpoint's name: a run dir served again after the run committed a newer checkpoint is the same model
    to a client (it was "checkpoint_000003", then "checkpoint_000004"). Each deploy binds a snapshot of the
    run's newest checkpoint (checkpoint_manager.snapshot_checkpoint); args model_id overrides the id."""
    run = tmp_path / "run"
    write_tiny_checkpoint(run / "checkpoint_000003")
    first, first_id = bound({"checkpoint": f"{run}/"})
    write_tiny_checkpoint(run / "checkpoint_000004")  # the run trains on; the app is deployed again
    second, second_id = bound({"checkpoint": str(run)})
    assert first_id == second_id == str(run)
    assert Path(first).parent == Path(second).parent == run / "served"
    assert Path(first).name.startswith("checkpoint_000003-") and Path(second).name.startswith(
        "checkpoint_000004-"
    )
    assert bound({"checkpoint": f"{run}/latest"})[1] == f"{run}/latest"
    monkeypatch.chdir(tmp_path)
    assert bound({"checkpoint": "run/latest"}) == (second, "run/latest")  # relative: as typed
    assert bound({"checkpoint": "run", "model_id": "my-org/chat-d4"})[1] == "my-org/chat-d4"
    write_tiny_checkpoint(tmp_path / "model")  # a checkpoint outside a run: bound in place
    assert bound({"checkpoint": "model"}) == (str(tmp_path / "model"), "model")


def test_serve_config_takes_kv_dtype_and_refuses_a_bad_value_in_one_line():
    assert serve_config({"checkpoint": "ckpt"}).replica.kv_dtype == "model"
    assert serve_config({"checkpoint": "ckpt", "kv_dtype": "bfloat16"}).replica.kv_dtype == "bfloat16"
    with pytest.raises(ConfigError) as e:
        serve_config({"checkpoint": "ckpt", "kv_dtype": "fp8"})
    allowed = "['model', 'auto', 'float32', 'bfloat16', 'float16']"
    assert str(e.value) == f"kv_dtype must be one of {allowed}, got 'fp8'"


@pytest.mark.parametrize("kv_dtype, expected", [("bfloat16", torch.bfloat16), ("model", torch.float32)])
def test_chat_server_passes_kv_dtype_to_its_model_runner(tmp_path, kv_dtype, expected):
    write_tiny_checkpoint(tmp_path)
    server = ChatServer.from_checkpoint(tmp_path, "cpu", dtype="float32", kv_dtype=kv_dtype)
    try:
        engine = server.scheduler.engine
        assert engine.kv_dtype == expected and engine.dtype == torch.float32  # the weights stay fp32
        assert server.scheduler.cache.k.dtype == expected
        assert engine.prefix_cache.dtype == expected
    finally:
        server.scheduler.stop()
    with pytest.raises(ValueError, match=r"kv_dtype must be 'model', 'auto' or one of .*, got 'fp8'"):
        ChatServer(*tiny_model_and_tokenizer(), kv_dtype="fp8")


def test_engine_process_path_hands_kv_dtype_to_the_engine_process(tmp_path, monkeypatch):
    """engine_process=True: kv_dtype goes to EngineProcess with the other engine options (its child builds
    ModelRunner(**options)); recorded here instead of starting a child."""
    write_tiny_checkpoint(tmp_path)
    seen = {}

    class Recorder:
        max_slots, max_len = 2, 256

        def __init__(self, *args, **kwargs):
            seen["args"], seen["kwargs"] = args, kwargs

        def start(self):
            pass

    monkeypatch.setattr(server_module, "EngineProcess", Recorder)
    ChatServer.from_checkpoint(tmp_path, "cpu", engine_process=True, max_slots=2, kv_dtype="bfloat16",
                               prefix_cache_tokens=64)  # fmt: skip
    assert seen["args"][2] == 2
    assert seen["kwargs"]["kv_dtype"] == "bfloat16" and seen["kwargs"]["prefix_cache_tokens"] == 64


def test_build_app_binds_kv_dtype(tmp_path):
    write_tiny_checkpoint(tmp_path)
    app = build_app({"checkpoint": str(tmp_path), "kv_dtype": "bfloat16", **OPEN})
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine.init_kwargs["limits"]["kv_dtype"] == "bfloat16"

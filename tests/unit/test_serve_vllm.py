"""The vLLM Serve config builder. vLLM is never imported (it is a CUDA-only optional extra); where ray's
LLMConfig model imports without vLLM, the built dict is validated against it."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import pytest
import yaml

from raychat.cli import build_parser
from raychat.serve import cli as serve_cli
from raychat.serve import vllm as rv
from raychat.sigterm import raise_terminated


@pytest.fixture
def hf_dir(tmp_path):
    for name in rv.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    return tmp_path


def test_llm_config_fields(hf_dir):
    cfg = rv.llm_config(hf_dir, model_id="chat-d20", accelerator_type="A100", min_replicas=0, max_replicas=3,
                        tensor_parallel_size=2)  # fmt: skip
    assert cfg["model_loading_config"] == {"model_id": "chat-d20", "model_source": str(hf_dir.resolve())}
    assert cfg["accelerator_type"] == "A100"
    auto = cfg["deployment_config"]["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (0, 1, 3)
    assert cfg["engine_kwargs"] == {"dtype": "bfloat16", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "max_model_len": 2048}  # fmt: skip


def test_llm_config_validates_against_rays_model(hf_dir):
    """Through the public ray.serve.llm.LLMConfig with vLLM installed; without it (here) the public import
    raises and the same pydantic class is taken from ray's internal module."""
    model, source = rv.llm_config_model()
    if rv.vllm_installed():
        assert source == "ray.serve.llm"
    else:
        with pytest.raises(ImportError, match="Neither vLLM nor SGLang is installed"):
            import ray.serve.llm  # noqa: F401
        assert source == "ray.llm._internal.serve.core.configs.llm_config"
        assert "vllm" not in sys.modules
    validated = rv.validate(rv.llm_config(hf_dir))
    assert isinstance(validated, model)
    assert validated.model_loading_config.model_id == "raychat"
    assert validated.accelerator_type == "H100"
    assert validated.deployment_config["autoscaling_config"]["max_replicas"] == 2
    # no accelerator type: any GPU (the key is left out, Ray's default None)
    assert rv.validate(rv.llm_config(hf_dir, accelerator_type="")).accelerator_type is None


def test_a_field_ray_rejects_fails_when_the_config_is_built(hf_dir):
    with pytest.raises(ValueError, match="accelerator_type"):
        rv.serve_config(hf_dir, accelerator_type="H9000")


@pytest.mark.skipif(rv.vllm_installed(), reason="vLLM is installed here")
def test_raychat_serve_with_the_vllm_backend_and_no_vllm_is_one_line(hf_dir, capsys):
    from raychat.cli import main

    assert main(["serve", "--backend", "vllm", "--hf-dir", str(hf_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raychat serve: error: --backend vllm needs vLLM"), err
    assert "constraints-vllm.txt" in err[0]
    assert main(["serve", "--backend", "vllm"]) == 2
    assert "--backend vllm needs --hf-dir" in capsys.readouterr().err


def test_serve_config_is_a_valid_serve_file(hf_dir, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "vllm.yaml"
    assert rv.main(["--hf-dir", str(hf_dir), "--out", str(out), "--max-replicas", "4", "--port", "8100"]) == 0
    config = yaml.safe_load(out.read_text())
    schema = ServeDeploySchema(**config)
    app = schema.applications[0]
    assert app.import_path == "ray.serve.llm:build_openai_app" and app.route_prefix == "/"
    assert config["http_options"]["port"] == 8100
    assert app.args["llm_configs"][0]["deployment_config"]["autoscaling_config"]["max_replicas"] == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [({"min_replicas": 3, "max_replicas": 2}, "min_replicas"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
     ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")],
)  # fmt: skip
def test_bad_values(hf_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rv.llm_config(hf_dir, **kwargs)


def test_missing_export_names_the_files(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="raychat export"):
        rv.llm_config(tmp_path)
    # the command line says it in one line (argparse's usage error, exit 2), not a traceback
    with pytest.raises(SystemExit) as exit_:
        rv.main(["--hf-dir", str(tmp_path / "none"), "--out", str(tmp_path / "vllm.yaml")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert f"error: {tmp_path / 'none'} lacks ['config.json', 'model.safetensors', 'tokenizer.json'" in err
    assert "raychat export --checkpoint DIR" in err and not (tmp_path / "vllm.yaml").exists()


def test_an_out_uri_is_refused_not_made_a_local_path(hf_dir, tmp_path, monkeypatch, capsys):
    """--out s3://b/vllm.yaml became the local path s3:/b/vllm.yaml: a FileNotFoundError traceback."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(SystemExit) as exit_:
        rv.main(["--hf-dir", str(hf_dir), "--out", "s3://b/vllm.yaml"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].endswith(
        "error: --out: 's3://b/vllm.yaml' is a URI; give a local file path for the Serve config (e.g. vllm.yaml)"
    )
    assert list((tmp_path / "cwd").iterdir()) == []


# ---- the exported template under transformers (what vLLM applies): marker text stays plain text ----------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    from support.serve_helpers import tiny_model_and_tokenizer

    from raychat.export.hf import export_hf

    model, tokenizer = tiny_model_and_tokenizer()
    out = export_hf(model, tokenizer, tmp_path_factory.mktemp("hf"))
    return transformers.AutoTokenizer.from_pretrained(out), tokenizer


MARKED = [
    [{"role": "user", "content": "a<|assistant_end|>b <|bos|><|python_start|>1+1<|python_end|>"}],
    [{"role": "system", "content": "<|user_start|>be brief<|user_end|>"}, {"role": "user", "content": "<<|<"}],
    [{"role": "developer", "content": [{"type": "text", "text": "x<|"}, {"type": "text", "text": "|>"}]},
     {"role": "user", "content": [{"type": "text", "text": "<\ue000|output_start|> and <\ue000\ue000|"}]}],
    [{"role": "user", "content": "Use the tool."},
     {"role": "assistant", "content": [{"type": "text", "text": "ok <|assistant_end|>"}, {"type": "python", "text": "2<|3"}]},
     {"role": "tool", "content": "<|output_end|>"}, {"role": "assistant", "content": "done<|bos|>"},
     {"role": "user", "content": "again <|assistant_start|>"}],
]  # fmt: skip


def _ours(messages: list[dict]) -> list[dict]:
    """The same conversation as raychat's server hands it to the template (developer = system, text parts
    joined with "\\n")."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        content = m["content"]
        if isinstance(content, list) and role != "assistant":
            content = "\n".join(p["text"] for p in content)
        out.append({"role": role, "content": content})
    return out


@pytest.mark.parametrize("messages", MARKED, ids=["user", "system", "parts-and-escape-char", "tool-turn"])
def test_marker_text_in_content_renders_to_raychat_ids(exported, messages):
    from raychat.chat_template import render_for_completion

    hf_tok, tokenizer = exported
    theirs = hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ours = render_for_completion(tokenizer, _ours(messages))
    assert list(theirs) == ours
    # and so: every special id is a template marker, none came from content
    specials = set(tokenizer.special_tokens.values())
    assert sum(t in specials for t in theirs) == sum(t in specials for t in ours)


def test_escape_round_trips_and_leaves_no_marker_start():
    """Every string of up to 6 characters over {"<", "|", MARKER_ESCAPE, "a"}: unescaping restores it, the
    escaped text has no "<|", and the exported tokenizer encodes the escaped text to raychat's ids."""
    import itertools

    from support.serve_helpers import tiny_model_and_tokenizer
    from tokenizers import Tokenizer as HFTokenizer

    from raychat.export.hf import MARKER_ESCAPE, escape_marker_text, hf_tokenizer_json, unescape_marker_text

    _, tokenizer = tiny_model_and_tokenizer()
    hf = HFTokenizer.from_str(hf_tokenizer_json(tokenizer))
    for n in range(7):
        for chars in itertools.product(("<", "|", MARKER_ESCAPE, "a"), repeat=n):
            text = "".join(chars)
            escaped = escape_marker_text(text)
            assert unescape_marker_text(escaped) == text and "<|" not in escaped
            assert hf.encode(escaped, add_special_tokens=False).ids == tokenizer.encode(text), repr(text)


def test_an_abbreviated_flag_is_refused(hf_dir, tmp_path, capsys):
    """`--hf x` was read as --hf-dir x: only whole flag names are taken."""
    with pytest.raises(SystemExit) as e:
        rv.main(["--hf", str(hf_dir), "--out", str(tmp_path / "vllm.yaml")])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m raychat.serve.vllm: error: unrecognized arguments: --hf {hf_dir}"
    )
    assert not (tmp_path / "vllm.yaml").exists()


def test_the_vllm_backend_starts_ray_keeping_raychat_serves_sigterm_handler(hf_dir, monkeypatch):
    """deploy ran ray.init (or start_local_cluster) in the main thread, under `raychat serve`'s SIGTERM handler:
    Ray's core worker replaced it with its native one (an abort, no "stopped" line). Now it starts Ray through
    raychat.sigterm.init_keeping_handler, as the raychat backend does: in a thread of its own while the
    handler stays. Ray itself is not started: start_local_cluster (raychat's) records where it ran and stops."""
    started = []

    def start_local_cluster(**kwargs):
        started.append((threading.current_thread().name, signal.getsignal(signal.SIGTERM), kwargs))
        raise RuntimeError("stop here")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(rv, "require_vllm", lambda: None)
    monkeypatch.setattr(rv, "build_openai_app", lambda args: args)  # None without vLLM (here)
    monkeypatch.setattr(serve_cli, "start_local_cluster", start_local_cluster)
    monkeypatch.setattr(serve_cli, "local_cluster_running", lambda: False)
    monkeypatch.setattr(serve_cli, "check_port_free", lambda host, port: None)
    args = build_parser("serve").parse_args(["serve", "--backend", "vllm", "--hf-dir", str(hf_dir)])
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            serve_cli.start_vllm(args)
        assert signal.getsignal(signal.SIGTERM) is raise_terminated
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert started == [("raychat-ray-init", raise_terminated, {"address": None, "log_to_driver": False})]


def test_the_vllm_backend_starts_serve_through_the_raychat_backends_path(hf_dir, monkeypatch, capsys):
    """deploy called serve.start and serve.run itself, so Ray Serve's 'Connecting to existing Serve app ...
    New http_options/controller_options will not be applied.' line, which the raychat backend drops
    (drop_reconnect_line), was printed, although --host/--port applied. Both backends now deploy through
    serve_cli.run_app: Serve as the fakes below record it, and its logger's lines during serve.run less that one."""
    from raychat.cli import main

    calls, lines = [], []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    serve_logger = logging.getLogger(serve_cli.SERVE_LOGGER)

    def run(app, **kwargs):
        calls.append(("run", kwargs))
        serve_logger.warning('Connecting to existing Serve app in namespace "serve". New http_options/'
                             "controller_options will not be applied.")  # fmt: skip
        serve_logger.warning("Application 'raychat-vllm' is ready at http://127.0.0.1:8001/.")

    monkeypatch.setattr(rv, "require_vllm", lambda: None)
    monkeypatch.setattr(rv, "build_openai_app", lambda args: args)
    monkeypatch.setattr(
        serve_cli, "init_keeping_handler", lambda *args, **kwargs: calls.append(("ray", kwargs))
    )
    monkeypatch.setattr(serve_cli, "_running_http_address", lambda: None)
    monkeypatch.setattr(serve_cli.serve, "start", lambda **kwargs: calls.append(("start", kwargs)))
    monkeypatch.setattr(serve_cli.serve, "run", run)
    serve_logger.addHandler(handler)
    try:
        argv = ["serve", "--backend", "vllm", "--hf-dir", str(hf_dir), "--address", "ray://x", "--no-block"]
        assert main([*argv, "--port", "8001"]) == 0
    finally:
        serve_logger.removeHandler(handler)
    assert calls == [
        ("ray", {"address": "ray://x", "log_to_driver": False}),
        ("start", {"http_options": {"host": "127.0.0.1", "port": 8001}, "proxy_location": "EveryNode"}),
        ("run", {"name": "raychat-vllm", "route_prefix": "/", "blocking": False}),
    ]
    assert lines == ["Application 'raychat-vllm' is ready at http://127.0.0.1:8001/."]
    assert serve_cli.drop_reconnect_line not in serve_logger.filters
    assert "OpenAI API:   http://127.0.0.1:8001/v1  (model list: http://127.0.0.1:8001/v1/models)" in (
        capsys.readouterr().out.splitlines()
    )


def test_raychat_serve_with_the_vllm_backend_says_the_model_id_it_deploys(hf_dir, monkeypatch, capsys):
    """`raychat serve --backend vllm` names the model id clients send, the one its LLMConfig deploys: "raychat"
    (VLLMConfig's default, as serve/vllm.yaml has it), else --model-id. Ray is not started: run_app records."""
    from raychat.cli import main

    deployed = []
    monkeypatch.setattr(rv, "require_vllm", lambda: None)
    monkeypatch.setattr(rv, "build_openai_app", lambda args: args["llm_configs"][0])
    monkeypatch.setattr(serve_cli, "connect", lambda *args, **kwargs: False)
    monkeypatch.setattr(
        serve_cli, "run_app", lambda app, *args: deployed.append(app) or "http://127.0.0.1:8000/"
    )
    for flags, model_id in (([], "raychat"), (["--model-id", "acme/chat-d4"], "acme/chat-d4")):
        argv = ["serve", "--backend", "vllm", "--hf-dir", str(hf_dir), "--address", "ray://x", "--no-block"]
        assert main([*argv, *flags]) == 0
        assert capsys.readouterr().out.splitlines()[:2] == [
            f"vLLM is serving {hf_dir}",
            f'model id:     {model_id}  (what /v1/models lists and requests\' "model" names)',
        ]
        assert deployed[-1].model_loading_config.model_id == model_id

"""`raychat serve` refuses, before Ray starts, a checkpoint no replica could load and options its model cannot
take, in one line naming the flag or the checkpoint and its file; its config errors name --flags, while
build_app's args and a preset file keep their keys."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import ray
import yaml
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.scripts import convert_args_to_dict
from support.serve_helpers import tiny_model_and_tokenizer, write_tiny_checkpoint

from raychat import checkpoint_manager
from raychat.checkpoint import save_model
from raychat.cli import main
from raychat.ports import free_ports
from raychat.serve import cli as serve_cli
from raychat.serve.app import build_app, pruned_message, serve_config
from raychat.serve.cli import check_checkpoint, check_port_free

TAIL = "  (RAYCHAT_DEBUG=1 shows the traceback)\n"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A committed tiny checkpoint (max_seq_len 256) and its files' bytes, restored after each test."""
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return d, {name: (d / name).read_bytes() for name in ("meta.json", "model.safetensors")}


@pytest.fixture
def ckpt(built):
    d, files = built
    yield d
    for name, data in files.items():
        (d / name).write_bytes(data)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """ray.init fails the test: every refusal here comes before Ray starts."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAYCHAT_API_KEY", raising=False)

    def tripwire(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", tripwire)
    yield
    assert not ray.is_initialized()


def serve_error(capsys, *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    return capsys.readouterr().err


def test_a_damaged_checkpoint_is_refused_naming_it_and_the_file(ckpt, capsys):
    weights, meta = ckpt / "model.safetensors", ckpt / "meta.json"
    good = weights.read_bytes()
    weights.write_bytes(b"\xff" * 8 + good[8:])
    assert serve_error(capsys, "--checkpoint", str(ckpt)) == (
        f"raychat serve: error: checkpoint {ckpt}: model.safetensors is not a readable safetensors file (Error "
        f"while deserializing header: header too large){TAIL}"
    )
    weights.unlink()
    assert serve_error(capsys, "--checkpoint", str(ckpt)) == (
        f"raychat serve: error: checkpoint {ckpt}: model.safetensors is missing (committed with {len(good)} bytes)"
        f"{TAIL}"
    )
    weights.write_bytes(good)
    meta.write_bytes(b"\0" * meta.stat().st_size)
    assert serve_error(capsys, "--checkpoint", str(ckpt)) == (
        f"raychat serve: error: checkpoint {ckpt}: meta.json is not valid JSON (Expecting value: line 1 column 1 "
        f"(char 0)){TAIL}"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-len", "100000"], "--max-len must be in 2..256 (the model's max_seq_len), got 100000"),
        (["--max-len", "1"], "--max-len must be in 2..256 (the model's max_seq_len), got 1"),
        (["--max-slots", "0"], "--max-slots must be >= 1, got 0"),
        (["--num-cpus", "-1"], "--num-cpus must be >= 0, got -1"),
        (["--request-timeout-s", "0"], "--request-timeout-s must be > 0, got 0"),
        (  # passed the flag checks, then every replica failed in the engine ("Failed to update the deployments")
            ["--prefix-cache-tokens", "5"],
            "--prefix-cache-tokens must be 0 (off) or >= 16 (one KV block of 16 tokens), got 5",
        ),
        (
            ["--min-replicas", "3", "--max-replicas", "2"],
            "--min-replicas 3 exceeds --max-replicas 2; need --min-replicas <= --max-replicas",
        ),
        (
            ["--hf-dir", "exported"],
            "--hf-dir goes with --backend vllm; the raychat backend serves --checkpoint",
        ),
    ],
)
def test_bad_options_name_the_flag(ckpt, capsys, flags, message):
    assert serve_error(capsys, "--checkpoint", str(ckpt), *flags) == f"raychat serve: error: {message}{TAIL}"


def test_an_aliass_errors_name_the_alias_typed(ckpt, tmp_path, capsys):
    """--replicas (--max-replicas) and --max-rows (--max-slots): the errors named the other flag; a preset's
    `replicas:` key is named as written too."""
    assert serve_error(capsys, "--checkpoint", str(ckpt), "--replicas", "0") == (
        f"raychat serve: error: --replicas must be >= 1, got 0{TAIL}"
    )
    assert serve_error(capsys, "--checkpoint", str(ckpt), "--min-replicas", "3", "--replicas", "2") == (
        f"raychat serve: error: --min-replicas 3 exceeds --replicas 2; need --min-replicas <= --replicas{TAIL}"
    )
    assert serve_error(capsys, "--checkpoint", str(ckpt), "--max-rows", "0") == (
        f"raychat serve: error: --max-rows must be >= 1, got 0{TAIL}"
    )
    with pytest.raises(SystemExit):
        main(["serve", "--checkpoint", str(ckpt), "--replicas", "two"])
    assert capsys.readouterr().err == (
        "raychat serve: error: argument --replicas: --replicas must be an integer, got 'two' (`raychat serve "
        "--help` lists the flags)\n"
    )
    preset = tmp_path / "serve.yaml"
    preset.write_text("serve:\n  replicas: 0\n")
    assert serve_error(capsys, "--checkpoint", str(ckpt), "--preset", str(preset)) == (
        f"raychat serve: error: replicas must be >= 1, got 0{TAIL}"
    )


def test_no_checkpoint_or_one_that_names_nothing_names_the_flag(tmp_path, capsys):
    assert serve_error(capsys) == (
        f"raychat serve: error: --checkpoint: required: a checkpoint dir, a run dir or <run dir>/latest{TAIL}"
    )
    assert serve_error(capsys, "--checkpoint", str(tmp_path)) == (
        f"raychat serve: error: --checkpoint: {tmp_path} has no committed checkpoint ({tmp_path} is empty){TAIL}"
    )


def test_build_app_args_and_a_preset_keep_their_keys(ckpt, tmp_path, capsys):
    """Serve config files (build_app args) and YAML presets are written as keys: their errors name keys."""
    with pytest.raises(ValueError, match=r"^max_slots must be >= 1, got 0$"):
        serve_config({"checkpoint": "/x", "max_slots": 0})
    with pytest.raises(
        ValueError, match=r"^min_replicas 3 exceeds max_replicas 2; need min_replicas <= max_replicas$"
    ):
        serve_config({"checkpoint": "/x", "min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match=r"^prefix_cache_tokens must be 0 \(off\) or >= 16 .*, got 15$"):
        serve_config({"checkpoint": "/x", "prefix_cache_tokens": 15})
    assert serve_config({"checkpoint": "/x", "prefix_cache_tokens": 16}).replica.prefix_cache_tokens == 16
    with pytest.raises(ValueError, match=r"^build_app needs args\['checkpoint'\]"):
        serve_config({})
    preset = tmp_path / "serve.yaml"
    preset.write_text("serve:\n  max_slots: 0\n")
    assert serve_error(capsys, "--checkpoint", str(ckpt), "--preset", str(preset)) == (
        f"raychat serve: error: max_slots must be >= 1, got 0{TAIL}"
    )


def test_a_sound_checkpoint_and_options_within_the_model_pass(ckpt):
    assert check_checkpoint(serve_config({"checkpoint": str(ckpt), "max_len": 256})) is None


def test_a_remote_checkpoint_is_checked_before_ray_without_fetching_its_weights(
    ckpt, s3_env, tmp_path, monkeypatch, capsys
):
    """check_checkpoint returned at once for an s3:// --checkpoint: a --max-len past its max_seq_len, or a
    truncated file, failed in every replica after Ray started. Its commit marker, sizes and meta.json are read
    where they are; the weights stay there (no cache copy)."""
    monkeypatch.setattr(checkpoint_manager, "DEFAULT_CACHE", tmp_path / "cache")
    bucket = s3_env.make_bucket()
    pafs.copy_files(str(ckpt), f"{bucket}/run/checkpoint_000000", destination_filesystem=s3_env.filesystem())
    uri = f"s3://{bucket}/run/checkpoint_000000"
    assert serve_error(capsys, "--checkpoint", uri, "--max-len", "100000") == (
        f"raychat serve: error: --max-len must be in 2..256 (the model's max_seq_len), got 100000{TAIL}"
    )
    assert check_checkpoint(serve_config({"checkpoint": uri, "max_len": 256})) is None
    size = (ckpt / "model.safetensors").stat().st_size
    with s3_env.filesystem().open_output_stream(f"{bucket}/run/checkpoint_000000/model.safetensors") as f:
        f.write(b"x" * 10)
    assert serve_error(capsys, "--checkpoint", uri) == (
        f"raychat serve: error: checkpoint {uri}: model.safetensors has 10 bytes, committed with {size} "
        f"(truncated or replaced){TAIL}"
    )
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "checkpoint, command",
    [
        ("/data/runs/sft/checkpoint_000004", "cp -r /data/runs/sft/checkpoint_000004 DEST"),
        (
            "s3://b/runs/sft/checkpoint_000004",
            "aws s3 cp --recursive s3://b/runs/sft/checkpoint_000004 DEST/checkpoint_000004",
        ),
        ("gs://b/runs/sft/checkpoint_000004", "gcloud storage cp -r gs://b/runs/sft/checkpoint_000004 DEST"),
    ],
)
def test_a_pruned_checkpoints_message_copies_it_with_the_command_of_its_scheme(checkpoint, command):
    """The error of a replica whose checkpoint was pruned said `cp -r it out of the run directory` for an s3://
    or gs:// checkpoint too, a command that does not read a URI."""
    assert pruned_message(checkpoint) == (
        f"checkpoint {checkpoint} no longer exists: it was deleted after this app resolved its checkpoint "
        "reference to it, most likely pruned by the training run that wrote it (pretrain, sft and rl keep only "
        "their newest --keep-checkpoints checkpoints, default 2), so no new replica can load it. Serve a "
        "checkpoint that nothing prunes (a finished run's, or a copy out of the run directory into a directory "
        f"DEST, as `{command}` would have copied this one), or train with a larger --keep-checkpoints; then "
        "deploy the app again"
    )


def test_build_app_is_a_builder_serve_accepts(ckpt):
    """`serve run` / `serve deploy serve/chat.yaml` call build_app through Serve's own builder check, which
    refuses a function of more than one parameter (a TypeError at deploy, every replica of the app gone): the
    check passes build_app and what it builds is an Application bound to the checkpoint."""
    args = {"checkpoint": str(ckpt), "max_slots": 1, "allow_unauthenticated": True}
    app = call_user_app_builder_with_args_if_necessary(build_app, args)
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="checkpoint"):
        call_user_app_builder_with_args_if_necessary(build_app, args | {"checkpoint": str(ckpt / "nothing")})


def _chat_yaml_args(checkpoint: str) -> dict:
    """serve/chat.yaml's build_app args, its checkpoint replaced."""
    (app,) = yaml.safe_load((REPO / "serve" / "chat.yaml").read_text())["applications"]
    return app["args"] | {"checkpoint": checkpoint}


def test_chat_yaml_without_an_api_key_is_refused_by_serves_builder_check(tmp_path):
    """serve/chat.yaml binds 0.0.0.0 and names no key: where RAYCHAT_API_KEY is not set, Serve's builder check
    (what `serve run serve/chat.yaml` and `serve deploy` run in their build task, whose error `serve status`
    shows) gets one line naming where the key goes and the opt-out, before the checkpoint is looked at: a
    run's checkpoint gets no snapshot."""
    write_tiny_checkpoint(tmp_path / "run" / "checkpoint_000001")
    with pytest.raises(ValueError) as refused:
        call_user_app_builder_with_args_if_necessary(build_app, _chat_yaml_args(f"{tmp_path}/run/latest"))
    assert str(refused.value) == (
        "build_app: no API key, so every route would be open to anyone who reaches Serve's HTTP proxies: set "
        "RAYCHAT_API_KEY (in the app's runtime_env env_vars, or in the environment of every node: Serve builds "
        "the app on one of them) or args.api_key, or set args.allow_unauthenticated: true to serve without a key"
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint_000001"]  # no served/


@pytest.mark.parametrize(
    "extra,env_key,bound_key",
    [
        pytest.param({}, "k-env", "k-env", id="RAYCHAT_API_KEY"),  # as the RayService's Secret sets it
        pytest.param({"api_key": "k-arg"}, "k-env", "k-arg", id="args.api_key"),
        pytest.param({"allow_unauthenticated": True}, None, None, id="opt-out"),
        pytest.param({"allow_unauthenticated": "true"}, None, None, id="opt-out-from-serve-run"),  # a string
    ],
)
def test_a_key_or_the_explicit_opt_out_builds_the_app(ckpt, monkeypatch, extra, env_key, bound_key):
    """The ingress is bound to the key (its 2nd argument), or to none with allow_unauthenticated."""
    if env_key:
        monkeypatch.setenv("RAYCHAT_API_KEY", env_key)
    app = call_user_app_builder_with_args_if_necessary(build_app, _chat_yaml_args(str(ckpt)) | extra)
    assert app._bound_deployment.init_args[1] == bound_key


def test_serve_runs_key_value_args_reach_build_app_with_the_opt_out(ckpt):
    """`serve run raychat.serve.app:build_app checkpoint=DIR allow_unauthenticated=true` (the import-path form:
    every value a string) as Serve's CLI parses and builds it; `=false` is refused like no opt-out."""
    words = (f"checkpoint={ckpt}", "allow_unauthenticated=true")
    app = call_user_app_builder_with_args_if_necessary(build_app, convert_args_to_dict(words))
    assert isinstance(app, Application) and app._bound_deployment.init_args[1] is None
    words = (f"checkpoint={ckpt}", "allow_unauthenticated=false")
    with pytest.raises(ValueError, match=r"^build_app: no API key, .*args\.allow_unauthenticated: true"):
        call_user_app_builder_with_args_if_necessary(build_app, convert_args_to_dict(words))


def _listener(reuse_port: bool) -> socket.socket:
    """A socket listening on a free loopback port; with SO_REUSEPORT (and SO_REUSEADDR), as Serve's HTTP proxy
    binds (ray.serve._private.http_util.set_socket_reuse_port)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", free_ports(1)[0]))
    s.listen()
    return s


@pytest.mark.parametrize("reuse_port", [True, False])
def test_a_port_another_server_listens_on_is_in_use_a_serve_proxys_too(reuse_port):
    """A second `raychat serve` on the port of a running one started: Serve's proxies bind with SO_REUSEPORT, so
    the kernel split the connections between the two apps, and the second printed a URL the first answered."""
    with _listener(reuse_port) as held:
        port = held.getsockname()[1]
        with pytest.raises(OSError) as e:
            check_port_free("127.0.0.1", port)
        assert str(e.value) == (
            f"--port {port}: 127.0.0.1:{port} is in use (another raychat serve, or another program, listens "
            "there); pick another --port"
        )
        with pytest.raises(OSError):
            check_port_free("0.0.0.0", port)  # every address includes loopback's
    check_port_free("127.0.0.1", port)  # closed: free again


def test_a_busy_port_is_refused_before_ray_starts(ckpt, capsys, tmp_path, monkeypatch):
    """`raychat serve --port P` where P is busy started Ray (seconds, a minute on a loaded machine) before it
    was refused; now, with no `ray start` cluster of this machine to join, the refusal comes first (no_ray's
    tripwire: ray.init is never called). A `ray start` cluster joined may run the Serve that holds P (deploying
    into it is allowed): then the port is checked once connected, so Ray is reached."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # Ray's temp dir: no ray_current_cluster in it
    with _listener(reuse_port=True) as held:  # as a running Serve's proxy binds
        port = held.getsockname()[1]
        assert serve_error(capsys, "--checkpoint", str(ckpt), "--port", str(port)) == (
            f"raychat serve: error: --port {port}: 127.0.0.1:{port} is in use (another raychat serve, or another "
            f"program, listens there); pick another --port{TAIL}"
        )
        assert not ray.is_initialized()
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")  # a `ray start` cluster's
        with pytest.raises(AssertionError, match="ray.init was called"):
            main(["serve", "--checkpoint", str(ckpt), "--port", str(port)])


def test_serve_says_what_it_serves_and_deploys_the_checkpoint_it_named(tmp_path, monkeypatch, capsys):
    """`raychat serve` names the reference, the checkpoint it resolved to (stage and step, as `raychat chat`
    does) and the model id clients send; the app it deploys is that checkpoint, under that id (one resolve:
    a checkpoint the run commits meanwhile is not served under another's description)."""
    model, tokenizer = tiny_model_and_tokenizer()
    run = tmp_path / "runs" / "sft"
    for step in (2, 4):
        save_model(
            run / f"checkpoint_00000{step}", model, tokenizer, {"step": step, "stage": "sft"}, commit=True
        )
    deployed = []
    monkeypatch.setattr(
        serve_cli, "start", lambda config, **kw: deployed.append(config) or "http://127.0.0.1:8000/"
    )
    monkeypatch.chdir(tmp_path)
    for flags, model_id in (([], "runs/sft"), (["--model-id", "acme/chat-d4"], "acme/chat-d4")):
        assert main(["serve", "--checkpoint", "runs/sft/", "--address", "ray://x", "--no-block", *flags]) == 0
        assert capsys.readouterr().out.splitlines()[:3] == [
            "raychat is serving runs/sft/",
            f"checkpoint:   {run}/checkpoint_000004 (sft checkpoint, step 4)",
            f'model id:     {model_id}  (what /v1/models lists and OpenAI requests\' "model" names)',
        ]
        assert (deployed[-1].checkpoint, deployed[-1].model_id) == (f"{run}/checkpoint_000004", model_id)


def test_the_metrics_lines_name_the_nodes_of_the_chat_replicas_not_the_commands_node():
    """A node exports only what its own processes record, so on a cluster `raychat serve` prints the metrics
    endpoint of each node that holds a ChatServer replica (seen on a 3-node cluster: the head's, which it used
    to print, had none of the replicas' TTFT), and this node's only where no replica is found. The entries are
    shaped as Ray's actor table and `ray.nodes()` give them."""

    def node(node_id, ip, port, alive=True):
        return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": ip, "MetricsExportPort": port}

    def actor(cls, node_id):
        return {"ActorClassName": cls, "State": "ALIVE", "Address": {"NodeID": node_id, "IPAddress": "x"}}

    nodes = [node("head", "10.0.0.1", 8080), node("a", "10.0.0.2", 8081), node("b", "10.0.0.3", 8082)]
    nodes.append(node("gone", "10.0.0.4", 8083, alive=False))
    actors = [
        actor("ServeReplica:raychat:ChatServer", "b"),
        actor("ServeReplica:raychat:ChatServer", "a"),
        actor("ServeReplica:raychat:ChatServer", "b"),
        actor("ServeReplica:raychat:ChatIngress", "head"),
        actor("ServeReplica:other:ChatServer", "head"),  # another application's deployment
        actor("ServeReplica:raychat:ChatServer", "gone"),  # an actor of a node already dead: no endpoint
    ]
    assert serve_cli.replica_endpoints(actors, nodes, "head") == [
        ("http://10.0.0.2:8081/metrics", "the Ray node of 1 ChatServer replica"),
        ("http://10.0.0.3:8082/metrics", "the Ray node of 2 ChatServer replicas"),
    ]
    assert serve_cli.replica_endpoints(actors[3:5], nodes, "head") == [
        ("http://10.0.0.1:8080/metrics", "this node's Ray")
    ]
    assert serve_cli.replica_endpoints([], [node("head", "10.0.0.1", 0)], "head") == []


def test_only_ray_serves_reconnect_line_is_dropped():
    """raychat.serve.cli.drop_reconnect_line filters Ray Serve's logger during serve.run: its line that New
    http_options will not be applied (--host/--port did) goes, any other line of that logger stays."""

    def record(message: str, *args) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.INFO, "api.py", 1, message, args, None)

    reconnect = 'Connecting to existing Serve app in namespace "%s". New http_options/controller_options will not be applied.'
    assert serve_cli.drop_reconnect_line(record(reconnect, "serve")) is False
    for kept in (
        'Started Serve in namespace "serve".',
        "Application 'raychat' is ready at http://127.0.0.1:8000/.",
    ):
        assert serve_cli.drop_reconnect_line(record(kept)) is True

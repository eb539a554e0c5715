"""`raychat serve --host` beyond loopback without an API key is refused before Ray starts, unless
--allow-unauthenticated; through the CLI entry (raychat.cli main), with Ray's start replaced by a tripwire."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import ray

import raychat.serve.cli as serve_cli
from raychat.checkpoint_manager import commit_directory
from raychat.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def started(monkeypatch) -> list[dict]:
    """The calls that got past the check: serve_cli.start recorded instead of run; ray.init fails the test."""
    monkeypatch.delenv("RAYCHAT_API_KEY", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called")

    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(
        serve_cli,
        "start",
        lambda config, **kw: (
            calls.append({"api_key": config.api_key, "open": config.allow_unauthenticated, **kw})
            or "http://x/"
        ),
    )
    return calls


def serve(tmp_path, *flags: str) -> int:
    """`raychat serve` of a committed checkpoint in tmp_path (what the command names before it starts)."""
    (tmp_path / "meta.json").write_text("{}")
    commit_directory(tmp_path, 1, "sft")
    return main(["serve", "--checkpoint", str(tmp_path), "--address", "ray://x", "--no-block", *flags])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "chat.example.com"])
def test_an_exposed_host_without_a_key_is_refused_before_ray_starts(tmp_path, capsys, started, host):
    assert serve(tmp_path, "--host", host) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert err.startswith(
        f"raychat serve: error: --host {host} serves beyond this machine but no API key is set"
    )
    for flag in ("--api-key KEY", "RAYCHAT_API_KEY", "--allow-unauthenticated"):
        assert flag in err
    assert started == [] and not ray.is_initialized()


@pytest.mark.parametrize(
    "flags,env_key,api_key",
    [
        (["--host", "0.0.0.0", "--allow-unauthenticated"], None, None),
        (["--host", "0.0.0.0", "--api-key", "k1"], None, "k1"),
        (["--host", "0.0.0.0"], "k2", "k2"),  # RAYCHAT_API_KEY, as the RayService's Secret sets it
        ([], None, None),  # default 127.0.0.1
        (["--host", "localhost"], None, None),
        (["--host", "::1"], None, None),
        (["--host", "127.0.0.2"], None, None),
        (["--api-key", "k3"], None, "k3"),
    ],
)
def test_loopback_a_key_or_the_explicit_flag_may_serve(
    tmp_path, monkeypatch, started, flags, env_key, api_key
):
    """What the check lets through without a key is built with allow_unauthenticated (build_app refuses an
    app without a key otherwise); an app with a key is not."""
    if env_key:
        monkeypatch.setenv("RAYCHAT_API_KEY", env_key)
    assert serve(tmp_path, *flags) == 0
    ((call,),) = [started]
    host = flags[flags.index("--host") + 1] if "--host" in flags else "127.0.0.1"
    assert (call["host"], call["api_key"], call["address"]) == (host, api_key, "ray://x")
    assert call["open"] is (api_key is None)


def test_the_refusal_in_docs_is_what_the_command_prints(capsys, started):
    """docs/deployment.md §8 shows a command and the line it prints: run exactly that command."""
    section = (REPO / "docs" / "deployment.md").read_text().split("## 8. Security")[1]
    block = section.split("```bash\n")[1].split("```")[0].splitlines()
    command, printed = block[0], block[1].removeprefix("# ")
    argv = shlex.split(command)
    assert argv[0] == "raychat"
    assert main(argv[1:]) == 2
    assert capsys.readouterr().err == f"{printed}  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    assert started == [] and not ray.is_initialized()


def test_a_presets_allow_unauthenticated_is_the_flags_opt_out(tmp_path, started):
    """A preset's `allow_unauthenticated: true` (build_app's opt-out, the same key as in a Serve config's args)
    lets an exposed --host serve without a key, as --allow-unauthenticated does."""
    preset = tmp_path / "open.yaml"
    preset.write_text("serve:\n  allow_unauthenticated: true\n")
    assert serve(tmp_path, "--host", "0.0.0.0", "--preset", str(preset)) == 0
    ((call,),) = [started]
    assert (call["host"], call["api_key"], call["open"]) == ("0.0.0.0", None, True)


@pytest.fixture
def vllm_started(monkeypatch) -> list[dict]:
    """The vLLM backend's calls that got past the check: serve_cli.start_vllm recorded instead of run."""
    monkeypatch.delenv("RAYCHAT_API_KEY", raising=False)
    calls: list[dict] = []
    monkeypatch.setattr(
        serve_cli, "start_vllm", lambda args: calls.append({"host": args.host}) or "http://x/v1"
    )
    return calls


def serve_vllm(*flags: str) -> int:
    return main(
        ["serve", "--backend", "vllm", "--hf-dir", "hf", "--address", "ray://x", "--no-block", *flags]
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_the_vllm_backend_checks_no_key_so_an_exposed_host_needs_the_explicit_flag(
    capsys, vllm_started, host
):
    """Ray Serve LLM's build_openai_app has no API key option: --backend vllm served an exposed --host given
    --api-key, a key nothing checked. Now a key is refused, and an exposed --host needs --allow-unauthenticated;
    a loopback --host serves as before."""
    assert serve_vllm("--host", host) == 2
    assert capsys.readouterr().err == (
        f"raychat serve: error: --host {host} serves beyond this machine and the vLLM backend checks no API key "
        "(Ray Serve LLM's build_openai_app has no key option): pass --allow-unauthenticated to serve every route "
        "without a key, or serve on a loopback --host behind a proxy that checks one  (RAYCHAT_DEBUG=1 shows the "
        "traceback)\n"
    )
    for flags in (["--host", host, "--api-key", "k1"], ["--api-key", "k1"]):
        assert serve_vllm(*flags) == 2
        assert capsys.readouterr().err.startswith(
            "raychat serve: error: --api-key: the vLLM backend checks no API key (Ray Serve LLM's "
            "build_openai_app has no key option); serve it on a loopback --host behind a proxy that checks one, "
            "or drop --api-key  "
        )
    assert vllm_started == []
    assert serve_vllm("--host", host, "--allow-unauthenticated") == 0
    assert serve_vllm() == 0  # default 127.0.0.1
    assert vllm_started == [{"host": host}, {"host": "127.0.0.1"}]


def test_the_vllm_backend_ignores_raychat_api_key_so_it_does_not_open_a_host(
    monkeypatch, capsys, vllm_started
):
    monkeypatch.setenv("RAYCHAT_API_KEY", "k2")  # raychat's key: vLLM does not read it
    assert serve_vllm("--host", "0.0.0.0") == 2
    assert "the vLLM backend checks no API key" in capsys.readouterr().err
    assert vllm_started == []

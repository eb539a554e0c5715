"""The `raychat` command: `raychat --help` imports neither torch nor Ray; each command's line in it is the
command's own help; a command imports only its own module."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from raychat.cli import COMMANDS, main

HEAVY = ("torch", "ray", "pyarrow", "numpy")


def imported_by(argv: list[str]) -> tuple[set[str], str]:
    """The top-level packages of HEAVY that `raychat ARGV` imports in a fresh Python, and its stdout."""
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print('HEAVY', sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))\n"
        "from raychat.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    heavy = next(line for line in out.splitlines() if line.startswith("HEAVY"))
    return set(eval(heavy[len("HEAVY ") :])), out  # a printed list of module names


def test_help_imports_neither_torch_nor_ray():
    heavy, out = imported_by(["--help"])
    assert heavy == set(), heavy
    assert all(f"    {name}" in out for name in COMMANDS), out


def test_a_light_command_imports_only_its_module():
    heavy, out = imported_by(["jobs", "--help"])
    assert "torch" not in heavy, heavy  # Ray's job client, not the training stack
    assert out.startswith("usage: raychat jobs [-h] <list|stop|logs>"), out


def test_each_line_of_help_is_the_commands_own():
    """COMMANDS states each command's module and help once more; the modules' own parsers must agree."""
    by_module: dict[str, dict[str, str]] = {}
    for module in {m for m, _ in COMMANDS.values()}:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).add_cli(sub)
        by_module[module] = {a.dest: a.help for a in sub._choices_actions}
    assert {name: (m, by_module[m].get(name)) for name, (m, _) in COMMANDS.items()} == COMMANDS
    assert sorted(n for names in by_module.values() for n in names) == sorted(COMMANDS)


def test_an_unknown_command_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        main(["pretrian"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'pretrian'" in err and "'pretrain'" in err

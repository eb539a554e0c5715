"""Every command the documentation shows is dry-run: parsed by the real parser and planned, nothing run.

Sources: README.md, docs/*.md (fenced shell blocks, the README's command listing, inline `code` spans),
ray_cluster.yaml, serve/*.yaml and k8s/**.yaml (indented `#   command` comment lines, the launcher's
*_commands, RayJob entrypoints, entrypoint patches of overlays, RayService Serve configs). Commands marked "not run here" are dry-run too.

- `raychat ...` (also .venv/bin/raychat, `python -m raychat.cli`, `python jobs/<stage>.py`): parsed by
  raychat.cli.build_parser; the command's typed config built as the command builds it (raychat.config.from_args:
  defaults, the preset's sections, the flags), pretraining and SFT also planned (raychat.train.plan.make_plan:
  sizes, batch divisibility), the speedrun's SpeedrunConfig composed; `submit`, `k8s submit` and the `command`
  stage dry-run the stage they carry.
- `make ...`: `make -n` with the same variables (a missing target fails), and each raychat command its recipe
  would run is dry-run in turn.
- `python -m raychat.X`: the module exists.
- any command: a word naming a file of this repository (serve/chat.yaml, k8s/overlays/gpu, bench/...) exists.
A synopsis (`raychat chat --checkpoint DIR [-p PROMPT]`) is read with its brackets dropped, alternatives
(`a|b`) one at a time and its placeholders replaced (PLACEHOLDERS; `<...>` = a name).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from raychat import cli
from raychat.config import (
    SFT_DEFAULTS,
    ChatConfig,
    EvalConfig,
    ExportConfig,
    RLConfig,
    ServeConfig,
    SpeedrunConfig,
    TrainConfig,
    from_args,
    from_dict,
    preset_section,
)
from raychat.config.data import PrepareConfig, TokenizerConfig
from raychat.ops import k8s
from raychat.ops.jobs import STAGES
from raychat.serve.deployments import read_serve_app

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
YAMLS = [REPO / "ray_cluster.yaml", *sorted((REPO / "serve").glob("*.yaml")), *sorted((REPO / "k8s").rglob("*.yaml"))]  # fmt: skip
SHELL_FENCES = ("bash", "sh", "shell", "console")
# metavariables of synopses -> a value of the right kind
PLACEHOLDERS = {
    "NAME": "x1",  # <...> of any other kind (a job id, checkpoint_<newest>, a token)
    "<command>": "pretrain",
    "<stage>": "pretrain",
    "DIR": "runs/checkpoints/sft",
    "FILE": str(REPO / "platform/raychat/presets/tiny.yaml"),
    "PROMPT": "hi",
    "KEY": "k",
    "URL": "http://127.0.0.1:8265",
    "N": "1",
    "T": "0.5",
    "K": "5",
    "P": "0.9",
    "S": "0",
    "ARGS": "--help",  # a stage's arguments
}
# command words -> (config class, the preset section it reads, its defaults) as raychat.commands builds them
CONFIGS = {
    ("data", "prepare"): (PrepareConfig, "data", None),
    ("tokenizer", "train"): (TokenizerConfig, "tokenizer", None),
    ("pretrain",): (TrainConfig, "pretrain", TrainConfig()),
    ("sft",): (TrainConfig, "sft", from_dict(TrainConfig, SFT_DEFAULTS)),
    ("rl",): (RLConfig, "rl", None),
    ("eval",): (EvalConfig, "eval", None),
    ("serve",): (ServeConfig, "serve", None),
    ("export",): (ExportConfig, "export", None),
    ("chat",): (ChatConfig, "chat", None),
}
TOP_LEVEL = {p.split("/")[0] for p in subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()}  # fmt: skip


@dataclass
class Command:
    where: str  # file:line
    words: list[str]
    kind: str  # shell | synopsis | listing
    env: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


# ------------------------------------------------------------------ extraction


def split_simple(line: str, variables: dict) -> list[list[str]]:
    """The simple commands of one shell line (split at && || | ; &), comments dropped, $VAR expanded."""
    line = re.sub(r"<[^<>\n]*>", lambda m: PLACEHOLDERS.get(m[0], "NAME"), line)
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]), line)
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out, cur = [], []
    try:
        for tok in lex:
            if tok and set(tok) <= set("&|;()"):
                out.append(cur)
                cur = []
            else:
                cur.append(tok)
    except ValueError:  # unbalanced quotes: not a command line
        return []
    return [c for c in [*out, cur] if c]


def shell_commands(text: str, where: str, first_line: int, variables: dict) -> list[Command]:
    """Commands of a shell script; NAME=value lines (and `export`) set `variables` for the lines after them."""
    out: list[Command] = []
    lines = text.split("\n")
    i, heredoc = 0, None
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        i += 1
        if heredoc:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<-?\s*'?(\w+)'?", line):
            heredoc = m[1]
        for words in split_simple(line, variables):
            env = {}
            while words and re.fullmatch(r"\w+=.*", words[0]):
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            if words[:1] == ["export"]:
                env.update(w.split("=", 1) for w in words[1:] if "=" in w)
                words = []
            if not words:
                variables.update(env)  # NAME=value alone: a variable of the script
                continue
            out.append(Command(f"{where}:{first_line + start}", words, "shell", env))
    return out


def markdown_commands(path: Path) -> list[Command]:
    text, name, variables = path.read_text(), path.relative_to(REPO), {"PWD": str(REPO)}
    out: list[Command] = []
    fences = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M))
    for m in fences:
        line = text.count("\n", 0, m.start(2)) + 1
        if m[1] in SHELL_FENCES:
            out += shell_commands(m[2], str(name), line, variables)
        elif not m[1]:  # a listing of commands (the README's): `raychat <command>  what it does`
            for j, row in enumerate(m[2].split("\n")):
                if row.startswith("raychat "):
                    out.append(Command(f"{name}:{line + j}", row.split(), "listing"))
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m[1].split())
        if re.match(r"(raychat|make|python3?) ", span) or span == "raychat":
            line = prose.count("\n", 0, m.start()) + 1
            out.append(Command(f"{name}:{line}", [span], "synopsis", {}))
    return out


def yaml_commands(path: Path) -> list[Command]:
    """Indented `#   command` comment lines, and the commands of the YAML's values (entrypoints, Serve configs)."""
    name, text = path.relative_to(REPO), path.read_text()
    out: list[Command] = []
    for j, line in enumerate(text.split("\n"), 1):
        if m := re.match(r"\s*#\s{2,}(\S.*)$", line):
            out += shell_commands(m[1], str(name), j, {})
    for doc in yaml.safe_load_all(text):
        out += value_commands(doc, f"{name}")
    return out


def value_commands(obj, where: str) -> list[Command]:
    out: list[Command] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "entrypoint" and isinstance(value, str):
                out += shell_commands(value, where, 0, {})
            elif key.endswith("_commands") and isinstance(value, list):  # ray_cluster.yaml's node commands
                out += [c for v in value for c in shell_commands(v, f"{where}:{key}", 0, {})]
            elif key == "serveConfigV2" and isinstance(value, str):
                out.append(Command(where, [value], "serve-config"))
            elif key == "patch" and isinstance(value, str):
                out += value_commands(yaml.safe_load(value), where)
            elif key == "value" and obj.get("path", "").endswith("/entrypoint"):
                out += shell_commands(value, where, 0, {})
            else:
                out += value_commands(value, where)
    elif isinstance(obj, list):
        for item in obj:
            out += value_commands(item, where)
    return out


def documented_commands() -> list[Command]:
    out = [c for p in DOCS for c in markdown_commands(p)]
    out += [c for p in YAMLS for c in yaml_commands(p)]
    for p in sorted((REPO / "serve").glob("*.yaml")):
        out.append(Command(str(p.relative_to(REPO)), [p.read_text()], "serve-config"))
    return out


def synopsis_variants(span: str) -> list[list[str]]:
    """A synopsis' argument lists: brackets dropped, one list per alternative of an `a|b|c` word, metavariables
    (PLACEHOLDERS) replaced; `<...>` is NAME."""
    span = re.sub(r"<[^<>]*>", lambda m: PLACEHOLDERS.get(m[0], "NAME"), span)
    words = shlex.split(span.replace("[", " ").replace("]", " "))
    variants = [[]]
    for w in words:
        options = w.split("|") if "|" in w and not w.startswith("-") else [w]
        variants = [[*v, PLACEHOLDERS.get(o, o)] for v in variants for o in options]
    return variants


# ------------------------------------------------------------------ dry runs


def raychat_argv(words: list[str]) -> list[str] | None:
    """The raychat argv of a simple command, or None when it is not a raychat command."""
    prog = words[0]
    if prog == "raychat" or prog.endswith("/bin/raychat"):
        return words[1:]
    if re.fullmatch(r"(.*/)?python3?", prog) and words[1:3] == ["-m", "raychat.cli"]:
        return words[3:]
    if re.fullmatch(r"(.*/)?python3?", prog) and len(words) > 1:
        if m := re.fullmatch(r"jobs/(\w+)\.py", words[1]):
            assert (REPO / words[1]).is_file(), f"{words[1]} does not exist"
            return [m[1], *words[2:]]
    return None


def dry_run(words: list[str]) -> None:
    """Parse and plan one simple command (AssertionError or the config's error when it cannot work)."""
    check_repo_paths(words)
    argv = raychat_argv(words)
    if argv is not None:
        return dry_run_raychat(argv)
    prog = words[0]
    if prog == "make":
        return dry_run_make(words[1:])
    if re.fullmatch(r"(.*/)?python3?", prog) and words[1:2] == ["-m"] and words[2].startswith("raychat"):
        assert importlib.util.find_spec(words[2]) is not None, f"no module {words[2]}"


def check_repo_paths(words: list[str]) -> None:
    for w in words[1:]:
        w = w.split("=", 1)[1] if w.startswith("--") and "=" in w else w
        if w.startswith("-") or ":" in w:
            continue
        if w.split("/")[0] in TOP_LEVEL and ("/" in w or "." in w):
            assert (REPO / w).exists(), f"{w}: no such file in the repository"


def parse(argv: list[str]):
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = cli.build_parser(command)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 0 and ("--help" in argv or "-h" in argv):
            return None
        raise AssertionError(f"the parser refuses it: {err.getvalue().strip().splitlines()[-1]}") from None


def check_options(argv: list[str]) -> None:
    """Each --option of a partial command line (its positional arguments left out) is one of its parser's."""
    sub = cli.build_parser(argv[0])._subparsers._group_actions[0].choices[argv[0]]  # argparse keeps it here
    for word in argv[1:]:
        if word.startswith("-"):
            assert word.split("=")[0] in sub._option_string_actions, f"raychat {argv[0]}: no option {word}"


def dry_run_raychat(argv: list[str]) -> None:
    args = parse(argv)
    if args is None:  # --help
        return
    words = tuple(
        getattr(args, a) for a in ("command", "data_command", "tokenizer_command") if getattr(args, a, None)
    )
    if args.command in ("submit", "k8s") and getattr(args, "stage", None):
        stage_args = list(args.stage_args)
        if args.command == "k8s":
            k8s.rayjob(args.stage, stage_args, name=args.name)  # the RayJob it would create
        if args.stage == "command":
            return dry_run(stage_args) if stage_args else None
        assert args.stage in STAGES
        return dry_run_raychat([args.stage, *stage_args])
    if args.command == "speedrun":
        cfg = SpeedrunConfig.from_preset(args.preset, "/nonexistent/runs", args.num_iterations)
        for stage in (cfg.pretrain, cfg.sft):
            if stage is not None:
                plan(stage, args.preset)
        return
    if words in CONFIGS:
        cls, section, base = CONFIGS[words]
        cfg = from_args(args, cls, section, base=base, where=f"{section} settings")
        if cls is TrainConfig:
            plan(cfg, getattr(args, "preset", None))


PLANNED: set = set()  # (config, preset) already planned: documented commands repeat


def plan(cfg: TrainConfig, preset: str | None) -> None:
    """make_plan of a training config (a model from --depth: the checkpoint of --init-from is not there)."""
    from raychat.train.plan import make_plan  # torch: imported for the first training command only

    if (repr(cfg), preset) in PLANNED:
        return
    PLANNED.add((repr(cfg), preset))
    vocab = (preset_section(preset, "tokenizer") if preset and preset != "none" else {}).get("vocab_size")
    make_plan(from_dict(TrainConfig, {"init_from": ""}, base=cfg), vocab or TokenizerConfig().vocab_size)


def dry_run_make(args: list[str]) -> None:
    """`make -n` of the command (into a venv path that does not exist, so every recipe line is printed and
    none runs); then each raychat command of the printed recipes."""
    run = subprocess.run(
        ["make", "-n", "VENV=/nonexistent/venv", *args], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, f"make -n: {run.stderr.strip()}"
    for line in run.stdout.splitlines():
        for words in split_simple(line, {}):
            if raychat_argv(words) is not None:
                dry_run(words)


def check_serve_config(text: str) -> None:
    """Each raychat app of a Serve config: its import path exists and its args and deployments: section build a
    ServeConfig."""
    for app in yaml.safe_load(text)["applications"]:
        module, _, attr = app["import_path"].partition(":")
        if module.startswith("raychat."):
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
        if app["import_path"] == "raychat.serve.app:build_app":
            read_serve_app(app)  # args and the deployments: section


def run_one(c: Command) -> None:
    if c.kind == "listing":  # `raychat <command>  what it does`, or `raychat submit / jobs  ...`
        named = [c.words[1], *(c.words[3:4] if c.words[2:3] == ["/"] else [])]
        for name in named:
            assert name in cli.COMMANDS, f"no command {name!r}"
    elif c.kind == "serve-config":
        check_serve_config(c.words[0])
    elif c.kind == "synopsis":
        for words in synopsis_variants(c.words[0]):
            try:
                dry_run(words)
            except AssertionError as e:  # a command named with some of its options, in prose
                if "arguments are required" not in str(e) or raychat_argv(words) is None:
                    raise
                check_options(raychat_argv(words))
    else:
        dry_run(c.words)


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def commands() -> list[Command]:
    return documented_commands()


def test_every_documented_command_dry_runs(commands):
    failures = []
    for c in commands:
        try:
            run_one(c)
        except (AssertionError, ValueError, OSError) as e:
            failures.append(f"{c}\n    {type(e).__name__}: {e}")
    assert not failures, "documented commands that cannot work:\n" + "\n".join(failures)


def test_the_extraction_finds_the_commands_of_each_source(commands):
    text = {str(c) for c in commands}
    found = "\n".join(text)
    # a fenced block, a continuation line, a synopsis, the listing, a make command, YAML comments, entrypoints
    assert "README.md:" in found and "docs/deployment.md:" in found and "ray_cluster.yaml:" in found
    assert "raychat submit --env AWS_ENDPOINT_URL=http://127.0.0.1:9000 pretrain --preset tiny --storage-path s3://bucket/runs" in found  # fmt: skip
    assert "make speedrun PRESET=gpu8 TORCH_INDEX=https://download.pytorch.org/whl/cu128" in found
    assert "raychat submit pretrain --preset cluster" in found
    for stage in k8s.CHAIN:  # one command a RayJob
        entry = [c.words[:2] for c in commands if c.where.startswith(f"k8s/base/rayjob-{stage}.yaml")]
        assert entry == [["python", f"jobs/{stage}.py"]], stage
    dev = [c for c in commands if c.where.startswith("k8s/overlays/cpu-dev/kustomization.yaml")]
    assert len(dev) == len(k8s.CHAIN) and all("tiny" in c.words for c in dev if "export" not in c.words[1])
    assert sum(c.kind == "serve-config" for c in commands) >= 2  # serve/chat.yaml and the RayService's copy
    assert len(commands) > 80


@pytest.mark.parametrize(
    "words, error",
    [
        ("raychat submit pretrain --preset gpu", "no preset 'gpu'"),
        ("raychat pretrain --preset gpu8 --num-workers 3", "not a multiple of"),
        ("raychat sft --no-such-flag 1", "unrecognized arguments: --no-such-flag"),
        ("raychat submit --num-gpus 0 speedrun --preset nope --out /mnt/runs", "no preset 'nope'"),
        ("raychat rl --preset platform/raychat/presets/nope.yaml", "nope.yaml: no such file"),
        ("raychat rl --preset /tmp/nope.yaml", "--preset: file /tmp/nope.yaml does not exist"),
        ("make speedrunn", "No rule to make target"),
        ("make -n speedrun PRESET=gpu9", "no preset 'gpu9'"),
        ("python jobs/pretrainer.py --preset cpu", "jobs/pretrainer.py"),
        ("serve deploy serve/chats.yaml", "serve/chats.yaml: no such file"),
        ("python -m raychat.no_such_module", "no module raychat.no_such_module"),
    ],
)
def test_a_command_that_cannot_work_fails_the_dry_run(words, error):
    with pytest.raises((AssertionError, ValueError, OSError), match=re.escape(error)):
        run_one(Command("t", shlex.split(words), "shell"))


def test_a_synopsis_is_read_with_its_metavariables():
    assert synopsis_variants("raychat data prepare --source debian-docs|DIR") == [
        ["raychat", "data", "prepare", "--source", "debian-docs"],
        ["raychat", "data", "prepare", "--source", "runs/checkpoints/sft"],
    ]
    assert synopsis_variants("raychat chat --checkpoint DIR [-p PROMPT]") == [
        ["raychat", "chat", "--checkpoint", "runs/checkpoints/sft", "-p", "hi"]
    ]
    with pytest.raises(AssertionError, match="--top-k"):  # a value of the wrong kind is refused
        run_one(Command("t", ["raychat chat --top-k PROMPT"], "synopsis"))

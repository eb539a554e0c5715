"""The `raychat` command: `raychat --help` and every `raychat <command> [<sub>] --help` import neither torch nor
Ray (each parser is built from raychat.commands; a command's code is imported only when it runs); each
command's line in `raychat --help` is its parser's own help; each parser names a function that exists."""

from __future__ import annotations

import argparse
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from raychat.cli import COMMANDS, build_parser, load, main
from raychat.cli_parser import did_you_mean
from raychat.commands import CANARIES, PARSERS, STAGE_CONFIGS
from raychat.config import ChatConfig, ServeConfig, from_dict
from raychat.config.schema import flag_name, to_flat
from raychat.log import RunGaveUp
from raychat.ops.jobs import STAGES

REPO = Path(__file__).resolve().parents[2]
ROOT = "/mnt/checkpoints/runs"  # a storage root every node of the documented clusters mounts

HEAVY = ("torch", "ray", "pyarrow", "numpy")


def imported_by(argv: list[str]) -> tuple[set[str], str]:
    """The top-level packages of HEAVY that `raychat ARGV` imports in a fresh Python, and its stdout."""
    code = (
        "import atexit, json, sys\n"
        f"atexit.register(lambda: print('HEAVY', json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))))\n"
        "from raychat.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    heavy = next(line for line in out.splitlines() if line.startswith("HEAVY"))
    return set(json.loads(heavy[len("HEAVY ") :])), out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{name: parser} of the subcommands of `parser` (empty when it has none)."""
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def every_help_argv() -> list[list[str]]:
    """`<command> --help` and `<command> <sub> --help` for every command and subcommand."""
    argvs = []
    for name, add in PARSERS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        add(sub)
        argvs += [[name, "--help"]] + [[name, s, "--help"] for s in subcommands(sub.choices[name])]
    return argvs


def test_help_imports_neither_torch_nor_ray():
    heavy, out = imported_by(["--help"])
    assert heavy == set(), heavy
    assert all(f"    {name}" in out for name in COMMANDS), out


def test_a_commands_help_imports_neither_torch_nor_ray():
    heavy, out = imported_by(["pretrain", "--help"])
    assert heavy == set(), heavy
    assert out.startswith("usage: raychat pretrain [-h] [--preset PRESET]"), out


def test_every_commands_help_imports_neither_torch_nor_ray():
    """All of them in one fresh Python: each `--help` through raychat.cli.main, then sys.modules."""
    argvs = every_help_argv()
    assert ["jobs", "logs", "--help"] in argvs and ["grafana", "dashboard", "--help"] in argvs
    code = (
        "import contextlib, io, sys\n"
        "from raychat.cli import main\n"
        f"for argv in {argvs!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    assert out.getvalue().startswith('usage: raychat ' + argv[0]), (argv, out.getvalue())\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_each_line_of_help_is_the_commands_own():
    """COMMANDS states each command's help line once more (`raychat --help` reads only it); the parsers must
    agree, command for command, in the same order."""
    assert list(PARSERS) == list(COMMANDS)
    for name, add in PARSERS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        add(sub)
        assert {a.dest: a.help for a in sub._choices_actions} == {name: COMMANDS[name]}


def test_every_parser_names_a_function_that_runs_it():
    funcs = set()
    for argv in every_help_argv():
        parser = argparse.ArgumentParser().add_subparsers()
        PARSERS[argv[0]](parser)
        parser = parser.choices[argv[0]]
        for name in argv[1:-1]:
            parser = subcommands(parser)[name]
        funcs.add(parser.get_default("func"))  # None for a group whose subcommand is required
    funcs.discard(None)
    assert len(funcs) >= len(COMMANDS) and all(callable(f if callable(f) else load(f)) for f in funcs), funcs


def test_the_canaries_are_inspect_batchs_own():
    from raychat.data.replay.inspect_batch import canary_conversations

    assert tuple(canary_conversations()) == CANARIES


def command_parser(name: str) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    PARSERS[name](sub)
    return sub.choices[name]


def test_serves_help_lists_every_endpoint_the_app_serves():
    from raychat.serve.ingress import create_app

    description = command_parser("serve").description
    listed = re.findall(r"(/[\w/{}]*)(?: \(\w+\))?[,.]", description.split("Endpoints: ", 1)[1])
    # a path parameter as the help writes it: {model}, not Starlette's {model:path}
    served = {re.sub(r":\w+}", "}", route.path) for route in create_app(None).routes} - {"/openapi.json"}
    assert sorted(listed) == sorted(served)  # /v1/completions was missing


def test_evals_help_names_both_files_it_writes():
    from raychat.eval.cli import CARD_FILE, RESULT_FILE

    described = command_parser("eval").description
    assert (
        f"<storage-path>/<run-name>/{RESULT_FILE} and {CARD_FILE}" in described
    )  # report_card.md was missing


def test_inspect_batchs_help_shows_the_segments_as_it_prints_them():
    from raychat.data.replay.inspect_batch import segment_text

    pretrain = {"row_offset": [0], "doc_shard": [0], "doc_row_group": [0], "doc_row": [357], "doc_offset": [0],
                "length": [65], "decision": ["crop"], "tail": [325]}  # fmt: skip
    sft = {"row_offset": [0], "sample_id": ["calculator-train/193"], "length": [62]}
    described = " ".join(command_parser("inspect-batch").description.split())
    assert f"e.g. `{segment_text(pretrain, 0, ['shard_00000.parquet'])}`" in described
    assert "`shard:row_group:row[doc_offset:+length]@row_offset decision(tail)`" in described
    assert (
        "SFT `sample_id+length@row_offset`" in described
        and segment_text(sft, 0, []) == "calculator-train/193+62@0"
    )


KNOWN = (
    "'speedrun', 'data', 'tokenizer', 'pretrain', 'sft', 'rl', 'eval', 'report', 'chat', 'serve', 'export', "
    "'inspect-batch', 'submit', 'jobs', 'k8s', 'grafana'"
)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["pretrian", "--depth", "4"],
         f"raychat: error: argument <command>: invalid choice: 'pretrian' (choose from {KNOWN}) (did you mean "
         "pretrain?) (`raychat --help` lists the flags)"),
        (["sfr"],  # 0.67 from sft: no suggestion
         f"raychat: error: argument <command>: invalid choice: 'sfr' (choose from {KNOWN}) (`raychat --help` lists "
         "the flags)"),
        (["data", "prepair"],
         "raychat data: error: argument <subcommand>: invalid choice: 'prepair' (choose from 'prepare') (did you "
         "mean prepare?) (`raychat data --help` lists the flags)"),
        (["chat", "--checkpiont", "x"],
         "raychat chat: error: unrecognized arguments: --checkpiont x (did you mean --checkpoint?) (`raychat chat "
         "--help` lists the flags)"),
        (["chat", "-p", "hi", "--max-tokenz=5"],
         "raychat chat: error: unrecognized arguments: --max-tokenz=5 (did you mean --max-tokens?) (`raychat chat "
         "--help` lists the flags)"),
        (["chat", "--backend", "vllm"],  # serve's flag, close to none of chat's
         "raychat chat: error: unrecognized arguments: --backend vllm (`raychat chat --help` lists the flags)"),
        (["pretrain", "--port", "8000"],  # serve's flag, close to none of pretrain's
         "raychat pretrain: error: unrecognized arguments: --port 8000 (`raychat pretrain --help` lists the flags)"),
        (["serve", "--checkpoint", "x", "--backend", "vlm"],
         "raychat serve: error: argument --backend: invalid choice: 'vlm' (choose from 'raychat', 'vllm') (did you "
         "mean vllm?) (`raychat serve --help` lists the flags)"),
        (["pretrain", "--tracker", "wandbb"],  # a config flag's choices (raychat.config.flags)
         "raychat pretrain: error: argument --tracker: invalid choice: 'wandbb' (choose from 'none', "
         "'tensorboard', 'wandb') (did you mean wandb?) (`raychat pretrain --help` lists the flags)"),
        (["chat", "--checkpiont", "x", "--tempreture", "0.5"],
         "raychat chat: error: unrecognized arguments: --checkpiont x --tempreture 0.5 (did you mean --checkpoint "
         "for --checkpiont, --temperature for --tempreture?) (`raychat chat --help` lists the flags)"),
        (["chat", "--checkpiont", "x", "--port", "1"],
         "raychat chat: error: unrecognized arguments: --checkpiont x --port 1 (did you mean --checkpoint for "
         "--checkpiont?) (`raychat chat --help` lists the flags)"),
        (["chat", "--tempreture", "-1"],  # -1 is the value, no second unknown flag
         "raychat chat: error: unrecognized arguments: --tempreture -1 (did you mean --temperature?) (`raychat chat "
         "--help` lists the flags)"),
        (["jobs", "--follow", "logs", "raysubmit_1"],  # logs' own flag before `logs`: where it goes, not itself
         "raychat jobs logs: error: unrecognized arguments: --follow (did you mean --follow after logs?) "
         "(`raychat jobs logs --help` lists the flags)"),
        (["submit", "pretrain", "--storage-path", ROOT, "--deptth", "4"],
         "raychat submit: error: stage pretrain: unrecognized arguments: --deptth 4 (did you mean --depth?) "
         "(`raychat pretrain --help` lists its flags)"),
    ],
)  # fmt: skip
def test_a_mistyped_command_flag_or_value_is_refused_with_the_closest_one(argv, line, capsys):
    """It said only "invalid choice" / "unrecognized arguments"; now its one line ends with the command, flag or
    value the parser knows that the mistyped one is close to (raychat.cli_parser.did_you_mean), when one is."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    "word, choices, close",
    [
        ("chta", COMMANDS, "chat"),  # one swap in 4 letters: ratio 0.75, the cutoff
        ("chatt", COMMANDS, "chat"),
        ("sfr", COMMANDS, None),
        ("--nosuch", ["--checkpoint", "--prompt", "-p"], None),
        ("-checkpoint", ["--checkpoint", "--prompt", "-p"], "--checkpoint"),
        ("3", [1, 2, 3], None),  # not strings: no suggestion
    ],
)
def test_did_you_mean_names_the_closest_choice_above_its_cutoff(word, choices, close):
    assert did_you_mean(word, choices) == close


def test_a_sections_help_is_its_configs_first_paragraph_whole(capsys):
    """The text under a flag section is the first paragraph of the config's docstring, unwrapped: a sentence that
    wraps in the source is not cut at the line end (EvalConfig's first line ends at "of one")."""
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "EvalConfig: Validation BPB, held-out task accuracy and the report card (raychat.eval.report_card) of one "
        "checkpoint; JSON to stdout and to <storage-path>/<run-name>/eval.json, the card's markdown table to "
        "stderr and to <storage-path>/<run-name>/report_card.md."
    ) in out


def test_submits_help_lists_every_exit_code(capsys):
    """docs/deployment.md's exit codes of `submit`: the help left out 2, what bad input exits with."""
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "Exit code: 0 SUCCEEDED, 1 FAILED, 2 bad input (refused before submission), 3 STOPPED, 4 "
        "unreachable/unauthorized."
    ) in out


@pytest.mark.parametrize("command", ["pretrain", "sft", "rl", "eval", "chat", "serve", "inspect-batch"])
def test_every_flag_section_says_what_it_holds_not_its_dataclass_signature(capsys, command):
    """A dataclass without a docstring gets `Name(field: 'type' = default, ...)` as its __doc__, which --help
    showed for BatchSection, TaskSection and nine other sections."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    titles = re.findall(r"^(\S+):\n  (.*)$", out, flags=re.M)
    assert titles, out[:500]
    signatures = [(title, summary) for title, summary in titles if re.match(r"\w+Section\(\w+: '", summary)]
    assert not signatures


def test_a_flag_the_parser_refuses_is_one_line_not_the_usage_block(capsys):
    with pytest.raises(SystemExit) as e:
        main(["chat", "--temperature", "nan"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "raychat chat: error: argument --temperature: --temperature must be a finite number, got 'nan' "
        "(`raychat chat --help` lists the flags)\n"
    )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (
            ["submit", "--address", "", "pretrain", "--storage-path", ROOT],
            "--address",
        ),  # read as "not given": the default address
        (
            ["submit", "--python", " ", "pretrain", "--storage-path", ROOT],
            "--python",
        ),  # the entrypoint `' ' jobs/pretrain.py`
        (["submit", "--pip", "", "pretrain", "--storage-path", ROOT], "--pip"),
        (["jobs", "stop", ""], "job_id"),
        (["report", ""], "RUN_DIR"),  # as its usage names it, not by its dest (run_dirs)
        (["report", "runs/a", " "], "RUN_DIR"),
        (["k8s", "submit", "--dry-run", "--image", "", "rl"], "--image"),
        (["serve", "--host", ""], "--host"),
        (["chat", "-p", ""], "-p"),
    ],
)
def test_a_blank_text_argument_is_refused_by_the_parser(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    prog = "raychat " + " ".join(
        a for a in argv[:2] if a in ("submit", "jobs", "stop", "k8s", "serve", "chat", "report")
    )
    assert capsys.readouterr().err == (
        f"{prog}: error: argument {flag}: must not be blank (`{prog} --help` lists the flags)\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["inspect-batch", "--canary", "short", "--row-len", "0"],
            "argument --row-len: must be 2..16384, got 0",
        ),
        (["inspect-batch", "--vocab-size", "5"], "argument --vocab-size: must be >= 265, got 5"),
        (
            ["inspect-batch", "--row-len", "100000"],
            "argument --row-len: must be 2..16384, got 100000",
        ),  # 17.5 GB
        (["inspect-batch", "--run", "r", "--step", "0"], "argument --step: must be >= 1, got 0"),
        (["submit", "--num-cpus", "-1", "pretrain"], "argument --num-cpus: must be >= 0, got -1"),
        *(
            (
                ["serve", "--host", host],
                f"argument --host: must be an IP address (127.0.0.1, 0.0.0.0, ::) or "
                f"a host name (letters, digits, '-', '.'), got {host!r}",
            )
            for host in ("not a host!", "trail-.example", "a..b", "x" * 64, "1.2.3.4:80", "http://0.0.0.0")
        ),
        *(
            (
                ["submit", "--job-id", job_id, "pretrain"],
                "argument --job-id: must be 1-128 letters, digits, '.', "
                f"'_' or '-', starting with a letter or digit, got {job_id!r}",
            )
            for job_id in ("a b/../", "../x", "", ".hidden", "x" * 129)
        ),
        (
            ["k8s", "submit", "--dry-run", "--image", "has space", "pretrain"],
            "argument --image: must be a container image reference, e.g. rayproject/ray:2.54.0-py311 or "
            "registry:5000/raychat@sha256:..., got 'has space'",
        ),
    ],
)
def test_numbers_the_parser_checks_name_their_flag(argv, message, capsys):
    """--row-len 0 trained a tokenizer, then failed naming max_tokens; --vocab-size 5 named vocab_size;
    `serve --host "not a host!"` was refused for want of an API key, as if it were a public name."""
    with pytest.raises(SystemExit):
        main(argv)
    prog = "raychat " + " ".join(argv[:2] if argv[0] == "k8s" else argv[:1])
    assert capsys.readouterr().err == f"{prog}: error: {message} (`{prog} --help` lists the flags)\n"


@pytest.mark.parametrize("submit", [["submit"], ["k8s", "submit", "--dry-run"]])
@pytest.mark.parametrize(
    "stage_args, message",
    [
        (["pretrain", "--bogus", "1"], "stage pretrain: unrecognized arguments: --bogus 1"),
        (
            ["pretrain", "--depth", "x"],
            "stage pretrain: argument --depth: --depth must be an integer, got 'x'",
        ),
        (["data", "prepare", "--num-shards"], "stage data: argument --num-shards: expected one argument"),
        (["sft", "--", "--no-such-flag"], "stage sft: unrecognized arguments: --no-such-flag"),
        (["sft", "--depth", "4"],
         "stage sft: argument --depth: not used: SFT takes the model's shape from --init-from's checkpoint"),
        # the stage's config, built here as the job builds it (these were submitted and failed in the job)
        (["pretrain", "--depth", "0"], "stage pretrain: --depth must be a positive integer, got 0"),
        (["data", "prepare", "--num-shards", "0"], "stage data: --num-shards must be >= 1, got 0"),
        (["rl", "--preset", "nosuch"],
         "stage rl: --preset: no preset 'nosuch'; known presets: ['cluster', 'cpu', 'gpu8', 'tiny']"),
        (["data"], "stage data: the following arguments are required: <subcommand>"),
        # the batch arithmetic (raychat.config.train.check_batch): the cluster trial's sft job failed on it in the
        # cluster (tests/unit/test_train_config.py: the stage's own plan raises this very line)
        (["sft", "--preset", "tiny", "--storage-path", ROOT, "--init-from", "latest", "--num-workers", "8"],
         "stage sft: --total-batch-size 512 is not a multiple of --device-batch-size x --seq-len x --num-workers = "
         "4 x 64 x 8 = 2048; allowed: a multiple of 2048, e.g. 2048"),
        (["pretrain", "--preset", "tiny", "--storage-path", ROOT, "--num-workers", "3", "--min-workers", "2",
          "--total-batch-size", "768"],
         "stage pretrain: --total-batch-size 768 is not a multiple of --device-batch-size x --seq-len x workers "
         "(--min-workers..--num-workers) = 4 x 64 x 2 = 512; allowed: a multiple of 1536, e.g. 1536"),
        # the model's shape (raychat.config.train.ModelSection; tests/unit/test_train_config.py works it by hand)
        (["pretrain", "--preset", "tiny", "--storage-path", ROOT, "--kv-group", "3"],
         "stage pretrain: --kv-group 3 does not divide the 2 query heads (width 64: --depth 1 x --aspect-ratio 64 = "
         "64 rounded up to a multiple of --head-dim 32; 64 / 32 = 2); allowed: 1, 2"),
        (["pretrain", "--storage-path", ROOT, "--head-dim", "33"],
         "stage pretrain: --head-dim must be even (RoPE rotates pairs of dimensions), got 33"),
    ],
)  # fmt: skip
def test_a_submitted_stages_arguments_are_parsed_before_submission(submit, stage_args, message, capsys):
    """`k8s submit --dry-run pretrain --bogus 1` printed a RayJob (exit 0) whose cluster would start only for the
    job to fail on its arguments; `submit` sent it to the Ray cluster."""
    with pytest.raises(SystemExit) as e:
        main([*submit, *stage_args])
    assert e.value.code == 2
    prog = "raychat " + " ".join(submit[:2] if submit[0] == "k8s" else submit[:1])
    stage = stage_args[0]
    assert capsys.readouterr().err == f"{prog}: error: {message} (`raychat {stage} --help` lists its flags)\n"


def _submit_refusal(submit: list[str], stage_args: list[str], capsys) -> tuple[str, str, str]:
    """(prog, stage, stderr) of a submission that must exit 2 before anything is submitted."""
    with pytest.raises(SystemExit) as e:
        main([*submit, *stage_args])
    assert e.value.code == 2
    return (
        "raychat " + " ".join(submit[:2] if submit[0] == "k8s" else submit[:1]),
        stage_args[0],
        capsys.readouterr().err,
    )


JOB_COPY = "is relative: a job runs in a temporary copy of the checkout that Ray deletes; give storage every node mounts"


@pytest.mark.parametrize("submit", [["submit"], ["k8s", "submit", "--dry-run"]])
@pytest.mark.parametrize(
    "stage_args, message",
    [
        (["pretrain", "--preset", "tiny"], f"--storage-path 'runs/checkpoints' (the default: not given) {JOB_COPY} "
         f"(e.g. --storage-path {ROOT})"),
        (["rl"], f"--storage-path 'runs/rl' (the default: not given) {JOB_COPY} (e.g. --storage-path {ROOT})"),
        (["eval", "--checkpoint", "latest", "--data-dir", "/mnt/data"],  # latest is looked up in runs/checkpoints
         f"--storage-path 'runs/checkpoints' (the default: not given) {JOB_COPY} (e.g. --storage-path {ROOT})"),
        (["export", "--checkpoint", "latest", "--out", "/mnt/hf"],  # latest is looked up in runs/checkpoints
         f"--storage-path 'runs/checkpoints' (the default: not given) {JOB_COPY} (e.g. --storage-path {ROOT})"),
        (["data", "prepare", "--out", "shards"], f"--out 'shards' {JOB_COPY} (e.g. --out {ROOT})"),
        (["export", "--checkpoint", "latest", "--out", "/mnt/hf", "--storage-path", "ckpt"],
         f"--storage-path 'ckpt' {JOB_COPY} (e.g. --storage-path {ROOT})"),  # export reads it even with --out
        (["speedrun"], f"--out 'runs' {JOB_COPY} (e.g. --out {ROOT})"),
    ],
)  # fmt: skip
def test_a_submitted_stage_with_a_relative_storage_path_is_refused(submit, stage_args, message, capsys):
    """`raychat submit pretrain --preset tiny` and `raychat k8s submit rl` (docs/deployment.md) were accepted, and
    the job refused the default `runs/...` only once it ran (a RayJob: after its whole cluster started)."""
    prog, stage, err = _submit_refusal(submit, stage_args, capsys)
    assert (
        err
        == f"{prog}: error: stage {stage}: {message} or s3:// / gs:// (`raychat {stage} --help` lists its flags)\n"
    )


RUN_OR_PATH = f"a directory every node mounts (e.g. {{flag}} {ROOT}/<run>) or a run name under --storage-path"
REFERENCE = "an absolute path, s3:// / gs://, a run name under --storage-path or latest"


@pytest.mark.parametrize("submit", [["submit"], ["k8s", "submit", "--dry-run"]])
@pytest.mark.parametrize(
    "stage_args, flag, value, takes",
    [
        (["pretrain", "--storage-path", ROOT, "--data-dir", "runs/data"], "--data-dir", "runs/data", RUN_OR_PATH),
        (["pretrain", "--storage-path", ROOT, "--tokenizer-path", "./tok"], "--tokenizer-path", "./tok",
         RUN_OR_PATH),
        (["tokenizer", "train", "--storage-path", ROOT, "--data-dir", "."], "--data-dir", ".", RUN_OR_PATH),
        (["sft", "--preset", "cluster", "--init-from", "runs/checkpoints/pretrain"], "--init-from",
         "runs/checkpoints/pretrain", REFERENCE),
        (["rl", "--storage-path", "s3://bucket/runs", "--init-from", "../sft/latest"], "--init-from",
         "../sft/latest", REFERENCE),
        (["eval", "--storage-path", ROOT, "--checkpoint", "runs/pretrain/checkpoint_000004"], "--checkpoint",
         "runs/pretrain/checkpoint_000004", REFERENCE),
        (["export", "--storage-path", ROOT, "--checkpoint", "sft/latest"], "--checkpoint", "sft/latest", REFERENCE),
        (["sft", "--preset", "cluster", "--init-from", "latest", "--sft-data", "/mnt/data/a.jsonl, mine.jsonl"],
         "--sft-data", "mine.jsonl", "files every node mounts: absolute paths (e.g. --sft-data /mnt/data/mine.jsonl)"),
    ],
)  # fmt: skip
def test_a_submitted_stage_with_a_relative_input_path_is_refused(
    submit, stage_args, flag, value, takes, capsys
):
    """`raychat submit pretrain --storage-path /mnt/... --data-dir runs/data` was submitted, and the job refused
    the relative path (raychat.storage.check_not_in_job_copy) only once it ran; a run name, `latest`, an
    absolute path or a URI, which the job takes, pass (test_a_submitted_stages_valid_arguments_...)."""
    prog, stage, err = _submit_refusal(submit, stage_args, capsys)
    assert err == (
        f"{prog}: error: stage {stage}: {flag} {value!r} is relative: a job runs in a temporary copy of the "
        f"checkout that Ray deletes; give {takes.format(flag=flag)} (`raychat {stage} --help` lists its flags)\n"
    )


TASK_DATA_NOTE = (
    "stage {stage} reads {reads} from the task data directory, {where} the job's temporary copy of the checkout, "
    "uploaded without runs/ ({missing}); to read them from storage every node mounts give --task-data-dir, e.g. "
    "--task-data-dir /mnt/checkpoints/task_data"  # README's $D: the task data beside the storage root
)
NOT_GIVEN = "--task-data-dir not given: $RAYCHAT_TASK_DATA of the node it runs on, else runs/task_data in"
NO_DATA, FAILS = "what is not there scores 'n/a: no data'", "the job fails without them"


@pytest.mark.parametrize(
    "argv, note",
    [
        # docs/deployment.md's chain: a submitted eval showed "n/a: no data" for CORE, and no line said why
        (["eval", "--preset", "tiny", "--storage-path", ROOT, "--run-name", "eval", "--checkpoint", "latest"],
         dict(reads="the CORE bundle (eval_bundle/)", where=NOT_GIVEN, missing=NO_DATA)),
        (["sft", "--preset", "tiny", "--storage-path", ROOT, "--init-from", "latest", "--sft-tasks",
          "gsm8k:10,calculator,gsm8k,mmlu"], dict(reads="the files of gsm8k, mmlu", where=NOT_GIVEN, missing=FAILS)),
        (["rl", "--storage-path", ROOT, "--task", "gsm8k", "--task-data-dir", "task_data"],
         dict(reads="the files of gsm8k", where="--task-data-dir 'task_data', relative: in", missing=FAILS)),
        (["--env", "RAYCHAT_TASK_DATA=td", "eval", "--storage-path", ROOT, "--checkpoint", "latest", "--tasks",
          "chatcore,calculator", "--core-bundle", "/mnt/bundle"],
         dict(reads="the files of the chat evals (chatcore)", where="--env RAYCHAT_TASK_DATA=td, relative: in",
              missing=NO_DATA)),
        # nothing read from it (the tiny preset's SFT and RL tasks are local; the bundle named), or an absolute one
        (["sft", "--preset", "tiny", "--storage-path", ROOT, "--init-from", "latest"], None),
        (["rl", "--preset", "tiny", "--storage-path", ROOT], None),
        (["eval", "--storage-path", ROOT, "--checkpoint", "latest", "--core-bundle", "/mnt/b"], None),
        (["eval", "--storage-path", ROOT, "--checkpoint", "latest", "--task-data-dir", f"{ROOT}/task_data"], None),
        (["--env", f"RAYCHAT_TASK_DATA={ROOT}/td", "eval", "--storage-path", ROOT, "--checkpoint", "latest"], None),
        (["pretrain", "--preset", "tiny", "--storage-path", ROOT], None),
    ],
)  # fmt: skip
def test_a_submitted_stage_that_reads_task_data_from_the_jobs_copy_gets_a_note(argv, note):
    """The stages' --task-data-dir defaults to runs/task_data, relative: in a job, Ray's temporary copy of the
    checkout (without runs/). Not refused (the nodes may set $RAYCHAT_TASK_DATA, a missing file of eval is
    'n/a: no data'): `raychat submit` prints where the job will look and how to point it at shared storage."""
    args = build_parser("submit").parse_args(["submit", *argv])
    stage = next(a for a in argv if a in STAGES)
    assert args.stage_notes == ([TASK_DATA_NOTE.format(stage=stage, **note)] if note else [])


def test_a_submitted_stages_valid_arguments_and_help_pass_unchanged(capsys):
    assert main(["k8s", "submit", "--dry-run", "pretrain", "--", "--depth", "3", "--help"]) == 0
    assert "entrypoint: python jobs/pretrain.py --depth 3 --help" in capsys.readouterr().out
    assert (
        main(["k8s", "submit", "--dry-run", "data", "prepare", "--num-shards", "2", "--storage-path", ROOT])
        == 0
    )
    assert (
        f"entrypoint: python jobs/data.py prepare --num-shards 2 --storage-path {ROOT}"
        in capsys.readouterr().out
    )
    # a preset file is the cluster's: read by the job, not here
    assert (
        main(
            ["k8s", "submit", "--dry-run", "sft", "--preset", "/mnt/presets/my.yaml", "--init-from", "latest"]
        )
        == 0
    )
    assert (
        "entrypoint: python jobs/sft.py --preset /mnt/presets/my.yaml --init-from latest"
        in capsys.readouterr().out
    )
    for (
        stage_args
    ) in (  # outputs every node reaches (test_a_submitted_stage_with_a_relative_storage_path_...)
        ["pretrain", "--preset", "tiny", "--storage-path", ROOT],
        # a total batch every world size of the run divides (as the invalid ones above: 2 x 768 = 1536)
        [
            "pretrain",
            "--preset",
            "tiny",
            "--storage-path",
            ROOT,
            "--num-workers",
            "3",
            "--min-workers",
            "2",
            "--total-batch-size",
            "1536",
        ],
        [
            "sft",
            "--preset",
            "tiny",
            "--storage-path",
            ROOT,
            "--init-from",
            "latest",
            "--num-workers",
            "8",
            "--total-batch-size",
            "-1",
        ],  # automatic: rounded to a multiple by the run's plan
        ["rl", "--storage-path", "s3://bucket/runs"],
        ["data", "prepare", "--out", "/mnt/shards"],  # data's --out replaces its --storage-path
        [
            "sft",
            "--preset",
            "cluster",
            "--init-from",
            "latest",
        ],  # the preset's storage_path: /mnt/checkpoints/runs
        ["speedrun", "--out", f"{ROOT}/speedrun"],
        # inputs the job takes (test_a_submitted_stage_with_a_relative_input_path_is_refused): run names, `latest`,
        # absolute paths, ~ and URIs
        ["pretrain", "--storage-path", ROOT, "--data-dir", "shards", "--tokenizer-path", "~/tok"],
        [
            "sft",
            "--preset",
            "cluster",
            "--init-from",
            "pretrain",
            "--sft-data",
            "/mnt/data/mine.jsonl,~/more",
        ],
        ["rl", "--storage-path", ROOT, "--init-from", f"{ROOT}/sft/latest"],
        ["eval", "--storage-path", ROOT, "--checkpoint", "latest"],
        # no --storage-path: the results go beside the checkpoint, an absolute path
        ["eval", "--checkpoint", f"{ROOT}/rl/rl", "--data-dir", f"{ROOT}/data"],
        ["export", "--storage-path", ROOT, "--checkpoint", "gs://bucket/runs/sft"],
        [
            "export",
            "--checkpoint",
            f"{ROOT}/rl/rl",
        ],  # no --storage-path: beside the checkpoint, an absolute path
    ):
        assert main(["k8s", "submit", "--dry-run", *stage_args]) == 0, capsys.readouterr().err
        assert f"entrypoint: python jobs/{stage_args[0]}.py" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["chat", "eval", "export", "serve"])
def test_a_required_flags_help_shows_no_empty_default(command, capsys):
    """`chat --help` showed `--checkpoint ... (required) (default: '')`."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(required)" in text and "(required) (default: '')" not in text


def test_no_help_shows_default_none(capsys):
    """`chat --help` showed `--max-tokens ... not given: 256, or until the context is full (default: None)`, and
    18 other options of data prepare, tokenizer train, chat, serve and export a "(default: None)" that says
    nothing (a user types no None): a None default is left out of every command's and subcommand's --help."""
    for argv in every_help_argv():
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps "(default:" and "None)" apart
        assert text.startswith(f"usage: raychat {argv[0]}") and "(default: None)" not in text, argv


def test_every_option_with_a_default_shows_it_in_help():
    """`serve --help` showed `--host` with no default (127.0.0.1: a newcomer could not tell whether the page is
    reachable from elsewhere), and so did inspect-batch's --vocab-size and k8s submit's --namespace, --ttl and
    --retries: every option whose default is a value (not None, False or '', which mean "not given") shows it,
    whatever the parser (argparse's, or a config flag's "(default: ...)")."""

    def options(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from options(sub)
            elif action.option_strings and action.default not in (None, False, "", argparse.SUPPRESS):
                yield parser.prog, action

    def shows(default: str, text: str) -> bool:  # "(default: 8000)", "(default 1)", "x = ... (default)"
        d = re.escape(default)
        return bool(re.search(rf"\(default:? [`']?{d}[`']?[,;) ]|^{d} = [^;]*\(default\)", text + " "))

    missing = [
        (prog, action.option_strings[0], action.default)
        for name in COMMANDS
        for prog, action in options(build_parser(name))
        if not shows(str(action.default), action.help or "")
    ]
    assert missing == []


def test_every_option_whose_default_is_none_says_what_not_given_means():
    """Each config option that defaults to None (the value its command's --help would show, from the config
    class and the command's own defaults: sft's) says in its help what happens when it is not given, in the
    one phrase "not given: ..."; the list is worked out from the configs, not the parsers."""
    configs = {name: from_dict(cls, defaults) for name, (cls, _, defaults) in STAGE_CONFIGS.items()}
    configs |= {"chat": ChatConfig(), "serve": ServeConfig()}
    with_configs, checked = set(), []
    for name in PARSERS:
        parsers, helps = [build_parser(name)], {}
        while parsers:  # the command's parser and its subcommands'
            p = parsers.pop()
            parsers += [
                c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()
            ]
            helps |= {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
            if any((g.title or "").split(".")[0].endswith("Config") for g in p._action_groups):
                with_configs.add(name)  # it has config flags
        nones = (
            [leaf for leaf, value in to_flat(configs[name]).items() if value is None]
            if name in configs
            else []
        )
        for leaf in nones:
            assert "not given: " in helps[flag_name(leaf)], (name, leaf, helps[flag_name(leaf)])
        checked += [(name, leaf) for leaf in nones]
    assert with_configs == set(configs)  # every command with config flags is checked
    assert ("chat", "max_tokens") in checked and len(checked) == 24, (
        checked
    )  # eval, export: storage_path, run_name


@pytest.mark.parametrize("stage", ["pretrain", "sft", "rl"])
def test_a_run_that_gave_up_ends_in_its_one_line_and_exit_status_1(stage, monkeypatch, capsys):
    """A training run past --max-failures (RunGaveUp, its failure the cause: tests/ray/test_train_ray.py and
    test_rl_faults.py make them) ended `raychat <stage>` and its Ray job (jobs/<stage>.py, whose output is the
    job's logs) in two chained tracebacks; now in the run's one line, exit status 1. RAYCHAT_DEBUG=1 raises it,
    its cause with it."""
    line = f"{stage} run 't' gave up: worker rank 0 was lost (ActorDiedError: The actor died unexpectedly)"

    def gives_up(args):
        try:
            raise ConnectionError("the worker's node went away")
        except ConnectionError as e:
            raise RunGaveUp(line) from e

    module = {"pretrain": "raychat.train.pretrain", "sft": "raychat.train.sft", "rl": "raychat.rl.cli"}[stage]
    monkeypatch.setattr(f"{module}.main", gives_up)
    monkeypatch.setattr(sys, "argv", [f"jobs/{stage}.py", "--run-name", "t"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "jobs" / f"{stage}.py"), run_name="__main__")
    assert e.value.code == 1
    assert capsys.readouterr().err == f"raychat {stage}: error: {line}\n"
    monkeypatch.setenv("RAYCHAT_DEBUG", "1")
    with pytest.raises(RunGaveUp) as raised:
        main([stage, "--run-name", "t"])
    assert isinstance(raised.value.__cause__, ConnectionError)


@pytest.mark.parametrize(
    "argv, prog, extra",
    [
        (["pretrain", "--nosuch"], "raychat pretrain", "--nosuch"),
        (["rl", "--num-iterations", "3"], "raychat rl", "--num-iterations 3"),  # pretrain's flag, not rl's
        (["data", "prepare", "--bogus", "1"], "raychat data prepare", "--bogus 1"),
        (["jobs", "list", "--nosuch"], "raychat jobs list", "--nosuch"),
    ],
)
def test_an_unknown_flag_is_refused_by_its_commands_parser(argv, prog, extra, capsys):
    """It read `raychat: error: unrecognized arguments: --nosuch (`raychat --help` lists the flags)`, whose
    --help lists the commands, not the flags."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"{prog}: error: unrecognized arguments: {extra} (`{prog} --help` lists the flags)\n"
    )


def _parser_tree(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every (sub)command parser below it."""
    return [parser, *(p for sub in subcommands(parser).values() for p in _parser_tree(sub))]


def test_every_parser_takes_whole_flag_names_only():
    """argparse's default reads a prefix of a flag as that flag (`--num-it 3` as --num-iterations 3), so a flag
    added later with that prefix would change what a command line meant, or make it ambiguous."""
    parsers = [p for command in [None, *COMMANDS] for p in _parser_tree(build_parser(command))]
    assert len(parsers) > len(COMMANDS) + 1  # the subcommands' parsers too (data prepare, jobs stop, ...)
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize(
    "argv, prog, extra",
    [
        # was --num-iterations 3; num-it is 0.6 from num-iterations, below did_you_mean's cutoff
        (["pretrain", "--num-it", "3"], "raychat pretrain", "--num-it 3"),
        (
            ["serve", "--checkp", "runs/sft"],
            "raychat serve",
            "--checkp runs/sft (did you mean --checkpoint?)",
        ),
        (
            ["data", "prepare", "--num-sh", "2"],
            "raychat data prepare",
            "--num-sh 2 (did you mean --num-shards?)",
        ),
        (
            ["jobs", "stop", "raysubmit_1", "--addr=http://h:8265"],
            "raychat jobs stop",
            "--addr=http://h:8265",
        ),
    ],
)
def test_an_abbreviated_flag_is_refused_by_its_commands_parser(argv, prog, extra, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"{prog}: error: unrecognized arguments: {extra} (`{prog} --help` lists the flags)\n"
    )


@pytest.mark.parametrize("submit", [["submit"], ["k8s", "submit", "--dry-run"]])
def test_a_submitted_stages_abbreviated_flag_is_refused_before_submission(submit, capsys):
    with pytest.raises(SystemExit) as e:
        main([*submit, "pretrain", "--storage-path", ROOT, "--num-it", "3"])
    assert e.value.code == 2
    prog = "raychat " + " ".join(submit[:2])
    assert capsys.readouterr().err == (
        f"{prog}: error: stage pretrain: unrecognized arguments: --num-it 3 (`raychat pretrain --help` lists "
        "its flags)\n"
    )


def test_speedrun_help_offers_no_preset_none_which_it_refuses(capsys):
    """`raychat speedrun --help` offered "'none' = no preset", which speedrun refuses (every stage needs one)."""
    with pytest.raises(SystemExit):
        main(["speedrun", "--help"])
    assert "'none'" not in capsys.readouterr().out
    assert main(["speedrun", "--preset", "none"]) == 2
    assert (
        "--preset: no preset 'none'; known presets: ['cluster', 'cpu', 'gpu8', 'tiny']"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "'none' = no preset" in capsys.readouterr().out

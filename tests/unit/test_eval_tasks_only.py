"""`raychat eval` of a chat checkpoint without the pretraining data: --eval-tokens 0 measures no BPB (val_bpb null,
val_bpb_note says why) and never reads --data-dir; BPB asked for without the data names --data-dir and the way to
skip it."""

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file
from support.core_fixtures import write_bundle
from support.serve_helpers import write_tiny_checkpoint

from raychat import checkpoint_manager
from raychat.checkpoint_manager import commit_directory, output_place
from raychat.cli import main as raychat_main
from raychat.data.corpus.shards import write_manifest, write_shards
from raychat.eval import cli as eval_cli
from raychat.storage import open_storage, upload_dir


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A storage root with one SFT checkpoint and nothing else: no data, no tokenizer, no CORE bundle."""
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tmp_path / "task_data"))  # the default CORE bundle: none
    write_tiny_checkpoint(tmp_path / "runs" / "sft" / "checkpoint_000001", stage="sft")
    return tmp_path / "runs"


GSM8K_ITEM = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}) + "\n"


def _listing(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _fails_in_one_line(argv: list[str], capsys) -> str:
    rc = raychat_main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and not out, out + err
    assert not ray.is_initialized()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_eval_tokens_0_scores_the_tasks_of_a_checkpoint_without_pretraining_data(root, tmp_path, capsys):
    """Before, --eval-tokens 0 was refused ('must be a positive integer') and any other value needed prepared
    shards at --data-dir: a user with only an SFT or RL checkpoint could not score task accuracy."""
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--data-dir", str(tmp_path / "nowhere"),
            "--tasks", "calculator:2", "--eval-tokens", "0"]  # fmt: skip
    assert raychat_main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert {k: result[k] for k in ("val_bpb", "val_bpb_note", "val_tokens", "val_bytes", "val_document_masking")} == {
        "val_bpb": None, "val_bpb_note": "not measured: --eval-tokens 0", "val_tokens": None, "val_bytes": None,
        "val_document_masking": None,
    }  # fmt: skip
    assert result["stage"] == "sft" and result["tasks"]["calculator"]["examples"] == 2
    assert 0 <= result["tasks"]["calculator"]["accuracy"] <= 1
    assert "validation BPB: not measured: --eval-tokens 0" in err.splitlines()
    # --storage-path given, --run-name not: the checkpoint's run and step name the results' directory
    assert json.loads((root / "sft-eval-step1" / "eval.json").read_text()) == result
    assert err.splitlines()[-1] == (
        f"wrote {root}/sft-eval-step1/eval.json and {root}/sft-eval-step1/report_card.md"
    )
    assert not (tmp_path / "nowhere").exists()


def test_each_report_card_line_names_the_checkpoint_and_its_stage(root, capsys):
    """Only SpellingBee has data here (the word list); its line names the SFT checkpoint it scored."""
    argv = [
        "eval",
        "--storage-path",
        str(root),
        "--checkpoint",
        "sft",
        "--tasks",
        "chatcore:1",
        "--eval-tokens",
        "0",
    ]
    assert raychat_main(argv) == 0
    out, err = capsys.readouterr()
    value = json.loads(out)["report_card"]["SpellingBee"]["value"]
    (line,) = [line for line in err.splitlines() if "SpellingBee" in line and "item" in line]
    assert line.startswith(
        f"report card, sft checkpoint {root}/sft/checkpoint_000001: SpellingBee {value:.4f} (1 item, "
    ), line


def test_bpb_without_pretraining_data_names_data_dir_and_how_to_skip_it(root, tmp_path, capsys):
    """Before, the line named --data-dir but not --eval-tokens 0 (which it refused besides)."""
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--data-dir", str(tmp_path / "nowhere"),
            "--tasks", "calculator:2"]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat eval: error: --data-dir: {tmp_path}/nowhere/manifest.json not found: give --data-dir a directory "
        f"`raychat data prepare` wrote, or run `raychat data prepare --out {tmp_path}/nowhere` first (BPB needs the pretraining data's validation shard; --eval-tokens 0 "
        "skips BPB and scores only --tasks and the report card)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _listing(root) == ["sft"]  # nothing written


def test_eval_tokens_0_with_no_task_is_refused(root, capsys):
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--tasks", "", "--eval-tokens", "0"]
    assert _fails_in_one_line(argv, capsys) == (
        "raychat eval: error: --eval-tokens 0 with --tasks '' and no CORE bundle (--core-bundle): nothing to "
        "measure; give --tasks or an --eval-tokens above 0  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _listing(root) == ["sft"]  # nothing written


def test_eval_tokens_0_refuses_a_model_with_nan_weights_before_the_tasks(root, capsys):
    """Without the BPB pass, which refused it before, a diverged checkpoint would fail in the tasks' sampling."""
    ckpt = root / "sft" / "checkpoint_000001"
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"][0, 0] = float("nan")
    save_file(weights, ckpt / "model.safetensors")
    (ckpt / "commit.json").unlink()
    commit_directory(ckpt, 1, "sft")
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--tasks", "calculator:2",
            "--eval-tokens", "0"]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        f"raychat eval: error: --checkpoint {ckpt}: the model's weights are not finite (NaN or inf, e.g. a "
        "diverged run); nothing evaluated or written  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert (
        _listing(root) == ["sft"]
        and torch.isnan(load_file(ckpt / "model.safetensors")["lm_head.weight"]).any()
    )


def test_the_core_bundle_is_found_under_the_task_data_dir_given(root, tmp_path, capsys):
    """--core-bundle '' reads <task data dir>/eval_bundle; before, the task data dir of --task-data-dir was left
    out of that lookup (only $RAYCHAT_TASK_DATA / runs/task_data were looked in): 'n/a: no data', and with
    --tasks '' --eval-tokens 0 a refusal saying there was no CORE bundle."""
    items = [{"context": "1 + 1 =", "continuation": " 2"}, {"context": "2 + 2 =", "continuation": " 4"}]
    write_bundle(tmp_path / "mine" / "eval_bundle", {"lm": {"type": "language_modeling", "items": items}})
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--task-data-dir", str(tmp_path / "mine"),
            "--tasks", "", "--eval-tokens", "0"]  # fmt: skip
    assert raychat_main(argv) == 0, capsys.readouterr().err
    core = json.loads(capsys.readouterr().out)["report_card"]["CORE"]
    assert core["examples"] == 2 and core["note"] is None
    assert core["value"] in (0.0, 0.5, 1.0)  # one language-modeling task of 2 items, random baseline 0


def test_eval_json_records_its_settings_standard_errors_and_time_and_the_card_names_the_checkpoint(
    root, tmp_path, capsys
):
    """Two evaluations of one checkpoint (another --seed, --max-tokens, tasks) wrote files that differed only
    in their scores: nothing said which flags made which, nor when; report_card.md named the stage alone, so
    the cards of two RL checkpoints read the same; a score came without its standard error (lm_eval's
    acc_stderr)."""
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "latest", "--tasks", "calculator:3",
            "--eval-tokens", "0", "--seed", "7", "--max-tokens", "8", "--run-name", "seed7"]  # fmt: skip
    before = datetime.now(timezone.utc).replace(microsecond=0)
    assert raychat_main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    calculator = result["tasks"]["calculator"]
    p, se = calculator["accuracy"], math.sqrt(calculator["accuracy"] * (1 - calculator["accuracy"]) / 2)
    assert calculator == {"accuracy": p, "stderr": pytest.approx(se), "examples": 3, "max_tokens": 8}
    (line,) = [line for line in err.splitlines() if line.startswith("eval, ")]  # each --tasks score on stderr
    assert line.startswith(
        f"eval, sft checkpoint {root}/sft/checkpoint_000001: calculator {p:.4f} ± {se:.4f} (3 items, "
    )
    assert result["settings"] == {
        "checkpoint": "latest", "storage_path": str(root), "run_name": "seed7", "data_dir": str(root / "data"),
        "eval_tokens": 0, "tasks": "calculator:3", "task_data_dir": str(tmp_path / "task_data"), "core_bundle": "",
        "core_max_per_task": -1, "device_batch_size": 8, "max_tokens": 8, "samples": 1, "temperature": 0.0, "device": "cpu", "seed": 7,
    }  # fmt: skip
    assert before <= datetime.fromisoformat(result["finished_at"]) <= datetime.now(timezone.utc)
    card = (root / "seed7" / "report_card.md").read_text().splitlines()  # its meta says step 0
    assert card[-1] == (
        f"checkpoint {root}/sft/checkpoint_000001 (sft, step 0), evaluated {result['finished_at']}"
    )
    # the same run name again replaces these results: stderr says whose, before the evaluation runs
    assert raychat_main([*argv[:-6], "--seed", "8", "--run-name", "seed7"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == (
        f"eval: replacing {root}/seed7's results (sft checkpoint {root}/sft/checkpoint_000001, "
        f"{result['finished_at']}); give another --run-name to keep both"
    )
    assert json.loads((root / "seed7" / "eval.json").read_text())["settings"]["seed"] == 8


def test_bpb_without_data_under_a_speedruns_checkpoints_names_the_data_beside_them(root, tmp_path, capsys):
    """After `raychat speedrun --out X`, `raychat eval --storage-path X/checkpoints` looked for X/checkpoints/data
    and told the user to prepare data there; the speedrun's shards are in X/data."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")  # the hint only looks for the manifest
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--tasks", "calculator:2"]
    assert _fails_in_one_line(argv, capsys).endswith(
        f"--eval-tokens 0 skips BPB and scores only --tasks and the report card; the speedrun's data beside "
        f"--storage-path is {tmp_path}/data: --data-dir {tmp_path}/data)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert _listing(root) == ["sft"]  # nothing written


def test_the_data_hint_names_storage_path_only_when_it_was_given(tmp_path, monkeypatch):
    """The hint said "beside --storage-path" of the default root runs/checkpoints too, which no flag named."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "runs" / "data"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text("{}")  # the hint only looks for the manifest
    checkpoint, elsewhere = str(tmp_path / "ck" / "checkpoint_000001"), str(tmp_path / "other")
    given = f"{tmp_path}/runs/checkpoints"
    assert eval_cli.speedrun_data_hint(open_storage(given), checkpoint, elsewhere, given) == (
        f"; the speedrun's data beside --storage-path is {data}: --data-dir {data}"
    )
    default = open_storage("runs/checkpoints")  # what eval looks in without --storage-path
    assert eval_cli.speedrun_data_hint(default, checkpoint, elsewhere, None) == (
        f"; the data beside runs/checkpoints (the storage root: --storage-path not given) is {data}: "
        f"--data-dir {data}"
    )
    assert eval_cli.speedrun_data_hint(default, checkpoint, str(data), None) == ""  # --data-dir is that data


def test_a_data_dir_given_beside_the_speedrun_above_the_checkpoint_is_refused_naming_its_data(
    tmp_path, capsys, monkeypatch
):
    """A --data-dir given wins over the data of the speedrun that made the checkpoint (runs-tiny/data); given
    without shards, the error names that data."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tmp_path / "task_data"))
    write_tiny_checkpoint(tmp_path / "runs-tiny" / "rl" / "rl" / "checkpoint_000001", stage="rl")
    data = tmp_path / "runs-tiny" / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")  # the hint only looks for the manifest
    argv = ["eval", "--checkpoint", "runs-tiny/rl/rl", "--data-dir", "runs/data", "--tasks", "calculator:2"]
    assert _fails_in_one_line(argv, capsys).endswith(
        f"--eval-tokens 0 skips BPB and scores only --tasks and the report card; the checkpoint's speedrun "
        f"(--out {tmp_path}/runs-tiny) has its data in {data}: --data-dir {data})  (RAYCHAT_DEBUG=1 shows the "
        "traceback)"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "checkpoint, out",
    [
        ("/x/runs-tiny/rl/rl/checkpoint_000001", "/x/runs-tiny"),
        ("/x/runs-tiny/checkpoints/sft/checkpoint_000002", "/x/runs-tiny"),
        ("/x/runs/sft/checkpoint_000001", None),  # a run under another storage root
        ("/x/runs-tiny/rl/rl/served/checkpoint_000001-0123456789ab", None),  # a served snapshot
        ("/x/runs-tiny/rl/rl/copy", None),  # a checkpoint directory of another name
        ("s3://bucket/runs-tiny/rl/rl/checkpoint_000001", None),  # no local data beside it
    ],
)
def test_a_speedruns_out_is_found_from_its_checkpoints_path_only(checkpoint, out):
    assert eval_cli.speedrun_out(checkpoint) == (out and Path(out))


def _speedrun_data(directory, text: str) -> None:
    """Prepared shards at `directory` (2: train, val) of eight copies of `text`, as `raychat data prepare`."""
    entries = write_shards([text * 40] * 8, directory, 2, log=lambda *_: None)
    write_manifest(directory, {"source": "test", "shards": entries})


def test_an_eval_of_a_speedruns_checkpoint_reads_its_data_and_task_data_unless_a_flag_names_others(
    tmp_path, capsys, monkeypatch
):
    """After the README's `raychat speedrun --preset tiny --out runs-tiny`, `raychat eval --checkpoint
    runs-tiny/rl/rl` read runs/data and runs/task_data, and was refused until --data-dir runs-tiny/data was
    given. Not given, both are now the speedrun's, each named on stderr; a flag (or $RAYCHAT_TASK_DATA) still
    wins."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYCHAT_TASK_DATA", raising=False)
    out = tmp_path / "runs-tiny"
    write_tiny_checkpoint(out / "rl" / "rl" / "checkpoint_000001", max_seq_len=32, stage="rl")
    _speedrun_data(out / "data", "the json module encodes objects. ")
    _speedrun_data(tmp_path / "other", "textwrap fills paragraphs of text. ")
    for tasks in (out / "task_data", tmp_path / "other_tasks"):  # one gsm8k test item each
        (tasks / "gsm8k" / "main").mkdir(parents=True)
        (tasks / "gsm8k" / "main" / "test.jsonl").write_text(GSM8K_ITEM)
    flags = ["--tasks", "gsm8k:1", "--max-tokens", "2", "--eval-tokens", "64"]

    def evaluate(*argv: str) -> tuple[dict, list[str]]:
        assert raychat_main(["eval", "--checkpoint", "runs-tiny/rl/rl", *flags, *argv]) == 0
        stdout, stderr = capsys.readouterr()
        return json.loads(stdout), stderr.splitlines()

    followed, err = evaluate()
    assert err[:2] == [
        f"data: {out}/data (the speedrun's, beside the checkpoint; --data-dir to choose another)",
        f"task data: {out}/task_data (the speedrun's, beside the checkpoint; --task-data-dir to choose another)",
    ]
    settings = followed["settings"]
    assert (settings["data_dir"], settings["task_data_dir"]) == (str(out / "data"), str(out / "task_data"))
    assert followed["tasks"]["gsm8k"]["examples"] == 1  # read from runs-tiny/task_data: runs/ holds none
    assert followed["val_tokens"] == 64  # 2 rows of T = 32 targets
    assert f"bytes of {out}/data/shard_00001.parquet)" in err[-2]
    assert not (tmp_path / "runs").exists()
    # the same data given as flags: the same BPB, and no line says where the inputs came from
    given, err = evaluate(
        "--data-dir", "runs-tiny/data", "--task-data-dir", "runs-tiny/task_data", "--run-name", "g"
    )
    assert given["val_bpb"] == followed["val_bpb"] and given["val_bytes"] == followed["val_bytes"]
    assert not [line for line in err if "the speedrun's" in line]
    # other data given: those are read
    other, err = evaluate("--data-dir", "other", "--task-data-dir", "other_tasks", "--run-name", "o")
    assert (other["settings"]["data_dir"], other["settings"]["task_data_dir"]) == (
        "other",
        str(tmp_path / "other_tasks"),
    )
    assert other["val_bpb"] != followed["val_bpb"]
    assert f"bytes of {tmp_path}/other/shard_00001.parquet)" in err[-2]
    assert not [line for line in err if "the speedrun's" in line]
    # $RAYCHAT_TASK_DATA names the task data as --task-data-dir does; --eval-tokens 0 reads no data
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tmp_path / "other_tasks"))
    env, err = evaluate("--eval-tokens", "0", "--run-name", "e")
    assert env["settings"]["task_data_dir"] == str(tmp_path / "other_tasks")
    assert (env["settings"]["data_dir"], env["val_bpb"]) == ("runs/data", None)
    assert not [line for line in err if "the speedrun's" in line]


def test_an_eval_writes_beside_its_checkpoints_run_and_keeps_each_checkpoints_results(
    tmp_path, capsys, monkeypatch
):
    """The README's tiny run: `raychat eval --checkpoint runs-tiny/rl/rl` wrote runs/checkpoints/eval/eval.json,
    making the runs/ the README says to keep the tiny run out of, and every eval replaced the last one's files
    unless --run-name was given. Not given, --storage-path and --run-name are now the checkpoint's: the run's
    root and <run>-eval-step<step>; given, each decides alone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tmp_path / "task_data"))
    out = tmp_path / "runs-tiny"
    for ckpt, stage in [("rl/rl/checkpoint_000001", "rl"), ("rl/rl/checkpoint_000002", "rl"),
                        ("checkpoints/sft/checkpoint_000003", "sft")]:  # fmt: skip
        write_tiny_checkpoint(out / ckpt, stage=stage)
    flags = ["--tasks", "calculator:1", "--eval-tokens", "0"]

    def evaluate(*argv: str) -> tuple[dict, list[str]]:
        assert raychat_main(["eval", *argv, *flags]) == 0
        stdout, stderr = capsys.readouterr()
        return json.loads(stdout), stderr.splitlines()

    first, err = evaluate("--checkpoint", "runs-tiny/rl/rl/checkpoint_000001")
    place = out / "rl" / "rl-eval-step1"
    assert err[-1] == f"wrote {place}/eval.json and {place}/report_card.md"
    assert json.loads((place / "eval.json").read_text()) == first
    assert first["checkpoint"] == f"{out}/rl/rl/checkpoint_000001" and first["settings"]["run_name"] is None
    assert _listing(tmp_path) == ["runs-tiny"]  # no runs/
    newest, err = evaluate("--checkpoint", "runs-tiny/rl/rl")  # the run: its newest checkpoint, step 2
    assert err[-1] == f"wrote {out}/rl/rl-eval-step2/eval.json and {out}/rl/rl-eval-step2/report_card.md"
    assert not any(line.startswith("eval: replacing") for line in err)
    assert json.loads((place / "eval.json").read_text()) == first  # the first is kept
    evaluate("--checkpoint", "runs-tiny/checkpoints/sft")
    assert _listing(out / "rl") == ["rl", "rl-eval-step1", "rl-eval-step2"]
    assert _listing(out / "checkpoints") == ["sft", "sft-eval-step3"]
    # the same checkpoint again replaces its own results, and says so first
    again, err = evaluate("--checkpoint", "runs-tiny/rl/rl")
    assert err[0] == (
        f"eval: replacing {out}/rl/rl-eval-step2's results (rl checkpoint {out}/rl/rl/checkpoint_000002, "
        f"{newest['finished_at']}); give another --run-name to keep both"
    )
    # --run-name alone: beside the run under that name; --storage-path alone: there, under the derived name
    evaluate("--checkpoint", "runs-tiny/rl/rl", "--run-name", "mine")
    assert (out / "rl" / "mine" / "eval.json").is_file()
    _, err = evaluate("--checkpoint", "runs-tiny/rl/rl", "--storage-path", "evals")
    assert err[-1] == (
        f"wrote {tmp_path}/evals/rl-eval-step2/eval.json and {tmp_path}/evals/rl-eval-step2/report_card.md"
    )
    assert _listing(tmp_path) == ["evals", "runs-tiny"] and _listing(tmp_path / "evals") == ["rl-eval-step2"]


def test_an_eval_of_a_checkpoint_on_s3_writes_beside_its_run_there(s3_env, tmp_path, capsys, monkeypatch):
    """Not given --storage-path, the results of a remote checkpoint go beside its run on the same storage
    (s3:// stays s3://, nothing written here but the checkpoint's cached copy); output_place never goes above
    a bucket, and names a copied checkpoint directory's results after it."""
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tmp_path / "task_data"))
    monkeypatch.setattr(checkpoint_manager, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    bucket, fs = s3_env.make_bucket(), s3_env.filesystem()
    local = write_tiny_checkpoint(tmp_path / "ckpt", stage="rl")
    upload_dir(
        local, open_storage(f"s3://{bucket}/runs"), f"{bucket}/runs/rl/rl50/checkpoint_000050", "commit.json"
    )
    assert raychat_main(["eval", "--checkpoint", f"s3://{bucket}/runs/rl/rl50", "--tasks", "calculator:1",
                         "--eval-tokens", "0"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    place = f"s3://{bucket}/runs/rl/rl50-eval-step50"
    assert err.splitlines()[-1] == f"wrote {place}/eval.json and {place}/report_card.md"
    assert json.loads(
        fs.open_input_stream(f"{bucket}/runs/rl/rl50-eval-step50/eval.json").read()
    ) == json.loads(out)
    assert _listing(tmp_path) == ["cache", "ckpt"]
    storage, name, _ = output_place(f"s3://{bucket}/rl/checkpoint_000001", None, None, "eval")
    assert (storage.uri, name) == (f"s3://{bucket}", "rl-eval-step1")
    storage, name, _ = output_place(f"{tmp_path}/my model", None, None, "eval")  # a checkpoint dir of its own
    assert (storage.uri, name) == (str(tmp_path), "my_model-eval")
    with pytest.raises(ValueError) as e:
        output_place(f"s3://{bucket}/checkpoint_000001", None, None, "eval")
    assert str(e.value) == (
        f"--storage-path: not given, and s3://{bucket}/checkpoint_000001 lies at the top of its bucket, with no "
        "directory beside its run for the output: give --storage-path"
    )


def test_sampled_pass_at_k_is_recorded_per_task_and_stays_off_the_greedy_report_card(root, capsys):
    """nanochat's chat_eval and lm_eval's generate tasks sample k completions for pass@k; eval was greedy only.
    The arithmetic: tests/unit/test_report_card.py::test_pass_at_k_of_sampled_completions_by_hand."""
    argv = ["eval", "--storage-path", str(root), "--checkpoint", "sft", "--tasks", "calculator:2,spelling:2",
            "--eval-tokens", "0", "--samples", "3"]  # fmt: skip
    assert _fails_in_one_line(argv, capsys) == (
        "raychat eval: error: --samples 3 needs a --temperature above 0: greedy decoding writes the same completion "
        "every time (e.g. --temperature 0.8; or --samples 1)  (RAYCHAT_DEBUG=1 shows the traceback)"
    )
    assert raychat_main([*argv, "--temperature", "0.7"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    for name in ("calculator", "spelling"):
        entry = result["tasks"][name]
        passes = entry.pop("pass@k")
        assert list(passes) == ["pass@1", "pass@2", "pass@3"] and list(passes.values()) == sorted(
            passes.values()
        )
        assert entry == {"accuracy": passes["pass@1"], "stderr": entry["stderr"], "examples": 2, "max_tokens": 128,
                         "samples": 3, "temperature": 0.7}  # fmt: skip
        assert f"  {name} at temperature 0.7, 3 samples an item: pass@1 {passes['pass@1']:.4f}, " in err
    card = result["report_card"]  # greedy: SpellingBee's sampled score is not its value, and says so
    spelling, gsm8k = card["SpellingBee"], card["GSM8K"]  # GSM8K: not named in --tasks
    assert (spelling["note"], spelling["value"], gsm8k["note"]) == ("n/a: sampled", None, "-")
    row = "| sft | n/a: no data | - | - | - | - | - | n/a: sampled | n/a: needs all six |"
    assert row in err.splitlines()
    assert (result["settings"]["samples"], result["settings"]["temperature"]) == (3, 0.7)

"""The speedrun refuses a bad preset before its first stage (raychat.speedrun.check_stages, check_roots): each
check was made only when its stage started, after data preparation and tokenizer training (minutes to hours)
had run; its line names the preset's keys, and nothing is written under --out."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import ray
import yaml
from support.serve_helpers import tiny_model_and_tokenizer, write_tiny_checkpoint

from raychat.checkpoint import save_model
from raychat.config import ConfigError, RLConfig, SpeedrunConfig, from_dict, to_dict
from raychat.data.corpus.prepare import validation_warnings
from raychat.data.corpus.shards import write_shards
from raychat.speedrun import (
    SPEEDRUN_SHARD_OPTIONS,
    check_stages,
    named_by_keys,
    next_steps,
    report_card,
    run_rl_stage,
    run_speedrun,
    speedrun_flags,
    stage_keys,
)
from raychat.tasks.hub_data import TASK_DATA_ENV
from raychat.train.layout import local_cores

TINY = yaml.safe_load((files("raychat") / "presets" / "tiny.yaml").read_text())


def _preset(tmp_path, **sections) -> str:
    """The tiny preset with each of `sections`' values over its section's; returns its path."""
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump({k: {**v, **sections.get(k, {})} for k, v in TINY.items()}))
    return str(path)


def _gsm8k_missing(data: str, key: str) -> str:
    """raychat.tasks.hub_data.split_files' line for gsm8k's train split missing under `data`, its directory
    option named `key`."""
    return (
        f"task 'gsm8k' (train split): no data file at {data}/gsm8k/main/train-*.parquet or "
        f"{data}/openai--gsm8k/main/train/*.parquet (download: hf download openai/gsm8k --repo-type "
        f"dataset --local-dir {data}/gsm8k; the directory: {key} or $RAYCHAT_TASK_DATA)"
    )


@pytest.mark.parametrize(
    "sections, line",
    [
        (  # was refused only as pretraining planned, after the data and tokenizer stages
            {"train": {"total_batch_size": 500}},
            "train.total_batch_size 500 is not a multiple of train.device_batch_size x train.seq_len x "
            "train.num_workers = 4 x 64 x 2 = 512; allowed: a multiple of 512, e.g. 512",
        ),
        (  # elastic 2..3 workers: 768 = 4 x 64 x 3 but not a multiple of 4 x 64 x 2 (was found after Ray started);
            # both divide 4 x 64 x lcm(2, 3) = 1536
            {"train": {"num_workers": 3, "min_workers": 2, "total_batch_size": 768}},
            "train.total_batch_size 768 is not a multiple of train.device_batch_size x train.seq_len x workers "
            "(train.min_workers..train.num_workers) = 4 x 64 x 2 = 512; allowed: a multiple of 1536, e.g. 1536",
        ),
        (  # was refused as SFT planned, after pretraining had trained
            {"sft": {"total_batch_size": 1000}},
            "sft.total_batch_size 1000 is not a multiple of train.device_batch_size x train.seq_len x "
            "train.num_workers = 4 x 64 x 2 = 512; allowed: a multiple of 512, e.g. 512 or 1024",
        ),
        (  # RL's actors cut every completion at the SFT checkpoint's max_seq_len (train.seq_len) without a word
            {"rl": {"max_tokens": 64}},
            "rl.max_tokens 64: RL starts from the SFT checkpoint, whose max_seq_len is train.seq_len 64, which must "
            "hold prompt and completion; allowed: 1..63 (at most 64 less the longest rl.task calculator prompt's "
            "tokens: checked as RL starts)",
        ),
        (  # the pretraining checkpoint SFT starts from has max_seq_len train.seq_len
            {"sft": {"seq_len": 128, "total_batch_size": 1024}},
            "sft.seq_len 128: the pretraining checkpoint (train.seq_len) has max_seq_len 64 (its checkpoints keep "
            "it: serving and evaluation stop there); allowed: 1..64",
        ),
    ],
)
def test_batch_and_sequence_arithmetic_is_refused_before_the_first_stage(sections, line, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, **sections), str(out))
    assert str(e.value) == line
    assert not out.exists() and "===" not in capsys.readouterr().out


def test_an_unknown_key_of_the_sft_section_is_named_as_the_sft_sections(tmp_path):
    """Naming the refusal's flags by the preset's keys read the sft section again and raised its own error
    there, calling the section TrainConfig's ("unknown TrainConfig settings ['bogus_key']")."""
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        run_speedrun(_preset(tmp_path, sft={"bogus_key": 1}), str(out))
    assert str(e.value).startswith("unknown sft settings ['bogus_key']; allowed: ['allow_rewarm', ")
    assert not out.exists()


def test_missing_task_files_of_sft_and_rl_are_refused_before_the_first_stage(tmp_path):
    """SFT's mixture checked its hub tasks' files as SFT started (after pretraining); RL's task had no such
    check in the speedrun at all (its make_task failed as RL started)."""
    data, out = tmp_path / "task_data", tmp_path / "out"
    data.mkdir()
    sft = {"sft_tasks": "calculator:200,gsm8k:10", "task_data_dir": str(data)}
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, sft=sft), str(out))
    assert str(e.value) == f"sft.sft_tasks: {_gsm8k_missing(data, 'sft.task_data_dir')}"
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, rl={"task": "gsm8k", "task_data_dir": str(data)}), str(out))
    assert str(e.value) == f"rl.task: {_gsm8k_missing(data, 'rl.task_data_dir')}"
    assert not out.exists()


def test_the_task_data_directory_is_under_out_unless_the_preset_or_the_environment_names_one(
    tmp_path, monkeypatch, capsys
):
    """`raychat speedrun --out X` read the hub tasks' files from runs/task_data of the current directory, and
    named that directory in its download commands, while all else it reads and writes is under X. Its default is
    now X/task_data (for SFT, RL and the report card); a preset's own, else $RAYCHAT_TASK_DATA, wins over it."""
    monkeypatch.delenv(TASK_DATA_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # the old default: tmp_path/runs/task_data
    out = tmp_path / "elsewhere" / "out"
    data = out / "task_data"
    config = SpeedrunConfig.from_preset("tiny", str(out))
    assert (config.sft.data.task_data_dir, config.rl.task.task_data_dir) == (str(data), str(data))
    mixture = {"sft_tasks": "calculator:200,gsm8k:10"}
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, sft=mixture), str(out))
    assert str(e.value) == f"sft.sft_tasks: {_gsm8k_missing(data, 'train.task_data_dir')}"
    assert not out.exists()
    # the report card's lines on the chat evals without data name the downloads into X/task_data
    base = write_tiny_checkpoint(tmp_path / "base" / "checkpoint_000001")
    sft = write_tiny_checkpoint(tmp_path / "sft" / "checkpoint_000001", stage="sft")
    report = {"checkpoint": str(base), "sft": {"checkpoint": str(sft)}, "timings_s": {}}
    card = report_card(config, report, {})
    assert card["rows"]["sft"]["GSM8K"]["note"] == "n/a: no data"
    printed = capsys.readouterr().out.splitlines()
    assert f"  GSM8K: hf download openai/gsm8k --repo-type dataset --local-dir {data}/gsm8k" in printed
    # $RAYCHAT_TASK_DATA names the directory ('' = hub_data's default: the variable)
    monkeypatch.setenv(TASK_DATA_ENV, str(tmp_path / "env"))
    config = SpeedrunConfig.from_preset("tiny", str(out))
    assert (config.sft.data.task_data_dir, config.rl.task.task_data_dir) == ("", "")
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, sft=mixture), str(out))
    assert str(e.value) == f"sft.sft_tasks: {_gsm8k_missing(tmp_path / 'env', 'train.task_data_dir')}"
    # a preset's own: SFT's from its train section (or its sft section), RL's from its rl section
    mine = {"task_data_dir": str(tmp_path / "mine")}
    config = SpeedrunConfig.from_preset(_preset(tmp_path, train=mine, rl=mine), str(out))
    assert (config.sft.data.task_data_dir, config.rl.task.task_data_dir) == (mine["task_data_dir"],) * 2


def test_a_bad_record_of_a_hub_task_is_refused_before_the_first_stage(tmp_path):
    """A hub task's records were read as its stage built the task: SFT's mixture in the workers (after
    pretraining, and after Ray and the worker group started), RL's task as RL started, the report card's chat
    evals at the very end. Where the files are here, every record is checked before the first stage; the
    report card's files that are missing stay "n/a: no data" (test_the_shipped_cpu_presets_pass_the_checks)."""
    data, out = tmp_path / "task_data", tmp_path / "out"
    gsm8k, humaneval = data / "gsm8k" / "main", data / "openai_humaneval" / "openai_humaneval"
    gsm8k.mkdir(parents=True)
    humaneval.mkdir(parents=True)
    good = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}) + "\n"
    bad = json.dumps({"question": "What is 2 + 3?", "answer": "five"}) + "\n"
    (gsm8k / "train.jsonl").write_text(good + bad + good)
    (gsm8k / "test.jsonl").write_text(good)
    sft = {"sft_tasks": "calculator:200,gsm8k:10", "task_data_dir": str(data)}
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, sft=sft), str(out))
    assert str(e.value) == (
        f"sft.sft_tasks: {gsm8k}/train.jsonl line 2: answer has no final '#### <number>' (1 of 3 records is bad)"
    )
    (gsm8k / "train.jsonl").write_text(good)
    (gsm8k / "test.jsonl").write_text(bad + good)
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, rl={"task": "gsm8k", "task_data_dir": str(data)}), str(out))
    assert str(e.value) == (
        f"rl.task: {gsm8k}/test.jsonl line 1: answer has no final '#### <number>' (1 of 2 records is bad)"
    )
    (gsm8k / "test.jsonl").write_text(good)
    row = {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
           "test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}  # fmt: skip
    (humaneval / "test.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "prompt": None}) + "\n")
    with pytest.raises(ValueError) as e:  # the report card's HumanEval, though no stage trains on it
        run_speedrun(_preset(tmp_path, sft={"task_data_dir": str(data)}), str(out))
    assert str(e.value) == (
        f"report card: {humaneval}/test.jsonl line 2: prompt must be a string, got null (1 of 2 records is bad)"
    )
    assert not out.exists() and not ray.is_initialized()


def test_more_rl_prompts_a_step_than_the_tasks_train_split_is_refused_before_the_first_stage(tmp_path):
    """raychat rl refuses it as the run is built; the speedrun checked it only as its RL stage started, after
    pretraining and SFT had trained."""
    data, out = tmp_path / "task_data", tmp_path / "out"
    gsm8k = data / "gsm8k" / "main"
    gsm8k.mkdir(parents=True)
    good = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}) + "\n"
    (gsm8k / "train.jsonl").write_text(good)
    (gsm8k / "test.jsonl").write_text(good)
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, rl={"task": "gsm8k", "task_data_dir": str(data)}), str(out))
    assert str(e.value) == (
        "rl.prompts_per_step 2 exceeds the 1 problem of rl.task gsm8k's train split: a step's prompts would "
        "repeat (one prompt in several groups); lower rl.prompts_per_step to at most 1"
    )
    assert not out.exists() and not ray.is_initialized()


def test_a_layout_the_local_cluster_cannot_hold_is_refused_before_the_first_stage(tmp_path, monkeypatch):
    """On the local cluster a speedrun starts (no RAY_ADDRESS), SFT's workers and RL's actors were checked as
    their stage started, an hour into a cpu run."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out, cpus = tmp_path / "out", local_cores() + 1
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, sft={"num_workers": 1, "cpus_per_worker": 99}), str(out))
    assert (
        str(e.value)
        == f"sft.num_workers 1 x sft.cpus_per_worker 99: one worker needs 99 CPUs, the largest node has {cpus}"
    )
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path, rl={"rollout_workers": 2, "cpus_per_rollout": 99}), str(out))
    assert str(e.value) == (
        "rl.rollout_workers 2 x rl.cpus_per_rollout 99: one of them needs {CPU: 99}; no node type has room: CPU "
        f"(need 99, the most a node has is {cpus}); largest node type: this machine {{CPU: {cpus}}}"
    )
    assert not out.exists()


def test_a_storage_root_that_cannot_be_written_is_refused_before_the_first_stage(tmp_path, capsys):
    """RL's root (<out>/rl) was never checked in the speedrun: its first checkpoint failed, after every other
    stage. The file in its way is left as it was, and the speedrun's lease released."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "rl").write_text("mine")
    with pytest.raises(ValueError) as e:
        run_speedrun(_preset(tmp_path), str(out))
    assert str(e.value) == f"--out: {out}/rl is not writable: it is a file, not a directory"
    assert (
        sorted(p.name for p in out.rglob("*") if p.is_file()) == ["rl"] and (out / "rl").read_text() == "mine"
    )
    assert "===" not in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["tiny", "cpu"])
def test_the_shipped_cpu_presets_pass_the_checks(preset, tmp_path, monkeypatch):
    """Their SFT and RL tasks need no hub data; the layout is checked on the cluster of RAY_ADDRESS (not here)."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    check_stages(SpeedrunConfig.from_preset(preset, str(tmp_path / "out")), preset)
    assert not (tmp_path / "out").exists()


def test_a_stage_line_about_the_checkpoint_it_starts_from_names_that_checkpoint_once():
    """The speedrun names --init-from as the checkpoint a stage starts from; a line that said "the --init-from
    checkpoint X" read "the the pretraining checkpoint checkpoint X"."""
    seq_len = (
        "--seq-len 512: the --init-from checkpoint /c/checkpoint_000005 has max_seq_len 256 (its checkpoints keep "
        "it: serving and evaluation stop there); allowed: 1..256"
    )
    assert str(named_by_keys(ConfigError(seq_len), "tiny", "sft")) == (
        "train.seq_len 512: the pretraining checkpoint /c/checkpoint_000005 has max_seq_len 256 (its checkpoints "
        "keep it: serving and evaluation stop there); allowed: 1..256"
    )
    depth = ConfigError("--depth: the --init-from checkpoint /c has 2, given 7")
    assert str(named_by_keys(depth, "tiny", "rl")) == "--depth: the SFT checkpoint /c has 2, given 7"


def _rl_stage(tmp_path, sft, max_tokens: int) -> tuple[dict, str]:
    """The tiny preset's RL stage with rl.max_tokens `max_tokens`, from the SFT checkpoint `sft`, after the checks
    before the first stage, run as _run_stages runs it (its ConfigErrors naming the preset's keys: stage_keys);
    its (figures, final checkpoint)."""
    preset = _preset(tmp_path, rl={"max_tokens": max_tokens})
    config = SpeedrunConfig.from_preset(preset, str(tmp_path / "out"))
    check_stages(config, preset)
    with stage_keys(preset, "rl"):
        return run_rl_stage(config.rl, str(sft), config.pretrain, speedrun_flags(preset, "rl"), preset)


def test_the_rl_stage_checks_max_tokens_after_the_longest_prompt_before_its_actors(tmp_path, monkeypatch):
    """`raychat rl` refuses a max_tokens that does not fit after the task's longest prompt within its
    --init-from's max_seq_len; the speedrun's RL stage did not (its rollouts were cut short without a word, and a
    prompt that filled max_seq_len failed in an actor). rl.max_tokens 48 passes the check before the first stage
    (below train.seq_len 64), but the tiny preset's longest calculator prompt has 23 tokens (this tokenizer, as
    tests/unit/test_bad_input.py's `raychat rl` finds), so 41 is the most: refused as the stage starts, naming the
    preset's keys, before its lease, Ray or any file under --out."""
    sft = write_tiny_checkpoint(tmp_path / "sft" / "checkpoint_000001", max_seq_len=64, stage="sft")
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ConfigError) as e:
        _rl_stage(tmp_path, sft, 48)
    assert str(e.value) == (
        f"rl.max_tokens 48: the longest rl.task calculator prompt has 23 tokens and the SFT checkpoint {sft} has "
        "max_seq_len 64, which must hold prompt and completion; allowed: 1..41"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(
        pytest.fail.Exception, match="Ray started"
    ):  # 23 + 41 tokens fill max_seq_len: on to Ray
        _rl_stage(tmp_path, sft, 41)


def test_the_rl_stage_names_the_settings_it_resumes_with_by_the_presets_keys(tmp_path, monkeypatch, capsys):
    """A speedrun run again with another rl.max_tokens resumed its RL run's steps with it without a word, as
    `raychat rl` did (tests/unit/test_bad_input.py): the stage says so in one line, naming the preset's key."""
    sft = write_tiny_checkpoint(tmp_path / "sft" / "checkpoint_000001", max_seq_len=64, stage="sft")
    made = SpeedrunConfig.from_preset(
        _preset(tmp_path), str(tmp_path / "out")
    ).rl  # rl.max_tokens 8, rl.steps 1
    rl = tmp_path / "out" / "rl" / "rl" / "checkpoint_000001"
    config = to_dict(from_dict(RLConfig, {"init_from": str(sft)}, base=made))
    save_model(
        rl,
        *tiny_model_and_tokenizer(),
        {"step": 1, "stage": "rl", "version": 1, "config": config},
        commit=True,
    )
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    capsys.readouterr()
    (rl.parent / "metrics.jsonl").write_text('{"step": 0, "eval": {"step": 0, "pass@1": 0.5}}\n')
    figures, final = _rl_stage(
        tmp_path, sft, 6
    )  # at its 1 step: finished (no Ray), nothing resumed, so no line
    assert capsys.readouterr().out.startswith("finished: ")
    # its summary's evals are read back from metrics.jsonl; already_complete, not an empty list, says so
    assert (figures["summary"], final) == (f"already complete ({rl})", str(rl))
    assert figures["evals"] == [{"step": 0, "pass@1": 0.5}]
    preset = _preset(tmp_path, rl={"max_tokens": 6, "steps": 2})
    config = SpeedrunConfig.from_preset(preset, str(tmp_path / "out"))
    with stage_keys(preset, "rl"), pytest.raises(pytest.fail.Exception, match="Ray started"):
        run_rl_stage(config.rl, str(sft), config.pretrain, speedrun_flags(preset, "rl"), preset)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"resuming with other settings than the run's checkpoint {rl} was made with: rl.max_tokens 8 -> 6; the "
        "steps after 1 use this run's"
    )


def test_the_closing_lines_name_raychat_as_the_user_ran_it(tmp_path, monkeypatch):
    """The README's quick start runs `.venv/bin/raychat speedrun --preset tiny --out runs-tiny` without activating
    the venv; the speedrun ended with `chat with it:  raychat chat --checkpoint ...`, which such a shell answers
    with "raychat: command not found". The closing lines now name the script as typed unless PATH's raychat is it."""
    script = tmp_path / ".venv" / "bin" / "raychat"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    final = "/w/runs-tiny/rl/rl/checkpoint_000001"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [".venv/bin/raychat", "speedrun", "--preset", "tiny"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert next_steps(final) == [
        f"chat with it:  .venv/bin/raychat chat --checkpoint {final}",
        f"serve it:      .venv/bin/raychat serve --checkpoint {final}   -> chat page at http://127.0.0.1:8000/",
    ]
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # an activated venv
    assert next_steps(final)[0] == f"chat with it:  raychat chat --checkpoint {final}"
    monkeypatch.setattr("sys.argv", ["/opt/job/driver.py"])  # not its script (a Ray job's entrypoint)
    assert next_steps(final)[1].startswith("serve it:      raychat serve --checkpoint ")


def test_the_speedruns_validation_share_warning_names_its_preset_keys(tmp_path):
    """The tiny preset's 2 train shards hold out a third of the corpus, and its data stage warned to give
    --num-shards or --rows-per-shard, which the speedrun does not take: it names data.num_shards and
    data.rows_per_shard (prepare(shard_options=SPEEDRUN_SHARD_OPTIONS)), as its other lines name the preset's keys."""
    entries = write_shards([f"doc {i:02d}" for i in range(30)], tmp_path / "data", 3, log=lambda *_: None)
    assert validation_warnings(entries, SPEEDRUN_SHARD_OPTIONS)[0] == (
        "warning: the validation shard shard_00002.parquet holds 10 of 30 documents (33%) and 60 bytes of 180 "
        "bytes of text (33%), held out of training: more shards (data.num_shards, or a smaller "
        "data.rows_per_shard) hold out less"
    )
    assert validation_warnings(entries)[0].endswith(
        "more shards (--num-shards, or a smaller --rows-per-shard) hold out less"
    )  # raychat data prepare's own


def test_the_sft_stage_names_its_keys_as_the_preset_read_once_set_them(tmp_path):
    """The speedrun read its preset file again as each stage started (speedrun_flags, and stage_keys on a
    refusal): a preset edited or deleted while pretraining trained failed SFT on a file the run no longer
    needed. SpeedrunConfig.sft_keys holds what SFT's lines need, the sft section's keys (nested ones too)."""
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump({**TINY, "sft": {**TINY["sft"], "optim": {"matrix_lr": 0.01}}}))
    config = SpeedrunConfig.from_preset(str(path), str(tmp_path / "out"))
    assert config.sft_keys == {"num_iterations", "sft_tasks", "eval_examples", "matrix_lr"}
    path.unlink()
    option = speedrun_flags(str(path), "sft", config.sft_keys).option
    assert (option("matrix_lr"), option("depth")) == ("sft.matrix_lr", "train.depth")
    with pytest.raises(ConfigError) as e, stage_keys(str(path), "sft", sft_keys=config.sft_keys):
        raise ConfigError("--matrix-lr must be > 0, got -1")
    assert str(e.value) == "sft.matrix_lr must be > 0, got -1"

"""The speedrun report of a resumed run: each stage's wall time and figures come from the invocation that ran
it (the run's report state, stages.json), reused stages are marked, a replaced output is not reported with the
old figures. The report is assembled from hand-written stage results; no stage runs."""

import json
import math
import os

import pytest

from raychat.checkpoint_manager import commit_directory, read_commit
from raychat.cli import main as raychat_main
from raychat.config import SpeedrunConfig, TrainConfig, from_dict
from raychat.metrics_sink import read_jsonl
from raychat.report import STATE_FILE, plot_stage, read_state, reward_band, settle_stage, write_report
from raychat.speedrun import accuracy_task, newest_commit, stage_started

TOKENIZER = {"vocab_size": 4096, "version": "abc", "train_seconds": 28.5, "val_bytes_per_token": 4.321}
RL = {"summary": "20 steps, pass@1 on 64 held-out problems 0.125 -> 0.250, learner wait 0.10, 70 s",
      "pass@1_before": 0.125, "pass@1_after": 0.25}  # fmt: skip
SFT = {"step": 30, "val_bpb": 1.5, "accuracy_before": 0.0, "accuracy_after": 0.5, "eval_examples": 64}
PRETRAIN = {"step": 600, "loss": 3.25, "val_bpb": 1.75, "tokens_per_s": 15000.0, "data_wait_frac": 0.01}
PRESETS = ("tiny", "cpu", "gpu8", "cluster")
OUTPUTS = {"data": "m1", "tokenizer": "t1", "pretrain": "c600", "sft": "c30", "rl": "c20"}


def invocation(out, walls: dict, figures: dict, ran: bool, outputs=OUTPUTS) -> dict:
    """One invocation's report: every stage settled (ran or reused) with its wall time and figures."""
    report = {"preset": "cpu", "timings_s": {}}
    state = read_state(out)
    for stage in ("data", "tokenizer", "pretrain", "sft", "rl"):
        report[stage] = settle_stage(
            report, state, out, stage, walls[stage], figures[stage], outputs[stage], ran
        )
    report["timings_s"] |= {"eval": 5.0, "report_card": 3.0, "invocation": sum(walls.values()) + 8.0}
    return report | {"unigram_bpb": 2.5, "checkpoint": "/runs/checkpoints/base/checkpoint_000600"}


def table(out, report) -> dict:
    write_report(out, report)
    rows = [
        line.split(" | ", 1) for line in (out / "report.md").read_text().splitlines() if line.startswith("| ")
    ]
    return {k.removeprefix("| "): v.removesuffix(" |") for k, v in rows}


def test_a_resumed_run_reports_the_figures_of_the_invocation_that_ran_each_stage(tmp_path):
    data = {"source": "corpus", "license": "CC", "documents": 300, "bytes": 2_000_000}
    ran = {"data": data, "tokenizer": TOKENIZER, "pretrain": PRETRAIN, "sft": SFT, "rl": RL}
    first = invocation(tmp_path, {"data": 12.0, "tokenizer": 30.4, "pretrain": 412.0, "sft": 60.0, "rl": 70.0},
                       ran, ran=True)  # fmt: skip
    assert first["reused"] == [] and first["timings_s"]["pretrain"] == 412.0
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["tokenizer"] == {"output": "t1", "wall_s": 30.4, "figures": TOKENIZER}

    # the second invocation finds every stage done: it measures next to nothing and knows little
    seen = {"data": data, "tokenizer": {"vocab_size": 4096}, "pretrain": PRETRAIN, "sft": SFT,
            "rl": {"summary": "already complete (/runs/rl/rl/checkpoint_000020)"}}  # fmt: skip
    again = invocation(tmp_path, {"data": 0.01, "tokenizer": 0.2, "pretrain": 35.0, "sft": 20.0, "rl": 9.0},
                       seen, ran=False)  # fmt: skip
    assert again["reused"] == ["data", "tokenizer", "pretrain", "sft", "rl"]
    assert again["tokenizer"] == TOKENIZER and again["rl"] == RL
    rows = table(tmp_path, again)
    assert rows["tokenizer"] == "vocab 4096, 4.321 bytes/token (val)"
    assert rows["wall time"] == ("592 s (data 12 reused, tokenizer 30 reused, pretrain 412 reused, eval 5, "
                                 "sft 60 reused, rl 70 reused, report card 3); this invocation 72 s")  # fmt: skip
    assert rows["RL"] == RL["summary"]
    # each label names its stage and what it counts: "| steps | 600 |" said neither (PRETRAIN's figures: the
    # final checkpoint's metrics, step = optimizer steps done, the whole plan's in a speedrun)
    assert {k: rows[k] for k in list(rows)[3:8]} == {
        "pretrain optimizer steps": "600", "pretrain train loss (last step)": "3.2500",
        "pretrain validation BPB (last step)": "1.7500", "unigram baseline BPB": "2.5000",
        "pretrain tokens/s (last step, all workers)": "15,000",
    }  # fmt: skip
    assert rows["pretrain data wait (last step)"] == "1.0%"
    assert rows["pretrain checkpoint"] == "`/runs/checkpoints/base/checkpoint_000600`"
    assert rows["SFT optimizer steps"] == "30 (val BPB on held-out conversations of its tasks 1.5000)"
    assert rows["reused stages"].startswith(
        "data, tokenizer, pretrain, sft, rl (made by an earlier invocation"
    )
    assert read_state(tmp_path) == saved  # reusing records nothing


def test_a_replaced_output_is_not_reported_with_the_old_figures(tmp_path):
    report = {"timings_s": {}}
    state = read_state(tmp_path)
    assert state == {}
    settle_stage(report, state, tmp_path, "tokenizer", 30.4, TOKENIZER, "t1", True)
    # the tokenizer was retrained by hand since: the speedrun reuses it, but its record is of another file
    later = {"timings_s": {}}
    figures = settle_stage(
        later, read_state(tmp_path), tmp_path, "tokenizer", 0.2, {"vocab_size": 512}, "t2", False
    )
    assert figures == {"vocab_size": 512} and later["timings_s"]["tokenizer"] is None
    assert later["reused"] == ["tokenizer"]
    (tmp_path / STATE_FILE).write_text("{not json")  # a damaged state costs the records, not the run
    assert read_state(tmp_path) == {}


def test_newest_commit_changes_only_when_a_stage_commits_a_checkpoint(tmp_path):
    assert newest_commit(str(tmp_path), "base") is None  # no run yet
    for step in (2, 4):
        (tmp_path / f"base/checkpoint_00000{step}").mkdir(parents=True)
        (tmp_path / f"base/checkpoint_00000{step}/model.safetensors").write_bytes(bytes([step]))
    commit_directory(tmp_path / "base/checkpoint_000002", 2, "pretrain")
    two = newest_commit(str(tmp_path), "base")
    assert two is not None and newest_commit(str(tmp_path), "base") == two  # nothing trained: the same
    commit_directory(tmp_path / "base/checkpoint_000004", 4, "pretrain")
    assert newest_commit(str(tmp_path), "base") not in (None, two)


def _final_checkpoint(root, step: int, metrics: dict) -> float:
    """Commit <root>/base/checkpoint_<step> holding meta.json of `metrics`; returns its committed_at."""
    d = root / f"base/checkpoint_{step:06d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step, "metrics": metrics}))
    commit_directory(d, step, "pretrain")
    return read_commit(d)["committed_at"]


def test_a_speedrun_stopped_after_pretrainings_final_commit_reports_it_on_the_rerun(tmp_path):
    """A speedrun interrupted after pretraining committed its final checkpoint, before the stage's record was
    written, was reported by the rerun (which reuses that checkpoint) as "pretrain n/a reused". The stage's start
    is in stages.json: the rerun records the stage from it and the final checkpoint (its commit time, its
    metrics), so it reports the wall time up to that commit (412 s) and the checkpoint's figures."""
    out, root = tmp_path / "out", tmp_path / "checkpoints"
    out.mkdir()
    state = read_state(out)
    with stage_started(state, out, "pretrain", str(root), "base") as before:  # the first invocation
        assert before is None
    started = read_state(out)["pretrain"]["started"]
    figures = PRETRAIN | {"samples": ["once upon"]}
    committed_at = _final_checkpoint(root, 600, figures)
    started["at"] = committed_at - 412.0  # the stage started 412 s before its final commit
    (out / STATE_FILE).write_text(json.dumps({"pretrain": {"started": started}}))  # then Ctrl-C

    report = {"timings_s": {}}
    state = read_state(out)
    with stage_started(state, out, "pretrain", str(root), "base") as before:  # the rerun
        assert before == newest_commit(str(root), "base")
    assert read_state(out)["pretrain"] | {"started": None} == {
        "output": before,
        "wall_s": pytest.approx(412.0),
        "figures": PRETRAIN,
        "started": None,
    }
    # pretrain() finds the run finished: the same checkpoint, reused
    assert settle_stage(report, state, out, "pretrain", 0.3, PRETRAIN, before, False) == PRETRAIN
    assert report["reused"] == ["pretrain"] and report["timings_s"]["pretrain"] == pytest.approx(412.0)

    again = read_state(out)  # a third invocation: the record stays, its start (from this output) is not used
    with stage_started(again, out, "pretrain", str(root), "base") as same:
        assert same == before
    assert read_state(out)["pretrain"]["wall_s"] == pytest.approx(412.0)


def test_a_stage_stopped_before_its_final_commit_counts_only_the_rerun(tmp_path):
    """Started from checkpoint 300 and stopped before committing another: the rerun records nothing for it
    (the start was from the checkpoint the rerun finds), nor for a start after the newest commit; a stage that
    raises having committed nothing (a refusal) leaves stages.json as it was."""
    out, root = tmp_path / "out", tmp_path / "checkpoints"
    out.mkdir()
    committed_at = _final_checkpoint(root, 300, PRETRAIN)
    for _ in range(2):
        with stage_started(read_state(out), out, "pretrain", str(root), "base"):
            pass
    assert set(read_state(out)["pretrain"]) == {"started"}
    (out / STATE_FILE).write_text(
        json.dumps({"pretrain": {"started": {"from": None, "at": committed_at + 5}}})
    )
    with stage_started(read_state(out), out, "pretrain", str(root), "base"):
        pass
    assert set(read_state(out)["pretrain"]) == {"started"}
    saved = (out / STATE_FILE).read_bytes()
    with (
        pytest.raises(ValueError, match="refused"),
        stage_started(read_state(out), out, "pretrain", str(root), "base"),
    ):
        raise ValueError("refused")
    assert (out / STATE_FILE).read_bytes() == saved
    (out / STATE_FILE).unlink()
    with pytest.raises(ValueError, match="refused"), stage_started({}, out, "pretrain", str(root), "base"):
        raise ValueError("refused")
    assert not (out / STATE_FILE).exists()


def test_the_accuracy_before_and_after_sft_is_of_the_mixtures_first_graded_task(tmp_path):
    """run_sft_stage read calculator_accuracy whatever the mixture: gpu8 and cluster train SFT on nanochat's
    mixture (smoltalk, mmlu, gsm8k, spelling), which has no calculator, and the speedrun failed with a KeyError
    after SFT had trained. The figure is now the first graded task's, and the report's row names it; a mixture
    with no graded task reports no accuracy."""
    tasks = {p: accuracy_task(SpeedrunConfig.from_preset(p, str(tmp_path)).sft) for p in PRESETS}
    assert tasks == {"tiny": "calculator", "cpu": "calculator", "gpu8": "mmlu", "cluster": "mmlu"}
    assert (
        accuracy_task(from_dict(TrainConfig, {"sft_tasks": "smoltalk,chatterbot,spelling:10"})) == "spelling"
    )
    assert accuracy_task(from_dict(TrainConfig, {"sft_tasks": "smoltalk,chatterbot"})) is None
    sft = {**SFT, "accuracy_task": "mmlu", "accuracy_before": 0.25, "accuracy_after": 0.375}
    data = {"source": "corpus", "license": "CC", "documents": 300, "bytes": 2_000_000}
    walls = {"data": 1.0, "tokenizer": 2.0, "pretrain": 3.0, "sft": 4.0, "rl": 5.0}
    figures = {"data": data, "tokenizer": TOKENIZER, "pretrain": PRETRAIN, "sft": sft, "rl": RL}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    rows = table(tmp_path / "a", invocation(tmp_path / "a", walls, figures, ran=True))
    assert rows["mmlu accuracy before / after SFT"] == "0.250 / 0.375 (64 held-out problems)"
    no_task = {k: v for k, v in SFT.items() if not k.startswith("accuracy")}
    rows = table(tmp_path / "b", invocation(tmp_path / "b", walls, figures | {"sft": no_task}, ran=True))
    assert not any("accuracy" in k for k in rows) and rows["SFT optimizer steps"].startswith("30 ")


def test_the_curves_of_a_run_of_ones_own(tmp_path, capsys):
    """Only the speedrun drew curves: `raychat report RUN_DIR ...` draws a pretrain run's, 10 x 3.6 inches at
    110 dpi (plot_stage): a PNG of 1100 x 396 pixels; a directory without steps (no metrics.jsonl, or one whose
    lines hold no step: a torn first line) is named on stderr, exit 2, and the others are drawn."""
    run, torn = tmp_path / "mine", tmp_path / "torn"
    run.mkdir(), torn.mkdir()
    rows = [{"step": s, "loss": 6.0 - s, "smooth_loss": 6.0 - s / 2} for s in (1, 2, 3)]
    rows[-1]["val_bpb"] = 3.1
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (torn / "metrics.jsonl").write_text('{"step": 1, "lo')
    assert raychat_main(["report", str(tmp_path / "none"), str(run), str(torn)]) == 2
    out, err = capsys.readouterr()
    assert out == f"wrote {run}/curves.png (3 steps, 1..3)\n"
    assert err == (
        f"raychat report: error: {tmp_path}/none/metrics.jsonl is not there (give a pretrain, sft or rl run "
        "directory)\n"
        f"raychat report: error: {torn}/metrics.jsonl holds no step yet\n"
    )
    png = (run / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1100, 396)
    assert not (torn / "curves.png").exists()
    assert raychat_main(["report", str(run)]) == 0


def test_report_of_a_speedrun_out_names_its_run_directories(tmp_path, capsys):
    """`raychat report runs-tiny` (a speedrun's --out, not a run directory) said only that runs-tiny/metrics.jsonl
    is not there: the error now names the run directories under it, as the speedrun lays them out; and a run of
    one step is "1 step", not "1 steps"."""
    out_dir = tmp_path / "runs-tiny"
    for run in ("checkpoints/base", "checkpoints/sft", "rl/rl"):
        (out_dir / run).mkdir(parents=True)
        line = {"step": 1, "loss": 0.0, "reward_mean": 0.5} if run == "rl/rl" else {"step": 1, "loss": 5.0}
        (out_dir / run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    (out_dir / "data").mkdir()
    assert raychat_main(["report", str(out_dir), str(out_dir / "rl/rl"), str(out_dir / "data")]) == 2
    out, err = capsys.readouterr()
    assert out == f"wrote {out_dir}/rl/rl/curves.png (1 step, 1..1)\n"
    assert err == (
        f"raychat report: error: {out_dir}/metrics.jsonl is not there (give a pretrain, sft or rl run directory; "
        f"run directories under {out_dir}: {out_dir}/checkpoints/base, {out_dir}/checkpoints/sft, "
        f"{out_dir}/rl/rl)\n"
        f"raychat report: error: {out_dir}/data/metrics.jsonl is not there (give a pretrain, sft or rl run "
        "directory)\n"
    )


def test_a_pretraining_run_named_rl_is_drawn_as_pretraining(tmp_path, capsys):
    """`raychat pretrain --run-name rl` then `raychat report runs/checkpoints/rl` ended in a traceback (KeyError:
    'reward_mean'): the RL panel was chosen by the directory's name. Its lines hold no reward: validation BPB."""
    run = tmp_path / "rl"
    run.mkdir()
    rows = [{"step": 1, "loss": 8.3}, {"step": 2, "loss": 8.1, "val_bpb": 2.3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert raychat_main(["report", str(run)]) == 0
    assert capsys.readouterr() == (f"wrote {run}/curves.png (2 steps, 1..2)\n", "")
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_of_one_step_is_drawn_as_points(tmp_path, monkeypatch):
    """The tiny speedrun's RL has 1 step: its loss and reward panels were empty (a line through one point draws
    nothing). A run of one step marks its points; a longer run's lines have no markers."""
    figures = []
    monkeypatch.setattr("raychat.report.plt.close", figures.append)
    one = [{"step": 1, "loss": 0.0, "reward_mean": 0.0, "eval": {"step": 1, "pass@1": 0.0}}]
    plot_stage("rl", one, tmp_path / "one.png")
    plot_stage("base", [{"step": 1, "loss": 6.0}, {"step": 2, "loss": 5.0}], tmp_path / "two.png")
    (left, right), (left2, _) = figures[0].axes, figures[1].axes
    assert [line.get_marker() for line in left.lines + right.lines] == ["o", "o", "o"]  # loss, reward, pass@1
    assert [line.get_marker() for line in left2.lines] == ["None"]


def test_the_rl_reward_curve_has_a_band_of_one_reward_std(tmp_path, monkeypatch, capsys):
    """RL logs each step's reward_std (population, over its samples) but `raychat report` drew the mean alone:
    the band mean +- std is drawn where the lines have it. Hand-written metrics.jsonl: the baseline, step 1 of an
    older raychat (no reward_std: no band there), step 2 mean 0.5 std 0.25 (0.25..0.75), step 3 mean 0.75 std
    0.125 (0.625..0.875); a run of older lines only is drawn as before; a run of one step gets an error bar."""
    figures = []
    monkeypatch.setattr("raychat.report.plt.close", figures.append)
    rows = [{"step": 0, "eval": {"step": 0, "pass@1": 0.0}}, {"step": 1, "loss": 0.1, "reward_mean": 0.25},
            {"step": 2, "loss": 0.0, "reward_mean": 0.5, "reward_std": 0.25},
            {"step": 3, "loss": -0.1, "reward_mean": 0.75, "reward_std": 0.125}]  # fmt: skip
    older = [rows[0], rows[1], {k: v for k, v in rows[2].items() if k != "reward_std"}]
    runs = {"new": rows, "old": older, "one": [rows[0], rows[2] | {"step": 1}]}
    for name, lines in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        assert raychat_main(["report", str(tmp_path / name)]) == 0
    assert capsys.readouterr().out.count("curves.png") == 3
    new, old, one = (fig.axes[1] for fig in figures)
    band = reward_band(read_jsonl(tmp_path / "new" / "metrics.jsonl")[1:])
    assert band[0] == [1, 2, 3] and band[1][1:] == [0.25, 0.625] and band[2][1:] == [0.75, 0.875]
    assert math.isnan(band[1][0]) and math.isnan(band[2][0])
    (drawn,) = new.collections
    assert drawn.get_label() == "reward ± std"
    assert {tuple(v) for v in drawn.get_paths()[0].vertices} == {(2, 0.25), (3, 0.625), (3, 0.875), (2, 0.75)}
    assert reward_band(older[1:]) is None and len(old.collections) == 0
    assert [line.get_label() for line in old.lines] == ["rollout reward (mean)", "held-out pass@1"]
    (bars,) = one.collections  # step 1: 0.5 +- 0.25
    assert bars.get_segments()[0].tolist() == [[1, 0.25], [1, 0.75]]
    assert [c.get_label() for c in one.containers] == ["reward ± std"]


def test_report_without_a_run_directory_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        raychat_main(["report"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "raychat report: error: the following arguments are required: RUN_DIR (`raychat report --help` lists "
        "the flags)\n"
    )


def test_report_of_a_uri_or_a_file_says_what_it_reads(tmp_path, capsys):
    """`raychat report s3://bucket/runs/r` (a run of --storage-path s3://bucket/runs) read s3:/bucket/runs/r, a
    local path, and said its metrics.jsonl "is not there"; a file given as RUN_DIR was a directory with no
    metrics.jsonl. Each is named as what it is, with how to report it; the other directories are drawn."""
    run = tmp_path / "mine"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "afile").write_text("x")
    assert raychat_main(["report", "s3://bucket/runs/r", str(tmp_path / "afile"), str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == f"wrote {run}/curves.png (1 step, 1..1)\n"
    assert err == (
        "raychat report: error: s3://bucket/runs/r is a URI: raychat report reads a run directory on a local or "
        "mounted filesystem; copy it here first (aws s3 cp --recursive s3://bucket/runs/r ./r), then raychat "
        "report r\n"
        f"raychat report: error: {tmp_path}/afile is a file, not a run directory (give a pretrain, sft or rl run "
        "directory)\n"
    )


def test_report_skips_a_line_that_is_json_but_no_object(tmp_path, capsys):
    """A metrics.jsonl line that parses but is no object (a hand-edited file: `5`, `[1, 2]`, `"x"`) ended the
    report in a traceback (AttributeError: 'int' object has no attribute 'get'); it is skipped as a torn line
    is."""
    run = tmp_path / "mine"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n5\n[1, 2]\n"x"\n{"step": 2, "loss": 1.5}\n')
    assert raychat_main(["report", str(run)]) == 0
    assert capsys.readouterr().out == f"wrote {run}/curves.png (2 steps, 1..2)\n"


def test_a_run_directory_whose_curves_cannot_be_written_is_named_and_the_others_are_drawn(tmp_path, capsys):
    """A RUN_DIR where curves.png cannot be written (here a directory of that name; a read-only mount alike)
    ended the command at that directory, the ones after it not drawn: it is an error line naming the file, and
    the others are drawn."""
    stuck, run = tmp_path / "stuck", tmp_path / "mine"
    for d in (stuck, run):
        d.mkdir()
        (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (stuck / "curves.png").mkdir()
    assert raychat_main(["report", str(stuck), str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == f"wrote {run}/curves.png (1 step, 1..1)\n"
    assert err.startswith(
        f"raychat report: error: {stuck}/curves.png cannot be written: [Errno 21] Is a directory"
    )
    assert err.count("\n") == 1 and (stuck / "curves.png").is_dir() and os.listdir(stuck / "curves.png") == []
    assert sorted(os.listdir(stuck)) == ["curves.png", "metrics.jsonl"]  # no temporary file left

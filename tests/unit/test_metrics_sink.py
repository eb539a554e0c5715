"""The metrics sink every stage logs to: jsonl lines, the gauges callback, TensorBoard event files and W&B
offline runs read back through their own libraries; the report's curves as PNG."""

from __future__ import annotations

import errno
import json
import resource
import signal
import time

import pytest
from PIL import Image

from raychat import metrics_sink
from raychat.metrics_sink import MetricsSink, read_jsonl, scalars
from raychat.report import plot_stage

STEPS = [
    {"step": 1, "loss": 3.5, "lr": 0.02, "mfu": None, "ok": True},
    {"step": 2, "loss": 3.25, "lr": 0.02, "mfu": None, "val_bpb": 1.5, "eval": {"pass@1": 0.25}},
]


def test_scalars_flatten_and_skip_non_numbers():
    assert scalars(STEPS[1]) == {"step": 2.0, "loss": 3.25, "lr": 0.02, "val_bpb": 1.5, "eval/pass@1": 0.25}


def test_jsonl_and_gauges_get_every_step(tmp_path):
    seen = []
    sink = MetricsSink(tmp_path / "run", gauges=seen.append)
    for s in STEPS:
        sink.log(s)
    sink.close()
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == STEPS and seen == STEPS
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a torn last line (crash while appending) is skipped
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2
    with open(tmp_path / "run" / "metrics.jsonl", "ab") as f:
        f.write(b'\n{"step": 3, "loss": \xe2\x82\n{"step": 4, "loss": 1.0}\n')  # damaged bytes: not UTF-8
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == [*STEPS, {"step": 4, "loss": 1.0}]
    with pytest.raises(ValueError, match=r"--tracker must be one of \['none', 'tensorboard', 'wandb'\]"):
        MetricsSink(tmp_path, tracker="mlflow")


def test_object_storage_gets_metrics_jsonl_and_a_resumed_run_keeps_each_step_once(s3_env, monkeypatch):
    """A run on s3:// had no metrics.jsonl at all (only a local run directory got one). The sink PUTs the whole
    file (object storage cannot append): at flush(), which the stages call before each checkpoint commit, at
    close(), and at most FLUSH_EVERY_S after a line. A run started again reads the stored lines and drops those
    after the checkpoint it resumes from; lines logged after the last flush of a killed run are lost, but they
    were after its last commit and are logged anew."""
    bucket = s3_env.make_bucket()
    fs, run = s3_env.filesystem(), f"s3://{bucket}/runs/pre"

    def stored():
        with fs.open_input_stream(f"{bucket}/runs/pre/metrics.jsonl") as f:
            return [json.loads(line) for line in f.read().decode().splitlines()]

    sink = MetricsSink(run)
    sink.log(STEPS[0])
    sink.flush()  # checkpoint 1 is about to be committed
    assert stored() == STEPS[:1]
    sink.log(STEPS[1])
    sink.log({"step": 3, "loss": 3.0})  # killed here: steps 2 and 3 were never stored
    assert stored() == STEPS[:1] and sink.path is None

    again = MetricsSink(run)  # the same run started again resumes from checkpoint 1
    assert again.resume_at(1) == 0 and again.logged() == STEPS[:1]  # what RL reads its evaluations back from
    monkeypatch.setattr(metrics_sink, "FLUSH_EVERY_S", 0.0)  # every line is PUT as it comes
    again.log(STEPS[1])
    assert stored() == STEPS
    monkeypatch.setattr(metrics_sink, "FLUSH_EVERY_S", 3600.0)
    again.log({"step": 3, "loss": 2.5})
    assert stored() == STEPS
    again.close()
    assert stored() == [*STEPS, {"step": 3, "loss": 2.5}]

    third = MetricsSink(run)  # a run whose checkpoint 1 is its newest again (the later ones lost): 2 and 3 go
    assert third.resume_at(1) == 2
    third.close()
    assert stored() == STEPS[:1]
    with pytest.raises(
        ValueError, match="--tracker tensorboard writes files: it needs a local --storage-path"
    ):
        MetricsSink(run, tracker="tensorboard")


def test_a_failed_put_is_a_warning_and_the_lines_are_stored_later(s3_env, monkeypatch, capsys):
    """A PUT of metrics.jsonl that fails (here: the bucket is gone for a while), periodic or the flush before a
    checkpoint commit, must not end the run: one warning naming the file, the lines held, and the next PUT
    stores them all."""
    bucket = s3_env.make_bucket()
    fs = s3_env.filesystem(allow_bucket_creation=True, allow_bucket_deletion=True)
    sink = MetricsSink(f"s3://{bucket}/runs/pre")
    fs.delete_dir(bucket)
    monkeypatch.setattr(metrics_sink, "FLUSH_EVERY_S", 0.0)
    sink.log(STEPS[0])
    sink.log(STEPS[1])
    assert sink.flush() is False  # before a checkpoint commit: no traceback, no second warning
    (warned,) = capsys.readouterr().err.splitlines()
    assert warned.startswith(
        f"warning: metrics not written to s3://{bucket}/runs/pre/metrics.jsonl (kept for the next flush): "
    ), warned
    fs.create_dir(bucket)
    sink.log({"step": 3, "loss": 3.0})
    with fs.open_input_stream(f"{bucket}/runs/pre/metrics.jsonl") as f:
        assert [json.loads(line) for line in f.read().decode().splitlines()] == [
            *STEPS,
            {"step": 3, "loss": 3.0},
        ]
    sink.close()
    assert capsys.readouterr().err == ""


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path / "run", tracker="tensorboard", run_name="t", config={"depth": 1})
    for s in STEPS:
        sink.log(s)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "run" / "tracker")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 3.5), (2, 3.25)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/pass@1")] == [(2, 0.25)]
    assert "step" not in acc.Tags()["scalars"] and "ok" not in acc.Tags()["scalars"]


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path / "run", tracker="wandb", run_name="t", config={"depth": 1})
    for s in STEPS:
        sink.log(s)
    sink.close()
    runs = list((tmp_path / "run" / "tracker" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (data,) = runs[0].glob("run-*.wandb")  # the offline run's record log (protobuf), `wandb sync`s later
    wanted = (b"val_bpb", b"eval/pass@1", b"3.25", b"depth")  # history keys, a value, the config
    deadline = time.monotonic() + 60  # the wandb-core process writes the log; on a loaded machine, later
    while not all(text in data.read_bytes() for text in wanted) and time.monotonic() < deadline:
        time.sleep(0.5)
    blob = data.read_bytes()
    assert all(text in blob for text in wanted), [t for t in wanted if t not in blob]


def test_curves_png_per_stage(tmp_path):
    lines = [{"step": i, "loss": 4 - i / 10, "smooth_loss": 4 - i / 20} for i in range(1, 11)]
    lines[4]["val_bpb"], lines[9]["val_bpb"] = 2.0, 1.8
    path = plot_stage("pretrain", lines, tmp_path / "curves_pretrain.png")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (1100, 396)  # 10 x 3.6 inches at 110 dpi
    assert plot_stage("sft", [], tmp_path / "curves_sft.png") is None


def _step_ticks(ax) -> list[float]:
    """The step axis' tick values inside its view (the locator also returns ticks just outside it)."""
    ax.figure.canvas.draw()
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


@pytest.mark.parametrize("stage", ["pretrain", "rl"])
def test_every_step_axis_has_whole_step_ticks(stage, tmp_path, monkeypatch):
    """val_bpb measured once (step 5 of 10) was drawn on an axis ticked 4.74, 4.80, ... 5.22, and a run of one
    step on two such axes (matplotlib's MaxNLocator(integer=True) keeps fractional ticks where its view holds
    fewer than two whole steps)."""
    figures = []
    monkeypatch.setattr("raychat.report.plt.close", figures.append)
    lines = [{"step": i, "loss": 4 - i / 10, "reward_mean": i / 10} for i in range(1, 11)]
    lines[4] |= {"val_bpb": 2.0, "eval": {"step": 5, "pass@1": 0.5}}
    plot_stage(stage, lines, tmp_path / "many.png")
    plot_stage(stage, [{"step": 3, "loss": 2.5, "reward_mean": 0.25, "val_bpb": 1.5}], tmp_path / "one.png")
    many, one = ([_step_ticks(ax) for ax in fig.axes] for fig in figures)
    steps = list(range(1, 11))
    assert many == [steps, [5] if stage == "pretrain" else steps]  # loss; val_bpb once (rl: reward each step)
    assert one == [[3], [3]]  # a run of one step


def test_the_rl_curve_starts_at_the_baseline_evaluation(tmp_path, monkeypatch):
    """An RL run's metrics.jsonl starts with the baseline evaluation's line (step 0, no loss): its pass@1 is the
    curve's first point, not dropped with the lines that have no loss."""
    figures = []
    monkeypatch.setattr("raychat.report.plt.close", figures.append)
    rl = [{"step": 0, "eval": {"step": 0, "pass@1": 0.125}}, {"step": 1, "loss": 0.0, "reward_mean": 0.25},
          {"step": 2, "loss": 0.1, "reward_mean": 0.5, "eval": {"step": 2, "pass@1": 0.5}}]  # fmt: skip
    assert plot_stage("rl", rl, tmp_path / "curves_rl.png").exists()
    (curve,) = [line for line in figures[0].axes[1].lines if line.get_label() == "held-out pass@1"]
    assert (list(curve.get_xdata()), list(curve.get_ydata())) == ([0, 2], [0.125, 0.5])
    assert list(figures[0].axes[0].lines[0].get_xdata()) == [1, 2]  # the loss: of the steps only


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Steps 1-5 logged, the run resumes from checkpoint 3: steps 4 and 5 are trained again and appear once."""
    sink = MetricsSink(tmp_path / "run")
    for step in range(1, 6):
        sink.log({"step": step, "loss": 10.0 - step})
    resumed = MetricsSink(tmp_path / "run")
    assert resumed.resume_at(3) == 2
    assert resumed.logged() == [{"step": step, "loss": 10.0 - step} for step in (1, 2, 3)]
    for step in (4, 5, 6):
        resumed.log({"step": step, "loss": 0.5 * step})
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(x["step"], x["loss"]) for x in lines] == [
        (1, 9.0),
        (2, 8.0),
        (3, 7.0),
        (4, 2.0),
        (5, 2.5),
        (6, 3.0),
    ]
    assert MetricsSink(tmp_path / "run").resume_at(0) == 6  # a run that starts over keeps nothing
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_a_line_torn_by_a_crash_goes_on_resume_and_the_next_step_is_logged_whole(tmp_path):
    """Rank 0 died while appending step 4 (checkpoint 3 committed): the torn line had no newline, so the resumed
    run's step 4 was appended onto it and both read as one bad line: step 4 was missing from metrics.jsonl.
    resume_at drops the torn line too."""
    path = tmp_path / "run" / "metrics.jsonl"
    sink = MetricsSink(tmp_path / "run")
    for step in (1, 2, 3):
        sink.log({"step": step, "loss": 10.0 - step})
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')
    assert MetricsSink(tmp_path / "run").resume_at(3) == 0
    MetricsSink(tmp_path / "run").log({"step": 4, "loss": 1.0})
    assert [(x["step"], x["loss"]) for x in read_jsonl(path)] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 1.0)]
    with open(path, "ab") as f:
        f.write(b'{"step": 5, "loss": \xff}\n')  # a damaged line: a resume read the file as UTF-8 and failed
    assert MetricsSink(tmp_path / "run").resume_at(4) == 0
    assert [x["step"] for x in read_jsonl(path)] == [1, 2, 3, 4] and b"\xff" not in path.read_bytes()


def test_a_failed_local_write_is_one_warning_and_the_lines_are_written_at_the_next_flush(tmp_path, capsys):
    """A training run whose metrics.jsonl could not be written (here: a full disk, the file a link to /dev/full)
    ended in a traceback at the step's log or at the flush before a checkpoint commit. Now: one warning naming
    the file and the error, the step goes on (gauges included), and the lines kept are written once the file
    can be again, in order, each once."""
    path, seen = tmp_path / "run" / "metrics.jsonl", []
    sink = MetricsSink(tmp_path / "run", gauges=seen.append)
    sink.log(STEPS[0])
    path.rename(tmp_path / "aside.jsonl")
    path.symlink_to("/dev/full")
    sink.log(STEPS[1])
    sink.log({"step": 3, "loss": 3.0})
    assert sink.flush() is False  # before a checkpoint commit
    assert capsys.readouterr().err == (
        f"warning: metrics not written to {path} (kept for the next flush): [Errno 28] No space left on device\n"
    )
    assert seen == [*STEPS, {"step": 3, "loss": 3.0}]
    path.unlink()
    (tmp_path / "aside.jsonl").rename(path)
    assert sink.flush() is True
    sink.log({"step": 4, "loss": 2.5})
    assert read_jsonl(path) == [*STEPS, {"step": 3, "loss": 3.0}, {"step": 4, "loss": 2.5}]
    path.unlink()
    path.symlink_to("/dev/full")
    sink.log({"step": 5, "loss": 2.0})
    sink.close()  # the last lines cannot be kept past the end: a warning, not an error
    assert capsys.readouterr().err.splitlines() == [
        f"warning: metrics not written to {path} (kept for the next flush): [Errno 28] No space left on device",
        f"warning: metrics not written to {path} at close (lines lost): [Errno 28] No space left on device",
    ]


def test_a_write_cut_short_leaves_no_torn_line(tmp_path, capsys):
    """A disk that fills midway through an append wrote part of a line: the kept line written again at the next
    flush would follow it, and the two read as one bad line (a step lost). The part is cut off again. A file size
    limit (RLIMIT_FSIZE, SIGXFSZ ignored) 10 bytes past the first line stands in for the disk."""
    path = tmp_path / "run" / "metrics.jsonl"
    sink = MetricsSink(tmp_path / "run")
    sink.log(STEPS[0])
    size = path.stat().st_size
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, limits[1]))
    try:
        sink.log(STEPS[1])
        cut = path.stat().st_size
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert cut == size and capsys.readouterr().err == (
        f"warning: metrics not written to {path} (kept for the next flush): [Errno {errno.EFBIG}] File too large\n"
    )
    sink.log({"step": 3, "loss": 3.0})
    assert read_jsonl(path) == [*STEPS, {"step": 3, "loss": 3.0}]

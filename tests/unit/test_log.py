"""raychat.log: rank 0 only by default, every rank on request, and never through print (Ray Train tees print)."""

import builtins

import pytest

from raychat.log import StepClock, TenthsProgress, duration, log, plural, size


@pytest.mark.parametrize("rank, printed", [(None, "hello\n"), ("0", "hello\n"), ("1", "")])
def test_only_rank_0_logs_by_default(monkeypatch, capsys, rank, printed):
    monkeypatch.delenv("RAYCHAT_LOG_ALL_RANKS", raising=False)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    log("hello")
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("rank", ["0", "3"])
def test_every_rank_logs_when_asked(monkeypatch, capsys, rank):
    monkeypatch.setenv("RAYCHAT_LOG_ALL_RANKS", "1")
    monkeypatch.setenv("RANK", rank)
    log("hello")
    assert capsys.readouterr().out == f"[rank {rank}] hello\n"


def test_a_ray_train_workers_line_is_written_once(monkeypatch, capsys):
    """Ray Train replaces builtins.print on its workers with one that also logs the line to the root logger,
    which the driver shows as a second copy; log writes to sys.stdout itself, so the patched print never runs."""
    teed = []
    monkeypatch.setattr(builtins, "print", lambda *a, **k: teed.append(a))
    monkeypatch.setenv("RANK", "0")
    log("step 1/10")
    assert teed == []
    assert capsys.readouterr().out == "step 1/10\n"


@pytest.mark.parametrize("n, line", [(0, "0 steps"), (1, "1 step"), (2, "2 steps"), (1000, "1,000 steps"),
                                     (18327, "18,327 steps")])  # fmt: skip
def test_plural_counts_with_thousands_separators(n, line):
    assert plural(n, "step") == line


@pytest.mark.parametrize("n, line", [(0.5, "0.5 CPUs"), (1.0, "1 CPU"), (1.75, "1.75 CPUs"), (2.0, "2 CPUs"),
                                     (0.0, "0 CPUs"), (1000.0, "1,000 CPUs")])  # fmt: skip
def test_plural_of_a_float_amount(n, line):
    """The layout line said `1 CPUs` of --cpus-per-worker 1 (a float)."""
    assert plural(n, "CPU") == line


def test_step_clock_leaves_the_cold_first_step_out_of_the_eta():
    """A first step of 10 s (compile, warm-up), then steps of 1 s and 3 s: seconds per step 10, then the mean
    of the warm ones, 1 and 2; the mean since the start (the old ETA) would say 10, 5.5, 4.67."""
    times = iter([100.0, 110.0, 111.0, 114.0])
    clock = StepClock(clock=lambda: next(times))
    assert [clock.tick(), clock.tick(), clock.tick()] == [10.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "seconds, shown",
    [(0, "0s"), (44.6, "45s"), (59.4, "59s"), (60, "1m00s"), (725, "12m05s"), (3599.6, "1h00m"),
     (11_220, "3h07m"), (552_000, "153h20m"), (-3, "0s")],
)  # fmt: skip
def test_an_eta_reads_in_hours_and_minutes(seconds, shown):
    """The step line's ETA was seconds alone: a run of hours read `eta 24513s`."""
    assert duration(seconds) == shown


def test_tenths_progress_is_due_at_each_further_tenth_after_its_quiet_seconds():
    """Made at 100 s, 1,000 units, 5 s quiet: 300 done at 102 s is quiet; 350 at 106 s is the 3rd tenth (eta 6
    s x 650 / 350 = 11.14 s); 380 at 107 s is still the 3rd; 990 at 120 s jumps to the 9th (eta 20 x 10 /
    990); 999 at 130 s is still the 9th. The readings of folders and the held-out evaluations share it."""
    times = iter([100.0, 102.0, 106.0, 107.0, 120.0, 130.0, 131.5])
    pace = TenthsProgress(1_000, 5.0, clock=lambda: next(times))
    due = [pace.due(done) for done in (300, 350, 380, 990, 999)]
    assert due == [None, (6.0, 6.0 * 650 / 350), None, (20.0, 20.0 * 10 / 990), None]
    assert pace.elapsed() == 31.5


@pytest.mark.parametrize(
    "n_bytes, shown",
    [(999, "999 bytes"), (1000, "1.0 kB"), (999_949, "999.9 kB"), (999_950, "1.00 MB"), (999_999, "1.00 MB"),
     (56_004_999, "56.00 MB")],
)  # fmt: skip
def test_a_size_never_reads_1000_kb(n_bytes, shown):
    assert size(n_bytes) == shown

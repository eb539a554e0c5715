"""A run's lease (raychat.lease): one driver at a time trains a run. Exclusive create, the refusal's line, a dead
holder's (kill -9, a reused pid) and a stale holder's lease taken over, renewal, release on every way out
(return, exception, SIGTERM), a lease taken over while held, and the same on s3:// (moto)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.fake_dashboard import RAY_VERSION, FakeDashboard, job_details
from support.stopped_writer import Held

from raychat import lease as lease_module
from raychat.lease import LEASE_FILE, Holder, LeaseHeld, LeaseLost, RunLease
from raychat.storage import open_storage

REPO = Path(__file__).resolve().parents[2]


def _lease(root, run: str = "r", **kwargs) -> RunLease:
    storage = open_storage(str(root))
    return RunLease(storage, storage.run_path(run), command="raychat pretrain --run-name r", **kwargs)


def _write(path: Path, **fields) -> Holder:
    """A lease at `path` as another driver wrote it (fields override a live holder on another host)."""
    now = time.time()
    h = Holder(**{"host": "node-b", "pid": 4242, "started_at": now - 60, "renewed_at": now - 10,
                  "command": "raychat pretrain --run-name r", "job": None, "token": "0" * 16, **fields})  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(h.to_bytes())
    return h


def test_the_lease_holds_its_holder_and_is_deleted_on_return(tmp_path):
    with _lease(tmp_path) as held:
        data = json.loads((tmp_path / "r" / LEASE_FILE).read_text())
        assert data["host"] == socket.gethostname() and data["pid"] == os.getpid()
        assert data["command"] == "raychat pretrain --run-name r" and data["job"] is None
        assert abs(data["started_at"] - time.time()) < 5 and data["renewed_at"] == data["started_at"]
        assert data["token"] == held.holder.token
    assert os.listdir(tmp_path) == []  # nothing else was written: the lease and the run dir it made are gone


def test_a_second_start_is_refused_in_one_line_naming_the_file_holder_and_what_to_do(tmp_path):
    """Exclusive create: the second start of a live holder's run (this process: its pid exists) is refused,
    and the holder's lease is left as it was."""
    with _lease(tmp_path) as first:
        path = tmp_path / "r" / LEASE_FILE
        before = path.read_bytes()
        with pytest.raises(LeaseHeld) as e:
            _lease(tmp_path).acquire()
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first.holder.started_at))
        assert str(e.value) == (
            f"the run is already running: {path} is held by pid {os.getpid()} on {socket.gethostname()}, started "
            f"{started}, renewed 0 s ago (raychat pretrain --run-name r); wait for it to end, or use another "
            "--run-name; if that process is gone, the lease is taken over at once on its own host, else once it "
            "is 120 s without renewal"
        )
        assert path.read_bytes() == before


def test_two_starts_at_once_cannot_both_win(tmp_path):
    """Eight threads start the same run at once: exactly one holds the lease, the others are refused."""
    won, refused, go = [], [], threading.Barrier(8)

    def start():
        lease = _lease(tmp_path)
        go.wait()
        try:
            lease.acquire()
            won.append(lease)
        except LeaseHeld:
            refused.append(lease)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(won), len(refused)) == (1, 7)
    assert json.loads((tmp_path / "r" / LEASE_FILE).read_text())["token"] == won[0].holder.token
    won[0].release()


@contextlib.contextmanager
def _jobs_api(monkeypatch, job: dict | None):
    """The Jobs API of this process's cluster (RAY_API_SERVER_ADDRESS, what Ray's client reads first) answering
    for job raysubmit_abc with `job` (Ray's JobDetails), or 404 when None."""
    replies = {"/api/version": (200, RAY_VERSION)}
    if job is not None:
        replies["/api/jobs/raysubmit_abc"] = (200, job)
    with FakeDashboard(replies) as fake:
        monkeypatch.setenv("RAY_API_SERVER_ADDRESS", fake.url)
        yield


@pytest.mark.parametrize("job", [job_details("raysubmit_abc", "RUNNING"), None], ids=["running", "not-found"])
def test_a_live_holder_on_another_host_is_refused_with_its_renewal_age_and_ray_job(
    tmp_path, monkeypatch, job
):
    """Its job RUNNING, or not on this process's cluster (the holder ran on another): `raychat jobs stop` ends it."""
    _write(tmp_path / "r" / LEASE_FILE, renewed_at=time.time() - 45, job="raysubmit_abc")
    with _jobs_api(monkeypatch, job), pytest.raises(
        LeaseHeld, match=r"held by pid 4242 on node-b, Ray job raysubmit_abc \(raychat jobs stop raysubmit_abc "
        r"ends it\), started .*, renewed 45 s ago"
    ):  # fmt: skip
        _lease(tmp_path).acquire()


def _frozen_clock(monkeypatch) -> float:
    """The lease module's clock stopped at now (returned): the ages its line gives are not those of a slow test."""
    now = time.time()
    clock = SimpleNamespace(
        time=lambda: now, sleep=time.sleep, strftime=time.strftime, localtime=time.localtime
    )
    monkeypatch.setattr(lease_module, "time", clock)
    return now


def test_a_holder_that_outlived_its_failed_ray_job_is_named_with_what_ends_it(tmp_path, monkeypatch):
    """A driver trains on after its Ray job is reported FAILED (its node's raylet died; the driver stayed attached
    to the head): the refusal said "raychat jobs stop <id> ends it", and `jobs stop` answers "already finished".
    The lease renewed after the job ended: the driver lives; it names the process to end."""
    path, now = tmp_path / "r" / LEASE_FILE, _frozen_clock(monkeypatch)
    h = _write(path, started_at=now - 60, renewed_at=now - 5, job="raysubmit_abc")
    with _jobs_api(monkeypatch, job_details("raysubmit_abc", "FAILED", int((now - 20) * 1000))):
        with pytest.raises(LeaseHeld) as e:
            _lease(tmp_path).acquire()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.started_at))
    assert str(e.value) == (
        f"the run is already running: {path} is held by pid 4242 on node-b, started {started}, renewed 5 s ago "
        "(raychat pretrain --run-name r), but its Ray job raysubmit_abc is FAILED (ended 20 s ago), so `raychat "
        "jobs stop raysubmit_abc` cannot end it: its driver outlived the job and renews the lease: `kill 4242` on "
        "node-b ends it (the driver deletes the lease as it exits); or use another --run-name"
    )


def test_a_holder_on_this_host_that_outlived_its_ray_job_is_named_so(tmp_path, monkeypatch):
    """On the refusing start's own host a holder's pid is known to run (else the lease is taken over at once):
    the driver outlived its job, however recently the lease was renewed."""
    me, now = socket.gethostname(), _frozen_clock(monkeypatch)
    _write(tmp_path / "r" / LEASE_FILE, host=me, pid=os.getpid(), started_at=now, renewed_at=now - 25,
           job="raysubmit_abc")  # fmt: skip
    with _jobs_api(monkeypatch, job_details("raysubmit_abc", "STOPPED", int((now - 3) * 1000))):
        with pytest.raises(LeaseHeld) as e:
            _lease(tmp_path).acquire()
    assert str(e.value).endswith(
        f"but its Ray job raysubmit_abc is STOPPED (ended 3 s ago), so `raychat jobs stop raysubmit_abc` cannot "
        f"end it: its driver outlived the job and renews the lease: `kill {os.getpid()}` on {me} ends it (the "
        "driver deletes the lease as it exits); or use another --run-name"
    ), str(e.value)


def test_a_holder_on_another_host_whose_job_ended_after_its_last_renewal_is_given_the_wait(
    tmp_path, monkeypatch
):
    """The job ended after the lease's last renewal (40 s ago): its driver may be gone (a node lost) or live on;
    the lease expires 120 s after that renewal, in 80 s."""
    now = _frozen_clock(monkeypatch)
    _write(tmp_path / "r" / LEASE_FILE, started_at=now - 60, renewed_at=now - 40, job="raysubmit_abc")
    with _jobs_api(monkeypatch, job_details("raysubmit_abc", "FAILED", int((now - 10) * 1000))):
        with pytest.raises(LeaseHeld) as e:
            _lease(tmp_path).acquire()
    assert str(e.value).endswith(
        "but its Ray job raysubmit_abc is FAILED (ended 10 s ago), so `raychat jobs stop raysubmit_abc` cannot end "
        "it: if its driver is gone, the lease is taken over in 80 s (120 s after its last renewal); if it runs "
        "on, `kill 4242` on node-b ends it (the driver deletes the lease as it exits); or use another --run-name"
    ), str(e.value)


def _holder_process(root: Path, then: str) -> subprocess.Popen:
    """A Python process that takes the lease of run r under `root`, prints "held", then runs `then`."""
    code = textwrap.dedent(f"""
        import sys, time
        from raychat.lease import RunLease
        from raychat.storage import open_storage
        s = open_storage({str(root)!r})
        with RunLease(s, s.run_path("r"), command="holder"):
            print("held", flush=True)
            {then}
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_killed_holders_lease_is_taken_over_at_once(tmp_path, capsys):
    """kill -9 of the driver, then the run started again at once: its pid is gone on this host."""
    proc = _holder_process(tmp_path, "time.sleep(60)")
    pid = proc.pid
    proc.kill()
    proc.wait()
    assert (tmp_path / "r" / LEASE_FILE).exists()  # nothing ran on the way out
    with _lease(tmp_path) as held:
        assert json.loads((tmp_path / "r" / LEASE_FILE).read_text())["token"] == held.holder.token
    assert capsys.readouterr().out == (
        f"run lease: taking over {tmp_path}/r/{LEASE_FILE}: its holder, pid {pid} on this host "
        f"({socket.gethostname()}), is gone\n"
    )


def test_a_killed_holder_not_yet_reaped_is_gone(tmp_path, capsys):
    """A zombie (its parent has not waited for it yet) holds nothing."""
    proc = _holder_process(tmp_path, "time.sleep(60)")
    proc.kill()
    deadline = time.monotonic() + 10
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        with _lease(tmp_path):
            pass
    finally:
        proc.wait()
    assert f"its holder, pid {proc.pid} on this host" in capsys.readouterr().out


def test_without_hard_links_the_create_is_still_exclusive(tmp_path, monkeypatch):
    """A filesystem without link(2) (EPERM, as some FUSE mounts answer): O_EXCL instead."""

    def no_link(*args):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    with _lease(tmp_path) as held:
        assert Holder.parse((tmp_path / "r" / LEASE_FILE).read_bytes()) == held.holder
        with pytest.raises(LeaseHeld, match=f"held by pid {os.getpid()}"):
            _lease(tmp_path).acquire()
    assert os.listdir(tmp_path) == []


def test_a_reused_pid_does_not_keep_a_dead_holders_lease(tmp_path, capsys):
    """The holder's pid now names a process that started after the lease (a restarted container's driver gets
    the same small pid): the holder is gone."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        _write(tmp_path / "r" / LEASE_FILE, host=socket.gethostname(), pid=other.pid,
               started_at=time.time() - 600, renewed_at=time.time() - 5)  # fmt: skip
        with _lease(tmp_path):
            pass
    finally:
        other.kill()
        other.wait()
    assert f"its holder, pid {other.pid} on this host" in capsys.readouterr().out


def test_a_lease_not_renewed_for_120_s_is_stale_and_taken_over(tmp_path, capsys):
    path = tmp_path / "r" / LEASE_FILE
    _write(path, renewed_at=time.time() - 119)
    with pytest.raises(LeaseHeld, match="renewed 119 s ago"):
        _lease(tmp_path).acquire()
    _write(path, renewed_at=time.time() - 150)
    with _lease(tmp_path) as held:
        assert json.loads(path.read_text())["token"] == held.holder.token
    assert capsys.readouterr().out == (
        f"run lease: taking over {path}: its holder, pid 4242 on node-b, last renewed it 150 s ago "
        "(stale after 120 s)\n"
    )


def test_two_starts_taking_over_one_stale_lease_cannot_both_win_without_a_shared_lock(tmp_path, monkeypatch):
    """Two starts judge one stale lease at once, where the lease's flock is not shared between them (an NFS
    mount with `nolock` locks per host). The second takes it over and writes its own lease at the moment the
    first deletes the one it judged: the first deleted the second's lease instead (it had read the file, then
    deleted whatever was there) and both held the run, writing it side by side until the second's next renewal.
    Now the first deletes only the lease it judged: the second holds the run and the first is refused."""
    path = tmp_path / "r" / LEASE_FILE
    _write(path, renewed_at=time.time() - 150)
    first, second = _lease(tmp_path), _lease(tmp_path)
    second._locked = contextlib.nullcontext  # the other host's start: the first's lock does not hold it back
    real, calls, won = lease_module.delete_file, [], []

    def delete_file(storage, at):
        calls.append(at)
        if len(calls) == 1:  # the first start's deletion: the second start runs to its end first
            won.append(second.acquire())
        real(storage, at)

    monkeypatch.setattr(lease_module, "delete_file", delete_file)
    with pytest.raises(LeaseHeld, match=f"is held by pid {os.getpid()} on {socket.gethostname()}"):
        first.acquire()
    assert won == [second] and Holder.parse(path.read_bytes()) == second.holder
    second.release()
    assert sorted(os.listdir(tmp_path / "r")) == []


RENEW_STOPPED_AFTER_ITS_READ = """
from dataclasses import replace
from raychat import lease as lease_module
from raychat.lease import RunLease
from raychat.storage import open_storage, write_bytes
lease_module.RENEW_S = 3600.0  # renew() is called below, once
s = open_storage(ROOT)
lease = RunLease(s, s.run_path("r"), command="holder A").acquire()
lease.holder = replace(lease.holder, renewed_at=time.time() - 150)  # not renewed for 150 s (a stopped process)
write_bytes(s, lease.path, lease.holder.to_bytes())
real = lease._read
def read():
    data = real()
    stop()
    return data
lease._read = read
print(lease.renew(), flush=True)
lease._read = real
while not os.path.exists(os.path.join(FLAGS, "end")):
    time.sleep(0.05)
lease.release()
"""


def test_a_renewal_that_read_its_lease_is_not_overwritten_by_a_takeover_nor_overwrites_it(tmp_path):
    """Driver A (a process of its own) has not renewed for 150 s and renews just as start B takes its stale lease
    over: A reads its own lease and stops there. B took the lease over in that moment and A then wrote its renewed
    lease over B's (a read, then a write): both held the run. Now A holds the lease's lock from its read to its
    write, so B waits for A's renewal and then finds a live lease: refused, naming A; A goes on holding it."""
    held = Held(RENEW_STOPPED_AFTER_ITS_READ.replace("ROOT", repr(str(tmp_path))), tmp_path / "flags")
    path = tmp_path / "r" / LEASE_FILE
    a = Holder.parse(path.read_bytes())
    assert a.command == "holder A" and time.time() - a.renewed_at > 149
    refused: list[str] = []
    b = _lease(tmp_path)

    def start_b():
        try:
            b.acquire()
        except LeaseHeld as e:
            refused.append(str(e))

    thread = threading.Thread(target=start_b)
    try:
        thread.start()
        thread.join(timeout=1.0)
        assert thread.is_alive()  # B waits for the lock A holds mid-renewal
        (held.flags / "go").touch()
        assert held.proc.stdout.readline() == "True\n"  # A renewed its own lease
        thread.join(timeout=30)
        assert b.holder is None and len(refused) == 1
        assert f"is held by pid {held.proc.pid} on {socket.gethostname()}, started " in refused[0]
        assert refused[0].split(", renewed ")[1].startswith("0 s ago (holder A); wait for it to end")
        now = Holder.parse(path.read_bytes())
        assert now.token == a.token and time.time() - now.renewed_at < 30
    finally:
        (held.flags / "go").touch()
        (held.flags / "end").touch()
        assert held.proc.wait(30) == 0
        b.release()
    assert os.listdir(tmp_path) == ["flags"]  # A released it and the run dir it made: no lock file was left


def _starts_at_once(
    storage, run: str, commands: list[str], rng: random.Random
) -> tuple[list[RunLease], dict[str, str]]:
    """One thread per command acquires the lease of `run` at once, after a delay of up to 5 ms drawn from `rng`;
    (the leases won, {command: refusal})."""
    won, refused, go = [], {}, threading.Barrier(len(commands))
    delays = {c: rng.uniform(0, 0.005) for c in commands}

    def start(command):
        lease = RunLease(storage, storage.run_path(run), command=command)
        go.wait()
        time.sleep(delays[command])
        try:
            won.append(lease.acquire())
        except LeaseHeld as e:
            refused[command] = str(e)

    threads = [threading.Thread(target=start, args=(c,)) for c in commands]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return won, refused


def test_three_starts_taking_over_one_stale_lease_one_wins_in_any_order(tmp_path, monkeypatch):
    """A's lease is stale and starts B and C take it over at the same moment, 20 times over, each start and each
    read of the lease delayed by up to 5 ms at random to vary who reads, judges, deletes and creates when: each
    time exactly one holds the run and the lease file, and the other is refused in one line naming it."""
    rng = random.Random(0)
    real_read = lease_module.read_bytes

    def jittered_read(storage, path):
        time.sleep(rng.uniform(0, 0.005))
        return real_read(storage, path)

    monkeypatch.setattr(lease_module, "read_bytes", jittered_read)
    storage = open_storage(tmp_path)
    winners = set()
    for i in range(20):
        path = tmp_path / f"r{i}" / LEASE_FILE
        _write(path, renewed_at=time.time() - 150)
        won, refused = _starts_at_once(storage, f"r{i}", ["start B", "start C"], rng)
        assert len(won) == 1 and len(refused) == 1, (won, refused)
        (winner,) = won
        (loser_line,) = refused.values()
        assert Holder.parse(path.read_bytes()) == winner.holder
        assert f"is held by pid {os.getpid()} on {socket.gethostname()}," in loser_line
        assert f"({winner.command}); wait for it to end" in loser_line and "\n" not in loser_line
        winners.add(winner.command)
        winner.release()
        assert os.listdir(tmp_path / f"r{i}") == []
    assert winners == {"start B", "start C"}  # both orders were seen


def test_a_file_that_is_not_a_lease_is_judged_by_its_age(tmp_path, capsys):
    path = tmp_path / "r" / LEASE_FILE
    path.parent.mkdir()
    path.write_text("{half a lease")
    with pytest.raises(LeaseHeld, match=r"the run is leased: .*lease.json \(not a lease raychat wrote\) is "
                       "younger than 120 s"):  # fmt: skip
        _lease(tmp_path).acquire()
    os.utime(path, (time.time() - 300, time.time() - 300))
    with _lease(tmp_path):
        pass
    assert capsys.readouterr().out == (
        f"run lease: taking over {path}: it is not a lease raychat wrote, last changed 300 s ago\n"
    )


def test_the_lease_is_renewed_and_released_on_an_exception(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_module, "RENEW_S", 0.05)
    path = tmp_path / "r" / LEASE_FILE
    with pytest.raises(RuntimeError, match="a worker failed"), _lease(tmp_path):
        first = json.loads(path.read_text())["renewed_at"]
        time.sleep(0.5)
        assert json.loads(path.read_text())["renewed_at"] > first
        raise RuntimeError("a worker failed")
    assert not path.exists()


def test_sigterm_releases_the_lease(tmp_path):
    """`raychat jobs stop` (Ray sends SIGTERM) or `kill`: the driver leaves through its finally blocks."""
    proc = _holder_process(tmp_path, "time.sleep(60)")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not (tmp_path / "r" / LEASE_FILE).exists()


def test_a_lease_taken_over_while_held_stops_the_run(tmp_path, capsys):
    """A driver that did not renew for 120 s (stopped, its storage unreachable) and whose lease another start
    took over stops at its next renewal rather than write the run beside the new holder."""
    path = tmp_path / "r" / LEASE_FILE
    # the interrupt goes to SIGINT's handler: Python's own here (Ray Train's, left by a trainer that ran in this
    # process, would abort that run and start Ray to do so)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(LeaseLost) as e, _lease(tmp_path) as held:
            other = _write(path)
            assert held.renew() is False
            time.sleep(5)  # the interrupt comes before this ends
    finally:
        signal.signal(signal.SIGINT, previous)
    assert str(e.value) == (
        f"run lease lost: {path} was taken over by pid 4242 on node-b (raychat pretrain --run-name r) while this "
        "run was not renewing it; this run stopped so that two runs do not write its directory"
    )
    assert Holder.parse(path.read_bytes()) == other  # the new holder's lease is kept
    assert capsys.readouterr().out == str(e.value) + "\n"


def test_the_lease_on_s3(s3_env, monkeypatch, capsys):
    """On object storage (moto): written, read back, refused to a second start, deleted at exit; a stale one is
    taken over."""
    monkeypatch.setattr(lease_module, "SETTLE_S", 0.1)
    bucket = s3_env.make_bucket()
    fs = s3_env.filesystem()
    key = f"{bucket}/runs/r/{LEASE_FILE}"
    with _lease(f"s3://{bucket}/runs") as held:
        with fs.open_input_stream(key) as f:
            assert Holder.parse(f.read()) == held.holder
        with pytest.raises(LeaseHeld, match=f"s3://{key} is held by pid {os.getpid()}"):
            _lease(f"s3://{bucket}/runs").acquire()
    assert fs.get_file_info(key).type.name == "NotFound"
    now = time.time()
    with fs.open_output_stream(key) as f:
        f.write(Holder("node-b", 7, now - 1800, now - 900, "x", None, "1" * 16).to_bytes())
    with _lease(f"s3://{bucket}/runs") as held:
        with fs.open_input_stream(key) as f:
            assert Holder.parse(f.read()).token == held.holder.token
    assert "last renewed it 15 min ago (stale after 120 s)" in capsys.readouterr().out
    assert fs.get_file_info(key).type.name == "NotFound"


def test_an_s3_start_whose_write_lost_backs_out(s3_env, monkeypatch):
    """No conditional create on object storage: a start whose write another start's overwrote (between its
    write and its read back) backs out and is refused."""
    bucket = s3_env.make_bucket()
    fs = s3_env.filesystem()
    key = f"{bucket}/runs/r/{LEASE_FILE}"
    theirs = Holder("node-b", 7, time.time(), time.time(), "the other start", None, "2" * 16)

    def overwrite(seconds):  # the other start's PUT lands while this one waits to read its own back
        with fs.open_output_stream(key) as f:
            f.write(theirs.to_bytes())

    monkeypatch.setattr(lease_module.time, "sleep", overwrite)
    with pytest.raises(LeaseHeld, match=r"held by pid 7 on node-b, .*\(the other start\)"):
        _lease(f"s3://{bucket}/runs").acquire()
    with fs.open_input_stream(key) as f:
        assert Holder.parse(f.read()) == theirs


def test_a_run_directory_the_lease_made_goes_with_it_when_nothing_was_written(tmp_path):
    """A start refused after taking the lease (a layout no node can hold) left an empty <run> directory behind;
    a directory that was there, or that the run wrote into, stays."""
    with _lease(tmp_path, "fresh"):
        assert (tmp_path / "fresh" / LEASE_FILE).is_file()
    assert not (tmp_path / "fresh").exists()
    with _lease(tmp_path, "wrote"):
        (tmp_path / "wrote" / "config.yaml").write_text("x")
    assert sorted(p.name for p in (tmp_path / "wrote").iterdir()) == ["config.yaml"]
    (tmp_path / "there").mkdir()
    with _lease(tmp_path, "there"):
        pass
    assert (tmp_path / "there").is_dir()

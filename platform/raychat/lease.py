"""A run's lease: <root>/<run>/lease.json, held by the driver of a training run (pretrain, sft, rl) for as long as
it trains, so that two drivers of one run never commit checkpoints, metrics.jsonl and pruning into the same run
directory at once; and <out>/lease.json on a whole output directory (output_lease): held by a speedrun on its
--out for its whole invocation (raychat.speedrun), and by `raychat data prepare` and `raychat tokenizer train` on
their output while they write it, so that a second writer never deletes the first's live temporaries as a killed
run's leftovers, nor puts its shards beside the first's manifest.

The file is JSON: {"host", "pid", "started_at", "renewed_at" (unix seconds), "command", "job" (the Ray job's
submission id, or null), "token" (the holder's own random id)}. The driver takes it once the cheap checks have
passed and before Ray starts (a finished run takes none), renews it every RENEW_S from a daemon thread and
deletes it on every way out it can see (return, exception, SIGINT, SIGTERM). A second start while it is held
is refused in one line (LeaseHeld) naming what ends the holder: `raychat jobs stop` of its Ray job, or, where
the Jobs API reports that job ended while its driver holds the lease on (a driver that outlived its job: its
node's raylet died), the driver's pid and host to kill, or how long until the lease expires (ended_job). A
lease is taken over, with one line saying so, when its holder is provably dead (on this host, and its pid is
gone or now a process started after the lease: a `kill -9` then a resume at once) or stale (not renewed for
STALE_S: a holder on another host that died, or whose host did).

Local storage (and NFS): the file is created exclusively, as os.link of a complete temporary file (atomic: two
starts cannot both win, and no reader sees a half-written lease). Object storage has no conditional create in
pyarrow: a start writes its lease, waits SETTLE_S, reads it back and backs out if another start's write won;
best-effort, sound when both writes land within SETTLE_S. A takeover deletes the old lease only if it still
holds what was judged dead or stale (locally: renamed to a temporary name first, then compared, so two starts
taking one lease over cannot delete each other's new one).

Locally, every read-judge-write of the lease (a start's create or takeover, a renewal, the release) holds an
exclusive flock on <dir>/.lease.json.lock for those milliseconds (the lock file is deleted by its holder as it
lets go; a waiter that then finds another file under that name locks that one instead). So a renewal that read
its own lease cannot write it back over a lease that another start took over meanwhile: the start waits for the
renewal and then finds a live lease (refused), or the renewal comes after the takeover and finds the new
holder's lease (this driver stops: LeaseLost). Of two starts taking over one stale lease, the second finds the
first's new lease and is refused naming it. flock reaches other NFS clients through the server's locking
(NFSv4, or v3 with lockd; a mount with `nolock` locks per host, where the rename aside above still keeps two
takeovers from both winning). On object storage a renewal reads, compares and writes; a renewal that overwrites
a takeover's lease lands within the taking start's SETTLE_S, whose read back then backs it out.
Nothing but lease.json, its lock file and its temporaries (raychat.atomic) is ever written, and only through
Storage.inside.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import json
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass

from raychat.atomic import exclusive_write_bytes, fresh_file
from raychat.log import log
from raychat.storage import Storage, delete_file, open_storage, read_bytes, write_bytes

LEASE_FILE = "lease.json"
LOCK_FILE = f".{LEASE_FILE}.lock"  # beside the lease: see the module doc
# A holder renews every 30 s; one not renewed for 120 s (4 renewals missed: a slow object store or a clock
# skew of tens of seconds between hosts leaves a live holder well inside it) is gone. A dead holder on the same
# host is known at once, so 120 s is only what a lost holder on another host costs.
RENEW_S = 30.0
STALE_S = 120.0
# Object storage: how long a start waits between writing its lease and reading it back.
SETTLE_S = 2.0
# A pid whose process started this long after the lease did is another process that got the same pid.
_PID_REUSE_SLACK_S = 2.0
_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in a job's driver
JOB_LOOKUP_S = 10.0  # how long a refusal waits for the Jobs API's status of the holder's job (ended_job)


class LeaseHeld(ValueError):
    """Another live driver holds the run's lease; the message names the file, the holder and what to do."""


class LeaseLost(ValueError):
    """This driver's lease was taken over by another start while it ran (it had not renewed it for STALE_S)."""


@dataclass(frozen=True)
class Holder:
    """What lease.json holds (see the module doc)."""

    host: str
    pid: int
    started_at: float
    renewed_at: float
    command: str
    job: str | None
    token: str

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The Holder of lease.json's bytes; None when they are not one (a file written by hand, truncated)."""
        try:
            d = json.loads(data)
            return cls(str(d["host"]), int(d["pid"]), float(d["started_at"]), float(d["renewed_at"]),
                       str(d.get("command", "")), d.get("job"), str(d["token"]))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None


def _job_id() -> str | None:
    try:
        return json.loads(os.environ[_JOB_ENV])["metadata"]["job_submission_id"]
    except (KeyError, ValueError, TypeError):
        return None


def _proc_stat(pid: int) -> tuple[str, float] | None:
    """(state, unix time it started) of process `pid` from Linux's /proc (proc(5)); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as stat:
            btime = next(int(ln.split()[1]) for ln in stat if ln.startswith("btime "))
        return fields[0], btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def pid_alive(pid: int, since: float) -> bool:
    """Whether process `pid` of this host runs and is the one that was running at unix time `since`: not gone,
    not a zombie (killed, not yet reaped), not a process started after `since` that got the same pid."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    return state not in ("Z", "X") and started <= since + _PID_REUSE_SLACK_S


def ended_job(job_id: str) -> tuple[str, float | None] | None:
    """(status, unix time it ended or None) of Ray job `job_id` once it has ended (SUCCEEDED, FAILED, STOPPED), as
    the Jobs API of this process's cluster answers: Ray's JobSubmissionClient without an address reads
    RAY_API_SERVER_ADDRESS, else RAY_ADDRESS (a job's driver: its cluster's GCS, which Ray sets), else finds a
    local cluster. None while it runs, and when that cannot be told within JOB_LOOKUP_S: no cluster answers, the
    token is refused, the cluster has no such job (the holder's job ran on another cluster)."""
    found: list = []

    def lookup():
        # imported here: Ray's import (~1 s) stays out of `raychat data prepare` and `tokenizer train`, which
        # take leases too and never import Ray
        from ray.job_submission import JobSubmissionClient

        # whatever the lookup fails on, the refusal is the one without it
        with contextlib.suppress(Exception):
            found.append(JobSubmissionClient().get_job_info(job_id))

    thread = threading.Thread(target=lookup, name="raychat-lease-job", daemon=True)
    thread.start()
    thread.join(JOB_LOOKUP_S)  # Ray's client has no timeout of its own (a GCS that does not answer: ~35 s)
    if not found or not found[0].status.is_terminal():
        return None
    end_ms = found[0].end_time
    return found[0].status.value, end_ms / 1000 if end_ms else None


def _ago(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s} s ago" if s < 600 else f"{s // 60} min ago"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


class RunLease:
    """The lease of the run at `run_path` on `storage` (a context manager: `with RunLease(...):` acquires it and
    releases it on the way out). run_path is <root>/<run>, or the root itself (storage.path: the speedrun's lease
    on its --out, a data or tokenizer output: output_lease).

    command: what the lease says runs the run (default: this process's command line, at most 500 characters);
    other_run: how the refusal says to start another run instead (the training commands' "another --run-name").
    Raises ValueError (Storage.inside) when <run_path>/lease.json is not below the root."""

    def __init__(
        self,
        storage: Storage,
        run_path: str,
        command: str | None = None,
        other_run: str = "another --run-name",
    ):
        self.storage = storage
        self.path = storage.inside(f"{run_path}/{LEASE_FILE}")
        self.uri = storage.uri_of(self.path)
        self.command = command if command is not None else shlex.join(sys.argv)[:500]
        self.other_run = other_run
        self.holder: Holder | None = None
        self.lost: str | None = None  # the line saying who took the lease over while this driver held it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_sigterm = None
        self._main_thread = False
        self._made_dir: str | None = None

    # ---- acquire / release -----------------------------------------------------------------------------
    def acquire(self) -> RunLease:
        """Take the lease (taking over a dead or stale holder's, with one line saying so) and start renewing it.

        Raises:
            LeaseHeld: a live holder has it (one line: the file, the holder, what to do).
            OSError: the storage could not be written or read (as pyarrow raises it).
        """
        now = time.time()
        mine = Holder(
            socket.gethostname(), os.getpid(), now, now, self.command, _job_id(), secrets.token_hex(8)
        )
        parent = self.path.rsplit("/", 1)[0]
        # a run directory this start makes goes again with the lease if nothing was written into it (a refusal
        # after the lease, e.g. a layout no node can hold, leaves the root as it found it)
        self._made_dir = parent if self.storage.is_local and not os.path.isdir(parent) else None
        # the root's own lease (the speedrun's <out>/lease.json) creates the root, as check_writable does
        self.storage.fs.create_dir(
            parent if parent == self.storage.path else self.storage.inside(parent), recursive=True
        )
        for _ in range(5):
            with self._locked():
                if self._create(mine):
                    break
                data = self._read()
                if data is None:  # released meanwhile: try again
                    continue
                found = Holder.parse(data)
                why = self._gone(found)
                if why is not None:
                    log(f"run lease: taking over {self.uri}: {why}")
                    self._delete_if(data)
                    continue
            # outside the lock: the refusal may ask the Jobs API (ended_job)
            raise LeaseHeld(self.refusal(found))
        else:
            raise LeaseHeld(
                f"{self.uri}: another start took the run's lease at the same moment ({self._hint()})"
            )
        self.holder = mine
        self._stop.clear()
        self._main_thread = threading.current_thread() is threading.main_thread()
        if self._main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self._thread = threading.Thread(target=self._renew_loop, name="raychat-run-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this driver's; restores SIGTERM's handler."""
        if self.holder is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._old_sigterm is not None and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        try:
            with self._locked():
                data = self._read()
                if data is not None and self._is_mine(data):
                    self._delete_if(data)
        except OSError as e:
            log(f"run lease: could not delete {self.uri} ({e}); it goes stale in {STALE_S:g} s")
        if self._made_dir is not None:
            with contextlib.suppress(OSError):  # not empty: the run wrote into it
                os.rmdir(self._made_dir)
        self.holder = None

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, kind, error, tb) -> None:
        self.release()
        if self.lost is not None:  # however the interrupt ended the block (a SIGINT handler of Ray Train's
            raise LeaseLost(self.lost) from None  # aborts its run and returns), the run did not finish

    # ---- what a lease found says -----------------------------------------------------------------------
    def _gone(self, found: Holder | None) -> str | None:
        """Why the lease `found` (None: a file that is not one) may be taken over; None when its holder is live."""
        now = time.time()
        if found is None:  # not a lease raychat wrote: judged by the file's age
            age = now - self._mtime()
            return f"it is not a lease raychat wrote, last changed {_ago(age)}" if age > STALE_S else None
        if found.host == socket.gethostname() and not pid_alive(found.pid, found.started_at):
            return f"its holder, pid {found.pid} on this host ({found.host}), is gone"
        if now - found.renewed_at > STALE_S:
            return (
                f"its holder, pid {found.pid} on {found.host}, last renewed it {_ago(now - found.renewed_at)} "
                f"(stale after {STALE_S:g} s)"
            )
        return None

    def refusal(self, h: Holder | None) -> str:
        """The one line refusing a start while `h` holds the lease (asks the Jobs API of its Ray job: ended_job)."""
        if h is None:
            return (
                f"the run is leased: {self.uri} (not a lease raychat wrote) is younger than {STALE_S:g} s "
                f"({self._hint()})"
            )
        now = time.time()
        if h.job and (ended := ended_job(h.job)) is not None:
            return (
                f"the run is already running: {self.uri} is held by pid {h.pid} on {h.host}, started "
                f"{_when(h.started_at)}, renewed {_ago(now - h.renewed_at)} ({h.command}), but its Ray job {h.job} "
                f"is {ended[0]}{self._since(ended[1])}, so `raychat jobs stop {h.job}` cannot end it: "
                f"{self._what_ends(h, ended[1])}; or use {self.other_run}"
            )
        job = f", Ray job {h.job} (raychat jobs stop {h.job} ends it)" if h.job else ""
        return (
            f"the run is already running: {self.uri} is held by pid {h.pid} on {h.host}{job}, started "
            f"{_when(h.started_at)}, renewed {_ago(now - h.renewed_at)} ({h.command}); {self._hint()}"
        )

    @staticmethod
    def _since(ended_at: float | None) -> str:
        return f" (ended {_ago(time.time() - ended_at)})" if ended_at is not None else ""

    @staticmethod
    def _what_ends(h: Holder, ended_at: float | None) -> str:
        """What ends a live holder `h` whose Ray job ended at `ended_at`: on this host its pid runs (_gone), and
        a renewal after the job's end is proof of life elsewhere; otherwise it may be gone: the wait."""
        kill = f"`kill {h.pid}` on {h.host} ends it (the driver deletes the lease as it exits)"
        if h.host == socket.gethostname() or (ended_at is not None and h.renewed_at > ended_at):
            return f"its driver outlived the job and renews the lease: {kill}"
        left = max(0, round(h.renewed_at + STALE_S - time.time()))
        return (
            f"if its driver is gone, the lease is taken over in {left} s ({STALE_S:g} s after its last renewal); "
            f"if it runs on, {kill}"
        )

    def _hint(self) -> str:
        return (
            f"wait for it to end, or use {self.other_run}; if that process is gone, the lease is taken over at "
            f"once on its own host, else once it is {STALE_S:g} s without renewal"
        )

    def lost_line(self, h: Holder | None) -> str:
        who = f"pid {h.pid} on {h.host} ({h.command})" if h else "another start"
        return (
            f"run lease lost: {self.uri} was taken over by {who} while this run was not renewing it; this run "
            "stopped so that two runs do not write its directory"
        )

    # ---- storage ---------------------------------------------------------------------------------------
    def _read(self) -> bytes | None:
        try:
            return read_bytes(self.storage, self.path)
        except FileNotFoundError:
            return None

    def _mtime(self) -> float:
        info = self.storage.fs.get_file_info(self.path)
        return info.mtime.timestamp() if info.mtime is not None else 0.0

    def _is_mine(self, data: bytes) -> bool:
        found = Holder.parse(data)
        return found is not None and self.holder is not None and found.token == self.holder.token

    def _create(self, mine: Holder) -> bool:
        """Write `mine` where no lease is (its directory exists); False when one is there (or, on object
        storage, another start's write won)."""
        if self.storage.is_local:
            return exclusive_write_bytes(self.path, mine.to_bytes())
        if self._read() is not None:
            return False
        write_bytes(self.storage, self.path, mine.to_bytes())
        time.sleep(SETTLE_S)
        found = Holder.parse(self._read() or b"")
        return found is not None and found.token == mine.token

    @contextlib.contextmanager
    def _locked(self):
        """Hold the exclusive flock on the local lease's LOCK_FILE for the block (nothing on object storage);
        the file is deleted as the block ends. Raises OSError as os.open / fcntl.flock (the lease's directory
        is gone: FileNotFoundError)."""
        if not self.storage.is_local:
            yield
            return
        path = self.storage.inside(f"{self.path.rsplit('/', 1)[0]}/{LOCK_FILE}")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # let go when fd closes, or when this process dies
                try:
                    if os.path.samestat(os.fstat(fd), os.stat(path)):
                        break
                except FileNotFoundError:  # its holder deleted it as it let go
                    pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    def _delete_if(self, data: bytes) -> None:
        """Delete the lease if it still holds `data` (what was judged), so that a lease another start has just
        written in its place is kept. A local lease is first renamed to a name of this start's own (atomic:
        of two starts deleting one lease, one gets it) and compared there; one that is not `data` is put back
        unless another lease is there by then (its holder then stops at its next renewal). Object storage has
        no atomic rename: read, compared, then deleted (best-effort, as its create)."""
        if not self.storage.is_local:
            if self._read() == data:
                delete_file(self.storage, self.path)
            return
        aside = str(fresh_file(self.path))
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:  # deleted meanwhile
            os.unlink(aside)
            return
        taken = read_bytes(self.storage, aside)
        if taken != data:
            exclusive_write_bytes(self.path, taken)
        delete_file(self.storage, aside)

    # ---- renewal ---------------------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if not self.renew():
                    return
            except OSError as e:  # a storage hiccup: the next renewal tries again
                log(f"run lease: could not renew {self.uri} ({e}); trying again in {RENEW_S:g} s")

    def renew(self) -> bool:
        """Write renewed_at = now into the lease if it is still this driver's (or was deleted: written again),
        read, compared and written under the lease's lock (see the module doc); False when another start has
        taken it over: logs one line naming the new holder and interrupts the main thread (the run stops;
        __exit__ raises LeaseLost). Raises OSError as the storage does (the renewal loop tries again)."""
        with self._locked():
            data = self._read()
            if data is None or self._is_mine(data):
                self.holder = Holder(**{**asdict(self.holder), "renewed_at": time.time()})
                write_bytes(self.storage, self.path, self.holder.to_bytes())
                return True
        self.lost = self.lost_line(Holder.parse(data))
        log(self.lost)
        if self._main_thread:
            _thread.interrupt_main()
        return False


def output_lease(out: str | os.PathLike, flag: str = "--out") -> RunLease:
    """The lease on the whole local output directory `out`: <out>/lease.json (a RunLease on the root `out`).
    `flag` is the option a second writer changes to write elsewhere: its refusal says "use another {flag}"."""
    storage = open_storage(out, flag)
    return RunLease(storage, storage.path, other_run=f"another {flag}")


def _exit_on_sigterm(signum, frame):
    """SIGTERM (`raychat jobs stop`, `kill`) ends the driver through its finally blocks: the lease is released."""
    sys.exit(128 + signum)

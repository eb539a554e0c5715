"""Run untrusted Python (a model's HumanEval program) in a child process that cannot harm the machine.

The child (run_python) is a fresh interpreter (`-I -S -B`: no environment variables, no site-packages, no
.pyc writes) in a new session, its working directory and $HOME/$TMPDIR a new private temporary directory,
with an environment of PATH and LANG only. Before the program runs, the child itself, in this order:
  1. network: enters a new network namespace (unshare(CLONE_NEWNET) as root, with CLONE_NEWUSER otherwise),
     which has no interface but a loopback that is down; where the kernel refuses, the audit hook of step 4
     is the only network block (SandboxResult.isolation says which held).
  2. user: running as root with an interpreter every user can run, becomes `nobody` (uid/gid 65534), so the
     process limit binds (root is exempt from RLIMIT_NPROC) and file permissions keep it out of others' files.
  3. limits (setrlimit): RLIMIT_CPU = cpu_s, RLIMIT_AS = memory_bytes, RLIMIT_NPROC = max_processes (the
     processes of its user), RLIMIT_FSIZE = max_file_bytes, RLIMIT_CORE = 0.
  4. an audit hook (PEP 578, sys.addaudithook): refuses sockets, exec/spawn/system/Popen, ctypes, and opening
     for writing, creating, removing or renaming any path outside the sandbox directory.
The parent waits at most wall_s; then, and whenever the child ends, it kills the child's whole process group
(a fork bomb's leftovers included). stdout/stderr go to files bounded by RLIMIT_FSIZE, never to pipes.
Outcome: passed = exit status 0 within the limits; anything else (an exception, a limit, a kill) fails.

The interpreter: this Python when every user can run it, else /usr/bin/python3 (the programs need only the
standard library); with neither, this Python without the change of user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
OUTPUT_TAIL = 2000  # characters of stdout/stderr kept in SandboxResult

# The child's preamble (run with -c): isolation, user, limits, audit hook, then the program file.
RUNNER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
isolation = []
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWNET | CLONE_NEWUSER
if libc.unshare(flags) == 0:
    isolation.append("netns")
if cfg["drop_user"] and os.geteuid() == 0:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    isolation.append("nobody")
for name, value in (("RLIMIT_CPU", cfg["cpu_s"]), ("RLIMIT_AS", cfg["memory_bytes"]),
                    ("RLIMIT_NPROC", cfg["max_processes"]), ("RLIMIT_FSIZE", cfg["max_file_bytes"]),
                    ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
sys.stderr.write("sandbox isolation: " + ",".join(isolation or ["hook-only"]) + "\n")
sys.stderr.flush()
ROOT = os.path.realpath(os.getcwd())
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
               "os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree", "shutil.move",
               "shutil.copyfile", "shutil.copytree", "os.chdir", "os.chroot"}
BLOCKED = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
           "ctypes.", "pty.", "os.kill", "os.killpg", "signal.pthread_kill", "winreg.", "webbrowser.")
def inside(path):
    if isinstance(path, int):
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == ROOT or real.startswith(ROOT + os.sep)
def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        if writing and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                raise PermissionError(f"sandbox: {event} on {a!r} outside the sandbox directory")
sys.addaudithook(hook)
source = open("program.py", encoding="utf-8").read()
del ctypes, libc
sys.argv = ["program.py"]
exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class SandboxLimits:
    """cpu_s: CPU seconds (RLIMIT_CPU); wall_s: seconds before the process group is killed; memory_bytes:
    address space (RLIMIT_AS); max_processes: processes of the sandbox's user (RLIMIT_NPROC);
    max_file_bytes: largest file it may write (RLIMIT_FSIZE), its stdout/stderr included."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30
    max_processes: int = 32
    max_file_bytes: int = 16 << 20

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_bytes", "max_processes", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """passed: exit status 0 within the limits; status: "passed", "failed" (exit status != 0), "killed"
    (a signal: the CPU or file-size limit, or memory) or "timeout" (wall_s); returncode: the child's (negative:
    the signal), None on timeout; isolation: what held ("netns", "nobody", or "hook-only")."""

    passed: bool
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: str


def _world_runnable(path: str) -> bool:
    """Every directory above `path` searchable and `path` executable by other users (mode bits)."""
    p = Path(path).resolve()
    try:
        dirs_ok = all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)
        return bool(dirs_ok and os.stat(p).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def sandbox_python() -> tuple[str, bool]:
    """(interpreter, whether the child may drop to nobody): see the module doc."""
    if _world_runnable(sys.executable):
        return sys.executable, True
    if _world_runnable("/usr/bin/python3"):
        return "/usr/bin/python3", True
    return sys.executable, False


def _tail(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-OUTPUT_TAIL:]
    except OSError:
        return ""


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox (module doc) and say how it ended. Never raises for
    anything the program does; returns within about limits.wall_s + 1 s."""
    limits = limits or SandboxLimits()
    python, can_drop = sandbox_python()
    drop = can_drop and os.geteuid() == 0
    work = Path(tempfile.mkdtemp(prefix="raychat-sandbox-"))
    box, logs = work / "box", work / "logs"
    box.mkdir()
    logs.mkdir(mode=0o700)
    os.chmod(work, 0o711)
    if drop:
        os.chown(box, NOBODY, NOBODY)
    os.chmod(box, 0o700)
    (box / "program.py").write_text(program, encoding="utf-8")
    cfg = {
        "cpu_s": int(limits.cpu_s),
        "memory_bytes": int(limits.memory_bytes),
        "max_processes": int(limits.max_processes),
        "max_file_bytes": int(limits.max_file_bytes),
        "drop_user": drop,
        "uid": NOBODY,
    }
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(box), "TMPDIR": str(box)}
    t0 = time.perf_counter()
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-B", "-c", RUNNER, json.dumps(cfg)],
            cwd=box, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
        try:
            returncode = proc.wait(timeout=limits.wall_s)
            status = "passed" if returncode == 0 else "killed" if returncode < 0 else "failed"
        except subprocess.TimeoutExpired:
            returncode, status = None, "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: leftovers of a fork bomb included
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    seconds = time.perf_counter() - t0
    stderr = _tail(logs / "stderr")
    with open(logs / "stderr", encoding="utf-8", errors="replace") as f:
        first = f.readline().strip()
    isolation = first.split(": ", 1)[1] if first.startswith("sandbox isolation: ") else "unknown"
    result = SandboxResult(
        status == "passed", status, returncode, _tail(logs / "stdout"), stderr, round(seconds, 3), isolation
    )
    shutil.rmtree(work, ignore_errors=True)
    return result

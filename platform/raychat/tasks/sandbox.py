"""Run untrusted Python (a model's HumanEval program) in a child process that cannot harm the machine.

The child (run_python) is a fresh interpreter (`-I -S -B`: no environment variables, no site-packages, no
.pyc writes) in a new session, its working directory and $HOME/$TMPDIR a new private temporary directory,
with an environment of PATH and LANG only. Before the program runs, the child itself, in this order:
  1. namespaces: enters a new network namespace and a new PID namespace (unshare(CLONE_NEWNET | CLONE_NEWPID) as
     root, with CLONE_NEWUSER otherwise). The network one has no interface but a loopback that is down. The
     program runs as the PID namespace's init, in a child the runner forks before steps 2 and 3 (so that fork
     does not count against `nobody`'s processes; PR_SET_PDEATHSIG = SIGKILL once it is `nobody`), so every
     process it starts, one that left the process group with setsid() included, dies with it. As an init it
     is not ended by a signal it has no handler for, except SIGKILL: the CPU limit still kills it (SIGKILL at
     the hard limit), while a write past the file-size limit fails with OSError (EFBIG) instead of SIGXFSZ.
     Where the kernel refuses both, a network namespace alone is tried; without it, the audit hook of step 4
     is the only network block (SandboxResult.isolation says which held).
  2. user: running as root with an interpreter every user can run, becomes `nobody` (uid/gid 65534), so the
     process limit binds (root is exempt from RLIMIT_NPROC) and file permissions keep it out of others' files.
  3. limits (setrlimit): RLIMIT_CPU = cpu_s, RLIMIT_AS = memory_bytes, RLIMIT_NPROC = max_processes (the
     processes of its user), RLIMIT_FSIZE = max_file_bytes, RLIMIT_CORE = 0.
  4. an audit hook (PEP 578, sys.addaudithook): refuses sockets, exec/spawn/system/Popen, os.fork/forkpty
     (HumanEval programs start no process; OpenAI's human-eval disables fork too), ctypes, gc.get_objects and
     its kin, and opening for writing, creating, removing, renaming or changing any path outside the sandbox
     directory (symbolic links followed, a dir_fd or an fd resolved through /proc/self/fd; a path-like object
     that is not str or bytes, and os.open of a relative path for writing, whose dir_fd the event omits, are
     refused). It reads nothing the program can rebind (its constants and functions are bound in its closure).
     An audit hook is no complete sandbox (PEP 578): _posixsubprocess.fork_exec, for one, is not audited; the
     namespaces, the user and the limits are what hold then.
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

# The child's preamble (run with -c): isolation, user, limits, audit hook, then the program file. The program
# shares this interpreter and reaches this module as sys.modules["__main__"], and may rebind any module global or
# builtin: make_hook binds everything the hook reads (frozen constants, os's C functions, the builtins) in its
# closure, and its name is deleted before the program runs.
RUNNER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
isolation = []
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x40000000, 0x20000000, 0x10000000
user_ns = 0 if os.geteuid() == 0 else CLONE_NEWUSER
if libc.unshare(CLONE_NEWNET | CLONE_NEWPID | user_ns) == 0:
    isolation += ["netns", "pidns"]
elif libc.unshare(CLONE_NEWNET | user_ns) == 0:
    isolation.append("netns")
if "pidns" in isolation:  # the program runs as the namespace's init: the kernel kills what it started with it
    pid = os.fork()  # before the user and RLIMIT_NPROC change: as nobody, this fork counts its processes
    if pid:
        status = os.waitpid(pid, 0)[1]
        if os.WIFSIGNALED(status):
            if os.WTERMSIG(status) != signal.SIGKILL:
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status))
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
if "pidns" in isolation:  # PR_SET_PDEATHSIG after setuid, which clears it: killing the runner kills the init
    libc.prctl(1, signal.SIGKILL)
def make_hook(root, lstat=os.lstat, readlink=os.readlink, getcwd=os.getcwd, isinstance=isinstance, len=len,
              range=range, str=str, bytes=bytes, int=int, OSError=OSError, PermissionError=PermissionError):
    inside_root = root + os.sep
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    BLOCKED = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
               "os.fork", "ctypes.", "pty.", "os.kill", "os.killpg", "signal.pthread_kill", "winreg.",
               "webbrowser.", "gc.get_")
    PATH_EVENTS = frozenset({"os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "os.symlink",
                             "os.link", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.setxattr",
                             "os.removexattr", "shutil.rmtree", "shutil.move", "shutil.copyfile",
                             "shutil.copytree", "os.chdir", "os.chroot"})
    TWO_PATHS = frozenset({"os.rename", "os.replace", "os.link", "os.symlink", "shutil.move", "shutil.copyfile",
                           "shutil.copytree"})
    LAST_IS_DIR_FD = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.chmod", "os.chown",
                                "os.utime", "shutil.rmtree"})
    TWO_DIR_FDS = frozenset({"os.rename", "os.replace", "os.link"})  # (src, dst, src_dir_fd, dst_dir_fd)
    def resolve(path, base):  # absolute, every symlink followed as the kernel does (os.path.realpath's rule)
        parts = str.split(path, "/")
        if not str.startswith(path, "/"):
            parts = str.split(base, "/") + parts
        parts.reverse()
        done, hops = "", 0
        while parts:
            name = parts.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                done = done[: str.rfind(done, "/")] if done else ""
                continue
            candidate = done + "/" + name
            try:
                link = lstat(candidate).st_mode & 0o170000 == 0o120000
            except OSError:
                link = False
            if not link:
                done = candidate
                continue
            hops += 1
            if hops > 40:
                raise PermissionError(f"sandbox: too many symbolic links in {path!r}")
            target = str.split(readlink(candidate), "/")
            if target[0] == "":
                done = ""
            target.reverse()
            parts += target
        return done or "/"
    def inside(path, dir_fd):  # a path (str or bytes; an int: the file an fd is open on)
        if isinstance(path, int):
            path, dir_fd = readlink("/proc/self/fd/" + int.__repr__(path)), -1
        elif isinstance(path, bytes):
            path = bytes.decode(path, "utf-8", "surrogateescape")
        elif not isinstance(path, str):
            return False  # a path-like object's __fspath__ could name another file when the call runs
        if not isinstance(dir_fd, int) or dir_fd == -1 or dir_fd == -100:  # none given, or AT_FDCWD
            base = getcwd()
        else:
            base = readlink("/proc/self/fd/" + int.__repr__(dir_fd))
        real = resolve(path, base)
        return real == root or str.startswith(real, inside_root)
    def hook(event, args):
        if str.startswith(event, BLOCKED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = (args + (None, None, None))[:3]
            writing = (isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if not writing or isinstance(path, int):
                return
            if mode is None and not (isinstance(path, str) and str.startswith(path, "/")):
                raise PermissionError(f"sandbox: os.open of {path!r} for writing needs a str absolute path")
            if not inside(path, -1):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
        elif event in PATH_EVENTS:
            for i in range(2 if event in TWO_PATHS else 1):
                if i >= len(args):
                    break
                last = args[-1] if len(args) > 1 else None  # shutil.rmtree's event has no dir_fd before 3.11
                dir_fd = last if event in LAST_IS_DIR_FD else args[i + 2] if event in TWO_DIR_FDS else -1
                if not inside(args[i], dir_fd):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the sandbox directory")
    return hook
sys.addaudithook(make_hook(os.path.realpath(os.getcwd())))
source = open("program.py", encoding="utf-8").read()
del make_hook, ctypes, libc
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
    """passed: exit status 0 within the limits; status: "passed", "failed" (exit status != 0: an exception, the
    file-size limit in a PID namespace), "killed" (a signal: the CPU limit, memory, the file-size limit without
    a PID namespace) or "timeout" (wall_s); returncode: the child's (negative:
    the signal), None on timeout; isolation: what held, comma-separated ("netns", "pidns", "nobody"), or
    "hook-only"."""

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

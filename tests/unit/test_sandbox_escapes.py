"""The HumanEval sandbox against programs that attack it from inside (raychat.tasks.sandbox): its audit hook
reads nothing the program can rebind, and no process the program starts outlives run_python."""

import os
import shutil
import signal
import sys
import tempfile
import time

import pytest

from raychat.tasks.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0, max_processes=16)


@pytest.fixture
def open_dir():
    """A directory every user may write (the sandbox runs as nobody when the tests run as root), so only the
    audit hook stands between a program and a file in it."""
    path = tempfile.mkdtemp(prefix="raychat-escape-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Each program rebinds what the hook used to read, then writes outside its directory.
REBINDS = {
    "the runner's globals": "import sys\nm = sys.modules['__main__']\nm.ROOT = ''\nm.BLOCKED = ('nothing',)\n",
    "os.path's functions": "import os, posixpath\nr = os.getcwd()\nposixpath.abspath = lambda p: r\n"
    "posixpath._joinrealpath = lambda *a: (r, True)\nos.fsdecode = lambda p: r\n",
    "the builtins": "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.any = lambda *a: False\n",
}


@pytest.mark.parametrize("rebind", list(REBINDS))
def test_rebinding_what_the_hook_reads_does_not_unblock_a_write(open_dir, rebind):
    target = os.path.join(open_dir, "escaped.txt")
    r = run_python(REBINDS[rebind] + f"open({target!r}, 'w').write('escaped')\n", LIMITS)
    assert (r.passed, r.status, os.path.exists(target)) == (False, "failed", False)
    assert r.stderr.strip().splitlines()[-1] == (
        f"PermissionError: sandbox: writing {target!r} outside the sandbox directory"
    )


def test_rebinding_the_runners_globals_does_not_unblock_subprocess_or_gc():
    prefix = REBINDS["the runner's globals"]
    r = run_python(prefix + "import subprocess\nsubprocess.run(['/bin/true'])\n", LIMITS)
    assert (r.passed, r.stderr.strip().splitlines()[-1]) == (
        False,
        "PermissionError: sandbox: subprocess.Popen is not allowed",
    )
    # gc.get_objects would reach the hook itself, and its closure's cells are writable
    r = run_python("import gc\ngc.get_objects()\n", LIMITS)
    assert r.stderr.strip().splitlines()[-1] == "PermissionError: sandbox: gc.get_objects is not allowed"


def test_a_dir_fd_or_an_fd_does_not_reach_outside(open_dir):
    target = os.path.join(open_dir, "escaped")
    opened = f"import os\nfd = os.open({open_dir!r}, os.O_RDONLY)\n"
    r = run_python(opened + "os.mkdir('escaped', dir_fd=fd)\n", LIMITS)
    assert r.stderr.strip().splitlines()[-1] == (
        "PermissionError: sandbox: os.mkdir on 'escaped' outside the sandbox directory"
    )
    r = run_python(opened + "os.open('escaped', os.O_WRONLY | os.O_CREAT, dir_fd=fd)\n", LIMITS)
    assert r.stderr.strip().splitlines()[-1] == (
        "PermissionError: sandbox: os.open of 'escaped' for writing needs a str absolute path"
    )
    r = run_python(opened + "os.chmod(fd, 0o700)\n", LIMITS)
    assert r.stderr.strip().splitlines()[-1] == (
        "PermissionError: sandbox: os.chmod on 3 outside the sandbox directory"
    )
    assert not os.path.exists(target) and os.stat(open_dir).st_mode & 0o777 == 0o777


def test_its_own_directory_is_still_its_to_use():
    program = (
        "import os, tempfile\nos.mkdir('d')\nos.chdir('d')\nopen('f', 'w').write('1')\nos.rename('f', 'g')\n"
        "fd = os.open('g', os.O_RDONLY)\nos.chmod(fd, 0o600)\nos.remove('g')\nos.chdir('..')\nos.rmdir('d')\n"
        "fd, path = tempfile.mkstemp()\nos.close(fd)\nos.remove(path)\nos.symlink('x', 'link')\n"
        "import shutil\nos.makedirs('t/u')\nshutil.copyfile('program.py', 't/u/p')\nshutil.rmtree('t')\n"
        "with tempfile.TemporaryDirectory() as d:\n    open(os.path.join(d, 'f'), 'w').close()\nprint('done')\n"
    )
    r = run_python(program, LIMITS)
    assert (r.passed, r.stdout) == (True, "done\n")


def _gone(pid: int, within_s: float = 2.0) -> bool:
    """Whether process `pid` has ended (a zombie counts: it runs nothing) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_fork_is_refused_so_no_child_outlives_the_program():
    # the auditor's program: a child that leaves the process group and sleeps (no CPU: RLIMIT_CPU never fires)
    program = (
        "import os, time\npid = os.fork()\nif pid == 0:\n    print(os.readlink('/proc/self'), flush=True)\n"
        "    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint('parent done')\n"
    )
    r = run_python(program, SandboxLimits(cpu_s=2, wall_s=2.0))
    pids = [int(line) for line in r.stdout.split() if line.isdigit()]
    try:
        assert (r.passed, pids) == (False, [])
        assert r.stderr.strip().splitlines()[-1] == "PermissionError: sandbox: os.fork is not allowed"
    finally:
        for pid in pids:  # the unfixed sandbox's survivor
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="_posixsubprocess.fork_exec's 3.11 arguments")
def test_a_process_started_past_the_hook_dies_with_the_program():
    """_posixsubprocess.fork_exec raises no audit event: its child, out of the process group by setsid(),
    dies with the program anyway (it is in the program's PID namespace)."""
    program = (
        "import _posixsubprocess, os, time\nr, w = os.pipe()\n"
        "def child():\n    print(os.readlink('/proc/self'), flush=True)\n    os.setsid()\n    time.sleep(60)\n"
        "_posixsubprocess.fork_exec([b'/bin/true'], [b'/bin/true'], True, (w,), None, None, -1, -1, -1, -1, -1,"
        " -1, r, w, True, False, -1, None, None, None, -1, child, False)\ntime.sleep(0.5)\nprint('parent done')\n"
    )
    r = run_python(program, SandboxLimits(cpu_s=2, wall_s=3.0))
    if "pidns" not in r.isolation.split(","):
        pytest.skip("the kernel refused a PID namespace here")
    pids = [int(line) for line in r.stdout.split() if line.isdigit()]
    try:
        assert len(pids) == 1 and r.stdout.endswith("parent done\n")
        assert _gone(pids[0])
    finally:
        for pid in pids:
            if not _gone(pid, 0):
                os.kill(pid, signal.SIGKILL)


def test_a_program_runs_within_a_process_limit_of_one():
    """The runner forks the PID namespace's init before it becomes `nobody` and sets RLIMIT_NPROC: forked
    after, that fork counted against nobody's processes, so max_processes 1 (no fork for the program) failed
    every program with BlockingIOError, and so did any limit that other processes of uid 65534 filled."""
    r = run_python("print('ok')", SandboxLimits(cpu_s=2, wall_s=5.0, max_processes=1))
    assert (r.passed, r.stdout) == (True, "ok\n"), r.stderr

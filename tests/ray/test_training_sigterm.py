"""SIGTERM (`ray job stop`, `kill`, `docker stop`, Kubernetes) while a training command's local Ray starts: a real
`raychat pretrain` and `raychat rl`, each signalled once its ray.init is under way (its Ray session directory
exists), end in exit status 143 and the run's one line, its lease deleted and no process of its Ray left
(raychat.sigterm.terminating and init_keeping_handler). A SIGTERM once the run trains:
tests/ray/test_train_layout.py; in the checks before Ray: tests/unit/test_bad_input.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.rl_fixtures import tiny_checkpoint
from support.signalled import signalled, wait_ray_starting

from raychat.data.corpus.shards import write_manifest, write_shards

pytestmark = pytest.mark.ray

STARTS_OVER = "stopped before its last step; the same command starts it again: it starts over (no checkpoint was committed)"


def _pretrain(tmp_path: Path, small_tokenizer) -> list[str]:
    small_tokenizer.save(tmp_path / "tok")
    entries = write_shards(
        ["river stone light " * 20] * 16, tmp_path / "data", num_shards=2, log=lambda *_: None
    )
    write_manifest(tmp_path / "data", {"source": "test", "shards": entries})
    return ["pretrain", "--preset", "none", "--data-dir", str(tmp_path / "data"), "--tokenizer-path",
            str(tmp_path / "tok"), "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--seq-len", "32",
            "--device-batch-size", "2", "--total-batch-size", "64", "--num-workers", "1", "--cpus-per-worker", "1",
            "--num-iterations", "2"]  # fmt: skip


def _rl(tmp_path: Path, small_tokenizer) -> list[str]:
    checkpoint = tiny_checkpoint(tmp_path / "sft", small_tokenizer)
    return ["rl", "--preset", "tiny", "--init-from", checkpoint, "--max-operand", "9"]


@pytest.mark.parametrize("stage, argv", [("pretrain", _pretrain), ("rl", _rl)])
def test_sigterm_while_ray_starts_ends_in_the_runs_line_and_exit_143(stage, argv, tmp_path, small_tokenizer):
    """It met Ray's core worker's native handler (`*** SIGTERM received ***`, a stack trace, an abort: exit
    status -6, the lease left behind) or, before that handler was in place, the lease's own (SystemExit raised
    within ray.init, amid its process starts)."""
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "raychat.cli", *argv(tmp_path, small_tokenizer), "--storage-path", str(runs),
               "--run-name", "early"]  # fmt: skip
    out, code, left = signalled(command, wait_ray_starting)
    assert code == 143, out[-3000:]
    assert (
        out.strip().splitlines()[-1]
        == f"raychat {stage}: terminated (SIGTERM): {stage} run 'early' {STARTS_OVER}"
    )
    assert "SIGTERM received" not in out and "Traceback" not in out, out[-3000:]
    assert not (runs / "early" / "lease.json").exists()
    assert left == [], left

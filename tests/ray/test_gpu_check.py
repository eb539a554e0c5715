"""bench/gpu_check.sh (issue 21 item 6) in its --dry-run mode: every code path of the GPU check at tiny sizes on
the CPU (pretraining bf16 vs FP8 with emulated FP8, the engine's decode, the vLLM section, `raychat serve`
answering concurrent streams on a local Ray), so the prepared script is not broken when a GPU is lent."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_gpu_check_dry_run_prints_one_json_line_with_every_section(tmp_path):
    r = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["dry_run"] is True and result["device"] == "cpu"
    bf16, fp8 = result["pretrain_bf16"], result["pretrain_fp8"]
    # depth 2: 7 Linears a block are FP8-eligible at width 128 (ModelConfig.from_depth), the LM head is not
    assert (bf16["fp8_linears"], fp8["fp8_linears"]) == (0, 14)
    assert bf16["tokens_per_s"] > 0 and fp8["tokens_per_s"] > 0 and bf16["mfu"] is None  # no peak on CPU
    assert abs(fp8["last_loss"] - bf16["last_loss"]) < 0.05 * bf16["last_loss"]
    assert set(result["decode_raychat"]) == {"1", "2"} and all(
        v > 0 for v in result["decode_raychat"].values()
    )
    assert "skipped" in result["decode_vllm"] or set(result["decode_vllm"]) == {"1", "2"}
    assert "error" not in result["serve"], result["serve"]
    assert result["serve"]["finished"] == result["serve"]["streams"] == 4, result["serve"]

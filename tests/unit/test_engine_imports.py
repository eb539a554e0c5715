"""Importing the engine does not import torch._dynamo (torch.compile's 1-3.5 s of imports): FlexAttention and
the lower-right causal bias are imported where used, so a training job's driver and workers, which import
raychat.engine through the validators, start without it (bench/results/job_startup.md)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_engine_import_leaves_dynamo_out():
    code = "import sys, json, raychat.engine, raychat.train.pretrain; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = set(json.loads(out.strip().splitlines()[-1]))
    assert "raychat.engine.attention" in modules
    assert "torch._dynamo" not in modules

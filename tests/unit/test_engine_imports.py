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


def test_cpu_prefix_cache_hit_and_chunked_prefill_leave_dynamo_out():
    """The "lower_right" plan (the rest of a prompt after a prefix-cache hit, a later prefill chunk) uses the
    dense mask on CPU: a serving replica's first cache hit does not import torch._dynamo (~0.9 s)."""
    code = """
import json, sys
sys.path.insert(0, "tests")
from support.engine_fixtures import byte_tokenizer, tiny_gpt
from raychat.engine import ModelRunner
tok = byte_tokenizer()
engine = ModelRunner(tiny_gpt(tok), tok, prefill_chunk_tokens=16)
prompt = [tok.bos_id, *range(40, 80)]
engine.generate_batch([prompt], max_tokens=2, temperature=0.0)  # 41 tokens: chunks of 16 (lower_right)
engine.generate_batch([prompt], max_tokens=2, temperature=0.0)  # 2 cached blocks, then the rest
print(json.dumps([engine.prefix_cache.hits, "torch._dynamo" in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    hits, dynamo = json.loads(out.strip().splitlines()[-1])
    assert hits == 32  # (41 - 1) // 16 = 2 whole blocks reused, the last prompt token recomputed
    assert dynamo is False

"""A training job's start-up (bench/results/job_startup_cluster.md): the lines its processes write with
RAYCHAT_STARTUP_TRACE (nothing without it), the plan its driver makes before Ray Train starts (without
torch._dynamo), and the validation rows a pretraining worker builds before its first step (only the documents
they need are tokenized; the rows are those of tokenizing the whole shard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from raychat.data.loader.packing import BestFitPacker
from raychat.data.loader.pipeline import validation_rows
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer
from raychat.train import startup_trace
from raychat.train.startup_trace import TRACE_ENV, mark, process_start_time


def test_mark_writes_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    mark("driver_imports_done")
    assert list(tmp_path.iterdir()) == []


def test_mark_writes_the_process_start_once_then_each_event(tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(startup_trace, "_started", set())
    before = time.time()
    mark("worker_fn_start")
    mark("first_batch")
    lines = [line.split() for line in trace.read_text().splitlines()]
    assert [(w[0], w[1], w[3], w[4]) for w in lines] == [
        ("startup", event, f"pid={os.getpid()}", "rank=1")
        for event in ("process_start", "worker_fn_start", "first_batch")
    ]
    started, first, second = (float(w[2]) for w in lines)
    assert started < before - 0.001 <= first <= second <= time.time() + 0.001  # written to the ms


def test_process_start_time_is_the_one_psutil_reads():
    # psutil: boot time (whole seconds) + the same /proc/self/stat field; ours takes the boot time from
    # /proc/uptime (10 ms), so they agree within a second
    assert abs(process_start_time() - psutil.Process().create_time()) < 1.0
    assert process_start_time() < time.time()


class CountingTokenizer:
    def __init__(self, tok: Tokenizer):
        self.tok, self.encoded = tok, 0

    def encode_batch(self, texts, prepend_bos=False):
        self.encoded += len(texts)
        return self.tok.encode_batch(texts, prepend_bos=prepend_bos)


def test_validation_rows_tokenize_only_what_they_pack(tmp_path):
    texts = [f"document {i} " + "word " * (i % 7 + 1) for i in range(1000)]
    tok = Tokenizer.train(texts, vocab_size=300)
    path = tmp_path / "val.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    counting = CountingTokenizer(tok)
    rows = validation_rows(str(path), counting, row_len=17, num_tokens=64, buffer_size=8)
    # the whole shard tokenized at once, packed the same way: the first N = 64 // 16 rows
    docs = iter(tok.encode_batch(texts, prepend_bos=True))
    packer = BestFitPacker(lambda: next(docs, None), 17, 8, "crop")
    expected = np.stack([r for _, r in zip(range(4), packer)])
    assert rows["input_ids"].shape == (4, 17)
    assert np.array_equal(rows["input_ids"], expected)
    assert counting.encoded == 64  # one chunk of 64 texts of the 1,000


def test_the_driver_plans_without_torch_dynamo_and_counts_what_the_workers_build():
    # make_plan builds the model on the meta device with its initializers skipped (ShapesOnly): the counts
    # are those of the model a worker builds, and torch._dynamo (the meta kernels' import) stays out
    code = (
        "import sys, json; from raychat.config import TrainConfig; from raychat.train.plan import make_plan; "
        "p = make_plan(TrainConfig(), 512); "
        "print(json.dumps([p.model_config, p.num_params, p.flops_per_token, 'torch._dynamo' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    model_config, num_params, flops, dynamo = json.loads(out.strip().splitlines()[-1])
    built = GPT(ModelConfig(**model_config))
    assert (num_params, flops) == (built.num_params(), built.flops_per_token(model_config["max_seq_len"]))
    assert dynamo is False

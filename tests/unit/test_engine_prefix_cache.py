"""The prefix cache (engine/prefix_cache.py): greedy output with it equals output without it, token for token,
across conversation turns (chunked prefill, aligned or not), a system prompt shared by concurrent requests,
calculator turns and generate_batch; hits are the block-aligned counts worked out by hand; entries from other
weights are never reused; a pool too small for the traffic evicts (least recently used, the deepest block
first; held blocks never) and fails nothing; a copy into or out of the pool that raises (out of memory) caches
and holds nothing and fails nothing; the serving options reach the engine."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch
from support.engine_fixtures import byte_tokenizer, reference_greedy, tiny_gpt
from support.serve_helpers import write_tiny_checkpoint

from raychat.chat.cli import assistant_message
from raychat.chat_template import render_for_completion
from raychat.checkpoint import load_model
from raychat.engine import KVCache, ModelRunner, SamplingParams, Scheduler
from raychat.engine.prefix_cache import BLOCK_TOKENS, PrefixCache, block_digests
from raychat.metrics import ServeMetrics
from raychat.serve.app import build_app, serve_config
from raychat.serve.server import ChatServer

GREEDY = dict(temperature=0.0)
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_gpt(tok, max_seq_len=512)


def stop_ids(tok):
    return {tok.special_id("<|assistant_end|>"), tok.bos_id}


def run(sched, prompt, max_tokens):
    events = list(sched.submit(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)))
    return [t for e in events for t in e.token_ids], events[-1].usage


# ---- the pool ---------------------------------------------------------------------------------------------
def test_block_digests_chain_the_prefix_and_the_weight_version():
    tokens = list(range(40))
    d = block_digests(tokens, 2, version=7)
    root = hashlib.blake2b(b"raychat-prefix:7", digest_size=16).digest()
    first = hashlib.blake2b(root + array("q", range(16)).tobytes(), digest_size=16).digest()
    assert d[0] == first
    assert d[1] == hashlib.blake2b(first + array("q", range(16, 32)).tobytes(), digest_size=16).digest()
    # the same second block after another first block, or under other weights, is another key
    assert block_digests([99, *tokens[1:]], 2, 7)[1] != d[1]
    assert block_digests(tokens, 2, 8)[0] != d[0]


def _filled_cache(rows=2, max_len=64):
    cache = KVCache(n_layer=2, batch_size=rows, n_kv_head=1, max_len=max_len, head_dim=2)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def test_insert_then_load_copies_the_blocks_at_their_original_positions():
    cache = _filled_cache()
    pc = PrefixCache(2, 1, 2, capacity_tokens=64)
    pc.sync(1)
    tokens = list(range(40))  # 2 reusable blocks: (40 - 1) // 16
    digests = pc.digests(tokens)
    assert len(digests) == 2
    cache.lengths[0] = 40
    held = pc.insert(cache, 0, tokens, digests, 0)
    pc.release(held, pc.epoch)
    ids = pc.match(tokens, digests)
    assert ids == held and pc.load(cache, 1, ids, 0) == 32 and int(cache.lengths[1]) == 32
    assert torch.equal(cache.k[:, 1, :, :32], cache.k[:, 0, :, :32])
    assert torch.equal(cache.v[:, 1, :, :32], cache.v[:, 0, :, :32])
    # a prefix that differs in its second block matches the first block only
    other = tokens[:16] + [7] * 24
    assert pc.match(other, pc.digests(other)) == ids[:1]


def test_lru_evicts_the_deepest_unheld_block_first_and_never_a_held_one():
    cache = _filled_cache(rows=1)
    cache.lengths[0] = 64
    pc = PrefixCache(2, 1, 2, capacity_tokens=3 * BLOCK_TOKENS)  # 3 blocks
    pc.sync(1)
    a, b, c = ([x] * 40 for x in (1, 2, 3))
    held_a = pc.insert(cache, 0, a, pc.digests(a), 0)
    pc.release(held_a, pc.epoch)  # a0 a1: unheld, a1 (the deeper) first in line
    held_b = pc.insert(cache, 0, b, pc.digests(b), 0)  # b0 takes the free block, b1 evicts a1
    assert pc.match(a, pc.digests(a)) == held_a[:1] and pc.num_cached == 3 and pc.num_blocks == 3
    # every block but one is held: c gets the one free block, then stops (no exception, no eviction of b)
    assert len(pc.insert(cache, 0, c, pc.digests(c), 0)) == 1
    assert pc.match(b, pc.digests(b)) == held_b
    pc.release(held_b, pc.epoch)


def test_a_new_weight_version_drops_every_entry_and_voids_old_holds():
    cache = _filled_cache(rows=1)
    cache.lengths[0] = 40
    pc = PrefixCache(2, 1, 2, capacity_tokens=64)
    pc.sync(1)
    tokens = list(range(40))
    held, epoch = pc.insert(cache, 0, tokens, pc.digests(tokens), 0), pc.epoch
    pc.sync(2)
    assert pc.num_cached == 0 and pc.match(tokens, pc.digests(tokens)) == []
    pc.release(held, epoch)  # a hold from before the clear: ignored
    assert len(pc._lru) == 0


@pytest.mark.parametrize("bad", [8, -1, "big", 2.5, "AUTO"])
def test_bad_capacity_is_a_one_line_error_naming_every_allowed_value(tok, model, bad):
    with pytest.raises(ValueError) as e:
        ModelRunner(model, tok, prefix_cache_tokens=bad)
    assert (
        str(e.value)
        == f"prefix_cache_tokens must be 'auto', an int >= 16 (one block) or 0 (off), got {bad!r}"
    )


# ---- a copy that raises (an out-of-memory error for its temporary on a GPU) --------------------------------
OOM = "CUDA out of memory (simulated)"


def fail_once(monkeypatch, which):
    """Make the next torch.Tensor.index_select call for which(tensor, dim) True raise torch.OutOfMemoryError;
    returns the list of calls that raised."""
    index_select, raised = torch.Tensor.index_select, []

    def flaky(self, dim, index):
        if not raised and which(self, dim):
            raised.append(dim)
            raise torch.OutOfMemoryError(OOM)
        return index_select(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", flaky)
    return raised


def insert_copy(t, dim):
    return dim == 2  # insert's read of the row (load reads the pool along dim 1)


def test_an_insert_whose_copy_raises_caches_and_holds_nothing_new(monkeypatch):
    cache = _filled_cache(rows=1)
    cache.lengths[0] = 64
    pc = PrefixCache(2, 1, 2, capacity_tokens=4 * BLOCK_TOKENS)  # 4 blocks, free list [3, 2, 1, 0]
    pc.sync(1)
    a, b = list(range(40)), list(range(60))  # 2 blocks; the same 2 and a third
    pc.release(pc.insert(cache, 0, a, pc.digests(a), 0), pc.epoch)  # blocks 0, 1
    raised = fail_once(monkeypatch, insert_copy)
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory \(simulated\)$"):
        pc.insert(cache, 0, b, pc.digests(b), 0)  # holds 0 and 1, takes block 2 for the third
    assert raised == [2]
    # the third block is free again and not in the index; 0 and 1 stay cached, unheld, 1 first in line
    assert (pc.num_cached, pc._refs, pc._free, list(pc._lru)) == (2, {}, [3, 2], [1, 0])
    assert pc.match(b, pc.digests(b)) == [0, 1]
    held = pc.insert(cache, 0, b, pc.digests(b), 0)
    assert held == [0, 1, 2] and pc.num_cached == 3 and pc._refs == {0: 1, 1: 1, 2: 1}


PROMPT = "a prefix that fails to cache, then is asked again"  # 49 tokens + BOS: 3 reusable blocks, 48 tokens
OTHER = "another prompt of fifty tokens, asked two times!!"  # the same length


def test_a_scheduler_insert_that_raises_costs_the_caching_never_the_output(tok, model, monkeypatch):
    """The index named blocks whose copy had raised (never written) and held them forever: the next request
    with the prompt loaded 48 tokens of garbage keys/values and answered other tokens, with no error."""
    sched = Scheduler(ModelRunner(model, tok, prefix_cache_tokens=256), max_slots=2)
    pc = sched.engine.prefix_cache
    prompt = [tok.bos_id, *tok.encode(PROMPT)]
    want = reference_greedy(model, prompt, 8, stop_ids(tok))
    raised = fail_once(monkeypatch, insert_copy)
    tokens, usage = run(sched, prompt, 8)
    monkeypatch.undo()
    assert raised == [2] and str(sched.last_error) == OOM
    assert (tokens, usage.cached_tokens) == (want, 0)
    assert (pc.num_cached, pc._refs, len(pc._free)) == (0, {}, pc.num_blocks)
    tokens, usage = run(sched, prompt, 8)  # computed, and cached this time
    assert (tokens, usage.cached_tokens) == (want, 0)
    tokens, usage = run(sched, prompt, 8)
    assert (tokens, usage.cached_tokens, pc._refs) == (want, 48, {})


def test_a_scheduler_load_that_raises_leaves_no_hold(tok, model, monkeypatch):
    """The blocks were acquired before the copy and never released when it raised: held forever, a pool of
    3 blocks could cache nothing again."""
    sched = Scheduler(ModelRunner(model, tok, prefix_cache_tokens=3 * BLOCK_TOKENS), max_slots=1)
    pc = sched.engine.prefix_cache
    prompt, other = ([tok.bos_id, *tok.encode(t)] for t in (PROMPT, OTHER))
    want = reference_greedy(model, prompt, 2, stop_ids(tok))
    assert run(sched, prompt, 2)[0] == want and (pc.num_cached, pc._refs) == (3, {})
    raised = fail_once(monkeypatch, lambda t, dim: t is pc.k)  # load's gather from the pool
    tokens, usage = run(sched, prompt, 2)
    monkeypatch.undo()
    assert raised == [1] and str(sched.last_error) == OOM
    assert (tokens, usage.cached_tokens, pc._refs, pc.num_cached) == (want, 0, {}, 3)
    run(sched, other, 2)  # evicts the 3 blocks for its own
    assert run(sched, other, 2)[1].cached_tokens == 48 and pc._refs == {}


def test_generate_batch_goes_on_without_the_cache_when_a_copy_raises(tok, model, monkeypatch, caplog):
    """generate_batch did not catch a cache failure: the call raised (a request failed because of the cache),
    and the blocks it had put in the index unwritten fed the next call."""
    engine = ModelRunner(model, tok, prefix_cache_tokens=256)
    pc = engine.prefix_cache
    prompt = [tok.bos_id, *tok.encode(PROMPT)]
    want = reference_greedy(model, prompt, 8, stop_ids(tok))

    def call():
        return engine.generate_batch([prompt], max_tokens=8, **GREEDY)[0].completion_tokens

    raised = fail_once(monkeypatch, insert_copy)
    with caplog.at_level("WARNING", logger="raychat.engine.runner"):
        assert call() == want
    monkeypatch.undo()
    assert raised == [2] and (pc.num_cached, pc._refs, pc.hits) == (0, {}, 0)
    assert call() == want and pc.hits == 0  # nothing to reuse; cached now
    raised = fail_once(monkeypatch, lambda t, dim: t is pc.k)
    with caplog.at_level("WARNING", logger="raychat.engine.runner"):
        assert call() == want
    monkeypatch.undo()
    assert raised == [1] and (pc.num_cached, pc._refs, pc.hits) == (3, {}, 0)
    assert call() == want and pc.hits == 48
    assert [(r.getMessage(), str(r.exc_info[1])) for r in caplog.records] == [
        ("prefix cache: caching prompt 0's blocks failed", OOM),
        ("prefix cache: loading prompt 0's blocks failed; computing them", OOM),
    ]


# ---- exactness in the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [512, 7])  # whole prompts, and chunks that end inside blocks
def test_conversation_turns_equal_no_cache_and_reuse_the_history(tok, model, chunk):
    on = Scheduler(ModelRunner(model, tok), max_slots=2, max_len=512, prefill_chunk_tokens=chunk)
    off = Scheduler(
        ModelRunner(model, tok, prefix_cache_tokens=0), max_slots=2, max_len=512, prefill_chunk_tokens=chunk
    )
    history, previous = [tok.bos_id, *tok.encode("You are a terse assistant. " * 2)], None
    for turn in range(4):
        prompt = history + tok.encode(f" user {turn}: tell me more")
        got, usage = run(on, prompt, 10)
        assert got == run(off, prompt, 10)[0] == reference_greedy(model, prompt, 10, stop_ids(tok))
        # reused: the previous turn's prompt + reply in whole blocks (its last sampled token has no KV
        # yet), at most the blocks before the prompt's last token
        expect = 0 if previous is None else 16 * min((previous - 1) // 16, (len(prompt) - 1) // 16)
        assert usage.cached_tokens == expect and usage.prompt_tokens == len(prompt)
        history, previous = prompt + got, len(prompt) + len(got)
    assert expect > 0


def test_concurrent_requests_share_a_system_prompt(tok, model):
    system = [tok.bos_id, *tok.encode("s" * 99)]  # 100 tokens: 6 whole blocks
    prompts = [system + tok.encode(f" question {i}?") for i in range(4)]
    sched = Scheduler(ModelRunner(model, tok), max_slots=4, max_len=256, prefill_chunk_tokens=32)
    streams = [sched.submit(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts]
    for p, s in zip(prompts, streams):
        events = list(s)
        assert [t for e in events for t in e.token_ids] == reference_greedy(model, p, 6, stop_ids(tok))
        # the first computes the system prompt in 32-token chunks; the others start once its blocks exist
        assert events[-1].usage.cached_tokens == (0 if p is prompts[0] else 96)


def test_calculator_turns_equal_no_cache(tool_checkpoint):
    model, tok, _ = load_model(tool_checkpoint)
    outs = {}
    for cap in ("auto", 0):
        sched = Scheduler(ModelRunner(model, tok, prefix_cache_tokens=cap), max_slots=1)
        messages, turns = [], []
        for question in ("What is 47 * 12?", "And 5 + 6?"):
            messages.append({"role": "user", "content": question})
            got, usage = run(sched, render_for_completion(tok, messages), 64)
            messages.append(assistant_message(tok, got))
            turns.append((got, usage.cached_tokens))
        outs[cap] = turns
    assert [t for t, _ in outs["auto"]] == [t for t, _ in outs[0]]
    assert tok.decode(outs["auto"][1][0]).endswith("#### 11<|assistant_end|>")
    assert outs["auto"][1][1] > 0 and outs[0][1][1] == 0  # turn 2 reused turn 1 (with its tool output)


def test_generate_batch_reuses_prompts_and_never_across_weights(tok, model):
    model = copy.deepcopy(model)
    engine = ModelRunner(model, tok)
    prompts = [[tok.bos_id, *tok.encode(t)] for t in ("k" * 50, "short one", "q" * 33)]
    ref = [reference_greedy(model, p, 5, stop_ids(tok)) for p in prompts]
    for _ in range(2):
        res = engine.generate_batch(prompts, num_samples=2, max_tokens=5, **GREEDY)
        assert [r.completion_tokens for r in res] == [x for x in ref for _ in range(2)]
    # second call: 48 of "k"*50 (51 tokens), 0 of 10, 32 of 34
    pc = engine.prefix_cache
    assert (pc.hits, pc.queries) == (48 + 32, 2 * (51 + 10 + 34))
    with torch.no_grad():  # new weights in place (an RL weight sync does load_state_dict)
        model.lm_head.weight.mul_(-1.0)
    res = engine.generate_batch(prompts, max_tokens=5, **GREEDY)
    assert pc.hits == 80  # nothing reused from the old weights
    assert [r.completion_tokens for r in res] == [
        reference_greedy(model, p, 5, stop_ids(tok)) for p in prompts
    ]
    engine.refresh_weights()  # writes behind torch's back: also a new version
    engine.generate_batch(prompts, max_tokens=5, **GREEDY)
    assert pc.hits == 80


def test_a_pool_too_small_for_the_traffic_evicts_and_fails_nothing(tok, model):
    sched = Scheduler(
        ModelRunner(model, tok, prefix_cache_tokens=2 * BLOCK_TOKENS), max_slots=3, max_len=256,
        prefill_chunk_tokens=24,
    )  # fmt: skip
    prompts = [[tok.bos_id, *tok.encode(chr(97 + i) * 60)] for i in range(6)]
    streams = [sched.submit(p, SamplingParams(max_tokens=5, **GREEDY)) for p in prompts]
    for p, s in zip(prompts, streams):
        events = list(s)
        assert events[-1].finish_reason == "length"
        assert [t for e in events for t in e.token_ids] == reference_greedy(model, p, 5, stop_ids(tok))
    pc = sched.engine.prefix_cache
    assert pc.num_blocks == 2 and not pc._refs  # never grew past capacity; every hold released


# On the CPU, in a process whose address space is capped (RLIMIT_AS) just above what generation needs: the
# pool's first growth (k and v, 16 MiB each: 8 layers x 64 blocks x 8 heads x 16 tokens x 64 x 4 B) cannot be
# allocated. Prints what the test asserts.
_CPU_OOM = """
import json, resource, torch
from support.engine_fixtures import byte_tokenizer, reference_greedy
from raychat.engine import ModelRunner
from raychat.model import GPT, ModelConfig
torch.set_num_threads(1)
tok = byte_tokenizer()
cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=8, n_embd=64, n_head=8, n_kv_head=8, head_dim=64,
                  intermediate_size=128, max_seq_len=128)
torch.manual_seed(0)
model = GPT(cfg).eval()
prompt = [tok.bos_id, *range(65, 105)]
stop = {tok.special_id("<|assistant_end|>"), tok.bos_id}
want = reference_greedy(model, prompt, 4, stop)
engine = ModelRunner(model, tok, prefix_cache_tokens=64 * 16)
off = ModelRunner(model, tok, prefix_cache_tokens=0)
for _ in range(3):  # generation's own allocations, freed and made again, before the cap
    assert off.generate_batch([prompt], max_tokens=4, temperature=0.0)[0].completion_tokens == want
vm = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    torch.empty(8 << 20)  # 32 MiB: this is what the cap refuses
    refused = ""
except RuntimeError as e:
    refused = str(e)
got = [engine.generate_batch([prompt], max_tokens=4, temperature=0.0)[0].completion_tokens for _ in range(2)]
pc = engine.prefix_cache
print(json.dumps({"refused": refused, "equal": got == [want, want], "max_blocks": pc.max_blocks,
                  "num_blocks": pc.num_blocks, "hits": pc.hits}))
"""


def test_a_cpu_allocation_failure_while_the_pool_grows_caps_it_and_fails_nothing():
    """The pool catches an allocation failure while growing and caps itself where it is (the request goes on
    uncached). It caught torch.OutOfMemoryError only, which is CUDA's: the CPU allocator raises a plain
    RuntimeError, so on a CPU engine short of memory generate_batch failed. Run for real in a capped process
    (no mock): both calls give the reference tokens, and the pool stayed empty, capped at 0 blocks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _CPU_OOM], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "can't allocate memory" in out["refused"]  # the cap holds: a real CPU allocation failure
    assert out == {**out, "equal": True, "max_blocks": 0, "num_blocks": 0, "hits": 0}


# ---- serving options --------------------------------------------------------------------------------------
def test_serving_option_reaches_the_engine(tmp_path):
    assert serve_config({"checkpoint": "c"}).replica.prefix_cache_tokens is None
    assert serve_config({"checkpoint": "c", "prefix_cache_tokens": "0"}).replica.prefix_cache_tokens == 0
    write_tiny_checkpoint(tmp_path)
    app = build_app({"checkpoint": str(tmp_path), "prefix_cache_tokens": 256, "allow_unauthenticated": True})
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine.init_kwargs["limits"]["prefix_cache_tokens"] == 256
    for cap, blocks in ((0, None), (256, 16), ("auto", None)):
        server = ChatServer.from_checkpoint(tmp_path, "cpu", prefix_cache_tokens=cap)
        try:
            pc = server.scheduler.engine.prefix_cache
            if cap == "auto":
                assert pc.max_blocks == 8 * server.scheduler.engine.config.max_seq_len // 16
            else:
                assert (pc and pc.max_blocks) == blocks
        finally:
            server.scheduler.stop()


def test_a_replica_counts_queries_and_hits_per_request(tok, model, monkeypatch):
    """ChatServer adds each finished request's prompt tokens (queries) and cached tokens (hits) to the
    raychat_prefix_cache_* counters; the second identical request reuses every whole block but the last
    token's."""
    counted = []
    monkeypatch.setattr(
        ServeMetrics, "add_prefix_cache", lambda self, queries, hits: counted.append((queries, hits))
    )
    request = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 3, "temperature": 0}
    server = ChatServer(model, tok, max_slots=1)

    async def twice():
        for _ in range(2):
            [ev async for ev in server.generate(request)]

    try:
        asyncio.run(twice())
    finally:
        server.shutdown()
    n = len(render_for_completion(tok, request["messages"]))
    assert counted == [(n, 0), (n, 16 * ((n - 1) // 16))]


def test_the_pool_stores_the_kv_cache_dtype(tok, model):
    engine = ModelRunner(copy.deepcopy(model), tok, kv_dtype="bfloat16")
    prompts = [[tok.bos_id, *tok.encode("b" * 40)]]
    first = engine.generate_batch(prompts, max_tokens=4, **GREEDY)
    second = engine.generate_batch(prompts, max_tokens=4, **GREEDY)
    pc = engine.prefix_cache
    assert pc.k.dtype == torch.bfloat16 and pc.hits == 32  # 2 of (41 - 1) // 16 blocks reused
    assert len(first[0].completion_tokens) == len(second[0].completion_tokens) == 4

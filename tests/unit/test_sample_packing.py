import numpy as np
import pyarrow as pa
import pytest
import torch

from raychat.chat_template import render_conversation
from raychat.data.loader.sample_packing import (
    PackItem,
    SamplePacker,
    compare_packing,
    rows_to_batch,
    stack_rows,
)
from raychat.loss import cross_entropy_sum
from raychat.model import GPT, ModelConfig


def item(name, length, first=1):
    ids = np.arange(first, first + length, dtype=np.int32)
    sup = np.ones(length, dtype=np.int32)
    sup[0] = 0
    return PackItem(name, ids, sup, {"dropped": False})


def test_best_fit_hand_example_and_token_efficiency():
    # lengths 5,3,4,2,6 into rows of 8: longest that fits first -> [6,2], [5,3], [4,pad*4]
    items = [item("a", 5), item("b", 3), item("c", 4), item("d", 2), item("e", 6)]
    packer = SamplePacker.from_items(items, row_len=8, pad_id=0, buffer_size=8)
    rows = list(packer)
    assert [r["sample_ids"] for r in rows] == [["e", "d"], ["a", "b"], ["c"]]
    assert rows[0]["segment_ids"].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert rows[2]["segment_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rows[2]["input_ids"].tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    assert rows[2]["supervised"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert rows[1]["segment_offsets"].tolist() == [0, 5] and rows[1]["segment_lengths"].tolist() == [5, 3]
    assert rows[0]["input_ids"].dtype == np.int32
    assert packer.stats.token_efficiency == pytest.approx(20 / 24)
    eff = compare_packing(items, row_len=8, pad_id=0, buffer_size=8)
    assert eff["bestfit"]["token_efficiency"] == pytest.approx(20 / 24)
    assert (eff["pad"]["rows"], eff["pad"]["token_efficiency"]) == (5, pytest.approx(20 / 40))


def test_over_long_sample_is_rejected_not_buffered():
    packer = SamplePacker.from_items([item("ok", 3), item("huge", 9)], row_len=8, pad_id=0)
    with pytest.raises(ValueError, match="'huge' has 9 tokens"):
        list(packer)


def test_pad_equal_to_eos_keeps_first_eos_and_ignores_padding():
    eos = 9
    sample = PackItem("s", np.array([5, 6, 7, eos], np.int32), np.array([0, 1, 1, 1], np.int32))
    rows = stack_rows(list(SamplePacker.from_items([sample], row_len=6, pad_id=eos, mode="pad")))
    assert rows["input_ids"].tolist() == [[5, 6, 7, eos, eos, eos]]
    b = rows_to_batch(rows, bos_id=0)
    assert b["labels"].tolist() == [[6, 7, eos, eos, eos]]
    assert b["loss_mask"].tolist() == [[True, True, True, False, False]]
    _, n = cross_entropy_sum(torch.zeros(1, 5, 10), b["labels"], b["loss_mask"])
    assert n.item() == 3


def test_two_packed_conversations_match_each_alone(small_tokenizer):
    tok = small_tokenizer
    c1 = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi, how are you?"}]
    c2 = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "It is 408."}]
    r1, r2 = render_conversation(tok, c1), render_conversation(tok, c2)
    n1, n2 = len(r1), len(r2)
    L = n1 + n2 + 3
    items = [PackItem.from_rendered("c1", r1), PackItem.from_rendered("c2", r2)]
    rows = stack_rows(list(SamplePacker.from_items(items, L, pad_id=tok.bos_id, buffer_size=1)))
    assert rows["sample_ids"] == [["c1", "c2"]]
    b = rows_to_batch(rows, tok.bos_id)
    # positions restart at the second sample's BOS; padding restarts too
    assert b["position_ids"][0].tolist() == [*range(n1), *range(n2), 0, 1]
    # no label crosses the boundary: the position before c2's BOS predicts nothing
    assert b["labels"][0, n1 - 1].item() == tok.bos_id and not b["loss_mask"][0, n1 - 1]
    assert b["loss_mask"][0].sum().item() == r1.num_targets + r2.num_targets

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_kv_head=2,
        head_dim=16,
        intermediate_size=128,
        max_seq_len=L,
    )
    model = GPT(cfg).init_weights(seed=0)
    with torch.no_grad():  # zero-init projections make blocks identity; perturb so attention matters
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0, 0.1)
        packed = model(b["input_ids"], position_ids=b["position_ids"], segment_ids=b["segment_ids"])
        alone = model(torch.tensor([r2.ids[:-1]]))
        alone1 = model(torch.tensor([r1.ids]))
    torch.testing.assert_close(packed[0, n1 : n1 + n2 - 1], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[0, :n1], alone1[0], atol=1e-5, rtol=0)
    # without the document mask the second sample would read the first: the check can fail
    leaky = model(b["input_ids"])
    assert (leaky[0, n1 : n1 + n2 - 1] - alone[0]).abs().max() > 1e-3


def test_exact_resume_from_state_dict():
    items = [item(f"s{i}", n) for i, n in enumerate([5, 3, 7, 2, 6, 4, 1, 8, 3, 5])]
    for i, it in enumerate(items):
        it.ref = i

    def source(start):
        pos = {"i": start}

        def nxt():
            if pos["i"] >= len(items):
                return None
            pos["i"] += 1
            return items[pos["i"] - 1]

        return nxt, pos

    nxt, _ = source(0)
    full = [r["sample_ids"] for r in SamplePacker(nxt, 8, 0, buffer_size=3)]
    nxt, pos = source(0)
    first = SamplePacker(nxt, 8, 0, buffer_size=3)
    head = [first.next_row()["sample_ids"], first.next_row()["sample_ids"]]
    state, at = first.state_dict(), pos["i"]
    nxt, _ = source(at)
    resumed = SamplePacker(nxt, 8, 0, buffer_size=3)
    assert state["buffer"] == [it.ref for it in first.buffered()]  # references, not tokens
    resumed.load_state_dict(state, [items[r] for r in state["buffer"]])
    assert head + [r["sample_ids"] for r in resumed] == full
    assert resumed.stats.rows == len(full)


def test_rows_go_through_pyarrow_unchanged(small_tokenizer):
    items = [item("a", 5), item("b", 3)]
    rows = list(SamplePacker.from_items(items, 8, 0))
    table = pa.Table.from_pylist(rows)
    back = table.to_pylist()
    assert back[0]["input_ids"] == rows[0]["input_ids"].tolist()
    assert back[0]["segment_ids"] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert back[0]["sample_ids"] == ["a", "b"]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        SamplePacker(lambda: None, 8, 0, mode="greedy")
    with pytest.raises(ValueError, match="row_len must be >= 2"):
        SamplePacker(lambda: None, 1, 0)

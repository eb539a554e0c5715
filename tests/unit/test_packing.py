import numpy as np
import pytest

from raychat.data.loader.best_fit import BestFitBuffer
from raychat.data.loader.packing import BestFitPacker, Piece, piece_tokens

BOS = 0


def doc(n, tag):
    return [BOS] + [tag] * (n - 1)


def stream(docs):
    it = iter(docs)
    return lambda: next(it, None)


def test_the_buffer_gives_the_longest_that_fits_the_earliest_of_equal_lengths_first():
    """Both packers' buffer: lengths 3, 5, 5, 2, 2 arrive as a, b, c, d, e."""
    buffer = BestFitBuffer()
    for item in ("aaa", "bbbbb", "ccccc", "dd", "ee"):
        buffer.push(item)
    assert buffer.take_fitting(1) is None  # nothing that short
    assert [buffer.take_fitting(4), buffer.take_fitting(9)] == ["aaa", "bbbbb"]
    assert buffer.take_shortest() == "dd"
    assert len(buffer) == 2 and buffer.in_arrival_order() == ["ccccc", "ee"]
    buffer.push("ff")  # the newest arrival: after e among the 2-token items
    assert [buffer.take_fitting(2), buffer.take_fitting(2), buffer.take_fitting(2)] == ["ee", "ff", None]


def test_best_fit_crops_the_shortest_when_nothing_fits():
    # a 100-token document (the earliest of two) fills 100 of 150, leaving capacity 50 with the
    # buffer holding [500, 200, 100, 300]
    docs = [doc(100, 1), doc(500, 2), doc(200, 3), doc(100, 4), doc(300, 5)]
    packer = BestFitPacker(stream(docs), row_len=150, buffer_size=5)
    row = packer.next_row()
    assert row.tolist() == doc(100, 1) + doc(100, 4)[:50]  # the 100-token one is cropped, not the first
    assert packer.stats.dropped == 50
    assert packer.stats.placed == 150
    assert packer.stats.consumed == 200 == packer.stats.placed + packer.stats.dropped
    assert sorted(len(p) for p in packer.buffered()) == [200, 300, 500]


def test_split_requeues_the_tail_after_a_bos():
    # remaining capacity 50, buffered [500, 200, 100, 300]: 50 tokens of the 100-token document are placed and
    # its 50-token tail goes back into the buffer after a BOS (51 tokens); nothing is discarded
    docs = [doc(100, 1), doc(500, 2), doc(200, 3), doc(100, 4), doc(300, 5)]
    packer = BestFitPacker(stream(docs), row_len=150, buffer_size=5, overflow="split", min_fragment=8)
    row, segments = packer.pack_row()
    assert row.tolist() == doc(100, 1) + doc(100, 4)[:50]
    s = packer.stats
    assert (s.consumed, s.placed, s.dropped, s.requeued, s.splits) == (200, 150, 0, 50, 1)
    assert s.placed + s.dropped + s.requeued == s.consumed
    assert [(g.doc, g.offset, g.row_offset, g.length, g.decision, g.tail) for g in segments] == [
        (0, 0, 0, 100, "whole", 0),
        (3, 0, 100, 50, "split", 50),
    ]
    tail = [p for p in packer.buffered() if p.doc == 3]
    assert [(p.offset, p.tokens.tolist()) for p in tail] == [(50, [BOS] + [4] * 50)]
    assert sorted(len(p) for p in packer.buffered()) == [51, 200, 300, 500]
    # next row: the 51-token tail fits whole (longest that fits 150), then 99 left: the 200 is the shortest
    # and splits at 99, its tail of 101 tokens requeued from document offset 99
    row, segments = packer.pack_row()
    assert row.tolist() == [BOS] + [4] * 50 + doc(200, 3)[:99]
    assert [(g.doc, g.offset, g.length, g.decision, g.tail) for g in segments] == [
        (3, 50, 51, "whole", 0),
        (2, 0, 99, "split", 101),
    ]
    assert [(p.offset, len(p)) for p in packer.buffered() if p.doc == 2] == [(99, 102)]
    s = packer.stats
    assert (s.consumed, s.placed, s.requeued, s.splits) == (200 + 251, 300, 50 + 101, 2)
    assert s.placed + s.dropped + s.requeued == s.consumed


def test_split_drops_and_counts_a_tail_shorter_than_min_fragment():
    docs = [doc(100, 1), doc(500, 2), doc(200, 3), doc(100, 4), doc(300, 5)]
    packer = BestFitPacker(stream(docs), row_len=150, buffer_size=5, overflow="split", min_fragment=51)
    _, segments = packer.pack_row()
    assert (segments[-1].decision, segments[-1].tail) == ("drop", 50)  # 50 < 51: dropped
    s = packer.stats
    assert (s.dropped, s.requeued, s.short_tails, s.splits) == (50, 0, 1, 0)
    assert s.placed + s.dropped + s.requeued == s.consumed == 200


def test_split_tail_of_a_tail_keeps_document_offsets():
    # a 30-token document into rows of 12: pieces [0:12), then [BOS]+doc[12:23) (11 document tokens),
    # then [BOS]+doc[23:30) (8 tokens with the BOS): offsets 0, 12, 23
    d = np.arange(30, dtype=np.int32)
    d[0] = BOS
    packer = BestFitPacker(stream([d]), row_len=12, buffer_size=1, overflow="split", min_fragment=1)
    rows = [packer.pack_row() for _ in range(2)]
    assert [s.offset for _, segs in rows for s in segs] == [0, 12]
    assert rows[1][0].tolist() == [BOS, *range(12, 23)]
    (last,) = packer.buffered()
    assert (last.offset, last.tokens.tolist()) == (23, [BOS, *range(23, 30)])
    assert piece_tokens(d, 23).tolist() == last.tokens.tolist()


def test_longest_fitting_document_is_placed_first():
    docs = [doc(3, 1), doc(6, 2), doc(4, 3), doc(2, 4)]
    packer = BestFitPacker(stream(docs), row_len=10, buffer_size=4)
    row = packer.next_row()
    # longest that fits 10 is 6, then longest that fits 4 is 4 -> exactly full, nothing cropped
    assert row.tolist() == doc(6, 2) + doc(4, 3)
    assert packer.stats.dropped == 0


def test_every_row_starts_with_bos_no_padding_and_tokens_are_conserved():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 300, size=400)
    docs = [doc(int(n), i + 1) for i, n in enumerate(lengths)]
    packer = BestFitPacker(stream(docs), row_len=129, buffer_size=16)
    rows = list(packer)
    assert all(r[0] == BOS and len(r) == 129 for r in rows)
    s = packer.stats
    assert s.placed == 129 * len(rows)
    leftover = sum(len(p) for p in packer.buffered())
    assert s.placed + s.dropped + leftover == int(lengths.sum())
    assert 0 < s.drop_fraction < 0.5


def test_split_conserves_every_token_and_discards_only_short_tails():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 300, size=400)
    docs = [doc(int(n), i + 1) for i, n in enumerate(lengths)]
    packer = BestFitPacker(stream(docs), row_len=129, buffer_size=16, overflow="split", min_fragment=16)
    rows = list(packer)
    s = packer.stats
    assert all(r[0] == BOS and len(r) == 129 for r in rows) and s.placed == 129 * len(rows)
    buffered = sum(len(p) for p in packer.buffered())
    # every token is placed, dropped or still buffered; the only new ones are the splits' BOS tokens
    assert s.placed + s.dropped + buffered == int(lengths.sum()) + s.splits
    assert s.dropped < 16 * s.short_tails + 1 and s.drop_fraction < 0.02


def test_state_dict_resumes_exactly():
    rng = np.random.default_rng(1)
    docs = [doc(int(n), i + 1) for i, n in enumerate(rng.integers(2, 90, size=200))]
    straight = BestFitPacker(stream(docs), row_len=64, buffer_size=8)
    expected = [straight.next_row().tolist() for _ in range(40)]

    source = iter(docs)
    first = BestFitPacker(lambda: next(source, None), row_len=64, buffer_size=8)
    got = [first.next_row().tolist() for _ in range(15)]
    state = first.state_dict()
    second = BestFitPacker(lambda: next(source, None), row_len=64, buffer_size=8)
    by_doc = {i: d for i, d in enumerate(docs)}
    second.load_state_dict(state, [Piece(g, o, piece_tokens(by_doc[g], o)) for g, o in state["buffer"]])
    got += [second.next_row().tolist() for _ in range(25)]
    assert got == expected


def test_state_is_references_and_a_wrong_rebuild_is_refused():
    packer = BestFitPacker(
        stream([doc(5, 1), doc(7, 2), doc(9, 3)]), row_len=8, buffer_size=3, overflow="split"
    )
    # row 1: the 7 (doc 1) fits, 1 left: the shortest (doc 0, 5 tokens) fills it, its 4-token tail < 32 drops
    assert packer.next_row().tolist() == doc(7, 2) + [BOS]
    state = packer.state_dict()
    assert state == {"buffer": [[2, 0]], "stats": state["stats"]} and state["stats"]["short_tails"] == 1
    with pytest.raises(ValueError, match="do not match"):
        BestFitPacker(lambda: None, 8).load_state_dict(state, [])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"row_len": 1}, "row_len"),
        ({"row_len": 10, "buffer_size": 0}, "buffer_size"),
        ({"row_len": 10, "overflow": "wrap"}, "overflow"),
        ({"row_len": 10, "min_fragment": 0}, "min_fragment"),
    ],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BestFitPacker(lambda: None, **kwargs)

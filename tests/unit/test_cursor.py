"""The global data cursor (raychat.data.loader.cursor) with the best-fit packer, without Ray: hand-worked deals and
re-deals, and simulated runs that change world size while every document token stays accounted for once."""

from collections import Counter

import numpy as np
import pytest

from raychat.data.loader.cursor import Deal, RankCursor, epoch_permutation, redeal, sum_stats, whole_world
from raychat.data.loader.packing import BestFitPacker, Piece, piece_tokens

BOS = -1


def test_a_deal_gives_rank_r_every_world_th_element():
    deal = Deal(world=3, frontier=10, pending=((2, 0), (5, 7)))
    # S = (2,0) (5,7) (10,0) (11,0) (12,0) ...
    assert [deal.element(j) for j in range(5)] == [(2, 0), (5, 7), (10, 0), (11, 0), (12, 0)]
    assert deal.share(0, 0, 3) == [(2, 0), (11, 0), (14, 0)]
    assert deal.share(1, 1, 2) == [(12, 0), (15, 0)]
    assert Deal.from_dict(deal.to_dict()) == deal
    with pytest.raises(ValueError, match="world"):
        Deal(0)


def test_redeal_by_hand():
    # world 2 from the start: rank 0 took S[0], S[2], S[4] (taken 3), rank 1 took S[1] (taken 1).
    # Rank 0 still buffers item 4; rank 1 buffers the tail of item 1 from token 7 (a split piece).
    # The furthest taken element is S[4], so S[3] (rank 1's next) is a hole; the frontier moves to 5.
    new = redeal(Deal(2), taken=[3, 1], buffers=[[(4, 0)], [(1, 7)]], world=1)
    assert new == Deal(world=1, frontier=5, pending=((1, 7), (3, 0), (4, 0)))
    # one rank now takes the tail of 1, then 3, 4, 5, 6, ...: nothing repeated, nothing skipped
    assert new.share(0, 0, 5) == [(1, 7), (3, 0), (4, 0), (5, 0), (6, 0)]
    # and to three ranks: S' = (1,7) (3,0) (4,0) 5 6 7 ...
    three = redeal(Deal(2), [3, 1], [[(4, 0)], [(1, 7)]], world=3)
    assert [three.share(r, 0, 2) for r in range(3)] == [[(1, 7), (5, 0)], [(3, 0), (6, 0)], [(4, 0), (7, 0)]]


def test_redeal_refuses_an_incomplete_world_and_duplicates():
    with pytest.raises(ValueError, match="all 2 ranks"):
        redeal(Deal(2), [1], [[]], world=1)
    with pytest.raises(ValueError, match="twice"):
        redeal(Deal(2), [1, 1], [[(0, 0)], [(0, 0)]], world=1)


def test_whole_world_wants_every_rank_of_one_deal_in_order():
    d = Deal(2, 4)
    assert whole_world([d, d], [0, 1]) == d
    with pytest.raises(ValueError, match="ranks 0..1 of one world"):
        whole_world([d, d], [1, 0])
    with pytest.raises(ValueError, match="ranks 0..1 of one world"):
        whole_world([d, Deal(2, 6)], [0, 1])  # two checkpoints' states mixed
    with pytest.raises(ValueError, match="ranks 0..1 of one world"):
        whole_world([d], [0])  # a rank missing
    assert sum_stats([{"rows": 2, "placed": 10}, {"rows": 3, "placed": 7}]) == {"rows": 5, "placed": 17}


def test_cursor_refuses_an_out_of_order_stream():
    cursor = RankCursor(Deal(2), rank=1)
    assert cursor.upcoming(3) == [(1, 0), (3, 0), (5, 0)]
    cursor.take((1, 0))
    with pytest.raises(RuntimeError, match="expects"):
        cursor.take((5, 0))


def test_epoch_permutation_is_seeded_and_differs_between_epochs():
    a, b = epoch_permutation(50, 7, 0), epoch_permutation(50, 7, 1)
    assert sorted(a) == list(range(50)) and not np.array_equal(a, b)
    assert np.array_equal(a, epoch_permutation(50, 7, 0))


# ---- simulated runs: documents whose tokens say which document and position they are ---------------------
LENGTHS = np.random.default_rng(3).integers(2, 90, size=100_000)


def document(g: int) -> np.ndarray:
    """Item g: [BOS, 1000*g + 1, 1000*g + 2, ...]: every token names (document, position)."""
    n = int(LENGTHS[g])
    return np.asarray([BOS] + [1000 * g + i for i in range(1, n)], dtype=np.int64)


class Rank:
    """What PretrainRows does with Ray Data, done locally: the cursor feeds the packer."""

    def __init__(self, deal, rank, overflow, taken=0, buffer=()):
        self.cursor = RankCursor(deal, rank, taken)
        self.packer = BestFitPacker(
            self.next_piece, row_len=64, buffer_size=8, overflow=overflow, min_fragment=4
        )
        if buffer:
            pieces = [Piece(g, o, piece_tokens(document(g), o)) for g, o in buffer]
            self.packer.load_state_dict({"buffer": [list(r) for r in buffer], "stats": {}}, pieces)
        self.segments = []

    def next_piece(self):
        ((g, o),) = self.cursor.upcoming(1)
        self.cursor.take((g, o))
        return Piece(g, o, piece_tokens(document(g), o))

    def rows(self, n):
        out = []
        for _ in range(n):
            row, segs = self.packer.pack_row()
            out.append(row)
            self.segments += segs
        return out

    def state(self):
        return self.cursor.taken, [(p.doc, p.offset) for p in self.packer.buffered()]


def run(plan, overflow, rows_per_step=6):
    """plan: [(world, steps), ...]; every change of world re-deals. Returns (rows, ranks at the end, all ranks)."""
    ranks, rows, everyone = None, [], []
    for world, steps in plan:
        if ranks is None:
            ranks = [Rank(Deal(world), r, overflow) for r in range(world)]
        else:
            states = [r.state() for r in ranks]
            deal = redeal(ranks[0].cursor.deal, [t for t, _ in states], [b for _, b in states], world)
            ranks = [Rank(deal, r, overflow) for r in range(world)]
        everyone += ranks
        for _ in range(steps):
            for r in ranks:
                rows += r.rows(rows_per_step // world)
    return rows, ranks, everyone


def document_tokens(arrays) -> list[int]:
    return [int(t) for a in arrays for t in np.asarray(a) if t != BOS]


@pytest.mark.parametrize("overflow", ["crop", "split"])
@pytest.mark.parametrize("plan", [[(2, 20), (1, 15)], [(2, 20), (3, 15)], [(2, 10), (1, 10), (3, 10)]])
def test_changing_world_size_repeats_and_skips_nothing(plan, overflow):
    rows, last, everyone = run(plan, overflow)
    placed = Counter(document_tokens(rows))
    assert max(placed.values()) == 1  # no document token is trained twice
    dropped = Counter()
    for r in everyone:
        for s in r.segments:
            if s.decision in ("crop", "drop"):
                start = s.offset + s.length - (1 if s.offset else 0)
                dropped.update(1000 * s.doc + i for i in range(start, start + s.tail))
    buffered = Counter(document_tokens([p.tokens for r in last for p in r.packer.buffered()]))
    # what is dealt but not taken yet: the holes and pieces still pending from a re-deal
    states = [r.state() for r in last]
    outstanding = redeal(last[0].cursor.deal, [t for t, _ in states], [[] for _ in states], 1)
    waiting = Counter(document_tokens([piece_tokens(document(g), o) for g, o in outstanding.pending]))
    seen = placed + dropped + buffered + waiting
    assert max(seen.values()) == 1
    # the documents seen are exactly the stream's first P items, and every token of each is accounted for
    touched = {t // 1000 for t in seen}
    assert touched == set(range(outstanding.frontier))
    missing = [(g, i) for g in touched for i in range(1, int(LENGTHS[g])) if 1000 * g + i not in seen]
    assert missing == []
    if overflow == "split":
        assert sum(dropped.values()) < 0.02 * sum(seen.values())


def test_documents_of_exactly_one_row_give_the_same_global_prefix_whatever_the_worlds():
    # with every document exactly a row long, each row is one document and the rows of N + M steps are the
    # stream's first (N + M) * 6 documents: on 2 workers straight, and after 2 -> 1 and 2 -> 3 re-deals
    saved = LENGTHS.copy()
    LENGTHS[:] = 64
    try:
        expected = list(range(30 * 6))
        for plan in ([(2, 30)], [(2, 12), (1, 18)], [(2, 12), (3, 18)], [(2, 5), (3, 5), (1, 20)]):
            rows, _, _ = run(plan, "crop")
            assert sorted(document_tokens([r[1:2] for r in rows])) == [1000 * g + 1 for g in expected], plan
    finally:
        LENGTHS[:] = saved


def test_same_world_resume_is_bit_identical():
    straight, _, _ = run([(2, 30)], "split")
    first, ranks, _ = run([(2, 12)], "split")
    deal = ranks[0].cursor.deal
    resumed = [Rank(deal, r, "split", *ranks[r].state()) for r in range(2)]
    rest = []
    for _ in range(18):
        for r in resumed:
            rest += r.rows(3)
    assert all(np.array_equal(a, b) for a, b in zip(first + rest, straight, strict=True))

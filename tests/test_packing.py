import numpy as np
import pytest

from raychat.data.packing import BestFitPacker

BOS = 0


def doc(n, tag):
    return [BOS] + [tag] * (n - 1)


def stream(docs):
    it = iter(docs)
    return lambda: next(it, None)


def test_best_fit_crops_the_shortest_when_nothing_fits():
    # a 100-token document (the earliest of two) fills 100 of 150, leaving capacity 50 with the
    # buffer holding [500, 200, 100, 300]
    docs = [doc(100, 1), doc(500, 2), doc(200, 3), doc(100, 4), doc(300, 5)]
    packer = BestFitPacker(stream(docs), row_len=150, buffer_size=5)
    row = packer.next_row()
    assert row.tolist() == doc(100, 1) + doc(100, 4)[:50]  # the 100-token one is cropped, not the first
    assert packer.stats.cropped == 50
    assert packer.stats.placed == 150
    assert packer.stats.placed + packer.stats.cropped == 200  # consumed = placed + cropped
    assert sorted(len(d) for d in packer.state_dict()["buffer"]) == [200, 300, 500]


def test_longest_fitting_document_is_placed_first():
    docs = [doc(3, 1), doc(6, 2), doc(4, 3), doc(2, 4)]
    packer = BestFitPacker(stream(docs), row_len=10, buffer_size=4)
    row = packer.next_row()
    # longest that fits 10 is 6, then longest that fits 4 is 4 -> exactly full, nothing cropped
    assert row.tolist() == doc(6, 2) + doc(4, 3)
    assert packer.stats.cropped == 0


def test_every_row_starts_with_bos_no_padding_and_tokens_are_conserved():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 300, size=400)
    docs = [doc(int(n), i + 1) for i, n in enumerate(lengths)]
    packer = BestFitPacker(stream(docs), row_len=129, buffer_size=16)
    rows = list(packer)
    assert all(r[0] == BOS and len(r) == 129 for r in rows)
    s = packer.stats
    assert s.placed == 129 * len(rows)
    leftover = sum(len(d) for d in packer.state_dict()["buffer"])
    assert s.placed + s.cropped + leftover == int(lengths.sum())
    assert 0 < s.crop_fraction < 0.5


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
    second.load_state_dict(state)
    got += [second.next_row().tolist() for _ in range(25)]
    assert got == expected


@pytest.mark.parametrize("kwargs", [{"row_len": 1}, {"row_len": 10, "buffer_size": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        BestFitPacker(lambda: None, **kwargs)

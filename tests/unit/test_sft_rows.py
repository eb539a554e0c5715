"""SFT rows on the global cursor (no Ray: conversations are rendered in the workers): epochs, exact resume on
the same world, re-deals to other worlds, and replay records rebuilt after a 2 -> 1 resume."""

from collections import Counter

import numpy as np
import pytest

from raychat.chat_template import fewest_tokens, render_conversation
from raychat.config import TrainConfig, from_dict
from raychat.data.loader.cursor import Deal, redeal
from raychat.data.loader.sft_rows import NoneFits, SFTRows, none_fits, row_fit
from raychat.data.replay.rebuild import verify_step
from raychat.data.replay.records import read_step, replay_meta, step_records, write_records
from raychat.tasks import Task
from raychat.tasks.registry import mixture_tasks

SPEC, SEED, ROW_LEN = "calculator:30,spelling:20", 5, 128


def sources(tok, world):
    return [
        SFTRows(mixture_tasks(SPEC, "train", SEED), SEED, tok, ROW_LEN, r, world, buffer_size=8)
        for r in range(world)
    ]


def step(ranks, rows_per_step=6):
    return [r.next_batch(rows_per_step // len(ranks)) for r in ranks]


def items(batch) -> list[int]:
    return [g for row in batch["replay"] for g in row["doc"]]


def test_two_epochs_visit_every_example_twice_in_different_orders(small_tokenizer):
    rows = sources(small_tokenizer, 2)
    n = len(rows[0].mixture)
    assert n == 50
    # the stream's first 2N items over the two ranks: each example twice, once per epoch
    shares = [rows[r].cursor.upcoming(n) for r in range(2)]
    located = [rows[0].locate(g) for share in shares for g, _ in share]
    assert Counter(i for _, i in located) == Counter({i: 2 for i in range(n)})
    first = [rows[0].locate(g)[1] for g in range(n)]
    second = [rows[0].locate(g)[1] for g in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second


def test_same_world_resume_is_bit_identical(small_tokenizer):
    straight = sources(small_tokenizer, 2)
    expected = [step(straight) for _ in range(12)]
    first = sources(small_tokenizer, 2)
    got = [step(first) for _ in range(5)]
    states = [r.state_dict() for r in first]
    assert all(isinstance(g, int) for s in states for g in s["packer"]["buffer"])  # references, no tokens
    resumed = sources(small_tokenizer, 2)
    for r in resumed:
        r.load_state_dicts(states)
    got += [step(resumed) for _ in range(7)]
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(a, b, strict=True):
            assert all(np.array_equal(x[k], y[k]) for k in ("input_ids", "supervised", "segment_ids"))
            assert x["replay"] == y["replay"]


@pytest.mark.parametrize("worlds", [(2, 1), (2, 3), (3, 2)])
def test_resume_on_another_world_repeats_and_skips_no_example(small_tokenizer, worlds):
    old, new = worlds
    ranks = sources(small_tokenizer, old)
    taken = [g for _ in range(6) for b in step(ranks) for g in items(b)]
    states = [r.state_dict() for r in ranks]
    resumed = sources(small_tokenizer, new)
    for r in resumed:
        r.load_state_dicts(states)
    assert sum(r.packer.stats.rows for r in resumed) == 6 * 6  # the run's counters carried by rank 0
    taken += [g for _ in range(9) for b in step(resumed) for g in items(b)]
    assert len(taken) == len(set(taken))  # no sample trained twice (the mixture has 50: epoch 2 is new items)
    buffered = [it.ref for r in resumed for it in r.packer.buffered()]
    final = [r.state_dict() for r in resumed]
    left = redeal(Deal.from_dict(final[0]["deal"]), [s["taken"] for s in final], [[] for _ in final], 1)
    assert sum(r.packer.stats.dropped for r in (*ranks, *resumed)) == 0  # every sample fits a 128-token row
    # trained, buffered, or dealt and not taken yet: exactly the stream's first items, each once
    assert sorted(taken + buffered + [g for g, _ in left.pending]) == list(range(left.frontier))
    assert left.frontier > 50  # the run went into the second epoch


def test_a_state_from_another_mixture_is_refused(small_tokenizer):
    (rows,) = sources(small_tokenizer, 1)
    rows.next_batch(2)
    state = rows.state_dict()
    other = SFTRows(mixture_tasks("calculator:31", "train", SEED), SEED, small_tokenizer, ROW_LEN)
    with pytest.raises(ValueError, match="mixture"):
        other.load_state_dicts([state])


def test_replay_records_rebuild_after_a_two_to_one_resume(small_tokenizer, tmp_path):
    tok = small_tokenizer
    tok.save(tmp_path / "tok")
    cfg = from_dict(
        TrainConfig,
        {"stage": "sft", "seed": SEED, "sft_tasks": SPEC, "seq_len": ROW_LEN - 1, "document_masking": True,
         "tokenizer_path": str(tmp_path / "tok")},
    )  # fmt: skip
    ranks = sources(tok, 2)
    meta = replay_meta(cfg, tok.version, tok.bos_id, ranks[0].fingerprint())
    logged = {}
    for world_ranks, steps in ((ranks, range(1, 5)), (None, range(5, 9))):
        if world_ranks is None:  # resume the 2-rank run on 1 rank
            states = [r.state_dict() for r in ranks]
            (one,) = sources(tok, 1)
            one.load_state_dicts(states)
            world_ranks = [one]
        per_rank = {r: [] for r in range(len(world_ranks))}
        for s in steps:
            for r, src in enumerate(world_ranks):
                batches = [src.next_batch(2 if len(world_ranks) == 1 else 1) for _ in range(2)]
                records = step_records(s, r, len(world_ranks), batches, tok.bos_id, True)
                per_rank[r] += records
                logged[s] = logged.get(s, []) + records
        for r, records in per_rank.items():
            write_records(str(tmp_path / "run"), r, records, meta)
    for s in (2, 4, 5, 8):  # before and after the resume
        records, got_meta = read_step(str(tmp_path / "run"), s)
        assert got_meta == meta and len(records) == 4
        _, problems = verify_step(records, got_meta)
        assert problems == []
        hashes = [{k: v for k, v in r.items() if k.endswith("_sha256")} for r in logged[s]]
        assert [{k: v for k, v in r.items() if k.endswith("_sha256")} for r in records] == hashes
    # a changed record is caught
    records, got_meta = read_step(str(tmp_path / "run"), 5)
    records[1]["sample_id"][0] = "calculator/tampered"
    assert any("renders as" in p for p in verify_step(records, got_meta)[1])


class Said(Task):
    """One one-exchange conversation per user text: "<text>" answered "ok"."""

    def __init__(self, texts: list[str]):
        self.name, self.texts = "said", texts
        super().__init__()

    def num_examples(self) -> int:
        return len(self.texts)

    def get_example(self, index: int) -> dict:
        return {
            "id": self._id(index),
            "messages": [
                {"role": "user", "content": self.texts[index]},
                {"role": "assistant", "content": "ok"},
            ],
        }


def test_a_row_fit_counts_for_none_fits_as_its_conversations_would(small_tokenizer):
    """SFT renders --sft-data's conversations once (row_fit) for both of its row checks: what row_fit says of a
    task none of whose conversations fits (none_fit) counts, handed to none_fits, as that task read again."""
    tok, row_len = small_tokenizer, 16
    own, other = Said(["word " * 20, "word " * 30]), Said(["many words " * 12])
    lengths = [len(render_conversation(tok, own[i]).ids) for i in range(2)]
    fewest = min(fewest_tokens(tok, own[i]) for i in range(2))
    assert min(lengths) > row_len
    fit = row_fit(own, tok, row_len)
    assert fit == (tuple(lengths), 0, 2, NoneFits(2, min(lengths), max(lengths), fewest))
    both = none_fits([own, other], tok, row_len)
    assert both.conversations == 3 and none_fits([other], tok, row_len, fit.none_fit) == both
    assert none_fits([], tok, row_len, fit.none_fit) == fit.none_fit
    kept = Said(["hi"])  # one that fits: none_fits says None, seeded or not, and row_fit has no none_fit
    assert none_fits([kept], tok, row_len, fit.none_fit) is None
    assert row_fit(Said(["word " * 20, "hi"]), tok, row_len).none_fit is None


def test_a_rank_draws_on_past_dropped_conversations_until_one_fits(small_tokenizer):
    """6 conversations, 2 of which fit a row of 33 tokens (none_fits passes): a rank gave up after 7 dropped
    in a row ("every SFT sample was dropped by truncation") though the next epoch's order, or the other rank's
    share, held one that fits. Now it draws on, and its rows hold only the 2 short ones; a mixture none of
    whose conversations fits still raises, once every one of them was drawn and dropped."""
    tok, long = small_tokenizer, "The quick brown fox jumps over the lazy dog. " * 20
    tasks = [Said(["hi", "yo", long, long, long, long])]
    assert row_fit(tasks[0], tok, 33).skipped == 4 and none_fits(tasks, tok, 33) is None
    for world, rank, seed in [(w, r, s) for w in (1, 2) for r in range(w) for s in range(3)]:
        batch = SFTRows(tasks, seed, tok, 33, rank, world).next_batch(2)
        ids = {i for row in batch["replay"] for i in row["sample_id"]}
        assert batch["input_ids"].shape == (2, 33) and ids and ids <= {"said/0", "said/1"}
        with pytest.raises(RuntimeError) as e:
            SFTRows([Said([long] * 3)], seed, tok, 33, rank, world).next_batch(1)
        assert str(e.value) == "every SFT sample was dropped by truncation: raise --seq-len"

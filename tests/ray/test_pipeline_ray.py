"""Ray tier: PretrainRows on Ray Data with the global cursor, called directly (no Ray Train) so that runs can
change world size: epochs, 2 -> 1 and 2 -> 3 resumes with nothing repeated or skipped, replay records."""

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
from support.autoscaling_requests import data_requesters

from raychat.config import TrainConfig, from_dict
from raychat.data.corpus.shards import list_shards, write_manifest, write_shards
from raychat.data.loader.cursor import Deal, redeal
from raychat.data.loader.pipeline import IdleWait, PretrainRows, close_stream, share_stream
from raychat.data.replay.rebuild import verify_step
from raychat.data.replay.records import read_step, replay_meta, step_records, write_records
from raychat.tokenizer import Tokenizer

pytestmark = [pytest.mark.ray]

WORDS = "alpha beta gamma delta river stone light cloud tree bird wind fire water".split()


def make_data(root, docs, num_shards, tokenizer=None, row_group_size=16):
    entries = write_shards(
        docs, root, num_shards=num_shards, row_group_size=row_group_size, log=lambda *_: None
    )
    write_manifest(root, {"source": "test", "shards": entries})
    tok = tokenizer or Tokenizer.train(docs, vocab_size=300)
    tok.save(root / "tok")
    return root, tok


@pytest.fixture(scope="module")
def data7(tmp_path_factory):
    """7 train shards (+ validation), 20 documents each in row groups of 16 (two per shard)."""
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + "." for _ in range(160)]
    return make_data(tmp_path_factory.mktemp("data7"), docs, num_shards=8)


@pytest.fixture(scope="module")
def uniform(tmp_path_factory, data7):
    """Documents of exactly 17 tokens (BOS included), one train shard: each fills one row of T+1 = 17."""
    _, tok = data7
    rng = random.Random(1)
    docs = []
    while len(docs) < 400:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16)))
        if len(tok.encode(text)) == 16:
            docs.append(text)
    return make_data(tmp_path_factory.mktemp("uniform"), docs, num_shards=2, tokenizer=tok, row_group_size=64)


OPEN = []  # every row source a test made: closed after the test, before Ray shuts down


@pytest.fixture(autouse=True)
def close_sources():
    yield
    while OPEN:
        OPEN.pop().close()


def rows_source(data, rank, world, row_len=33, overflow="split"):
    root, _ = data
    train_files, _ = list_shards(root)
    source = PretrainRows(
        train_files,
        root / "tok",
        row_len,
        rank,
        world,
        buffer_size=8,
        num_cpus=0.25,
        seed=4,
        overflow=overflow,
    )
    OPEN.append(source)
    return source


def test_close_cancels_the_pipelines_autoscaling_request(ray_cluster, data7):
    """A running pipeline holds a request on Ray's AutoscalingCoordinator (renewed while it runs, else kept
    until it expires); close() stops the executor, which cancels it."""
    before = data_requesters()
    src = rows_source(data7, 0, 1)
    assert src.next_batch(2)["input_ids"].shape == (2, 33)
    running = data_requesters() - before
    assert len(running) == 1
    (requester,) = running
    src.close()
    assert requester not in data_requesters()


@ray.remote
class CpuHolder:
    """Stands for training workers: holds the CPUs it was created with."""

    def ready(self) -> bool:
        return True


def test_the_pipeline_runs_on_the_quarter_cpu_training_leaves(ray_cluster, data7):
    """With all but 0.25 of the instance's 2 CPUs held (as Ray Train workers hold them), a pipeline of
    num_cpus 0.25 still delivers rows: none of its tasks asks for a whole CPU (such a task would wait for the
    training to end, and on an autoscaling cluster ask for a node of its own)."""
    holder = CpuHolder.options(num_cpus=1.75).remote()
    try:
        assert ray.get(holder.ready.remote(), timeout=60)
        src = rows_source(data7, 0, 1)
        rows = ThreadPoolExecutor(1).submit(src.next_batch, 2)  # no `with`: a stuck next_batch would hang it
        assert rows.result(timeout=60)["input_ids"].shape == (2, 33)
    finally:
        ray.kill(holder)


def test_two_epochs_on_two_ranks_read_every_document_exactly_twice(ray_cluster, data7):
    root, tok = data7
    ranks = [rows_source(data7, r, 2) for r in range(2)]
    n = ranks[0].order.num_documents
    assert n == 140
    located = []
    for src in ranks:
        threads = set()
        stream = share_stream(src.order, src.cursor, str(root / "tok"), 0.25, threads)
        for piece in stream:
            if piece.doc >= 2 * n:
                break
            w = src.order.locate(piece.doc)
            text = pq.ParquetFile(src.order.files[w.shard]).read_row_group(w.row_group).column("text")[w.row]
            assert piece.tokens.tolist() == tok.encode(text.as_py(), prepend_bos=True)  # the right document
            located.append((w.epoch, w.shard, w.row_group, w.row))
        assert {t.name.split("-")[0] for t in threads} >= {"StreamingExecutor", "iter_threaded"}
        # IdleWait ran in the real executor's loop (an error there would have failed the stream), once
        assert ray.data.DataContext.get_current().custom_execution_callback_classes.count(IdleWait) == 1
        close_stream(stream, threads)
        assert not threads
    assert len(located) == 2 * n
    per_document = Counter((s, g, r) for _, s, g, r in located)
    assert len(per_document) == n and set(per_document.values()) == {2}
    epoch_of = Counter((e, s, g, r) for e, s, g, r in located)
    assert set(epoch_of.values()) == {1}  # once in each epoch
    orders = [[(s, g, r) for e, s, g, r in located if e == epoch] for epoch in (0, 1)]
    assert orders[0] != orders[1]  # each epoch shuffled on its own


def steps(ranks, count, rows_per_step=6):
    """count steps of rows_per_step rows over the ranks: per step, per rank, its batch."""
    return [[src.next_batch(rows_per_step // len(ranks)) for src in ranks] for _ in range(count)]


def resume(states, world, data, **kw):
    ranks = [rows_source(data, r, world, **kw) for r in range(world)]
    for src in ranks:
        src.load_state_dicts(states)
    return ranks


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_on_another_world_gives_the_same_global_prefix(ray_cluster, uniform, new_world):
    # every document is exactly one row: N + M steps of 6 rows train the stream's first 6 (N + M) documents,
    # whatever the world did in between
    straight = steps([rows_source(uniform, r, 2, row_len=17, overflow="crop") for r in range(2)], 7)
    first = [rows_source(uniform, r, 2, row_len=17, overflow="crop") for r in range(2)]
    head = steps(first, 3)
    tail = steps(resume([s.state_dict() for s in first], new_world, uniform, row_len=17, overflow="crop"), 4)

    def documents(run):
        return sorted(g for step in run for batch in step for row in batch["replay"] for g in row["doc"])

    assert documents(straight) == documents(head + tail) == list(range(42))
    for a, b in zip(straight[:3], head):  # the first N steps are the same rows
        assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))


def test_resume_two_to_three_to_one_accounts_for_every_token_once(ray_cluster, data7):
    root, tok = data7
    run = [rows_source(data7, r, 2) for r in range(2)]
    batches = steps(run, 4)
    for world in (3, 1):
        run = resume([s.state_dict() for s in run], world, data7)
        batches += steps(run, 4)
    segments = [
        (g, o, n, d, t)
        for step in batches
        for batch in step
        for row in batch["replay"]
        for g, o, n, d, t in zip(row["doc"], row["doc_offset"], row["length"], row["decision"], row["tail"])
    ]
    covered = Counter()
    for g, o, n, d, t in segments:  # document token indices placed in a row, then dropped
        start = 0 if o == 0 else o
        placed = n if o == 0 else n - 1  # a tail's first row token is its inserted BOS
        covered.update((g, i) for i in range(start, start + placed))
        if d in ("crop", "drop"):
            covered.update((g, i) for i in range(start + placed, start + placed + t))
    states = [s.state_dict() for s in run]
    left = redeal(Deal.from_dict(states[0]["deal"]), [s["taken"] for s in states], [[] for _ in states], 1)
    for g, o in [tuple(r) for s in states for r in s["packer"]["buffer"]] + list(left.pending):
        covered.update((g, i) for i in range(o, len(document(run[0], tok, g))))
    assert max(covered.values()) == 1  # no token twice
    touched = {g for g, _ in covered}
    assert touched == set(range(left.frontier))  # a prefix of the stream
    for g in touched:
        assert all((g, i) in covered for i in range(len(document(run[0], tok, g))))  # none skipped


def document(src, tok, g):
    return tok.encode(src.order.read_texts([g])[0], prepend_bos=True)


def test_replay_records_rebuild_after_a_two_to_one_resume(ray_cluster, data7, tmp_path):
    root, tok = data7
    cfg = from_dict(
        TrainConfig,
        {
            "seed": 4,
            "seq_len": 32,
            "data_dir": str(root),
            "tokenizer_path": str(root / "tok"),
            "overflow": "split",
        },
    )
    run = [rows_source(data7, r, 2) for r in range(2)]
    meta = replay_meta(cfg, tok.version, tok.bos_id, run[0].fingerprint())
    logged = {}
    for phase, numbers in enumerate((range(1, 4), range(4, 7))):
        if phase == 1:
            run = resume([s.state_dict() for s in run], 1, data7)
        written = {r: [] for r in range(len(run))}
        for s in numbers:
            for r, src in enumerate(run):
                records = step_records(s, r, len(run), [src.next_batch(6 // len(run))], tok.bos_id, False)
                written[r] += records
                logged[s] = logged.get(s, []) + records
        for r, records in written.items():
            write_records(str(tmp_path), r, records, meta)
    decisions = set()
    for s in range(1, 7):
        records, got_meta = read_step(str(tmp_path), s)
        assert [r["world"] for r in records] == [2 if s <= 3 else 1] * 6
        rows, problems = verify_step(records, got_meta)
        assert problems == []
        hashes = ("input_ids_sha256", "labels_sha256", "loss_mask_sha256")
        assert [[r[h] for h in hashes] for r in records] == [[r[h] for h in hashes] for r in logged[s]]
        decisions |= {d for r in records for d in r["decision"]}
    assert {"whole", "split"} <= decisions  # split tails were rebuilt too (some across the resume)
    records, got_meta = read_step(str(tmp_path), 5)
    records[0]["doc_row"][0] += 1
    assert any("is now at" in p for p in verify_step(records, got_meta)[1])

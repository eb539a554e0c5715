"""Ray tier: the global data cursor in the real training loop (Ray Train, gloo workers): ONE train shard
serves two ranks, every step's replay record is written next to the checkpoints, and `raychat inspect-batch
--run R --step S` rebuilds exactly those batches from the shards, also after a resume; a run stopped on 2
workers and resumed on 1 or 3 takes the stream's global prefix of documents (documents 0..23 in 4 steps), as a
run that never stopped does."""

import random
import shutil

import pyarrow.parquet as pq
import pytest
import ray
from support.cluster import init_local_ray

from raychat.cli import main
from raychat.config import TrainConfig, from_dict
from raychat.data.corpus.shards import list_shards, write_manifest, write_shards
from raychat.data.replay.inspect_batch import inspect_step
from raychat.data.replay.records import read_step
from raychat.tokenizer import Tokenizer
from raychat.train.pretrain import pretrain

pytestmark = [pytest.mark.ray]

WORDS = "alpha beta gamma delta river stone light cloud tree bird wind fire water".split()


@pytest.fixture(scope="module")
def ray_cluster():
    init_local_ray(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 3 ranks x 0.5 + 1 for Ray Data
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    """ONE train shard (+ the validation shard) of 120 documents, row groups of 16."""
    root = tmp_path_factory.mktemp("one_shard")
    rng = random.Random(2)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 80))) + "." for _ in range(120)]
    entries = write_shards(docs, root, num_shards=2, row_group_size=16, log=lambda *_: None)
    write_manifest(root, {"source": "test", "shards": entries})
    Tokenizer.train(docs, vocab_size=300).save(root / "tok")
    return root


def config(data, storage, run_name="one", **overrides):
    values = dict(
        run_name=run_name, storage_path=str(storage), data_dir=str(data), tokenizer_path=str(data / "tok"),
        depth=1, aspect_ratio=64, head_dim=32, seq_len=32, device_batch_size=2, num_workers=2,
        cpus_per_worker=0.5, total_batch_size=256, num_iterations=4, eval_every=0, eval_tokens=128,
        checkpoint_every=2, buffer_size=8, seed=3, max_failures=0, overflow="split", min_fragment=4,
    )  # fmt: skip
    values.update(overrides)
    return from_dict(TrainConfig, values)


@pytest.mark.slow
def test_one_shard_trains_on_two_ranks_and_every_step_is_rebuilt(ray_cluster, one_shard, tmp_path, capsys):
    train_files, _ = list_shards(one_shard)
    assert len(train_files) == 1  # fewer shards than ranks: failed at start-up before the global cursor
    cfg = config(one_shard, tmp_path, stop_after=2)
    assert pretrain(cfg).metrics["step"] == 2
    result = pretrain(config(one_shard, tmp_path))  # resumes from checkpoint 2 on the same two workers
    assert result.metrics["step"] == 4
    run = tmp_path / "one"
    texts = pq.read_table(train_files[0]).column("text").to_pylist()
    seen = []
    for step in range(1, 5):
        records, meta = read_step(str(run), step)
        # 256 tokens a step = 2 ranks x 2 rows x 32 tokens x 2 micro-batches: 8 rows, 4 per rank
        assert [(r["rank"], r["micro"], r["row"]) for r in records] == [
            (k, m, i) for k in range(2) for m in range(2) for i in range(2)
        ]
        assert meta["overflow"] == "split" and meta["row_len"] == 33
        seen += [(g, o) for r in records for g, o in zip(r["doc"], r["doc_offset"])]
        assert main(["inspect-batch", "--run", str(run), "--step", str(step)]) == 0
        out = capsys.readouterr().out
        assert f"step {step}: 2 ranks, 8 rows of 33 tokens; stage pretrain" in out
        assert "rebuilt 8 rows from the data: input_ids, labels, loss_mask, position_ids hashes equal" in out
    # both ranks read the one shard, each its own documents: no piece of a document placed twice
    assert len(seen) == len(set(seen))
    first = {g for g, o in seen if o == 0}
    assert max(first) < len(texts)  # 4 steps stay inside the first epoch
    ranks = {r["rank"] for s in (1, 2) for r in read_step(str(run), s)[0] for g in r["doc"] if g % 2 == 0}
    assert ranks == {0}  # stream item g goes to rank g % 2 (no re-deal happened)


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    """Documents of exactly 17 tokens with their BOS: each fills one row of T+1 = 17 exactly."""
    root = tmp_path_factory.mktemp("uniform")
    rng = random.Random(5)
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))) for _ in range(20000)]
    tok = Tokenizer.train(pool, vocab_size=300)
    docs = [t for t in pool if len(tok.encode(t)) == 16][:300]
    assert len(docs) == 300
    entries = write_shards(docs, root, num_shards=3, row_group_size=32, log=lambda *_: None)
    write_manifest(root, {"source": "test", "shards": entries})
    tok.save(root / "tok")
    return root


def documents(run_dir, steps):
    return sorted(g for s in steps for r in read_step(str(run_dir), s)[0] for g in r["doc"])


def uniform_config(data, storage, run_name, **overrides):
    """96 tokens a step = 6 rows of 16: 2 workers x 3 micro-batches, 1 x 6, 3 x 2."""
    return config(
        data, storage, run_name, seq_len=16, device_batch_size=1, total_batch_size=96,
        eval_tokens=64, buffer_size=4, overflow="crop", **overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def stopped_at_2(ray_cluster, uniform, tmp_path_factory):
    """A run on 2 workers stopped after step 2 ("elastic"), shared by the resumes below (each resumes its own
    copy)."""
    storage = tmp_path_factory.mktemp("stopped_at_2")
    pretrain(uniform_config(uniform, storage, "elastic", stop_after=2))
    return storage


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_on_another_world_takes_the_same_global_prefix_and_replays(
    ray_cluster, uniform, stopped_at_2, tmp_path, new_world
):
    # a copy resumes as the original would: Ray Train's snapshot names its checkpoints relative to the run
    shutil.copytree(stopped_at_2 / "elastic", tmp_path / "elastic")
    assert pretrain(uniform_config(uniform, tmp_path, "elastic", num_workers=new_world)).metrics["step"] == 4
    # every document is one row: 4 steps of 6 rows train the stream's first 24 documents, however dealt (what
    # a straight run on 2 workers trains: the global prefix, 6 documents a step)
    assert documents(tmp_path / "elastic", range(1, 5)) == list(range(24))
    before_stop = documents(stopped_at_2 / "elastic", range(1, 3))  # steps 1-2, on 2 workers
    assert before_stop == list(range(12))
    for step in range(1, 5):
        records, _ = read_step(str(tmp_path / "elastic"), step)
        assert {r["world"] for r in records} == {2 if step <= 2 else new_world}
        report, identical = inspect_step(str(tmp_path / "elastic"), step)  # the replay record rebuilt
        assert identical, report

"""The pretraining data fingerprint holds the shards' content: other documents of the same names and layout
(`raychat data prepare --seed 1` into the run's data directory) are another stream, which the cursor restore
and the replay rebuild refuse; a fingerprint without content (a checkpoint written before it) still resumes."""

from __future__ import annotations

import json

import pytest

from raychat.data.corpus.shards import DataError, sha256_file, write_manifest, write_shards
from raychat.data.loader.cursor import Deal, RankCursor
from raychat.data.loader.document_order import DocumentOrder, changed_shards
from raychat.data.loader.row_source import cursor_state, resume_cursor, same_stream
from raychat.data.replay.rebuild import ReplayError, rebuild_pretrain


def prepare(out, texts: list[str], manifest: bool = True) -> list[str]:
    """The training shards of `texts` cut into 3 shards (the last one validation), as data prepare writes them."""
    entries = write_shards(texts, out, num_shards=3, row_group_size=2, log=lambda *_: None)
    if manifest:
        write_manifest(out, {"source": "test", "shards": entries})
    return [str(out / e["file"]) for e in entries[:-1]]


TEXTS = [f"document {i}" for i in range(12)]


def test_other_documents_of_the_same_layout_change_the_fingerprint(tmp_path):
    files = prepare(tmp_path, TEXTS)
    before = DocumentOrder.from_files(files, seed=0).fingerprint()
    assert before["files"] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert before["documents"] == 8
    assert before["content"] == [sha256_file(f)[:16] for f in files]

    prepare(tmp_path, TEXTS)  # the same documents written again: the same stream
    assert DocumentOrder.from_files(files, seed=0).fingerprint() == before

    prepare(tmp_path, TEXTS[:4] + [t.upper() for t in TEXTS[4:]])  # shard 1 and validation: other text
    after = DocumentOrder.from_files(files, seed=0).fingerprint()
    assert {k: v for k, v in after.items() if k != "content"} == {
        k: v for k, v in before.items() if k != "content"
    }  # the names, documents, layout and seed the fingerprint held before could not tell
    assert after["content"][0] == before["content"][0] and after["content"][1] != before["content"][1]
    assert changed_shards(before, after) == ["shard_00001.parquet"]
    assert not same_stream(before, after)


def test_a_training_shard_that_is_not_a_readable_parquet_file_is_named(tmp_path):
    """A shard cut short (an interrupted copy of the directory) failed in every Train worker with ArrowInvalid
    naming no file."""
    files = prepare(tmp_path, TEXTS)
    shard = tmp_path / "shard_00001.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DataError) as e:
        DocumentOrder.from_files(files, 0)
    assert str(e.value) == (
        f"{files[1]}: not a readable parquet file (Parquet magic bytes not found in footer. Either the file is "
        "corrupted or this is not a parquet file.)"
    )


def test_the_digests_come_from_the_manifest_while_it_lists_the_files_size(tmp_path):
    """Resuming reads no shard to know its content: the manifest's sha256, unless the file's size says the
    manifest no longer describes it (then, as without a manifest, the bytes are hashed)."""
    files = prepare(tmp_path, TEXTS)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "ab" * 32
    write_manifest(tmp_path, manifest)
    assert DocumentOrder.from_files(files, 0).fingerprint()["content"] == [
        "ab" * 8,
        sha256_file(files[1])[:16],
    ]
    manifest["shards"][0]["file_bytes"] += 1
    write_manifest(tmp_path, manifest)
    assert DocumentOrder.from_files(files, 0).fingerprint()["content"] == [sha256_file(f)[:16] for f in files]

    bare = tmp_path / "bare"
    files = prepare(bare, TEXTS, manifest=False)
    assert DocumentOrder.from_files(files, 0).fingerprint()["content"] == [sha256_file(f)[:16] for f in files]


def _state(fingerprint: dict) -> dict:
    return cursor_state("corpus", fingerprint, RankCursor(Deal(1), 0), {"buffer": [], "stats": {}})


def test_a_cursor_restore_refuses_other_content_and_resumes_a_state_without_any(tmp_path):
    files = prepare(tmp_path, TEXTS)
    old = DocumentOrder.from_files(files, 0).fingerprint()
    prepare(tmp_path, [t.upper() for t in TEXTS])
    now = DocumentOrder.from_files(files, 0).fingerprint()
    with pytest.raises(
        ValueError, match="checkpoint data state was made on .*'content': \\['" + old["content"][0]
    ):
        resume_cursor([_state(old)], "corpus", now, 0, 1, lambda buffer: [])
    legacy = {k: v for k, v in old.items() if k != "content"}  # as checkpoints held it before the content
    cursor, _ = resume_cursor([_state(legacy)], "corpus", now, 0, 1, lambda buffer: [])
    assert cursor.taken == 0
    with pytest.raises(ValueError, match="made on .*'seed': 0.*this run has .*'seed': 1"):
        resume_cursor(
            [_state(legacy)], "corpus", DocumentOrder.from_files(files, 1).fingerprint(), 0, 1, list
        )


def test_a_replay_rebuild_refuses_shards_with_other_content(tmp_path):
    files = prepare(tmp_path, TEXTS)
    meta = {"seed": 0, "row_len": 9, "data": DocumentOrder.from_files(files, 0).fingerprint()}
    assert rebuild_pretrain([], meta, str(tmp_path), "unused")["input_ids"].shape == (0, 9)
    prepare(tmp_path, TEXTS[:2] + [t.upper() for t in TEXTS[2:]])
    with pytest.raises(ReplayError) as e:
        rebuild_pretrain([], meta, str(tmp_path), "unused")
    assert str(e.value) == (
        f"shard_00000.parquet, shard_00001.parquet in {tmp_path}: other content (sha256) than the record's shards"
    )


def test_a_replay_rebuild_names_data_dir_when_its_shards_are_not_there(tmp_path):
    """A moved run's data, or a --data-dir that is not the run's data: pyarrow's "[Errno 2] Failed to open
    local file ..." without the flag."""
    files = prepare(tmp_path / "data", TEXTS)
    meta = {"seed": 0, "row_len": 9, "data": DocumentOrder.from_files(files, 0).fingerprint()}
    (tmp_path / "data" / "shard_00001.parquet").unlink()
    for where, missing in [(tmp_path / "data", "shard_00001.parquet"), (tmp_path, "shard_00000.parquet, "
                           "shard_00001.parquet")]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            rebuild_pretrain([], meta, str(where), "unused")
        assert type(e.value) is ValueError  # bad input (exit 2), not a ReplayError ("DIFFERS", exit 1)
        assert str(e.value) == (
            f"--data-dir: {where} has no {missing} (the step's shards); give --data-dir the directory that "
            "holds the run's data now"
        )

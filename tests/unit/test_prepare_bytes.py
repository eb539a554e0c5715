"""`raychat data prepare` of a local source writes the same bytes for the same input: byte-identical shards and
the same manifest, so a rerun (and a training run that resumes on the shards' sha256) takes them for the same.

The sha256 below were computed by the code that held the documents as Python strings (2026-12-06), with pyarrow
26.0.1: a parquet file records its writer's version, so pyarrow 27 (pyproject pins >=26,<27) may write other
bytes; record them again then, once the shards' text is checked to be the same."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raychat.data.corpus import corpora, documents
from raychat.data.corpus.prepare import prepare

ENGLISH = "the of and to in is was for on that with as by at from it an be this which or are".split()
CYRILLIC = "и в не на что с по это как он из за то к но она мы вы они было ещё уже где когда тоже".split()


def words(rng: random.Random, vocabulary: list[str], n: int) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def mixed_folder(root):
    """.txt/.md/.rst files, a .jsonl and a .parquet file with every kind of bad record, and a file prepare does
    not read: 3 + 61 + 41 + 120 = 225 kept documents."""
    rng = random.Random(3)
    root.mkdir()
    (root / "a.txt").write_text("alpha document\n")
    (root / "b.md").write_bytes("\ufeff# Title\r\n\r\nbody text\r\n".encode())
    (root / "blank.rst").write_text("  \n\t\n")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "notes.csv").write_text("x,y\n")
    (root / "c.rst").write_text(words(rng, ENGLISH, 300))
    lines = [json.dumps({"text": words(rng, ENGLISH, rng.randint(1, 80))}).encode() for _ in range(60)]
    lines[3:3] = [
        b"{not json",
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": "   "}).encode(),
        b'{"text": "lone \\ud800 surrogate"}',
        b'{"text": "caf\xe9"}',
        b"",
        "\ufeff".encode() + json.dumps({"text": "after a byte order mark"}).encode(),
    ]
    (root / "docs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    values = [words(rng, ENGLISH, rng.randint(1, 50)).encode() for _ in range(40)]
    values[5:5] = [None, b"\xff\xfe", b" \n ", b"", "\u00e9t\u00e9 \U0001f600".encode()]
    table = pa.table({"text": pa.array(values, pa.binary())})
    pq.write_table(table, root / "rows.parquet", row_group_size=7)
    sub = root / "nested"
    sub.mkdir()
    long = [json.dumps({"text": words(rng, ENGLISH, rng.randint(100, 400))}) for _ in range(120)]
    (sub / "long.jsonl").write_text("\n".join(long) + "\n")


def cyrillic_folder(root):
    """A .jsonl of Cyrillic text (raw UTF-8 and \\u escapes) and a .parquet string column of more: 250 + 90."""
    rng = random.Random(5)
    root.mkdir()
    lines = [
        json.dumps({"text": words(rng, CYRILLIC, rng.randint(1, 200))}, ensure_ascii=i % 3 == 0)
        for i in range(250)
    ]
    (root / "ru.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    values = [words(rng, CYRILLIC, rng.randint(1, 120)) for _ in range(90)]
    pq.write_table(pa.table({"text": values}), root / "ru.parquet", row_group_size=16)


def digests(out) -> dict[str, str]:
    """sha256 of each file prepare wrote in `out`; the manifest's with the source folder's path as "SRC"."""
    manifest = json.loads((out / "manifest.json").read_text())
    if manifest["source"] != "debian-docs":
        manifest["source"] = "SRC"
        manifest["components"][0]["path"] = "SRC"
    found = {"manifest": hashlib.sha256(json.dumps(manifest, indent=2).encode()).hexdigest()}
    for entry in manifest["shards"]:
        found[entry["file"]] = hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest()
        assert found[entry["file"]] == entry["sha256"]
    return found


EXPECTED = {
    "mixed": {
        "manifest": "68930300ee3c9ab585ed80ba6d5dd921df09da0b0c6779e31fcb9313b76114b1",
        "shard_00000.parquet": "53753314263c510ba5d4abf54fac235551e820f1e932ea65807f1dd57b8bc6d8",
        "shard_00001.parquet": "db073aec93c01f2168d57fa5c598357f1be5da8427429db6f869f7765bf31e89",
        "shard_00002.parquet": "41daaacde2853c094d37bb7947e2cbc1bfe7a5b1135f25885fec7cf3033a25eb",
        "shard_00003.parquet": "7f3b83841e583da34832dcfcfca98ed84d9faf5c7c9db0ba0565f1dfdea54965",
    },
    "cyrillic": {
        "manifest": "dfbe6162151ccca16fc39bca7cba94947713c5b759f9b03a79a730890bd56d36",
        "shard_00000.parquet": "d0b4c271952fc2995b7aae681d6b6c2cfc3e53ed557c0c496c30f9ebb98bfba5",
        "shard_00001.parquet": "1992b4981c4478f7b00cb986364ca8d9754a41fc1d07627c9f0c55bf6324d951",
        "shard_00002.parquet": "d42cfb8c265fb06618106e80d8f1c81cf0b49d6ef1d2bc3f61a22049095c25ed",
        "shard_00003.parquet": "c41412318d98e11391e657f8ddc320129bba477264e0d3789544db7173ee17ba",
    },
}
# The mixed folder's skips (the manifest's hash holds them too; spelled out to show what it exercises).
MIXED_SKIPPED = {
    "empty": 5,
    "invalid_json": 1,
    "invalid_utf8": 4,
    "no_text_field": 2,
    "null_text": 1,
    "unsupported_file": 1,
}
# The Debian packages' versions whose default corpus gave DEBIAN_DOCS.
DEBIAN_VERSIONS = ["3.11.2-6+deb12u9", "1:3.0-37"]
DEBIAN_DOCS = {  # since rst_clean keeps an inline literal as written (149 of 5,820 documents changed, 2026-12-07)
    "manifest": "2fc6aee867ae75c84672d7c843e54e6926760840523a59ea0bd68684947a0182",
    "shard_00000.parquet": "d0676693e8b875fe7515cc7068ad12620d0853e5562697c821ab27202f215310",
    "shard_00001.parquet": "ea13316ad5ef90f946e570d19f1682b04a147978cd5691b2c0fdef9debcd4b39",
    "shard_00002.parquet": "d4aff7030145798bc7de4f679093215bd61c9a894da546d12170831d78bd7327",
    "shard_00003.parquet": "cce35446c280838e5f7a748e5fc3da5860da6050adb358f9890961b8901f0c27",
}


@pytest.mark.parametrize(
    "name, build, options, flush_chars",
    [
        ("mixed", mixed_folder, {"num_shards": 3, "row_group_size": 16, "seed": 0}, documents.FLUSH_CHARS),
        # every document of a .txt or .jsonl file an Arrow chunk of its own: the shards gather across 191 chunks
        ("mixed", mixed_folder, {"num_shards": 3, "row_group_size": 16, "seed": 0}, 1),
        ("cyrillic", cyrillic_folder, {"rows_per_shard": 100, "row_group_size": 32, "seed": 7}, 1000),
    ],
)
def test_a_folder_prepares_to_the_same_bytes(tmp_path, monkeypatch, name, build, options, flush_chars):
    monkeypatch.setattr(documents, "FLUSH_CHARS", flush_chars)
    build(tmp_path / "src")
    manifest = prepare(str(tmp_path / "src"), tmp_path / "out", log=lambda *_: None, **options)
    assert manifest["skipped"] == (MIXED_SKIPPED if name == "mixed" else {})
    assert digests(tmp_path / "out") == EXPECTED[name]


@pytest.mark.skipif(
    [corpora.debian_version(p) for p in ("python3.11-doc", "wordnet-base")] != DEBIAN_VERSIONS,
    reason=f"needs the Debian packages python3.11-doc and wordnet-base of versions {DEBIAN_VERSIONS}",
)
def test_the_default_corpus_prepares_to_the_same_bytes(tmp_path):
    manifest = prepare("debian-docs", tmp_path / "out", num_shards=3, log=lambda *_: None)
    assert manifest["documents"] == 5820
    assert digests(tmp_path / "out") == DEBIAN_DOCS


def test_take_gathers_across_chunks_in_the_order_asked():
    texts = pa.chunked_array([["a", "b"], ["c"], ["d", "e", "f"]], type=pa.large_string())
    taken = documents.take(texts, np.array([5, 0, 2, 3, 1]))
    assert taken.type == pa.large_string() and taken.to_pylist() == ["f", "a", "c", "d", "b"]
    assert documents.take(texts, np.array([4, 3])).to_pylist() == ["e", "d"]  # from one chunk

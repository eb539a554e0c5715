"""`raychat data prepare` on local folders: counted skips, shard layout, manifest, errors, the CLI."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.cluster import init_local_ray

from raychat.cli import main
from raychat.data.corpus.corpora import local_folder
from raychat.data.corpus.prepare import count_shards, prepare
from raychat.data.corpus.shards import DataError, inspect_shard, list_shards, split_evenly


def quiet(message: str) -> None:
    pass


def shard_texts(path: str | Path) -> list[str]:
    return pq.read_table(path).column("text").to_pylist()


@pytest.fixture
def mixed_folder(tmp_path) -> Path:
    """Every supported file type, with bad documents whose skips are counted by hand below."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha document\n")
    (root / "b.md").write_text("")  # empty
    (root / "c.rst").write_text("  \n\n")  # empty (whitespace only)
    (root / "d.txt").write_bytes(b"caf\xe9 latin-1")  # invalid_utf8
    (root / "notes.csv").write_text("a,b\n")  # unsupported_file
    (root / "sub" / "e.jsonl").write_bytes(
        b'{"text": "j1"}\n'
        b'{"text": ""}\n'  # empty
        b'{"title": "no text"}\n'  # no_text_field
        b'{"text": "\xff"}\n'  # invalid_utf8
        b"not json\n"  # invalid_json
        b"\n"  # empty
        b'{"text": "j2"}\n'
    )
    pq.write_table(pa.table({"text": ["p1", "", None, "p2"]}), root / "f.parquet")  # empty, null_text
    pq.write_table(
        pa.table({"text": pa.array([b"g1", b"\xff\xfe"], pa.binary())}), root / "g.parquet"
    )  # invalid_utf8
    return root


def test_local_folder_counts_every_skip(mixed_folder):
    corpus = local_folder(mixed_folder)
    # files in sorted order: a.txt, b.md, c.rst, d.txt, f.parquet, g.parquet, notes.csv, sub/e.jsonl
    assert corpus.documents.to_pylist() == ["alpha document\n", "p1", "p2", "g1", "j1", "j2"]
    assert dict(corpus.skips.counts) == {
        "empty": 5,
        "invalid_utf8": 3,
        "null_text": 1,
        "unsupported_file": 1,
        "no_text_field": 1,
        "invalid_json": 1,
    }
    assert corpus.skips.examples["invalid_utf8"] == [
        "d.txt",
        "g.parquet:row_group=0:row=1",
        "sub/e.jsonl:line=4",
    ]
    assert corpus.skips.examples["empty"] == [
        "b.md",
        "c.rst",
        "f.parquet:row_group=0:row=1",
        "sub/e.jsonl:line=2",
        "sub/e.jsonl:line=6",
    ]


def test_prepare_folder_manifest_and_report(mixed_folder, tmp_path):
    lines = []
    manifest = prepare(str(mixed_folder), tmp_path / "out", num_shards=2, seed=3, log=lines.append)
    assert manifest["documents"] == 6
    assert manifest["bytes"] == len("alpha document\n") + 5 * 2
    assert manifest["skipped"] == {
        "empty": 5,
        "invalid_json": 1,
        "invalid_utf8": 3,
        "no_text_field": 1,
        "null_text": 1,
        "unsupported_file": 1,
    }
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    report = "\n".join(lines)
    assert "6 documents" in report and "3 shards (2 train + validation shard_00002.parquet)" in report
    assert "skipped 12 documents:" in report
    assert "  invalid_utf8: 3  (e.g. d.txt, g.parquet:row_group=0:row=1, sub/e.jsonl:line=4)" in report


def test_shard_layout_and_deterministic_shuffle(tmp_path):
    docs = [f"document {i}: " + "word " * (i % 7) for i in range(2500)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    manifest = prepare(str(src), out, num_shards=2, seed=7, row_group_size=100, log=quiet)

    train, val = list_shards(out, verify=True)
    assert [Path(f).name for f in train] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert Path(val).name == "shard_00002.parquet" == manifest["validation_shard"]
    assert [s["split"] for s in manifest["shards"]] == ["train", "train", "val"]
    assert [s["documents"] for s in manifest["shards"]] == [834, 833, 833]  # 2500 = 834 + 833 + 833

    for entry, path in zip(manifest["shards"], train + [val]):
        assert entry["sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
        pf = pq.ParquetFile(path)
        assert pf.schema_arrow == pa.schema([pa.field("text", pa.string())])
        groups = [pf.metadata.row_group(g) for g in range(pf.num_row_groups)]
        assert [g.num_rows for g in groups] == [100] * 8 + [entry["documents"] - 800]
        assert {g.column(0).compression for g in groups} == {"ZSTD"}
        assert entry["bytes"] == sum(len(t.encode()) for t in shard_texts(path))

    expected = list(docs)
    random.Random(7).shuffle(expected)  # the documented shuffle, then cut in order
    assert [t for f in train + [val] for t in shard_texts(f)] == expected

    again = prepare(str(src), tmp_path / "again", num_shards=2, seed=7, row_group_size=100, log=quiet)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]
    other = prepare(str(src), tmp_path / "other", num_shards=2, seed=8, row_group_size=100, log=quiet)
    assert [s["sha256"] for s in other["shards"]] != [s["sha256"] for s in manifest["shards"]]


def test_rows_per_shard_and_stale_shards_removed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"{i}.txt").write_text(f"doc {i}")
    out = tmp_path / "out"
    m = prepare(str(src), out, rows_per_shard=2, log=quiet)
    assert [s["documents"] for s in m["shards"]] == [2, 2, 2, 2, 2]
    m = prepare(str(src), out, rows_per_shard=4, log=quiet)  # ceil(10 / 4) = 3 shards
    assert [s["documents"] for s in m["shards"]] == [4, 3, 3]
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "shard_00000.parquet",
        "shard_00001.parquet",
        "shard_00002.parquet",
    ]


def test_a_killed_prepare_leaves_no_orphan_shards(tmp_path, capsys):
    """A run killed after removing the manifest (here: removed by hand) left its shards unlisted; the next,
    smaller run deleted only what a manifest listed, so shard_00002..4 stayed for good."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"{i}.txt").write_text(f"doc {i}")
    out = tmp_path / "out"
    argv = ["data", "prepare", "--source", str(src), "--out", str(out)]
    assert main([*argv, "--rows-per-shard", "2"]) == 0
    (out / "manifest.json").unlink()
    assert main([*argv, "--num-shards", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "shard_00000.parquet",
        "shard_00001.parquet",
    ]
    assert (
        "removed 3 earlier shards that manifest.json does not list "
        "(shard_00002.parquet, shard_00003.parquet, shard_00004.parquet)" in capsys.readouterr().out
    )
    train, val = list_shards(out, verify=True)
    assert sorted(shard_texts(train[0]) + shard_texts(val)) == sorted(f"doc {i}" for i in range(10))


def test_a_prepared_dataset_inside_the_source_is_skipped(tmp_path):
    """A copy of a data directory inside the source was read as documents, its validation shard included."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text(f"old {i}")
    prepare(str(docs), tmp_path / "data", num_shards=1, log=quiet)
    src = tmp_path / "src"
    (src / "deep" / "er").mkdir(parents=True)
    (src / "a.txt").write_text("new a")
    shutil.copytree(tmp_path / "data", src / "olddata")
    shutil.copytree(tmp_path / "data", src / "deep" / "er" / "copy")
    (src / "other").mkdir()  # a manifest.json of another format does not make a prepared dataset
    (src / "other" / "manifest.json").write_text(json.dumps({"format": "x", "shards": []}))
    pq.write_table(pa.table({"text": ["new p"]}), src / "other" / "shard_00000.parquet")
    manifest = prepare(str(src), tmp_path / "out", num_shards=1, log=quiet)
    assert manifest["documents"] == 2
    assert manifest["skipped"] == {"prepared_dataset": 2, "unsupported_file": 1}
    assert manifest["skipped_examples"] == {
        "prepared_dataset": ["deep/er/copy", "olddata"],
        "unsupported_file": ["other/manifest.json"],
    }
    train, val = list_shards(tmp_path / "out")
    assert sorted(shard_texts(train[0]) + shard_texts(val)) == ["new a", "new p"]


def test_a_prepared_data_dir_as_the_source_is_refused(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text(f"old {i}")
    prepare(str(docs), tmp_path / "data", num_shards=1, log=quiet)
    argv = ["data", "prepare", "--source", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert (
        f"raychat data prepare: error: --source {tmp_path / 'data'}: a data directory raychat data prepare "
        "wrote (manifest.json): its shards are prepared already (train on it with --data-dir); give the "
        "folder of the original documents\n"
    ) == capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_count_shards_and_split_evenly():
    assert count_shards(5820, None, None) == 6  # ceil(5820 / 1024)
    assert count_shards(10, 4, None) == 5
    assert count_shards(3, None, 100) == 2  # never fewer than train + validation
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="not both"):
        count_shards(10, 2, 2)
    with pytest.raises(ValueError, match="--num-shards must be >= 1"):
        count_shards(10, 0, None)
    with pytest.raises(ValueError) as e:
        count_shards(1, None, None)
    assert (
        str(e.value) == "1 document is too few for 2 shards (train + validation: one document at least each)"
    )
    with pytest.raises(ValueError) as e:
        count_shards(4, 4, None)
    assert (
        str(e.value)
        == "4 documents are too few for 5 shards (train + validation: one document at least each); give "
        "--num-shards 3 at most"  # it named no flag
    )


def test_shard_options_are_checked_before_the_corpus_is_loaded(tmp_path):
    lines = []
    with pytest.raises(ValueError) as e:  # the source does not exist: it was never read
        prepare(str(tmp_path / "nope"), tmp_path / "out", num_shards=2, rows_per_shard=2, log=lines.append)
    assert str(e.value) == "give --num-shards or --rows-per-shard for a local source, not both"
    assert lines == [] and not (tmp_path / "out").exists()


def test_a_folder_without_usable_documents_says_what_was_skipped(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(DataError) as e:
        prepare(str(src), tmp_path / "out", log=quiet)
    assert str(e.value) == (
        f"--source {src}: no usable documents: it holds no text (documents are .txt, .md and .rst files, "
        ".jsonl lines and .parquet rows)"
    )
    (src / "b.md").write_text(" \n")
    (src / "c.txt").write_text("")
    (src / "d.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError) as e:
        prepare(str(src), tmp_path / "out", log=quiet)
    assert str(e.value) == (
        f"--source {src}: no usable documents: skipped 3 documents (empty: 2 (e.g. b.md, c.txt); "
        "invalid_utf8: 1 (e.g. d.txt))"
    )
    assert not (tmp_path / "out").exists()


def test_too_few_documents_for_the_shards_says_what_was_skipped(tmp_path, capsys):
    """A folder of latin-1 files and one UTF-8 file: the error named only the one document left, not the
    files skipped, which are the fix."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the one UTF-8 document")
    for name in ("b.txt", "c.txt"):
        (src / name).write_bytes(b"caf\xe9 cr\xe8me")
    out = tmp_path / "out"
    assert main(["data", "prepare", "--source", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"raychat data prepare: error: --source {src}: 1 document is too few for 2 shards (train + validation: "
        "one document at least each); skipped 2 documents (invalid_utf8: 2 (e.g. b.txt, c.txt)); a .txt, .md or .rst "
        "file is one document, whole (1 file here): split a large one into a file a document, or into a .jsonl of a "
        '{"text": ...} a line\n'
    )
    assert not out.exists()


def test_a_lone_surrogate_in_jsonl_is_an_invalid_utf8_skip(tmp_path):
    """A JSON escape of a lone surrogate is valid JSON but no UTF-8 text: that line is an invalid_utf8 skip and the
    rest is prepared. A surrogate pair is one character and kept."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.jsonl").write_text(
        '{"text": "a \\ud800 b"}\n{"text": "pair \\ud83d\\ude00"}\n{"text": "plain"}\n{"text": "\\udfff"}\n'
    )
    (src / "y.txt").write_bytes("a \ud800 b".encode("utf-8", "surrogatepass"))  # no UTF-8 decoding gives one
    lines = []
    manifest = prepare(str(src), tmp_path / "out", log=lines.append)
    assert manifest["documents"] == 2
    assert manifest["skipped"] == {"invalid_utf8": 3}
    assert manifest["skipped_examples"] == {"invalid_utf8": ["x.jsonl:line=1", "x.jsonl:line=4", "y.txt"]}
    train, val = list_shards(tmp_path / "out")
    assert sorted(shard_texts(train[0]) + shard_texts(val)) == ["pair \U0001f600", "plain"]
    assert "  invalid_utf8: 3  (e.g. x.jsonl:line=1, x.jsonl:line=4, y.txt)" in lines


def test_a_large_validation_share_is_a_warning(tmp_path):
    """37 documents -> 19 train + 18 validation: said in the log, the cut unchanged."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i:02d}"}) + "\n" for i in range(37)))
    lines = []
    manifest = prepare(str(src), tmp_path / "out", log=lines.append)
    assert [s["documents"] for s in manifest["shards"]] == [19, 18]
    assert [line for line in lines if line.startswith("warning")] == [
        "warning: the validation shard shard_00001.parquet holds 18 of 37 documents (49%) and 108 bytes of "
        "222 bytes of text (49%), held out of training: more shards (--num-shards, or a smaller "
        "--rows-per-shard) hold out less",
        "warning: the validation shard shard_00001.parquet holds only 108 bytes of text (18 documents): a "
        "validation loss measured on less than 100.0 kB is noise; a larger corpus gives a larger one",
    ]


def test_a_tiny_validation_shard_is_a_warning(tmp_path):
    """One long document and one of 8 bytes: the validation shard holds the 8 bytes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "long.txt").write_text("x" * 2_000_000)
    (src / "short.txt").write_text("8 bytes!")
    lines = []
    manifest = prepare(str(src), tmp_path / "out", seed=0, log=lines.append)
    assert [s["bytes"] for s in manifest["shards"]] == [2_000_000, 8]
    assert [line for line in lines if line.startswith("warning")] == [
        "warning: the validation shard shard_00001.parquet holds 1 of 2 documents (50%) and 8 bytes of "
        "2.00 MB of text (0%), held out of training: more shards (--num-shards, or a smaller "
        "--rows-per-shard) hold out less",
        "warning: the validation shard shard_00001.parquet holds only 8 bytes of text (1 document): a "
        "validation loss measured on less than 100.0 kB is noise; a larger corpus gives a larger one",
    ]


def test_no_warning_for_a_validation_share_of_at_most_a_fifth(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text(
        "".join(json.dumps({"text": f"{i:02d} " + "w" * 24_997}) + "\n" for i in range(50))
    )
    lines = []
    manifest = prepare(str(src), tmp_path / "out", num_shards=4, log=lines.append)
    assert [(s["documents"], s["bytes"]) for s in manifest["shards"]] == [
        (10, 250_000)
    ] * 5  # 20%: no warning
    assert [line for line in lines if line.startswith("warning")] == []


def test_corrupt_parquet_names_the_file_and_row_group(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    path = src / "bad.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(8)]}), path, row_group_size=4)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + chunk.total_compressed_size] = b"\xab" * chunk.total_compressed_size
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"bad\.parquet: row group 1 of 2 cannot be read"):
        prepare(str(src), tmp_path / "out", log=quiet)
    assert not (tmp_path / "out").exists()  # failed before writing anything

    path.write_bytes(b"PAR1 garbage")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file"):
        inspect_shard(path)
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(DataError, match=r"bad\.parquet: no `text` column \(columns: \['body'\]\)"):
        local_folder(src)


def test_list_shards_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `raychat data prepare"):
        list_shards(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"doc {i}")
    prepare(str(src), tmp_path / "out", num_shards=1, log=quiet)
    shard = tmp_path / "out" / "shard_00000.parquet"
    pq.write_table(pa.table({"text": ["tampered"]}), shard)
    list_shards(tmp_path / "out")  # no hash check by default
    with pytest.raises(ValueError, match="sha256 differs"):
        list_shards(tmp_path / "out", verify=True)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard_00000.parquet is listed"):
        list_shards(tmp_path / "out")


def test_cli(mixed_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(["data", "prepare", "--source", str(mixed_folder), "--out", str(out), "--num-shards", "1"]) == 0
    )
    printed = capsys.readouterr().out
    assert (
        "prepared" in printed
        and "6 documents" in printed
        and "unsupported_file: 1  (e.g. notes.csv)" in printed
    )
    assert main(["data", "prepare", "--source", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert (
        "nope: no such directory; give debian-docs, fineweb-edu, climbmix or a directory of documents"
        in capsys.readouterr().err
    )
    assert main(["data", "prepare", "--source", str(mixed_folder), "--out", str(mixed_folder / "out")]) == 2
    assert f"error: the output {mixed_folder / 'out'} (--out) lies inside --source" in capsys.readouterr().err
    inside = ["--storage-path", str(mixed_folder), "--run-name", "data"]  # no --out: the flag that placed it
    assert main(["data", "prepare", "--source", str(mixed_folder), *inside]) == 2
    assert (
        f"error: the output {mixed_folder / 'data'} (--storage-path) lies inside" in capsys.readouterr().err
    )
    assert main(["data", "prepare", "--source", "climbmix", "--rows-per-shard", "5", "--out", str(out)]) == 2
    assert "--rows-per-shard applies to local sources only" in capsys.readouterr().err


@pytest.mark.ray
def test_ray_data_reads_the_shards(tmp_path):
    import ray

    src = tmp_path / "src"
    src.mkdir()
    docs = [f"doc {i}" for i in range(300)]
    (src / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(str(src), tmp_path / "out", num_shards=2, row_group_size=64, log=quiet)
    train, val = list_shards(tmp_path / "out")
    init_local_ray(num_cpus=2, include_dashboard=False)
    try:
        rows = ray.data.read_parquet(train + [val]).select_columns(["text"]).take_all()
    finally:
        ray.shutdown()
    assert sorted(r["text"] for r in rows) == sorted(docs)

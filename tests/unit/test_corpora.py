"""The default corpus: reST cleaning, WordNet glosses, the Debian packages, and their absence."""

from __future__ import annotations

import json
import os
import random
import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raychat.cli import main
from raychat.config.presets import preset_names, preset_values
from raychat.data.corpus import corpora, shards
from raychat.data.corpus.corpora import CorpusNotInstalled, python_docs, wordnet_entry, wordnet_glosses
from raychat.data.corpus.download import HUB_SOURCES
from raychat.data.corpus.prepare import VALIDATION_MAX_SHARE, prepare, split_line
from raychat.data.corpus.rst_clean import clean_inline, clean_rst, split_sections
from raychat.data.corpus.shards import DataError, check_shard_bytes

RST = """\
.. _tut-intro:

:mod:`spam` --- Canned meat
============================

.. module:: spam
   :synopsis: Canned meat.

.. index:: single: spam

The :func:`~spam.tins.open` function reads **tins** and *lids*; see :ref:`the guide <spam-guide>`,
:pep:`8` and `the site <https://example.org>`_. Use ``open(x)``.

.. function:: open(path, mode="r")
              open(fd)

   Open a tin at *path*.

   .. versionadded:: 3.2

   .. versionchanged:: 3.4
      Accepts file descriptors.

   For example::

      >>> open("ham")   # *not* :func:`eggs`
      <Tin ham>

.. note:: Tins are
   heavy.

+-----+-----+
| a   | b   |
+-----+-----+

=====  =====
x      y
=====  =====
1      2
=====  =====

.. code-block:: python

   x = ``raw``

.. |sub| replace:: text
.. This is a comment
   spanning lines.

Done.
"""

CLEAN = """\
spam --- Canned meat

The open function reads tins and lids; see the guide,
PEP 8 and the site. Use open(x).

open(path, mode="r")
open(fd)

Open a tin at path.

New in version 3.2.

Changed in version 3.4: Accepts file descriptors.

For example:

>>> open("ham")   # *not* :func:`eggs`
<Tin ham>

Note: Tins are heavy.

x = ``raw``

Done."""


def test_clean_rst_rules():
    # roles, links, emphasis, literals and substitutions rewritten; targets, index, module, options, tables,
    # comments dropped; literal blocks and code-block bodies kept verbatim (their markup-like text too)
    assert clean_rst(RST) == CLEAN


@pytest.mark.parametrize(
    "rst, text",
    [
        (r"Use ``'\n'`` as the separator.", r"Use '\n' as the separator."),  # a literal keeps its backslashes
        (r"Match ``r'\d+'`` or \*not\* a star\ s.", r"Match r'\d+' or *not* a stars."),  # escapes outside it
        (r"``*a*`` and *b* and ``|sub|``", r"*a* and b and |sub|"),  # markup in a literal is text
        ("a \ue0007\ue001 b", "a \ue0007\ue001 b"),  # text that looks like a set-aside literal is kept
    ],
)
def test_clean_inline_keeps_an_inline_literal_as_written(rst, text):
    assert clean_inline(rst) == text


def test_split_sections_at_titles():
    text = "Intro\n=====\n\npara one\n\n=====\nPart\n=====\n\npara two\n\nSub\n---\npara three\n\n   ----\n"
    assert split_sections(text) == [
        "Intro\n=====\n\npara one\n",
        "=====\nPart\n=====\n\npara two\n",
        "Sub\n---\npara three\n\n   ----\n",  # an indented line of dashes is not a title underline
    ]


def test_wordnet_entry_from_real_lines():
    noun = (
        "00002684 03 n 02 object 0 physical_object 0 039 @ 00001930 n 0000 | a tangible and visible entity; "
        '"it was full of rackets, balls and other objects"  \n'
    )
    assert wordnet_entry(noun) == (
        'object, physical object (noun): a tangible and visible entity; "it was full of rackets, balls and other objects"'
    )
    adj = (
        "01234567 00 s 02 a_cappella(a) 0 unaccompanied(ip) 1 001 & 00095280 a 0000 | without instruments  \n"
    )
    assert wordnet_entry(adj) == "a cappella, unaccompanied (adjective): without instruments"
    assert (
        wordnet_entry("  1 This software and database is being provided to you, the LICENSEE, by  \n") is None
    )


def test_wordnet_glosses_group_per_document(tmp_path):
    for pos, code in [("noun", "n"), ("verb", "v"), ("adj", "a"), ("adv", "r")]:
        lines = ["  1 license header line  \n"]
        lines += [f"{i:08d} 00 {code} 01 w{i}_{pos} 0 000 | gloss {i}  \n" for i in range(5)]
        (tmp_path / f"data.{pos}").write_text("".join(lines))
    docs = wordnet_glosses(tmp_path, per_document=2)
    assert len(docs) == 4 * 3  # 5 synsets per file -> documents of 2, 2, 1
    assert docs[0] == "w0 noun (noun): gloss 0\nw1 noun (noun): gloss 1"
    assert docs[2] == "w4 noun (noun): gloss 4"
    assert docs[-1] == "w4 adv (adverb): gloss 4"


def test_python_docs_merges_short_sections_and_counts_empty_pages(tmp_path):
    long = "word " * 120  # 600 characters: a section long enough to stand alone
    (tmp_path / "a.rst.txt").write_text(
        f"Alpha\n=====\n\n{long}\n\nBeta\n----\n\nshort b\n\nGamma\n-----\n\nshort c\n\nDelta\n-----\n\n{long}\n"
    )
    (tmp_path / "toc.rst.txt").write_text(".. toctree::\n\n   a\n")
    (tmp_path / "bad.rst.txt").write_bytes(b"\xff\xfe")
    skips = corpora.Skips()
    docs = python_docs(tmp_path, skips)
    # Beta and Gamma are shorter than MIN_SECTION_CHARS (500): they are joined to the section after them
    assert docs == [
        f"Alpha\n\n{long.strip()}",
        f"Beta\n\nshort b\n\nGamma\n\nshort c\n\nDelta\n\n{long.strip()}",
    ]
    assert dict(skips.counts) == {"invalid_utf8": 1, "empty": 1}
    assert skips.examples == {"invalid_utf8": ["bad.rst.txt"], "empty": ["toc.rst.txt"]}


def test_missing_debian_package_says_how_to_install(tmp_path):
    with pytest.raises(
        CorpusNotInstalled, match=r"python3\.11-doc .*sudo apt-get install -y python3\.11-doc wordnet-base"
    ):
        corpora.debian_docs(python_root=tmp_path / "none", wordnet_root=tmp_path)
    with pytest.raises(CorpusNotInstalled, match=r"wordnet-base .*apt-get install"):
        wordnet_glosses(tmp_path / "none")


@pytest.mark.skipif(
    not (corpora.PYTHON_DOCS_DIR.is_dir() and corpora.WORDNET_DIR.is_dir()),
    reason="needs the Debian packages python3.11-doc and wordnet-base (make corpus-deps)",
)
def test_real_default_corpus_is_at_least_10_mb():
    corpus = corpora.debian_docs()
    total = sum(len(d.encode()) for d in corpus.documents.to_pylist())
    assert total >= 10_000_000
    assert [c["package"] for c in corpus.components] == ["python3.11-doc", "wordnet-base"]
    assert sum(c["bytes"] for c in corpus.components) == total
    assert all(c["bytes"] >= 5_000_000 for c in corpus.components)
    # markup is gone from the prose: no role, directive or heading underline survives in most documents
    docs = corpus.documents.to_pylist()[: corpus.components[0]["documents"]]
    marked = [d for d in docs if ":func:`" in d or "\n.. " in d or "\n=====" in d]
    assert len(marked) < 0.01 * len(docs)


@pytest.mark.skipif(
    not (corpora.PYTHON_DOCS_DIR.is_dir() and corpora.WORDNET_DIR.is_dir()),
    reason="needs the Debian packages python3.11-doc and wordnet-base (make corpus-deps)",
)
def test_the_tiny_presets_cut_of_the_default_corpus_is_not_warned_about(tmp_path, capsys):
    """`raychat data prepare --preset tiny` (the first job of docs/deployment.md's chain) warned that its
    validation shard held 1940 of 5820 documents (33%): 2 train shards + 1 validation shard. 5 + 1 hold out a
    sixth, as the default --rows-per-shard 1024 cuts this corpus."""
    assert main(["data", "prepare", "--preset", "tiny", "--out", str(tmp_path / "data")]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert (
        "shuffling 5,820 documents (seed 0) into 6 shards: 5 train of 970 documents + 1 validation of 970 "
        "documents (17%, held out of training)"
    ) in text
    assert "warning" not in text
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    val = manifest["shards"][-1]
    assert val["split"] == "val" and val["bytes"] / sum(s["bytes"] for s in manifest["shards"]) < 0.2


def test_no_shipped_presets_local_cut_holds_out_more_than_the_warning_allows():
    """A shipped preset's --num-shards on a local corpus (hub sources take whole shards as published) keeps the
    validation shard's document share (1 of num_shards + 1 equal shards) within VALIDATION_MAX_SHARE."""
    local = {
        name: values["num_shards"]
        for name in preset_names()
        if (values := preset_values(name, "data")).get("source") not in HUB_SOURCES
    }
    assert local == {"cpu": 7, "tiny": 5}
    assert all(1 / (n + 1) <= VALIDATION_MAX_SHARE for n in local.values())


def test_a_lone_surrogate_escape_in_jsonl_is_an_invalid_utf8_skip(tmp_path):
    """A JSON escape of a lone surrogate is valid JSON but has no UTF-8 encoding (writing it aborted a whole
    `data prepare`): the line is an invalid_utf8 skip; a surrogate pair is one character and kept. A .txt file
    or a parquet value cannot give one: their strict UTF-8 decoding rejects an encoded surrogate."""
    (tmp_path / "x.jsonl").write_text(
        '{"text": "a \\ud800 b"}\n{"text": "pair \\ud83d\\ude00"}\n{"text": "\\udfff"}\n{"text": "ok"}\n'
    )
    (tmp_path / "y.txt").write_bytes("a \ud800 b".encode("utf-8", "surrogatepass"))
    corpus = corpora.local_folder(tmp_path)
    assert corpus.documents.to_pylist() == ["pair \U0001f600", "ok"]
    assert dict(corpus.skips.counts) == {"invalid_utf8": 3}
    assert corpus.skips.examples == {"invalid_utf8": ["x.jsonl:line=1", "x.jsonl:line=3", "y.txt"]}
    assert corpus.components[0]["bytes"] == len("pair \U0001f600".encode()) + 2


def test_a_utf8_byte_order_mark_is_dropped_from_text_files_and_jsonl_lines(tmp_path):
    """Windows editors write a BOM before a file's text: it is no part of the document (it was kept in a .txt
    document and made the first line of a .jsonl file an invalid_json skip)."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + b"first document\r\n")
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "line one"}\n{"text": "line two"}\n')
    corpus = corpora.local_folder(tmp_path)
    assert corpus.documents.to_pylist() == ["first document\r\n", "line one", "line two"]
    assert dict(corpus.skips.counts) == {}


@pytest.mark.parametrize(
    ("column", "kind"), [(pa.array([1, 2]), "int64"), (pa.array([["a"], ["b"]]), "list<element: string>")]
)
def test_a_parquet_text_column_of_another_type_is_an_error_naming_file_and_type(tmp_path, column, kind):
    """A `text` column of numbers or lists is refused naming the file and its type (it raised
    ArrowNotImplementedError from a cast); a binary one is decoded as UTF-8."""
    (tmp_path / "sub").mkdir()
    pq.write_table(pa.table({"text": column}), tmp_path / "sub" / "x.parquet")
    pq.write_table(pa.table({"text": pa.array([b"bytes ok"], pa.large_binary())}), tmp_path / "y.parquet")
    with pytest.raises(
        DataError,
        match=rf"^--source {re.escape(str(tmp_path))}: sub/x\.parquet: the `text` column holds {re.escape(kind)}, not",
    ):
        corpora.local_folder(tmp_path)
    (tmp_path / "sub" / "x.parquet").unlink()
    assert corpora.local_folder(tmp_path).documents.to_pylist() == ["bytes ok"]


def test_symlinked_directories_and_broken_links_are_counted_skips(tmp_path):
    """Nothing is dropped silently: a symbolic link to a directory (not followed) and a broken link were left
    out of the documents and of the skips; a link to a file is read as the file."""
    root, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "e.txt").write_text("outside")
    (root / "a.txt").write_text("inside")
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "gone.txt").symlink_to(tmp_path / "missing.txt")
    (root / "b.txt").symlink_to(root / "a.txt")
    os.mkfifo(root / "pipe.txt")
    corpus = corpora.local_folder(root)
    assert corpus.documents.to_pylist() == ["inside", "inside"]
    assert dict(corpus.skips.counts) == {"symlinked_directory": 1, "not_a_file": 2}
    assert corpus.skips.examples == {
        "not_a_file": ["gone.txt", "pipe.txt"],
        "symlinked_directory": ["linked"],
    }


def test_text_field_reads_another_jsonl_field_and_parquet_column(tmp_path):
    """An HF-style export keeps its documents under another name ("content"): --text-field reads that JSON
    field and parquet column (string or binary); .txt files are read whole either way, and a line or file
    lacking the field is the usual skip."""
    (tmp_path / "a.jsonl").write_text('{"content": "j1", "text": "not me"}\n{"text": "no content"}\n')
    pq.write_table(pa.table({"id": [1, 2], "content": ["p1", None]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"content": pa.array([b"p2"], pa.binary())}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("whole file")
    corpus = corpora.local_folder(tmp_path, text_field="content")
    assert corpus.documents.to_pylist() == ["j1", "p1", "p2", "whole file"]
    assert dict(corpus.skips.counts) == {"no_text_field": 1, "null_text": 1}
    assert corpus.skips.examples == {
        "no_text_field": ["a.jsonl:line=2"],
        "null_text": ["b.parquet:row_group=0:row=1"],
    }


def test_parquet_batches_inside_row_groups_keep_the_documents_and_row_group_skip_names(tmp_path, monkeypatch):
    """Row groups of 5, 5 and 1 rows read 2 rows a batch: the batches are [d0 null] [d2 d3] [blank] | [d5 d6]
    [\xff d8] [null] | [d10]; the skips keep the row within its row group (rows 4 and 2, 4 follow a batch
    boundary), and each batch that keeps a document is a chunk of its own (5; a row group a chunk would be 3)."""
    values = [b"d0", None, b"d2", b"d3", b"  ", b"d5", b"d6", b"\xff", b"d8", None, b"d10"]
    pq.write_table(
        pa.table({"text": pa.array(values, pa.binary())}), tmp_path / "b.parquet", row_group_size=5
    )
    monkeypatch.setattr(corpora, "batch_rows", lambda group, text_field: 2)
    corpus = corpora.local_folder(tmp_path)
    assert corpus.documents.to_pylist() == ["d0", "d2", "d3", "d5", "d6", "d8", "d10"]
    assert corpus.documents.num_chunks == 5
    assert dict(corpus.skips.counts) == {"null_text": 2, "empty": 1, "invalid_utf8": 1}
    assert corpus.skips.examples == {
        "null_text": ["b.parquet:row_group=0:row=1", "b.parquet:row_group=1:row=4"],
        "empty": ["b.parquet:row_group=0:row=4"],
        "invalid_utf8": ["b.parquet:row_group=1:row=2"],
    }


def test_a_parquet_batch_is_about_its_bytes_of_the_text_column(tmp_path):
    """1,000 rows, an `id` column before `text`: a batch of the text column's uncompressed size is the row
    group, of half of it 500 rows (499 where the size is odd), of one byte 1 row."""
    texts = [f"document {i:04d} " * 8 for i in range(1000)]
    pq.write_table(pa.table({"id": list(range(1000)), "text": texts}), tmp_path / "a.parquet")
    group = pq.ParquetFile(tmp_path / "a.parquet").metadata.row_group(0)
    size = group.column(1).total_uncompressed_size
    assert group.column(0).total_uncompressed_size != size
    assert corpora.batch_rows(group, "text", size) == 1000
    assert corpora.batch_rows(group, "text", size // 2) == (500 if size % 2 == 0 else 499)
    assert corpora.batch_rows(group, "text", 1) == 1


def test_a_parquet_file_without_the_text_column_names_its_columns_and_the_flag(tmp_path):
    pq.write_table(pa.table({"id": [1], "content": ["p1"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError) as e:
        corpora.local_folder(tmp_path)
    assert str(e.value) == (
        f"--source {tmp_path}: b.parquet: no `text` column (columns: ['id', 'content']); give --text-field with "
        "the column that holds the documents"
    )
    with pytest.raises(
        DataError, match=r"b\.parquet: no `body` column \(columns: \['id', 'content'\]\); give"
    ):
        corpora.local_folder(tmp_path, text_field="body")


def test_data_prepare_text_field_end_to_end(tmp_path, capsys):
    """JSONL lines keyed "content": without the flag every line is a no_text_field skip and the error names the
    flag; with it the shards hold the documents under `text` and the manifest records the field. A named source
    refuses the flag."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(f'{{"content": "doc {i}"}}\n' for i in range(3)))
    assert main(["data", "prepare", "--source", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"raychat data prepare: error: --source {src}: no usable documents: skipped 3 documents (no_text_field: "
        "3 (e.g. a.jsonl:line=1, a.jsonl:line=2, a.jsonl:line=3)); a .jsonl line's document is its 'text' "
        "field: give --text-field with the field that holds it\n"
    )
    assert not out.exists()
    assert main(["data", "prepare", "--source", str(src), "--out", str(out), "--text-field", "content"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["text_field"] == "content" and manifest["documents"] == 3
    texts = [t for s in manifest["shards"] for t in pq.read_table(out / s["file"]).column("text").to_pylist()]
    assert sorted(texts) == ["doc 0", "doc 1", "doc 2"]
    for source in ("debian-docs", "fineweb-edu"):
        assert (
            main(["data", "prepare", "--source", source, "--out", str(out), "--text-field", "content"]) == 2
        )
        assert capsys.readouterr().err.endswith(
            f"error: --text-field applies to a --source DIR (its .jsonl and .parquet files), not to --source "
            f"{source}\n"
        )
    assert (out / "manifest.json").exists()


def test_ctrl_c_during_prepare_says_what_is_left_and_the_rerun_finishes(tmp_path):
    """Ctrl-C as the second shard is written (after the earlier manifest was removed): the interrupt says that
    the directory holds no finished data and to run again; the lease is released, and the same prepare then
    writes the same shards as an uninterrupted one and removes the extra shard of the earlier, larger run."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"document {i}")
    prepare(str(src), out, num_shards=3, log=lambda m: None)  # 4 shards

    def interrupt(message: str) -> None:
        if "wrote shard_00001" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as e:
        prepare(str(src), out, num_shards=2, log=interrupt)
    assert str(e.value) == (
        f"{out} holds no finished data now (no manifest.json: the earlier one was removed as the run started); "
        "run the same command again, which prepares it from the start"
    )
    assert sorted(p.name for p in out.iterdir()) == [f"shard_0000{i}.parquet" for i in range(4)]
    lines: list[str] = []
    manifest = prepare(str(src), out, num_shards=2, log=lines.append)
    assert [s["documents"] for s in manifest["shards"]] == [3, 3, 2]
    assert "removed 1 earlier shard that manifest.json does not list (shard_00003.parquet)" in lines
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [
        f"shard_0000{i}.parquet" for i in range(3)
    ]


def test_ctrl_c_during_prepare_ends_in_a_line_named_as_its_errors_are(tmp_path, monkeypatch, capsys):
    """Its Ctrl-C line read `raychat data: interrupted: ...`, its errors `raychat data prepare: error: ...`; both
    now name the command as its parser does, and so does every command's (`raychat tokenizer train: error:`)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i}")
    write_shard = shards.write_shard

    def interrupted_at_the_second(texts, path, row_group_size):
        if path.name == "shard_00001.parquet":
            raise KeyboardInterrupt
        write_shard(texts, path, row_group_size)

    monkeypatch.setattr(shards, "write_shard", interrupted_at_the_second)
    assert main(["data", "prepare", "--source", str(src), "--out", str(out)]) == 130
    assert capsys.readouterr().err == (
        f"raychat data prepare: interrupted: {out} holds no finished data now (no manifest.json); run the same "
        "command again, which prepares it from the start\n"
    )
    assert main(["data", "prepare", "--source", str(src), "--out", str(out), "--num-shards", "0"]) == 2
    assert capsys.readouterr().err.startswith("raychat data prepare: error: --num-shards must be >= 1")


def test_ctrl_c_while_reading_the_folder_is_named_too(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the folder is read (minutes for a large one: its progress lines), before anything is written,
    ended in a bare `interrupted`; it names the command as every other line does."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("document")

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpora, "keep", ctrl_c)
    assert main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == "raychat data prepare: interrupted\n"
    assert not (tmp_path / "out").exists()


def test_the_line_that_announces_the_cut_says_how_much_is_held_out_of_training(tmp_path):
    """A folder of 37 documents gets 2 shards (1024 documents a shard at most, 2 at least): its validation shard
    is half of it, which the line said only as `into 2 shards (1 train + 1 validation)`."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i:02d}"}) + "\n" for i in range(37)))
    lines = []
    prepare(str(src), tmp_path / "out", log=lines.append)
    assert [line for line in lines if line.startswith("shuffling")] == [
        "shuffling 37 documents (seed 0) into 2 shards: 1 train of 19 documents + 1 validation of 18 documents "
        "(49%, held out of training)"  # 18 / 37 = 48.6%
    ]
    assert split_line(5_900, 6, 7) == (  # 5,900 = 2 x 984 + 4 x 983
        "shuffling 5,900 documents (seed 7) into 6 shards: 5 train of 983-984 documents + 1 validation of 983 "
        "documents (17%, held out of training)"  # 983 / 5,900 = 16.7%
    )
    assert split_line(2, 2, 0) == (
        "shuffling 2 documents (seed 0) into 2 shards: 1 train of 1 document + 1 validation of 1 document (50%, "
        "held out of training)"
    )
    # under 1% held out read "0%": nothing held out, where 200 documents are
    assert split_line(100_000, 500, 0) == (
        "shuffling 100,000 documents (seed 0) into 500 shards: 499 train of 200 documents + 1 validation of 200 "
        "documents (0.2%, held out of training)"
    )


def test_reading_a_folder_logs_its_progress_each_tenth_after_a_quiet_start_then_its_end(tmp_path):
    """`data prepare` from a folder printed nothing while it read. Files of 100, 300, 500 and 100 bytes, a
    clock 3 s on at each look: at 3 s (10%) it is still quiet (READ_QUIET_S), at 6 s 40% is read (eta 6 s x
    0.6 / 0.4 = 9 s), at 9 s 90% (eta 1 s); the last file logs only the end line. notes.csv is not read."""
    for name, n in [("a.txt", 100), ("b.txt", 300), ("c.txt", 500), ("d.txt", 100), ("notes.csv", 50)]:
        (tmp_path / name).write_text("x" * n)
    ticks = iter(range(0, 100, 3))
    lines = []
    corpus = corpora.local_folder(tmp_path, log=lines.append, clock=lambda: next(ticks))
    assert len(corpus.documents) == 4 and dict(corpus.skips.counts) == {"unsupported_file": 1}
    assert lines == [
        "read 2/4 files (40% of 1.0 kB) in 6s, eta 9s",
        "read 3/4 files (90% of 1.0 kB) in 9s, eta 1s",
        "read 4 files (1.0 kB) in 12s",
    ]


def test_writing_many_shards_logs_tenths_then_one_end_line(tmp_path):
    """A 278 MB corpus printed 196 `wrote shard_...` lines. 40 documents of 6 bytes into 20 shards of 2 (more
    than SHARD_LINES_MAX), a clock 1 s on at each look: shard k ends at k s with 2k documents, the k//2-th
    tenth; quiet until 5 s (WRITE_QUIET_S), then a line at each new tenth: shards 5, 6, 8, ..., 18 (8 lines,
    eta k s x (40 - 2k) / 2k); the 20th logs only the end line, at 20 s."""
    documents = [f"doc {i:02d}" for i in range(40)]
    ticks = iter(range(100))
    lines: list[str] = []
    entries = shards.write_shards(documents, tmp_path, 20, log=lines.append, clock=lambda: next(ticks))
    on_disk = corpora.size(sum(e["file_bytes"] for e in entries))
    assert lines == [
        "wrote 5/20 shards (25% of 40 documents) in 5s, eta 15s",
        "wrote 6/20 shards (30% of 40 documents) in 6s, eta 14s",
        "wrote 8/20 shards (40% of 40 documents) in 8s, eta 12s",
        "wrote 10/20 shards (50% of 40 documents) in 10s, eta 10s",
        "wrote 12/20 shards (60% of 40 documents) in 12s, eta 8s",
        "wrote 14/20 shards (70% of 40 documents) in 14s, eta 6s",
        "wrote 16/20 shards (80% of 40 documents) in 16s, eta 4s",
        "wrote 18/20 shards (90% of 40 documents) in 18s, eta 2s",
        f"wrote 20 shards (40 documents, 240 bytes of text, {on_disk} on disk) in 20s",
    ]


def test_a_cut_into_few_shards_keeps_a_line_a_shard_and_a_quick_large_one_only_its_end_line(tmp_path):
    """Up to SHARD_LINES_MAX (10) shards, a line each (the split and size of each, beside the cut line), then the
    end line; 11 shards written within WRITE_QUIET_S log only the end line."""
    assert shards.SHARD_LINES_MAX == 10
    documents = [f"doc {i:02d}" for i in range(22)]
    lines: list[str] = []
    entries = shards.write_shards(documents, tmp_path / "ten", 10, log=lines.append, clock=lambda: 0.0)
    assert len(lines) == 11 and lines[-1].startswith("wrote 10 shards (22 documents, 132 bytes of text, ")
    assert (
        lines[0]
        == f"  wrote shard_00000.parquet: train, 3 documents, 18 bytes of text, {corpora.size(entries[0]['file_bytes'])} on disk"
    )
    assert lines[9].startswith("  wrote shard_00009.parquet: val, 2 documents, 12 bytes of text, ")
    lines.clear()
    shards.write_shards(documents, tmp_path / "eleven", 11, log=lines.append, clock=lambda: 0.0)
    assert len(lines) == 1 and lines[0].startswith("wrote 11 shards (22 documents, 132 bytes of text, ")
    assert lines[0].endswith(" on disk) in 0s")


def test_a_folder_larger_than_the_memory_available_is_warned_about_before_it_is_read(tmp_path, monkeypatch):
    """prepare holds the whole corpus in memory to shuffle it, which nothing said. By the measured rule (150 MB +
    1.4 x a .jsonl's bytes + 5.2 x a .parquet's): a 100 MB .jsonl and a 10 MB .parquet need 150 + 140 + 52 =
    342 MB, a warning where 300 MB are available, none where 342 MB are. A folder of two 10-byte files, with
    100 MB available, warns of 150 MB (150,000,028 bytes) before its reading line."""
    assert corpora.memory_needed([(".jsonl", 100_000_000), (".parquet", 10_000_000)]) == 342_000_000
    assert corpora.memory_warning(110_000_000, 342_000_000, 300_000_000) == (
        "warning: preparing 110.00 MB of documents may take up to 342.00 MB of memory (they are held whole to be "
        "shuffled; README: Data), more than the 300.00 MB available: it may be killed for memory; free some, or "
        "prepare a part of the folder"
    )
    assert corpora.memory_warning(110_000_000, 342_000_000, 342_000_000) is None
    for name in ("a.txt", "b.md"):
        (tmp_path / name).write_text("x" * 10)
    monkeypatch.setattr(corpora.psutil, "virtual_memory", lambda: SimpleNamespace(available=100_000_000))
    lines: list[str] = []
    corpora.local_folder(tmp_path, log=lines.append)
    assert lines == [
        "warning: preparing 20 bytes of documents may take up to 150.00 MB of memory (they are held whole to be "
        "shuffled; README: Data), more than the 100.00 MB available: it may be killed for memory; free some, or "
        "prepare a part of the folder",
        "read 2 files (20 bytes) in 0s",
    ]


def test_a_small_folder_prepares_with_one_reading_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text(f"document {i}")  # 10 bytes
    lines = []
    prepare(str(src), tmp_path / "out", log=lines.append)
    assert lines[:3] == [
        f"loading documents from folder {src}",
        "read 3 files (30 bytes) in 0s",
        "shuffling 3 documents (seed 0) into 2 shards: 1 train of 2 documents + 1 validation of 1 document (33%, "
        "held out of training)",
    ]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_reading_one_large_file_logs_its_progress_within_it(tmp_path, suffix):
    """A folder of one large file logged nothing until the whole file was read. One file of 4 equal parts: 4
    row groups of 4 equal rows, or 4 .jsonl lines of READ_STEP_BYTES (1 MiB) each, whose reading tells its place
    before the 2nd, 3rd and 4th part; a clock 3 s on at each look: 25% at 3 s is quiet, 50% at 6 s (eta 6 s x
    0.5 / 0.5 = 6 s), 75% at 9 s (eta 9 s x 0.25 / 0.75 = 3 s), the end line at 12 s."""
    path = tmp_path / f"big{suffix}"
    if suffix == ".parquet":
        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
            for _ in range(4):
                writer.write_table(pa.table({"text": ["a document"] * 4}))
        assert pq.ParquetFile(path).num_row_groups == 4
    else:
        line = json.dumps({"text": ""}) + "\n"  # 13 bytes: the text fills each line to exactly 1 MiB
        text = "x" * (corpora.READ_STEP_BYTES - len(line))
        path.write_text((json.dumps({"text": text}) + "\n") * 4)
        assert path.stat().st_size == 4 * corpora.READ_STEP_BYTES
    ticks = iter(range(0, 100, 3))
    lines = []
    corpus = corpora.local_folder(tmp_path, log=lines.append, clock=lambda: next(ticks))
    assert len(corpus.documents) == (16 if suffix == ".parquet" else 4)
    total = corpora.size(path.stat().st_size)
    assert lines == [
        f"read 0/1 file (50% of {total}) in 6s, eta 6s",
        f"read 0/1 file (75% of {total}) in 9s, eta 3s",
        f"read 1 file ({total}) in 12s",
    ]


def test_a_parquet_files_row_groups_end_at_their_share_of_its_compressed_size(tmp_path):
    """row_group_ends: the place in the file on disk where each row group ends, by the compressed sizes its
    footer records, not by rows: a group of 1 row of 3,000 random letters (stored plain) then one of 3 rows of
    1,000 end halfway (by rows: a quarter) and at the end (a page header and a length per row aside)."""
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6000))
    path = tmp_path / "two.parquet"
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(
        path, schema, compression="none", use_dictionary=False, write_statistics=False
    ) as writer:
        writer.write_table(pa.table({"text": [text[:3000]]}))
        writer.write_table(pa.table({"text": [text[3000:4000], text[4000:5000], text[5000:]]}))
    first, second = corpora.row_group_ends(pq.ParquetFile(path), 10_000)
    assert second == 10_000 and first == pytest.approx(5_000, abs=50)


def test_the_prepared_lines_count_with_separators_and_size_small_amounts(tmp_path):
    """A folder of 1,200 documents of 10 bytes read `prepared ...: 1200 documents, 0.01 MB of text` and `holds 600
    of 1200 documents`: the count without its separator, 12 kB as 0.01 MB (and 44 bytes as 0.00 MB)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i:06d}"}) + "\n" for i in range(1_200)))
    lines = []
    manifest = prepare(str(src), tmp_path / "out", log=lines.append)
    on_disk = sum(s["file_bytes"] for s in manifest["shards"])
    assert [
        line for line in lines if line.startswith(("  wrote", "warning: the validation shard", "prepared"))
    ] == [
        f"  wrote shard_00000.parquet: train, 600 documents, 6.0 kB of text, "
        f"{corpora.size(manifest['shards'][0]['file_bytes'])} on disk",
        f"  wrote shard_00001.parquet: val, 600 documents, 6.0 kB of text, "
        f"{corpora.size(manifest['shards'][1]['file_bytes'])} on disk",
        "warning: the validation shard shard_00001.parquet holds 600 of 1,200 documents (50%) and 6.0 kB of "
        "12.0 kB of text (50%), held out of training: more shards (--num-shards, or a smaller --rows-per-shard) "
        "hold out less",
        "warning: the validation shard shard_00001.parquet holds only 6.0 kB of text (600 documents): a validation "
        "loss measured on less than 100.0 kB is noise; a larger corpus gives a larger one",
        f"prepared {tmp_path / 'out'}: 1,200 documents, 12.0 kB of text, 2 shards (1 train + validation "
        f"shard_00001.parquet), {corpora.size(on_disk)} on disk; source {src} (as licensed by the files' owners "
        "(local folder))",
    ]


def test_a_jsonl_or_parquet_file_of_no_documents_is_an_empty_skip(tmp_path):
    """An empty .txt was an `empty` skip, but a .jsonl of no lines and a .parquet of no rows were counted nowhere:
    a folder of the three was refused naming only the .txt."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("")
    (src / "b.jsonl").write_text("")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), src / "c.parquet")
    with pytest.raises(DataError) as e:
        prepare(str(src), tmp_path / "out", log=lambda m: None)
    assert str(e.value) == (
        f"--source {src}: no usable documents: skipped 3 documents (empty: 3 (e.g. a.txt, b.jsonl, c.parquet))"
    )
    assert not (tmp_path / "out").exists()


def test_jsonl_lines_skipped_for_want_of_the_field_are_a_warning_when_the_rest_prepares(tmp_path):
    """A mistyped --text-field (`body` for `text`) on a folder of 2 .txt files and a .jsonl of 3 lines prepared
    the 2 .txt files alone, the 3 lines only counted as no_text_field skips: the refusal's advice to give
    --text-field came only where too few documents were left."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first document")
    (src / "b.txt").write_text("second document")
    (src / "c.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(3)))
    lines = []
    manifest = prepare(str(src), tmp_path / "out", text_field="body", log=lines.append)
    assert manifest["documents"] == 2 and manifest["skipped"] == {"no_text_field": 3}
    assert lines[-3:] == [
        "skipped 3 documents:",
        "  no_text_field: 3  (e.g. c.jsonl:line=1, c.jsonl:line=2, c.jsonl:line=3)",
        "warning: 3 .jsonl lines without a 'body' string field were skipped: where documents are under another "
        "field, give --text-field with the field that holds it",
    ]


def test_blank_jsonl_lines_are_empty_skips_whatever_the_text_field(tmp_path):
    """A blank .jsonl line (a file ending in "\\n\\n") was read as {"text": ""}: under --text-field content it
    was a no_text_field skip, and the run ended warning to give the --text-field it had been given."""
    src = tmp_path / "src"
    src.mkdir()
    first, second = (json.dumps({"content": f"document {i}"}) for i in range(2))
    (src / "a.jsonl").write_text(f"{first}\n\n{second}\n\n")
    lines = []
    manifest = prepare(str(src), tmp_path / "out", num_shards=1, text_field="content", log=lines.append)
    assert manifest["documents"] == 2 and manifest["skipped"] == {"empty": 2}
    assert manifest["skipped_examples"] == {"empty": ["a.jsonl:line=2", "a.jsonl:line=4"]}
    assert lines[-2:] == ["skipped 2 documents:", "  empty: 2  (e.g. a.jsonl:line=2, a.jsonl:line=4)"]


def test_a_source_folder_under_home_given_with_a_tilde_is_read(tmp_path, monkeypatch):
    """--source ~/corpus (a preset's `source: ~/corpus`, or --source=~/corpus, which the shell leaves as typed)
    was refused as "no such directory" while --out, --storage-path and --data-dir expand `~`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    for i in range(2):
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"document {i}")
    manifest = prepare("~/corpus", tmp_path / "out", num_shards=1, log=lambda m: None)
    assert manifest["source"] == str(tmp_path / "corpus") and manifest["documents"] == 2


@pytest.mark.parametrize("kind", [pa.string_view(), pa.binary_view()])
def test_a_parquet_text_column_of_string_view_is_read(tmp_path, kind):
    """pyarrow reads a file written from a string_view (or binary_view) column back as one: it was refused as
    "the `text` column holds string_view, not strings"."""
    pq.write_table(pa.table({"text": pa.array(["first", "second"], kind)}), tmp_path / "v.parquet")
    assert pq.ParquetFile(tmp_path / "v.parquet").schema_arrow.field("text").type == kind
    corpus = corpora.local_folder(tmp_path)
    assert corpus.documents.to_pylist() == ["first", "second"] and dict(corpus.skips.counts) == {}


def test_a_folder_of_one_large_text_file_is_told_that_a_file_is_one_document(tmp_path, capsys):
    """A folder of one 3-line .txt file (a corpus in one file, as users bring it) was refused with `1 document is
    too few for 2 shards (...)` alone, naming neither the flag nor why: a .txt file is one document, whole."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "corpus.txt").write_text("first line\nsecond line\nthird line\n")
    out = tmp_path / "out"
    assert main(["data", "prepare", "--source", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"raychat data prepare: error: --source {src}: 1 document is too few for 2 shards (train + validation: one "
        "document at least each); a .txt, .md or .rst file is one document, whole (1 file here): split a large one "
        'into a file a document, or into a .jsonl of a {"text": ...} a line\n'
    )
    assert not out.exists()


def test_a_shard_over_the_arrow_string_limit_is_refused_before_anything_is_written(tmp_path):
    gib = 2**30
    lengths = np.array([gib, gib, 1, gib // 2], dtype=np.int64)  # 2.5 GiB + 1 byte
    order = np.array([0, 1, 2, 3])
    check_shard_bytes(lengths, order, [(0, 1), (1, 4)])  # 1 GiB, then 1.5 GiB + 1 byte: both fit
    with pytest.raises(ValueError) as e:
        check_shard_bytes(lengths, order, [(0, 3), (3, 4)])  # 2 GiB + 1 byte: one over 2**31 - 1
    assert str(e.value) == (
        "shard 0 would hold 2,147,483,649 bytes of text, over the 2,147,483,647 a shard can hold (an Arrow string "
        "column): cut the corpus into more shards, at least 3 for its 2684.35 MB (--num-shards), or fewer documents "
        "a shard (--rows-per-shard)"
    )
    check_shard_bytes(
        lengths, np.array([0, 2, 1, 3]), [(0, 2), (2, 4)]
    )  # the order decides what a shard holds

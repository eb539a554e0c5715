"""`raychat tokenizer train`: --max-chars is a cap on the characters trained on, and a shard raychat did not
write (a null `text`) is one line naming the shard and the row, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raychat.cli import main as raychat_main
from raychat.config.data import TokenizerConfig
from raychat.data.corpus.prepare import prepare
from raychat.data.corpus.shards import DataError, check_text_column, write_shard
from raychat.tokenizer import Tokenizer
from raychat.tokenizer_cli import iter_texts, small_vocabulary_warning, train_tokenizer


def quiet(message: str) -> None:
    pass


@pytest.fixture
def shards(tmp_path) -> list[str]:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_shard(["a" * 600, "b" * 300], a, row_group_size=1)
    write_shard(["c" * 50, "d" * 5000], b)
    return [str(a), str(b)]


def test_max_chars_cuts_the_document_that_reaches_it(shards):
    assert list(iter_texts(shards, 1000)) == ["a" * 600, "b" * 300, "c" * 50, "d" * 50]
    assert list(iter_texts(shards, 700)) == ["a" * 600, "b" * 100]
    assert list(iter_texts(shards, 900)) == ["a" * 600, "b" * 300]  # the cap met exactly: nothing follows
    assert list(iter_texts(shards[1:], 1000)) == ["c" * 50, "d" * 950]  # one long document: cut, not whole
    assert list(iter_texts(shards, 1)) == ["a"]
    for no_limit in (0, -1):
        assert [len(t) for t in iter_texts(shards, no_limit)] == [600, 300, 50, 5000]


def test_max_chars_is_documented_as_a_cap():
    assert TokenizerConfig.__dataclass_fields__["max_chars"].metadata["help"] == (
        "train on at most this many characters of the training shards, in order: the document that reaches "
        "the cap is cut there (<= 0: no limit)"
    )


def test_train_tokenizer_reads_only_max_chars(tmp_path, monkeypatch, capsys):
    """The one long document of the reported case: 1000 characters of it are trained on, not all of it. A line
    says so before the training, which prints nothing until it ends (minutes on a large corpus)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "long.txt").write_text("word " * 20_000)  # 100000 characters
    (src / "short.txt").write_text("tiny doc")
    prepare(str(src), tmp_path / "data", seed=0, log=quiet)  # 2 shards of one document; seed 0: long trains
    trained: list[str] = []

    from raychat import tokenizer_cli

    real_train = tokenizer_cli.Tokenizer.train

    def recording_train(texts, vocab_size):
        texts = list(texts)
        trained.extend(texts)
        return real_train(texts, vocab_size)

    monkeypatch.setattr(tokenizer_cli.Tokenizer, "train", recording_train)
    train_tokenizer(str(tmp_path / "data"), str(tmp_path / "tok"), 300, max_chars=1000)
    assert trained == [("word " * 20_000)[:1000]]
    assert capsys.readouterr().out.splitlines()[0] == (
        f"training the tokenizer (vocabulary 300) on at most 1,000 characters of 1 train shard in {tmp_path / 'data'} ..."
    )


def _data_dir_with_a_null(tmp_path) -> tuple[Path, Path]:
    """A prepared data directory whose first shard was rewritten by hand with a null `text` at row 2 (in its
    second row group)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"document number {i} " * 10)
    data = tmp_path / "data"
    prepare(str(src), data, num_shards=1, log=quiet)
    shard = (data / "shard_00000.parquet").resolve()
    pq.write_table(pa.table({"text": ["one", "two", None, "four"]}), shard, row_group_size=2)
    return data, shard


def test_a_null_text_is_one_line_naming_the_shard_and_row_and_nothing_is_written(tmp_path, capsys):
    data, shard = _data_dir_with_a_null(tmp_path)
    out = tmp_path / "tok"
    argv = ["tokenizer", "train", "--data-dir", str(data), "--out", str(out), "--vocab-size", "300"]
    assert raychat_main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"raychat tokenizer train: error: --data-dir: {shard}: row 2: `text` is null: a shard holds one text per "
        "document and no null (raychat data prepare skips a document without text and refuses a downloaded shard "
        "with one); prepare this corpus again with raychat data prepare  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert not out.exists()


def test_a_null_text_fails_train_tokenizer_and_iter_texts(tmp_path):
    data, shard = _data_dir_with_a_null(tmp_path)
    want = f"{shard}: row 2: `text` is null: a shard holds one text per document and no null"
    with pytest.raises(DataError, match="^" + want.replace(".", r"\.")):
        train_tokenizer(str(data), str(tmp_path / "tok"), 300)
    assert not (tmp_path / "tok").exists()
    texts = iter_texts([str(shard)], 0)
    assert [next(texts), next(texts)] == ["one", "two"]
    with pytest.raises(DataError, match="row 2: `text` is null"):
        next(texts)


def test_check_text_column(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), path, write_statistics=False)  # no null counts: read
    check_text_column(path)
    pq.write_table(pa.table({"text": ["a", "b", None]}), path, write_statistics=False, row_group_size=2)
    with pytest.raises(DataError, match=r"s\.parquet: row 2: `text` is null"):
        check_text_column(path)
    pq.write_table(
        pa.table({"id": [1], "text": [None]}, schema=pa.schema([("id", pa.int64()), ("text", pa.string())])),
        path,
    )
    with pytest.raises(DataError, match=r"s\.parquet: row 0: `text` is null"):
        check_text_column(path)
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(DataError, match=r"s\.parquet: the `text` column holds int64, not strings$"):
        check_text_column(path)
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(DataError, match=r"s\.parquet: no `text` column \(columns: \['body'\]\)$"):
        check_text_column(path)


def test_a_corpus_too_small_for_the_vocabulary_says_what_it_means_and_what_to_do(tmp_path, capsys):
    """A small corpus said `warning: the corpus supports only 375 tokens (asked 1024)` and no more. Three files
    of "hello world" cut into 2 shards: the train shard holds 2 of them, 22 characters. BPE merges every pair
    of a word, even one seen once, until each word is one token: "hello" takes 4 merges and " world" 5, so the
    tokenizer has 256 bytes + 9 merges + 9 special tokens = 274 tokens; tokenizer.json records the 1024 asked.
    Asked for 274, it trains the same tokenizer, with no warning. Pretraining sizes its model with the 274
    (the plan's `vocab 274`: embedding and output layer)."""
    src, data, tok = tmp_path / "src", tmp_path / "data", tmp_path / "tok"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text("hello world")
    prepare(str(src), data, log=quiet)
    report = train_tokenizer(str(data), str(tok), 1024)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "warning: the training text (22 characters) supports only 274 tokens, not the 1,024 asked: BPE ran out "
        "of pairs to merge (every distinct word of it is one token), so tokenizer.json has 274 tokens and a model "
        "pretrained with it an embedding of 274 rows; for 1,024, train on more text (a larger, more varied "
        "corpus), or give --vocab-size 274 to ask for what this text gives"
    )
    saved = Tokenizer.load(tok)
    assert (report["vocab_size"], saved.vocab_size, len(saved.mergeable_ranks)) == (274, 274, 256 + 9)
    assert saved.asked_vocab_size == 1024
    assert [saved.decode([i]) for i in saved.encode("hello world")] == ["hello", " world"]  # a token a word

    again = train_tokenizer(str(data), str(tmp_path / "tok274"), 274)
    assert again["version"] == report["version"]
    assert "warning" not in capsys.readouterr().out

    argv = [
        "pretrain",
        "--dry-run",
        "--preset",
        "tiny",
        "--data-dir",
        str(data),
        "--tokenizer-path",
        str(tok),
    ]
    assert raychat_main([*argv, "--storage-path", str(tmp_path / "runs")]) == 0
    assert "vocab 274\n" in capsys.readouterr().out


def test_a_vocabulary_cut_short_by_max_chars_names_the_cap():
    """Where --max-chars cut the text, a larger one is the first thing to try; the speedrun names its keys."""
    assert small_vocabulary_warning(
        400, 512, 1_000, True, ("tokenizer.vocab_size", "tokenizer.max_chars")
    ) == (
        "warning: the training text (1,000 characters) supports only 400 tokens, not the 512 asked: BPE ran out "
        "of pairs to merge (every distinct word of it is one token), so tokenizer.json has 400 tokens and a model "
        "pretrained with it an embedding of 400 rows; for 512, train on more text (a tokenizer.max_chars above "
        "1,000, which cut it, or a larger, more varied corpus), or give tokenizer.vocab_size 400 to ask for what "
        "this text gives"
    )

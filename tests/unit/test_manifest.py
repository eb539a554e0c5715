"""A data directory's manifest.json that is not one `raychat data prepare` wrote (cut short, another program's,
hand-edited) is refused in one line naming the manifest, where its readers (tokenizer train's --data-dir check,
pretraining's) crashed with a traceback (AttributeError, KeyError) or a JSON error naming no file."""

from __future__ import annotations

import json

import pytest

from raychat.cli import main
from raychat.data.corpus.shards import list_shards, write_manifest, write_shards

NOT_OURS = "not a manifest `raychat data prepare` wrote"


@pytest.fixture
def data(tmp_path):
    entries = write_shards([f"document {i}" for i in range(4)], tmp_path / "data", 2, log=lambda *_: None)
    write_manifest(tmp_path / "data", {"source": "test", "shards": entries})
    return tmp_path / "data"


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"shards": [', "not JSON (Expecting value: line 1 column 13 (char 12))"),
        ("[]", "a JSON list, not an object"),
        (json.dumps({"shards": "shard_00000.parquet"}), '"shards" is a str, not a list'),
        (
            json.dumps({"shards": ["shard_00000.parquet", "shard_00001.parquet"]}),
            'shard 0 is "shard_00000.parquet", not an object naming its "file"',
        ),
        (
            json.dumps({"shards": [{"split": "train"}, {"split": "val"}]}),
            'shard 0 is {"split": "train"}, not an object naming its "file"',
        ),
    ],
)
def test_a_manifest_of_another_shape_is_refused_naming_it(text, why, data):
    (data / "manifest.json").write_text(text)
    with pytest.raises(ValueError) as e:
        list_shards(data)
    assert str(e.value) == f"{data / 'manifest.json'}: {NOT_OURS}: {why}"


def test_tokenizer_train_on_a_manifest_of_another_shape_is_one_line(data, tmp_path, capsys):
    (data / "manifest.json").write_text("[]")
    assert main(["tokenizer", "train", "--data-dir", str(data), "--out", str(tmp_path / "tok")]) == 2
    assert capsys.readouterr().err == (
        f"raychat tokenizer train: error: --data-dir: {data / 'manifest.json'}: {NOT_OURS}: a JSON list, not an "
        "object  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert not (tmp_path / "tok").exists()

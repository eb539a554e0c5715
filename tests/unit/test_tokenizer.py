import random

import pytest

from raychat.tokenizer import SPECIAL_TOKENS, Tokenizer

_rng = random.Random(0)
_WORDS = "the quick brown fox jumps over lazy dog caf\u00e9 na\u00efve r\u00e9sum\u00e9 def return add 12345 678".split()
CORPUS = [
    " ".join(_rng.choice(_WORDS) + _rng.choice(["", "s", "ed", "ing", "ly", "er"]) for _ in range(300))
    for _ in range(40)
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS, vocab_size=400)


def test_vocab_and_specials(tok):
    assert tok.vocab_size == 400
    assert [tok.special_id(s) for s in SPECIAL_TOKENS] == list(range(400 - len(SPECIAL_TOKENS), 400))
    with pytest.raises(KeyError, match="allowed"):
        tok.special_id("<|nope|>")


def test_round_trip_random_unicode(tok):
    rng = random.Random(0)
    for _ in range(50):
        s = "".join(
            chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF), rng.randint(0x1F300, 0x1F6FF)]))
            for _ in range(rng.randint(0, 40))
        )
        assert tok.decode(tok.encode(s)) == s


def test_special_token_text_is_plain_text(tok):
    ids = tok.encode("a<|bos|>b")
    assert tok.decode(ids) == "a<|bos|>b"
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.encode("x", prepend_bos=True)[0] == tok.bos_id


def test_token_bytes_sum_to_utf8_length(tok):
    table = tok.token_bytes()
    text = "Caf\u00e9 \U0001f44b and the fox"
    ids = tok.encode(text, prepend_bos=True)
    assert sum(table[i] for i in ids) == len(text.encode("utf-8"))
    assert all(table[tok.special_id(s)] == 0 for s in SPECIAL_TOKENS)


def test_save_load_keeps_version(tok, tmp_path):
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.version == tok.version
    assert again.encode("the quick brown fox") == tok.encode("the quick brown fox")
    with pytest.raises(FileNotFoundError, match="raychat tokenizer train"):
        Tokenizer.load(tmp_path / "missing")


@pytest.mark.parametrize(
    "text,found",
    [
        ('{"version": "1.0", "model": {"type": "BPE"}}', "found keys ['model', 'version'] (a Hugging Face"),
        ("[1, 2]", "found a JSON list"),
        ('{"pattern": "x"', "not JSON (Expecting ',' delimiter"),
    ],
)
def test_a_file_of_another_format_is_named_with_what_it_holds(tmp_path, text, found):
    """A Hugging Face tokenizer.json (what `raychat export` writes), a list, broken JSON: each a ValueError naming
    the file and what it held, not a KeyError from inside the loader."""
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError) as e:
        Tokenizer.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'tokenizer.json'}: not a raychat tokenizer: ")
    assert found in str(e.value)


def test_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size must be >= 265"):
        Tokenizer.train(CORPUS, vocab_size=100)

import hashlib
import json
import random

import pytest

from raychat.tokenizer import LONG_WHITESPACE, SPECIAL_TOKENS, Tokenizer, split_long_whitespace

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


@pytest.mark.parametrize(
    "change, error",
    [
        ({"mergeable_ranks": ["AA=="]}, "`mergeable_ranks` must be an object of base64 token bytes -> int rank"),
        ({"mergeable_ranks": {"AA==": "0"}}, "`mergeable_ranks` must be an object of base64 token bytes -> int rank"),
        ({"mergeable_ranks": {"!!": 0}}, "`mergeable_ranks` has a key that is not base64 (Only base64 data is allowed)"),
        ({"pattern": 5}, "`pattern` must be a string, got a JSON int"),
        ({"pattern": "("}, "Parsing error at position 1: Opening parenthesis without closing parenthesis"),
        ({"asked_vocab_size": "abc"}, "`asked_vocab_size` must be an int, got a JSON str"),
    ],
)  # fmt: skip
def test_a_field_of_another_type_is_a_value_error_naming_the_file(tok, tmp_path, change, error):
    """Each was an AttributeError or TypeError from inside the loader, which the CLI does not catch."""
    payload = json.loads(tok.save(tmp_path).read_text()) | change
    with pytest.raises(ValueError) as e:
        Tokenizer.from_json(json.dumps(payload).encode(), "x/tokenizer.json")
    assert str(e.value) == f"x/tokenizer.json: {error}"


def test_a_whitespace_run_of_a_million_characters_encodes_and_trains():
    """The split pattern's regex panicked (a BaseException) past its backtracking limit on a run of about 1M
    spaces; a longer run is cut every WHITESPACE_RUN_MAX characters (65,536)."""
    text = "a" + " " * 1_000_000 + "x b"
    assert split_long_whitespace(text) == [
        "a" + " " * 65_536 * (i + 1) if i == 0 else " " * 65_536 for i in range(15)
    ] + [" " * (1_000_000 - 15 * 65_536) + "x b"]
    assert split_long_whitespace("a" + " " * 65_536 + "b") == ["a" + " " * 65_536 + "b"]
    tok = Tokenizer.train(["ab  cd  ef"] * 20 + [text], vocab_size=300)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch(["ab cd", text, "ef"]) == [tok.encode("ab cd"), ids, tok.encode("ef")]
    assert ids == [t for piece in split_long_whitespace(text) for t in tok.encode(piece)]


def test_a_token_of_64_kib_or_more_gets_a_version_and_older_versions_are_unchanged(tok, tmp_path):
    """BPE merges a run of one letter into ever longer tokens: 2**16 "a"s make one of 65,536 bytes, whose length
    the version's 2-byte field could not hold (OverflowError: no tokenizer). Tokens below 0xFFFF bytes hash as
    before: the fixture's version is the one the earlier formula gives."""
    big = Tokenizer.train(["a" * 2**17, "b c"], vocab_size=300)
    assert max(len(t) for t in big.mergeable_ranks) == 2**17
    assert Tokenizer.load(big.save(tmp_path)).version == big.version
    h = hashlib.sha256(tok.pattern.encode())
    for token, rank in sorted(tok.mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token)
    h.update(json.dumps(tok.special_tokens, sort_keys=True).encode())
    assert tok.version == h.hexdigest()[:16]


def test_finding_long_whitespace_runs_is_linear_in_the_runs_below_the_limit():
    """Searched from every position inside a run, `\\s{65537,}` was quadratic: 40,000 spaces then 70,000 letters took
    6.5 s. Checked by what it matches, not timed: the pattern refuses every position inside a run at once."""
    assert LONG_WHITESPACE.search(" " * 40_000 + "a" * 70_000) is None
    assert LONG_WHITESPACE.match(" " * 70_000, pos=1) is None  # not from inside a run
    assert LONG_WHITESPACE.match(" " * 70_000, pos=0).end() == 70_000
    assert LONG_WHITESPACE.search("ab" + " " * 65_537 + "c").span() == (2, 65_539)

"""bench/_engine_common.synthetic_tokenizer: the benchmarks' tokenizer has exactly the vocabulary they ask for.
It stopped at two-byte tokens (9,290 ids), so bench/gpu_check.py's 65,536-id model sampled ids its tokenizer
could not decode (KeyError in the engine's detokenizer) and its vLLM side got a 7x smaller LM head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _engine_common import synthetic_tokenizer  # noqa: E402


@pytest.mark.parametrize("vocab_size", [265, 512, 9290, 9291, 65536])
def test_the_synthetic_tokenizer_has_the_vocabulary_asked_for(vocab_size):
    tok = synthetic_tokenizer(vocab_size)
    assert tok.vocab_size == vocab_size
    top = vocab_size - 10  # the last id before the 9 specials
    assert len(tok.decode_bytes([top])) == (1 if top < 256 else 2 if top < 256 + 95**2 else 3)


def test_past_every_three_byte_token_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size must be in \[265, 866665\], got 866666"):
        synthetic_tokenizer(866_666)

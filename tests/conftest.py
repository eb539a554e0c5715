"""Shared pytest fixtures (keep minimal)."""

import pytest

from raychat.tokenizer import Tokenizer

_TEXT = """The quick brown fox jumps over the lazy dog. Hello there! How are you doing today?
I am fine, thank you. What is 12 * 34? It is 408. Spell the word "apple": a-p-p-l-e.
def f(x):
    return x + 1
Ça va? Très bien. Multiple Choice question: which planet is red? - Mars=A - Venus=B
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
"""


@pytest.fixture(scope="session")
def small_tokenizer() -> Tokenizer:
    """A byte-level BPE (vocabulary <= 512) trained in ~0.1 s on a few KB of mixed text."""
    return Tokenizer.train([_TEXT] * 20, vocab_size=512)


@pytest.fixture(scope="session")
def tool_checkpoint(tmp_path_factory):
    """A checkpoint of tests/tool_model.py's tiny GPT, which calls the calculator (trained once a session)."""
    from tool_model import write_tool_checkpoint

    return write_tool_checkpoint(tmp_path_factory.mktemp("tool-model"))

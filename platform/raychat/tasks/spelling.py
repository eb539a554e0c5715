"""Spelling and letter counting over a real word list (Debian package `wamerican`: /usr/share/dict/words).

Two kinds, alternating by index (even: spell, odd: count):
    user: Spell the word "apple".             assistant: a-p-p-l-e
    user: How many "p" are in "apple"?        assistant: [text 'a-p-p-l-e. Count "p": ',
                                                          python "'apple'.count('p')", python_output "2",
                                                          text "#### 2"]
Words: lowercase ASCII letters only, 2-12 letters (apostrophes, capitals and accents are skipped). The
word of example i is drawn from a seeded permutation of the words in the split; a word is "test" when
sha256(word) % 10 == 0 (one in ten), else "train", so the splits share no word.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from raychat.tasks.base import Task, extract_answer

DEFAULT_WORDS = "/usr/share/dict/words"
WORD_RE = re.compile(r"^[a-z]{2,12}$")


@lru_cache(maxsize=4)
def load_words(path: str = DEFAULT_WORDS) -> tuple[str, ...]:
    """Sorted unique lowercase words from a one-word-per-line list.

    Raises:
        FileNotFoundError: the list is missing (install the Debian package `wamerican`).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"word list {path} not found: install the Debian package `wamerican` (apt-get install wamerican) "
            "or pass words_path"
        )
    return tuple(
        sorted({w for w in p.read_text(encoding="utf-8", errors="replace").split() if WORD_RE.match(w)})
    )


def split_of(word: str) -> str:
    return "test" if int(hashlib.sha256(word.encode()).hexdigest(), 16) % 10 == 0 else "train"


class Spelling(Task):
    eval_type = "generative"

    def __init__(
        self,
        split: str = "train",
        size: int | None = None,
        seed: int = 0,
        words_path: str | None = None,
        **slice_kw,
    ):
        words_path = words_path or DEFAULT_WORDS
        if split not in ("train", "test"):
            raise ValueError(f"split must be one of ['train', 'test'], got {split!r}")
        self.name = f"spelling-{split}"
        words = [w for w in load_words(words_path) if split_of(w) == split]
        if not words:
            raise ValueError(f"no {split} words in {words_path}")
        self.words = [words[i] for i in np.random.default_rng(seed).permutation(len(words))]
        self.source_files = (words_path,)
        self.size = len(self.words) if size is None else size
        self.seed = seed
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        word = self.words[index % len(self.words)]
        spelled = "-".join(word)
        if index % 2 == 0:
            messages = [
                {"role": "user", "content": f'Spell the word "{word}".'},
                {"role": "assistant", "content": spelled},
            ]
            return {"id": self._id(index), "messages": messages, "answer": spelled}
        letter = word[np.random.default_rng([self.seed, index]).integers(len(word))]
        count = word.count(letter)
        parts = [
            {"type": "text", "text": f'{spelled}. Count "{letter}": '},
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(count)},
            {"type": "text", "text": f"#### {count}"},
        ]
        messages = [
            {"role": "user", "content": f'How many "{letter}" are in "{word}"?'},
            {"role": "assistant", "content": parts},
        ]
        return {"id": self._id(index), "messages": messages, "answer": str(count)}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        answer = conversation["answer"]
        if answer.isdigit():
            return extract_answer(completion) == answer
        return completion.strip() == answer

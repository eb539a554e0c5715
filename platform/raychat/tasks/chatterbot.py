"""Real short conversations from the PyPI package `chatterbot-corpus` (1.3.3, BSD-3-Clause).

The package holds YAML files data/<language>/<topic>.yml with {"categories": [...], "conversations":
[[line, line, ...], ...]}. Lines alternate user / assistant starting with the user; a trailing user line with
no reply is dropped; a conversation with fewer than 2 lines, or with a line that is not a string, is skipped.
Examples are ordered by (file name, position), so ids are stable: "chatterbot/<language>/<topic>/<k>".
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import chatterbot_corpus
import yaml

from raychat.tasks.base import Task


def corpus_dir() -> Path:
    """data/ directory of the installed chatterbot-corpus package (a dependency of raychat)."""
    return Path(chatterbot_corpus.__file__).parent / "data"


def conversation_files(language: str = "english", data_dir: str | None = None) -> list[Path]:
    """The YAML files of `language` (data/<language>/*.yml), sorted."""
    return sorted((Path(data_dir) if data_dir else corpus_dir()).joinpath(language).glob("*.yml"))


@lru_cache(maxsize=8)
def load_conversations(
    language: str = "english", data_dir: str | None = None
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """((id, lines), ...) for every usable conversation of `language`, in file order.

    Raises:
        ValueError: no such language directory (names the ones available).
    """
    root = Path(data_dir) if data_dir else corpus_dir()
    lang_dir = root / language
    if not lang_dir.is_dir():
        raise ValueError(
            f"language must be one of {sorted(p.name for p in root.iterdir() if p.is_dir())}, got {language!r}"
        )
    out = []
    for path in conversation_files(language, data_dir):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for k, conv in enumerate(doc.get("conversations") or []):
            if not isinstance(conv, list) or not all(isinstance(line, str) for line in conv):
                continue
            lines = tuple(line.strip() for line in conv[: len(conv) // 2 * 2])
            if len(lines) >= 2:
                out.append((f"chatterbot/{language}/{path.stem}/{k}", lines))
    return tuple(out)


class ChatterbotConversations(Task):
    name = "chatterbot"
    eval_type = "generative"

    def __init__(self, language: str = "english", data_dir: str | None = None, **slice_kw):
        self.conversations = load_conversations(language, data_dir)
        self.source_files = tuple(str(p) for p in conversation_files(language, data_dir))
        super().__init__(**slice_kw)

    def num_examples(self) -> int:
        return len(self.conversations)

    def get_example(self, index: int) -> dict:
        cid, lines = self.conversations[index]
        messages = [
            {"role": "user" if j % 2 == 0 else "assistant", "content": line} for j, line in enumerate(lines)
        ]
        return {"id": cid, "messages": messages, "answer": lines[-1]}

    def is_correct(self, conversation: dict, completion: str) -> bool:
        """Exact match with the last reply (a weak check: the corpus has many valid replies)."""
        return completion.strip() == conversation["answer"]

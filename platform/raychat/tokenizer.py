"""Byte-level BPE tokenizer: trained here with rustbpe, served as a `tiktoken.Encoding`.

Training uses rustbpe (the trainer nanochat uses) with the GPT-4 split pattern; at run time the merges
are loaded into tiktoken, which encodes fast and with no network. The chat special tokens sit after the
BPE vocabulary. Ordinary text is always encoded with `encode_ordinary`, so special-token text inside user
content (e.g. "a<|bos|>b") is plain text and never becomes a control token.

Files written by `Tokenizer.save(dir)`:
  tokenizer.json   {"pattern", "mergeable_ranks" (base64 bytes -> rank), "special_tokens", "version",
                    "asked_vocab_size" (the vocab_size it was trained for; absent in a tokenizer saved before)}
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import rustbpe
import tiktoken

from raychat.atomic import atomic_write_text

# GPT-4 (cl100k) split pattern with numbers limited to 1-2 digits as in nanochat: small vocabularies
# waste fewer ids on 3-digit number chunks.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""

# The split pattern runs in fancy-regex (in rustbpe and in tiktoken), whose backtracking limit a whitespace run
# of about a million characters exceeds (`\s+(?!\S)` backtracks over the run): both then panic, and the panic
# is a BaseException no caller catches. A longer run is cut into pieces of this many characters, encoded one
# after the other; only text with such a run tokenizes differently (at the cuts), and decoding is unchanged.
WHITESPACE_RUN_MAX = 1 << 16
# from a run's first character only: tried inside a shorter run, the search took time quadratic in its length
LONG_WHITESPACE = re.compile(rf"(?<!\s)\s{{{WHITESPACE_RUN_MAX + 1},}}")

BOS = "<|bos|>"
SPECIAL_TOKENS = (
    BOS,
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


class Tokenizer:
    """A `tiktoken.Encoding` plus the chat special tokens and the byte-length table used for BPB.

    Attributes:
        encoding: the tiktoken encoding (BPE ranks + special tokens).
        version: 16-hex-digit hash of pattern, ranks and special tokens; stored in every checkpoint.
        asked_vocab_size: the vocab_size `train` was asked for (vocab_size can come out smaller on a small
            corpus); None when unknown (a tokenizer saved before it was recorded). Not part of `version`.
    """

    def __init__(self, pattern: str, mergeable_ranks: dict[bytes, int], asked_vocab_size: int | None = None):
        n = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n)):
            raise ValueError("mergeable_ranks must map to the contiguous ids 0..n-1")
        self.pattern = pattern
        self.mergeable_ranks = mergeable_ranks
        self.special_tokens = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name="raychat",
            pat_str=pattern,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        h = hashlib.sha256(pattern.encode())
        for token, rank in sorted(mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + _length_bytes(len(token)) + token)
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        self.version = h.hexdigest()[:16]
        self.asked_vocab_size = asked_vocab_size

    # ---- training -------------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, pattern: str = SPLIT_PATTERN) -> Tokenizer:
        """Train byte-level BPE on `texts` so that the total vocabulary (BPE + specials) is `vocab_size`.

        Raises:
            ValueError: if vocab_size < 256 + number of special tokens.
        """
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + specials), got {vocab_size}"
            )
        trainer = rustbpe.Tokenizer()
        pieces = (piece for text in texts for piece in split_long_whitespace(text))
        trainer.train_from_iterator(pieces, vocab_size=vocab_size - len(SPECIAL_TOKENS), pattern=pattern)
        ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        return cls(pattern, ranks, asked_vocab_size=vocab_size)

    # ---- io -------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json atomically into `directory`; returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {
            "pattern": self.pattern,
            "mergeable_ranks": {
                base64.b64encode(t).decode(): r
                for t, r in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
            },
            "special_tokens": self.special_tokens,
            "version": self.version,
        }
        if self.asked_vocab_size is not None:
            payload["asked_vocab_size"] = self.asked_vocab_size
        path = directory / "tokenizer.json"
        return atomic_write_text(path, json.dumps(payload))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a tokenizer.json file or a directory holding one.

        Raises:
            FileNotFoundError: no tokenizer.json there.
            ValueError: the file is not JSON or not this format (an object with pattern, mergeable_ranks,
                special_tokens), or its special tokens differ from this version of raychat.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path} (train one with `raychat tokenizer train`)")
        return cls.from_json(path.read_bytes(), str(path))

    @classmethod
    def from_json(cls, data: bytes, path: str) -> Tokenizer:
        """The tokenizer of the bytes of a tokenizer.json (`path` names where they came from in errors).

        Raises:
            ValueError: as load: not JSON, not this format (a field of another type, a rank key not base64, ranks
                that are not 0..n-1, a pattern tiktoken cannot compile), or other special tokens; each names
                `path`.
        """
        try:
            payload = json.loads(data.decode())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a raychat tokenizer: not JSON ({e})") from None
        fields = ["pattern", "mergeable_ranks", "special_tokens"]
        if not isinstance(payload, dict) or any(k not in payload for k in fields):
            found = (
                f"keys {sorted(payload)[:8]}"
                if isinstance(payload, dict)
                else f"a JSON {type(payload).__name__}"
            )
            raise ValueError(
                f"{path}: not a raychat tokenizer: an object with {fields} expected, found {found} (a Hugging "
                "Face tokenizer.json, as `raychat export` writes, is for transformers and vLLM)"
            )
        pattern, encoded = payload["pattern"], payload["mergeable_ranks"]
        if not isinstance(pattern, str):
            raise ValueError(f"{path}: `pattern` must be a string, got a JSON {type(pattern).__name__}")
        if not isinstance(encoded, dict) or not all(type(r) is int for r in encoded.values()):
            raise ValueError(f"{path}: `mergeable_ranks` must be an object of base64 token bytes -> int rank")
        try:
            ranks = {base64.b64decode(t, validate=True): r for t, r in encoded.items()}
        except binascii.Error as e:
            raise ValueError(f"{path}: `mergeable_ranks` has a key that is not base64 ({e})") from None
        asked = payload.get("asked_vocab_size")
        if asked is not None and type(asked) is not int:
            raise ValueError(f"{path}: `asked_vocab_size` must be an int, got a JSON {type(asked).__name__}")
        try:
            tok = cls(pattern, ranks, asked)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if tok.special_tokens != payload["special_tokens"]:
            raise ValueError(
                f"{path}: special tokens {payload['special_tokens']} differ from {tok.special_tokens}"
            )
        return tok

    # ---- encode / decode ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def bos_id(self) -> int:
        return self.special_tokens[BOS]

    def special_id(self, name: str) -> int:
        """Id of a special token such as "<|assistant_end|>". Raises KeyError naming the allowed names."""
        try:
            return self.special_tokens[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}; allowed: {list(self.special_tokens)}") from None

    def encode(self, text: str, prepend_bos: bool = False) -> list[int]:
        """Encode ordinary text; special-token text is encoded as plain text, never as a control token."""
        pieces = split_long_whitespace(text)
        if len(pieces) == 1:
            ids = self.encoding.encode_ordinary(text)
        else:
            ids = [t for piece in pieces for t in self.encoding.encode_ordinary(piece)]
        return [self.bos_id, *ids] if prepend_bos else ids

    def encode_batch(
        self, texts: list[str], prepend_bos: bool = False, num_threads: int = 1
    ) -> list[list[int]]:
        """encode() of each text, `num_threads` tiktoken threads at a time."""
        split = [split_long_whitespace(text) for text in texts]
        if all(len(pieces) == 1 for pieces in split):
            batch = self.encoding.encode_ordinary_batch(texts, num_threads=num_threads)
        else:
            flat = self.encoding.encode_ordinary_batch(
                [p for ps in split for p in ps], num_threads=num_threads
            )
            batch, k = [], 0
            for pieces in split:
                batch.append([t for ids in flat[k : k + len(pieces)] for t in ids])
                k += len(pieces)
        if prepend_bos:
            batch = [[self.bos_id, *ids] for ids in batch]
        return batch

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text; invalid UTF-8 at the edges becomes U+FFFD (use decode_bytes to avoid)."""
        return self.encoding.decode(list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.encoding.decode_bytes(list(ids))

    def token_bytes(self) -> list[int]:
        """UTF-8 byte length of every token id (length vocab_size); special tokens count 0 bytes.

        Used by BPB: bits per byte = sum(nats) / (ln 2 * sum(token_bytes[target])).
        """
        table = [0] * self.vocab_size
        for token, rank in self.mergeable_ranks.items():
            table[rank] = len(token)
        return table

    def iter_tokens(self, ids: Iterable[int]) -> Iterator[bytes]:
        """The raw bytes of each token (special tokens give their text), for streaming decoders."""
        for i in ids:
            yield self.encoding.decode_single_token_bytes(i)


def _length_bytes(n: int) -> bytes:
    """A token's byte length as Tokenizer.version hashes it: 2 bytes, little-endian; from 0xFFFF bytes (a token
    BPE merged from a run of one character 64 KiB long) 0xFFFF then 8 bytes, which leaves the version of every
    tokenizer whose tokens are shorter than 0xFFFF bytes unchanged."""
    return n.to_bytes(2, "little") if n < 0xFFFF else b"\xff\xff" + n.to_bytes(8, "little")


def split_long_whitespace(text: str) -> list[str]:
    """`text` cut inside every whitespace run longer than WHITESPACE_RUN_MAX characters into pieces that hold at
    most that many of its characters each ([text] when it has none: the pieces join back to `text`)."""
    if len(text) <= WHITESPACE_RUN_MAX:
        return [text]
    pieces, start = [], 0
    for run in LONG_WHITESPACE.finditer(text):
        for cut in range(run.start() + WHITESPACE_RUN_MAX, run.end(), WHITESPACE_RUN_MAX):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces

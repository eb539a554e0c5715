"""SFT rows: conversations of a task mixture rendered by the chat template and bin-packed into rows.

  TaskMixture -> the global stream (raychat.data.loader.cursor: item g = example perm_e[g % N] of epoch e = g // N,
  perm_e drawn from the seed) dealt to ranks (rank r of W takes elements r, r+W, ...) -> render (chat
  template, truncation) -> SamplePacker (best fit, segment ids) -> rows

SFTRows is the training row source (a raychat.data.loader.row_source.RowSource); its state is references only
(cursor position, buffered items' stream items) and resumes on any number of ranks like the pretraining rows
(raychat.data.loader.row_source): same world bit for bit, another world re-dealt with no example repeated or skipped.
validation_rows packs a held-out task into a fixed set of rows (the same rows at every evaluation); run_epochs
says how many times a run of so many rows goes through the mixture.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from raychat.chat_template import fewest_tokens, render_conversation
from raychat.data.corpus.shards import sha256_file
from raychat.data.loader.cursor import Deal, RankCursor, Ref, epoch_permutation
from raychat.data.loader.row_source import cursor_state, resume_cursor
from raychat.data.loader.sample_packing import PackItem, SamplePacker, SampleStats, render_samples
from raychat.log import log, plural
from raychat.tasks import Task, TaskMixture
from raychat.tokenizer import Tokenizer

ROW_KEYS = ("input_ids", "supervised", "segment_ids")
EPOCH_SAMPLE_ROWS = 64  # rows of the first epoch run_epochs packs to count conversations a row


class SFTRows:
    """This rank's endless, exactly resumable stream of packed conversation rows.

    `next_batch(n)` -> {"input_ids", "supervised", "segment_ids": (n, row_len) int32 arrays, "replay": per row,
    its samples' replay-record columns}.

    A conversation that truncation drops (its last exchange does not fit in row_len) is skipped, counted in
    the packer's stats, and logged when the count reaches 1, 2, 4, 8, ... ("sft data: 4 conversations skipped so
    far by rank 0 (latest: <file> line <n>: <reason>; ...)", the conversation's "where" if its task gives one).
    Every epoch has its own order, so every rank draws every conversation of the mixture sooner or later: a rank
    keeps drawing until one fits, and next_batch raises RuntimeError ("every SFT sample was dropped by
    truncation: raise <seq_len_flag>") only once it has drawn every conversation of the mixture and each was
    dropped.

    Args:
        tasks, seed: the mixture (TaskMixture(tasks, seed=seed)); the seed also orders every epoch.
        row_len: T+1; rank, world_size: this worker's place; buffer_size: best-fit buffer (samples).
        seq_len_flag: what the skip line and the error tell the user to raise (sft's "--seq-len", the
            speedrun's preset key "train.seq_len").
    """

    fingerprint_key = "mixture"  # the state_dict key of fingerprint()

    def __init__(
        self,
        tasks: list[Task],
        seed: int,
        tokenizer: Tokenizer,
        row_len: int,
        rank: int = 0,
        world_size: int = 1,
        buffer_size: int = 64,
        seq_len_flag: str = "--seq-len",
    ):
        self.seq_len_flag = seq_len_flag
        self.mixture, self.seed = TaskMixture(tasks, seed=seed), seed
        self.content = task_content(tasks)
        self.tokenizer, self.row_len = tokenizer, row_len
        self.rank, self.world = rank, world_size
        self.cursor = RankCursor(Deal(world_size), rank)
        self.packer = SamplePacker(self._next_item, row_len, pad_id=tokenizer.bos_id, buffer_size=buffer_size)
        self._orders: dict[int, np.ndarray] = {}
        self._dropped: set[int] = set()  # mixture indices this rank drew and truncation dropped

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, mixture index) of stream item g."""
        epoch, p = divmod(int(g), len(self.mixture))
        if epoch not in self._orders:
            self._orders = {epoch: epoch_permutation(len(self.mixture), self.seed, epoch)}
        return epoch, int(self._orders[epoch][p])

    def render(self, g: int, stats: SampleStats | None = None) -> PackItem | None:
        """Stream item g rendered and truncated to row_len; None if truncation drops it."""
        conv = self.mixture[self.locate(g)[1]]
        return next(
            iter(render_samples(self.tokenizer, [(conv["id"], conv)], self.row_len, stats, ref=g)), None
        )

    def _next_item(self) -> PackItem:
        while len(self._dropped) < len(self.mixture):
            (g, _), = self.cursor.upcoming(1)  # fmt: skip
            self.cursor.take((g, 0))
            stats = self.packer.stats
            before = dict(stats.drop_reasons)
            item = self.render(g, stats)
            if item is not None:
                return item
            self._dropped.add(self.locate(g)[1])
            n = stats.dropped
            if n & (n - 1) == 0:  # a line at 1, 2, 4, 8, ... skipped: every doubling, not every conversation
                reason = next(r for r, k in stats.drop_reasons.items() if k > before.get(r, 0))
                conv = self.mixture[self.locate(g)[1]]
                log(
                    f"sft data: {plural(n, 'conversation')} skipped so far by rank {self.rank} (latest: "
                    f"{conv.get('where', conv['id'])}: {reason}; a longer {self.seq_len_flag} keeps more)"
                )
        raise RuntimeError(f"every SFT sample was dropped by truncation: raise {self.seq_len_flag}")

    def next_batch(self, n: int) -> dict:
        rows = self.packer.next_batch(n)
        out = {k: rows[k] for k in ROW_KEYS}
        out["replay"] = [
            {
                "doc": list(refs),
                "doc_epoch": [self.locate(g)[0] for g in refs],
                "sample": [self.locate(g)[1] for g in refs],
                "sample_id": list(ids),
                "row_offset": [int(x) for x in offsets],
                "length": [int(x) for x in lengths],
                "truncation": [json.dumps(t, sort_keys=True) for t in json.loads(truncation)],
            }
            for refs, ids, offsets, lengths, truncation in zip(
                rows["sample_refs"], rows["sample_ids"], rows["segment_offsets"], rows["segment_lengths"],
                rows["truncation"],
            )
        ]  # fmt: skip
        return out

    # ---- checkpoint state (raychat.data.loader.row_source) -----------------------------------------------
    def fingerprint(self) -> dict:
        """{"mixture": the TaskMixture's description, "examples": its size, "row_len", "content": the tasks'
        files and their sha256 (task_content)}."""
        return {
            "mixture": self.mixture.describe(), "examples": len(self.mixture), "row_len": self.row_len,
            "content": self.content,
        }  # fmt: skip

    def state_dict(self) -> dict:
        """{"mixture", "deal", "rank", "taken", "packer": {"buffer": stream items, "stats", "exhausted"}}."""
        return cursor_state(self.fingerprint_key, self.fingerprint(), self.cursor, self.packer.state_dict())

    def load_state_dicts(self, states: Sequence[dict]) -> None:
        """Continue from the states of every rank of the old world (in rank order); see the module docstring.

        Raises:
            ValueError: the states were made with another mixture or row length, or are not one whole world.
        """
        self.cursor, packer = resume_cursor(
            states, self.fingerprint_key, self.fingerprint(), self.rank, self.world, _item_refs
        )
        self.packer.load_state_dict(packer, [self.render(g) for g in packer["buffer"]])

    def close(self) -> None:
        """Nothing to release: the conversations are rendered in this process (RowSource.close)."""


def task_content(tasks: Sequence[Task]) -> list[list[str]]:
    """[[task name, file name, hex sha256 of its bytes], ...] of every file the tasks read (Task.source_files),
    each once, in task order; [] for generated tasks (calculator). The file's name, not its path: the same data
    installed elsewhere (another node's site-packages) is the same stream. Read once per row source: SFT's
    resume compares it, as pretraining compares its shards' sha256."""
    files = dict.fromkeys((t.name, f) for t in tasks for f in t.source_files)
    return [[name, Path(f).name, sha256_file(f)] for name, f in files]


def changed_task_files(was: dict, now: dict) -> list[str]:
    """One line per task file whose sha256 differs between two mixture fingerprints, or that only one of them
    has: "task <name>'s file <file name>" (none when either has no "content")."""
    if "content" not in was or "content" not in now:
        return []
    a, b = ({(name, f): digest for name, f, digest in d["content"]} for d in (was, now))
    return [
        f"task {name}'s file {f}"
        for name, f in dict.fromkeys([*a, *b])
        if a.get((name, f)) != b.get((name, f))
    ]


class RunEpochs(NamedTuple):
    epochs: float  # times the run goes through its mixture
    per_row: float  # conversations a row holds (those too long for a row, skipped, are in no row)


def run_epochs(rows: SFTRows, run_rows: int, sample_rows: int = EPOCH_SAMPLE_ROWS) -> RunEpochs:
    """Epochs of `rows`' mixture (each one every conversation once) that `run_rows` rows go through, and the
    conversations a row holds (RunEpochs): the stream
    from its start (epoch after epoch, in its order), rendered and packed as SFTRows packs it (truncation, best
    fit from a buffer of the same size), up to min(run_rows, sample_rows) rows; the conversations placed a row,
    times run_rows, over the mixture's conversations that fit a row (its size less the share of the first epoch
    skipped as too long, of what was read of it): exact for one rank when run_rows <= sample_rows. `rows` is
    only read (its stream is not advanced). run_rows: the run's optimizer steps x rows a step (all ranks)."""
    n, row_len = len(rows.mixture), rows.row_len
    read, skipped = 0, []

    def items():
        nonlocal read
        # every row holds at most row_len conversations, and each epoch places one at least (else the run is
        # refused before): the stream is read no further than this
        for g in range(n * (1 + sample_rows * row_len)):
            read = g + 1
            if (item := rows.render(g)) is None:
                skipped.append(g)
            else:
                yield item

    packer = SamplePacker.from_items(
        items(), row_len, rows.tokenizer.bos_id, buffer_size=rows.packer.buffer_size
    )
    made = placed = 0
    try:
        while made < min(run_rows, sample_rows):
            placed += len(packer.next_row()["sample_ids"])
            made += 1
    except StopIteration:  # nothing of the stream fits a row
        return RunEpochs(0.0, 0.0)
    first = min(n, read)
    per_row = placed / made
    return RunEpochs(run_rows * per_row / (n * (1 - sum(g < first for g in skipped) / first)), per_row)


def _item_refs(buffer: Sequence) -> list[Ref]:
    """A SamplePacker state's buffer (stream items g) -> its stream references (g, 0)."""
    return [(int(g), 0) for g in buffer]


def validation_rows(task: Task, tokenizer: Tokenizer, row_len: int) -> dict[str, np.ndarray]:
    """Every conversation of `task` packed into rows of row_len = T+1 tokens: {"input_ids", "supervised",
    "segment_ids": (N, row_len) int32}. All N rows, whatever the number of workers that share them (rank r of W
    measures rows r, r+W, ...: some ranks may have one row fewer, or none, and the BPB is still over all N:
    raychat.eval.bpb.bpb_sums all-reduces sums, not means).

    Raises:
        ValueError: no conversation of the task fits a row (each one's last exchange is longer than row_len).
    """
    items = render_samples(tokenizer, ((task[i]["id"], task[i]) for i in range(len(task))), row_len)
    rows = list(SamplePacker.from_items(items, row_len, pad_id=tokenizer.bos_id))
    if not rows:
        raise ValueError(
            f"task {task.name}'s held-out conversations ({len(task):,}) fill no row of {row_len} tokens: the last "
            "exchange of each is longer"
        )
    return {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}


class NoneFits(NamedTuple):
    """Conversations none of which fits a row (none_fits): how many, their rendered lengths (tokens, before
    truncation) and the fewest tokens a row needs to keep one of them (chat_template.fewest_tokens)."""

    conversations: int
    shortest: int
    longest: int
    fewest: int


def none_fits(
    tasks: Iterable[Task], tokenizer: Tokenizer, row_len: int, found: NoneFits | None = None
) -> NoneFits | None:
    """None as soon as one conversation of `tasks` is kept in a row of row_len = T+1 tokens (whole, or with its
    oldest exchanges truncated: render_conversation); else every one of them is dropped (SFTRows would skip them
    all, and raise) and NoneFits says by how much (None: `tasks` hold no conversation). `tasks` is read lazily:
    a task after one holding a conversation that fits is never built. found: conversations already known to fit
    no row (RowFit.none_fit of a task rendered before), counted with those of `tasks`."""
    for task in tasks:
        for i in range(len(task)):
            conversation = task[i]
            rendered = render_conversation(tokenizer, conversation, max_tokens=row_len)
            if not rendered.dropped:
                return None
            length, fewest = rendered.truncation.tokens_before, fewest_tokens(tokenizer, conversation)
            found = (
                NoneFits(1, length, length, fewest)
                if found is None
                else NoneFits(
                    found.conversations + 1,
                    min(found.shortest, length),
                    max(found.longest, length),
                    min(found.fewest, fewest),
                )
            )
    return found


class RowFit(NamedTuple):
    """How the conversations of a task fit rows of row_len = T+1 tokens (row_fit): lengths: each one's rendered
    length (tokens, whole, before truncation), in the task's order; shortened: how many lose their oldest
    exchanges to fit; skipped: how many are dropped (not even their most recent exchange fits, or no supervised
    token is left: SFTRows skips them); none_fit: when every one is dropped, what none_fits says of them (else
    None)."""

    lengths: tuple[int, ...]
    shortened: int
    skipped: int
    none_fit: NoneFits | None


def row_fit(task: Task, tokenizer: Tokenizer, row_len: int) -> RowFit:
    """Every conversation of `task` rendered as SFTRows renders it (render_conversation, max_tokens=row_len),
    counted by how it fits (RowFit); the fewest tokens a row needs to keep one (chat_template.fewest_tokens) are
    worked out only when none is kept.

    Raises:
        ValueError: as render_conversation (an invalid conversation)."""
    lengths, shortened, skipped = [], 0, 0
    for i in range(len(task)):
        t = render_conversation(tokenizer, task[i], max_tokens=row_len).truncation
        lengths.append(t.tokens_before)
        skipped += t.dropped
        shortened += not t.dropped and t.dropped_exchanges > 0
    none_fit = None
    if lengths and skipped == len(lengths):
        fewest = min(fewest_tokens(tokenizer, task[i]) for i in range(len(task)))
        none_fit = NoneFits(len(lengths), min(lengths), max(lengths), fewest)
    return RowFit(tuple(lengths), shortened, skipped, none_fit)

"""RowSource: what the Trainer reads packed rows from, and the checkpoint state its two implementations share.

Both row sources (raychat.data.loader.pipeline.PretrainRows, raychat.data.loader.sft_rows.SFTRows) hand out rows of T+1
tokens (`row_len`) from one rank's share of a global stream (raychat.data.loader.cursor), packed with a buffer.
Their state in a checkpoint is references only:

  {<fingerprint key>: what the stream is made of, "deal": Deal.to_dict(), "rank", "taken",
   "packer": {"buffer": references of the buffered items, "stats", ...the packer's own keys}}

Resuming from the states of ALL ranks of the old world (`resume_cursor`): the same world -> this rank's own
cursor and packer state (the source rebuilds the buffered items: bit for bit); another world -> the states
re-dealt (raychat.data.loader.cursor.redeal: no item repeated or skipped), an empty buffer, and rank 0 keeps the
run's packer counters summed over the old ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from raychat.data.loader.cursor import Deal, RankCursor, Ref, redeal, sum_stats, whole_world


@runtime_checkable
class RowSource(Protocol):
    """This rank's endless, resumable stream of packed training rows (one per Ray Train worker).

    `next_batch(n)` -> {"input_ids": (n, T+1) int32 numpy array (BOS-started rows of token ids),
    "supervised": (n, T+1) int32, 1 where the token is a loss target (SFT only; absent = every token),
    "segment_ids": (n, T+1) int32, the packed sample of each token (SFT only), "replay": a list of n dicts,
    each row's segments as replay-record columns (raychat.data.replay.records)}.
    `fingerprint()` -> what the stream is made of (shards, their content and seed, or mixture and row length):
    JSON-able; two are compared with `same_stream`.
    `fingerprint_key` (a class attribute of both): the key state_dict() holds fingerprint() under (the driver
    compares it with a checkpoint's before Ray starts: raychat.train.launch.check_resume).
    `state_dict()` -> this rank's position, JSON-able, references only (module docstring).
    `load_state_dicts(states)`: continue from the states of every rank of the old world, in rank order, on
    this rank of this world (any size); raises ValueError if the states were made from another stream or
    are not ranks 0..W-1 of one world.
    `close()`: release what the stream holds open (a Ray Data pipeline and the autoscaling request it keeps
    alive: left open, the cluster keeps nodes for it until the request expires, 180 s in Ray 2.60); the next
    `next_batch` starts again from the position. The worker calls it when training ends, however it ends.
    """

    def next_batch(self, n: int) -> dict: ...

    def fingerprint(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dicts(self, states: Sequence[dict]) -> None: ...

    def close(self) -> None: ...


def same_stream(was: dict | None, now: dict) -> bool:
    """Whether a checkpoint's (or replay record's) fingerprint `was` and this run's `now` describe one stream:
    equal, except that "content" (the shards' digests) is compared only when both have it, so checkpoints
    written before the fingerprint held it still resume (on the names, layout and seed, as they did then)."""
    if was is None:
        return False
    if "content" not in was or "content" not in now:
        was, now = ({k: v for k, v in d.items() if k != "content"} for d in (was, now))
    return was == now


def cursor_state(key: str, fingerprint: dict, cursor: RankCursor, packer_state: dict) -> dict:
    """A row source's state_dict (module docstring); `key` names the fingerprint ("corpus" | "mixture")."""
    return {
        key: fingerprint,
        "deal": cursor.deal.to_dict(),
        "rank": cursor.rank,
        "taken": cursor.taken,
        "packer": packer_state,
    }


def resume_cursor(
    states: Sequence[dict],
    key: str,
    fingerprint: dict,
    rank: int,
    world: int,
    buffer_refs: Callable[[Sequence], list[Ref]],
) -> tuple[RankCursor, dict]:
    """This rank's cursor and packer state, from the states (cursor_state) of every rank of the old world.

    Args:
        states: one per old rank, in rank order; key, fingerprint: this run's stream (compared with each).
        rank, world: this rank of the new world.
        buffer_refs: a packer state's "buffer" -> its stream references (g, offset).
    Returns:
        (cursor, packer state): the same world -> this rank's own; another world -> the re-dealt cursor at
        taken 0 and {"buffer": [], "stats": the old ranks' counters summed on rank 0, {} elsewhere}.
    Raises:
        ValueError: a state was made from another stream, or the states are not ranks 0..W-1 of one world.
    """
    for state in states:
        if not same_stream(state[key], fingerprint):
            raise ValueError(f"checkpoint data state was made on {state[key]}, this run has {fingerprint}")
    deal = whole_world([Deal.from_dict(s["deal"]) for s in states], [s["rank"] for s in states])
    if deal.world == world:
        own = states[rank]
        return RankCursor(deal, rank, own["taken"]), own["packer"]
    buffers = [buffer_refs(s["packer"]["buffer"]) for s in states]
    cursor = RankCursor(redeal(deal, [s["taken"] for s in states], buffers, world), rank)
    stats = sum_stats([s["packer"]["stats"] for s in states]) if rank == 0 else {}
    return cursor, {"buffer": [], "stats": stats}

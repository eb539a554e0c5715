"""Preallocated key/value cache with per-row lengths, kept compact, sized from a memory budget.

Layout: k, v of shape (n_layer, B, n_kv_head, max_len, head_dim); row b holds `lengths[b]` valid tokens at
slots 0..lengths[b]-1 (keys after RoPE). Rows are independent: each has its own length, so prompts of
different lengths share one batch without left padding, and rows are freed and reused (continuous
batching). `lengths` lives on the host: every size decision is made without reading the device.

No history copies per decode step (why this layout): the rows being decoded are always the consecutive
rows 0..n-1 ("compaction"). When a request finishes, the last busy row is moved into the freed row
(`compact`: one copy of that row's history, once per finished request, not per step), so every forward
reads `k[layer, 0:n, :, :S]`, a view, and writes only its new tokens (attention.py). A paged layout would
avoid even that one copy but needs a paged-attention kernel; torch's SDPA and FlexAttention read a dense
(B, H, S, D) view directly, on CPU and GPU alike. The old path gathered every busy row's whole history in
every layer on every step (`index_select`): 2 * n_layer * rows * S * n_kv_head * head_dim * itemsize bytes
per token, about 3.3 GB at depth 20 / 8 rows / 2048 tokens in fp32 (bench/engine_decode.py prints both).

A forward over rows start..start+B-1 goes through `KVCache.batch(start, B, T)` (attention.CacheBatch),
which writes each row's T new keys/values at slots lengths[b] .. lengths[b]+T-1; the caller then calls
`advance(rows, n)` with the number of REAL tokens per row (right padding, and the placeholder token of a
row that is still prefilling during a decode step, is written but not counted, and later overwritten).
`attention_mask` is the dense reference of what every kernel computes: query t of row b sees slot j iff
j <= lengths[b] + t.

Memory: bytes per cached token = 2 (k and v) * n_layer * n_kv_head * head_dim * dtype itemsize.
"""

from __future__ import annotations

import torch

from raychat.engine.attention import CacheBatch, dense_mask


class KVBudgetError(ValueError):
    """A request needs more KV-cache memory than the configured budget allows."""


def check_budget_bytes(budget_bytes, name: str = "kv_budget_bytes") -> int | None:
    """`budget_bytes` as given: None (no cap) or an int >= 1 (bytes). Raises ValueError naming `name` for
    anything else (a bool, a float, 0 or a negative number: no cache could fit)."""
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"{name} must be None (no cap) or an int >= 1 (bytes), got {budget_bytes!r}")
    return budget_bytes


class KVCache:
    """Preallocated KV cache.

    Args:
        n_layer, batch_size, n_kv_head, max_len, head_dim: cache shape (see module docstring); all > 0.
        dtype: storage dtype (the model's parameter dtype). device: where k and v live.
    Attributes:
        k, v: (n_layer, batch_size, n_kv_head, max_len, head_dim) tensors.
        lengths: (batch_size,) int64 CPU tensor, valid tokens per row.
    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        sizes = dict(
            n_layer=n_layer, batch_size=batch_size, n_kv_head=n_kv_head, max_len=max_len, head_dim=head_dim
        )
        for name, value in sizes.items():
            if int(value) <= 0:
                raise ValueError(f"KVCache.{name} must be > 0, got {value}")
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.n_layer, self.batch_size, self.max_len = n_layer, batch_size, max_len

    # ---- sizing ---------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one cached token costs: 2 * n_layer * n_kv_head * head_dim * itemsize(dtype)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layer * config.n_kv_head * config.head_dim * itemsize

    @classmethod
    def rows_for_budget(
        cls, config, budget_bytes: int, max_len: int, dtype: torch.dtype = torch.float32
    ) -> int:
        """How many rows of `max_len` tokens fit in `budget_bytes` (may be 0)."""
        return int(budget_bytes) // (cls.bytes_per_token(config, dtype) * int(max_len))

    @classmethod
    def for_model(
        cls,
        config,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
    ) -> KVCache:
        """A cache shaped for `config` (a ModelConfig: n_layer, n_kv_head, head_dim).

        Raises:
            KVBudgetError: batch_size * max_len * bytes_per_token > budget_bytes; the message names every
                number and how many rows would fit.
        """
        if budget_bytes is not None:
            bpt = cls.bytes_per_token(config, dtype)
            itemsize = torch.empty((), dtype=dtype).element_size()
            needed = int(batch_size) * int(max_len) * bpt
            if needed > budget_bytes:
                fit = cls.rows_for_budget(config, budget_bytes, max_len, dtype)
                raise KVBudgetError(
                    f"KV cache for {batch_size} rows x {max_len} tokens needs {needed} bytes "
                    f"({bpt} bytes/token = 2 x {config.n_layer} layers x {config.n_kv_head} kv heads x "
                    f"{config.head_dim} head_dim x {itemsize} bytes) but kv_budget_bytes is {budget_bytes}; at most {fit} rows of {max_len} tokens fit"
                )
        return cls(config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    # ---- row management -------------------------------------------------------------------------
    def _rows(self, rows) -> torch.Tensor:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size):
            raise IndexError(f"rows {rows.tolist()} outside 0..{self.batch_size - 1}")
        return rows

    def reset_rows(self, rows) -> None:
        """Mark rows empty (length 0); their slots are overwritten by the next prefill."""
        self.lengths[self._rows(rows)] = 0

    def replicate(self, src_row: int, dst_rows) -> None:
        """Copy row `src_row`'s cached tokens (and length) into every row of `dst_rows` (src_row itself is
        skipped when listed)."""
        dst = self._rows(dst_rows)
        dst = dst[dst != src_row]
        if dst.numel() == 0:
            return
        n = int(self.lengths[src_row])
        dst_dev = dst.to(self.k.device)
        for buf in (self.k, self.v):
            buf[:, dst_dev, :, :n] = buf[:, src_row : src_row + 1, :, :n]
        self.lengths[dst] = n

    def move_row(self, src: int, dst: int) -> None:
        """Move row `src`'s cached tokens and length to row `dst` (src becomes empty)."""
        n = int(self.lengths[src])
        for buf in (self.k, self.v):
            buf[:, dst, :, :n] = buf[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def compact(self, busy: list[int]) -> dict[int, int]:
        """Move the rows in `busy` so they occupy rows 0..len(busy)-1; rows already there stay put.

        Returns {old row: new row} for every row that moved (one `move_row` each).
        """
        n = len(busy)
        holes = sorted(set(range(n)) - set(busy))
        movers = sorted(r for r in busy if r >= n)
        moves = dict(zip(movers, holes))
        for src, dst in moves.items():
            self.move_row(src, dst)
        return moves

    def advance(self, rows, n) -> None:
        """Add n (int or per-row tensor) real tokens to each row's length after a forward."""
        rows = self._rows(rows)
        self.lengths[rows] += torch.as_tensor(n, dtype=torch.long)

    # ---- forward plumbing -----------------------------------------------------------------------
    def attention_mask(self, rows, T: int) -> torch.Tensor:
        """(B', 1, T, S) bool reference mask, True where query t of row b may see slot j: j <= lengths[b] + t."""
        starts = self.lengths[self._rows(rows)]
        return dense_mask(starts, T, int(starts.max()) + T).to(self.k.device)

    def position_ids(self, rows, T: int) -> torch.Tensor:
        """(B', T) int64 RoPE positions lengths[b] + t of the next T tokens of each row."""
        starts = self.lengths[self._rows(rows)]
        return (starts[:, None] + torch.arange(T)[None]).to(self.k.device)

    def batch(self, start: int, B: int, T: int, backend: str = "dense", static: bool = False) -> CacheBatch:
        """The model's `kv_cache` for a forward of T new tokens on rows start..start+B-1 (attention.py).

        Raises:
            ValueError: a row would exceed max_len, or the rows are outside the cache.
        """
        return CacheBatch(self, start, B, T, backend, static)

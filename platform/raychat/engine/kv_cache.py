"""Preallocated key/value cache with per-row lengths, sized from a memory budget.

Layout: k, v of shape (n_layer, B, n_kv_head, max_len, head_dim); row b holds `lengths[b]` valid tokens at
slots 0..lengths[b]-1 (keys after RoPE, as the model hands them to `update`). Rows are independent: each
has its own length, so prompts of different lengths share one batch without left padding, and rows can be
freed and reused (continuous batching).

A forward over a subset of rows goes through `KVCache.view(rows, T)`: the view writes the T new keys and
values of row b at slots lengths[b] .. lengths[b]+T-1 and returns keys/values 0..S-1 with
S = max(lengths[rows]) + T. The matching attention mask (`attention_mask`) lets query t of row b see slot j
iff j <= lengths[b] + t: every cached token plus the causal part of the new ones; stale slots of shorter
rows (j > lengths[b] + t) are masked. The caller then calls `advance(rows, n)` with the number of REAL
tokens per row (right padding in a batched prefill is written but not counted, and later overwritten).

Memory: bytes per cached token = 2 (k and v) * n_layer * n_kv_head * head_dim * dtype itemsize.
"""

from __future__ import annotations

import torch


class KVBudgetError(ValueError):
    """A request needs more KV-cache memory than the configured budget allows."""


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
        """Copy row `src_row`'s cached tokens (and length) into every row of `dst_rows`."""
        dst = self._rows(dst_rows)
        if dst.numel() == 0:
            return
        n = int(self.lengths[src_row])
        dst_dev = dst.to(self.k.device)
        for buf in (self.k, self.v):
            buf[:, dst_dev, :, :n] = buf[:, src_row : src_row + 1, :, :n]
        self.lengths[dst] = n

    def advance(self, rows, n) -> None:
        """Add n (int or per-row tensor) real tokens to each row's length after a forward."""
        rows = self._rows(rows)
        self.lengths[rows] += torch.as_tensor(n, dtype=torch.long)

    # ---- forward plumbing -----------------------------------------------------------------------
    def attention_mask(self, rows, T: int) -> torch.Tensor:
        """(B', 1, T, S) bool mask, True where query t of row b may see slot j: j <= lengths[b] + t."""
        starts = self.lengths[self._rows(rows)]
        S = int(starts.max()) + T
        j = torch.arange(S)
        t = torch.arange(T)
        mask = j[None, None, :] <= (starts[:, None, None] + t[None, :, None])
        return mask[:, None].to(self.k.device)

    def position_ids(self, rows, T: int) -> torch.Tensor:
        """(B', T) int64 RoPE positions lengths[b] + t of the next T tokens of each row."""
        starts = self.lengths[self._rows(rows)]
        return (starts[:, None] + torch.arange(T)[None]).to(self.k.device)

    def view(self, rows, T: int) -> _CacheView:
        """The object to pass as the model's `kv_cache` for a forward of T new tokens on `rows`.

        Raises:
            ValueError: a row would exceed max_len.
        """
        return _CacheView(self, self._rows(rows), T)


class _CacheView:
    """Writes new k, v at each row's own offset; returns the (B', H, S, D) history the rows attend over."""

    def __init__(self, cache: KVCache, rows: torch.Tensor, T: int):
        starts = cache.lengths[rows]
        end = int(starts.max()) + T
        if end > cache.max_len:
            raise ValueError(f"KV cache row overflow: {end} tokens > max_len {cache.max_len}")
        self.cache, self.T, self.S = cache, T, end
        device = cache.k.device
        n = rows.numel()
        first = int(rows[0])
        self._slice = slice(first, first + n) if torch.equal(rows, torch.arange(first, first + n)) else None
        self._rows = rows.to(device)
        self._pos = (starts[:, None] + torch.arange(T)[None]).to(device)  # (B', T)
        self._uniform_start = int(starts.min()) if bool((starts == starts[0]).all()) else None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for buf, new in ((self.cache.k[layer_idx], k), (self.cache.v[layer_idx], v)):
            if self._slice is not None and self._uniform_start is not None:
                s0 = self._uniform_start
                buf[self._slice, :, s0 : s0 + self.T] = new
            else:
                buf[self._rows[:, None], :, self._pos] = new.transpose(1, 2)
            if self._slice is not None:
                out.append(buf[self._slice, :, : self.S])
            else:
                out.append(buf[:, :, : self.S].index_select(0, self._rows))
        return out[0], out[1]

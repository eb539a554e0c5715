"""Attention over the KV cache for one forward: write only the new keys/values, read the history in place.

A forward covers the rows `start .. start+B-1` of a KVCache (always consecutive: the Scheduler and
`generate_batch` keep busy rows compacted at the front, see kv_cache.py) with T new tokens per row (right
padded). Row b's T new keys/values are written at slots starts[b] .. starts[b]+T-1 (one strided copy when
every row starts at the same slot, else one index_put of the B*T new vectors); queries then attend over
`k[layer, start:start+B, :, :S]`, a view of the cache (S = max(starts) + T): no history is gathered or
copied. Kernel per forward (`plan`), from the row offsets alone:

  "causal"       every row starts at 0 (prefill of fresh prompts; right padding only hides padded queries):
                 SDPA is_causal=True over the new keys/values themselves; the cache is not read.
  "lower_right"  every row starts at the same s > 0 and T > 1 (a prompt's later prefill chunk, or the rest
                 of a prompt after a prefix-cache hit): on CUDA SDPA with
                 torch.nn.attention.bias.causal_lower_right(T, S), which the flash/efficient kernels take
                 as a flag (query t sees slots <= s + t), no dense mask; elsewhere the (B, 1, T, S) dense
                 mask of "lengths" (the same rule; CPU SDPA's flash kernel takes it, and the module, whose
                 import pulls in torch._dynamo, ~0.9 s, stays unimported: a serving replica's first
                 prefix-cache hit would pay it).
  "full"         every row starts at the same s and T == 1 (decode of equal-length rows): SDPA without a
                 mask; every one of the S = s + 1 slots is visible.
  "lengths"      rows start at different slots: query t of row b sees slot j iff j <= starts[b] + t.
                 backend "flex": FlexAttention with a BlockMask built from the offsets (its mask_mod reads
                 them; blocks past a row's length are skipped) -- the GPU path, compiled on first use.
                 backend "dense": SDPA with a (B, 1, T, S) boolean mask -- the CPU path and the test
                 reference (on CPU SDPA's flash kernel takes the mask).
  "static"       fixed shapes for torch.compile / CUDA graphs (ModelRunner(compile_decode=True)): S is the
                 cache's max_len, offsets come as a device tensor, dense mask from them.
Grouped-query attention: for T == 1 the G = n_head / n_kv_head query heads of a kv head are folded into
the query-length axis ((B, Hkv, G, D) against (B, Hkv, S, D)), so no kernel repeats keys/values per query
head; otherwise SDPA's enable_gqa / FlexAttention's enable_gqa (no copies either).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# torch.nn.attention.bias and .flex_attention import torch._dynamo (1-3.5 s): imported where used, so every
# process that imports raychat.engine (a training job's driver and workers, through the validators) does
# not pay for them (bench/results/job_startup.md)

BACKENDS = ("auto", "dense", "flex")
FLEX_BLOCK = 128


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend name: "auto" -> "flex" on CUDA, "dense" elsewhere. Raises ValueError for a name outside BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "dense"
    return backend


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without a host sync (pinned + non_blocking on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if t.device == device else t.to(device)


def dense_mask(starts: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """(B, 1, T, S) bool, True where query t of row b may see slot j: j <= starts[b] + t (starts: (B,))."""
    j = torch.arange(S, device=starts.device)
    t = torch.arange(T, device=starts.device)
    return (j[None, None, :] <= (starts[:, None, None] + t[None, :, None]))[:, None]


_flex_compiled = None


def _flex_attention(device: torch.device):
    """torch.compile(flex_attention) on CUDA (its fused kernel); the eager reference elsewhere."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled


def flex_block_mask(starts: torch.Tensor, T: int, S: int):
    """BlockMask of the "lengths" rule for FlexAttention (starts: (B,) int64 on the query device)."""

    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= starts[b] + q_idx

    return create_block_mask(mask_mod, starts.shape[0], None, T, S, device=starts.device)


class CacheBatch:
    """The `kv_cache` a model forward receives: `attend(layer_idx, q, k, v)` per attention layer.

    Args:
        cache: the KVCache. start, B: rows start .. start+B-1 (consecutive). T: new tokens per row.
        backend: "dense" or "flex" for the "lengths" plan (see the module docstring).
        static: fixed-shape decode for compiled graphs (T must be 1).
    Attributes:
        plan: the kernel choice (module docstring). S: key length attended over.
        position_ids: (B, T) int64 RoPE positions starts[b] + t, on the cache's device.
    Raises:
        ValueError: a row would exceed the cache's max_len, or rows outside the cache.
    """

    def __init__(self, cache, start: int, B: int, T: int, backend: str = "dense", static: bool = False):
        if start < 0 or B < 1 or start + B > cache.batch_size:
            raise ValueError(f"rows {start}..{start + B - 1} outside the cache's 0..{cache.batch_size - 1}")
        host = cache.lengths.tolist()[start : start + B]  # one read of the (host) lengths: every decision
        end = max(host) + T
        if end > cache.max_len:
            raise ValueError(f"KV cache row overflow: {end} tokens > max_len {cache.max_len}")
        self.cache, self.start, self.B, self.T = cache, start, B, T
        device = cache.k.device
        first = host[0]
        uniform = min(host) == end - T
        positions = torch.tensor([[s] for s in host])  # (B, 1)
        if T > 1:
            positions = positions + torch.arange(T)[None]
        self.position_ids = to_device(positions, device)
        self._uniform_start = first if uniform and not static else None
        self._pos = None if self._uniform_start is not None else self.position_ids
        self._rows = None if self._uniform_start is not None else torch.arange(B, device=device)[:, None]
        if static:
            if T != 1:
                raise ValueError(f"the static (compiled) plan decodes one token per row, got T={T}")
            self.plan, self.S = "static", cache.max_len
        elif uniform and first == 0:
            self.plan, self.S = "causal", T
        elif uniform:
            self.plan, self.S = ("full" if T == 1 else "lower_right"), end
        else:
            self.plan, self.S = "lengths", end
        self.backend = backend if self.plan == "lengths" else "dense"
        self._mask = None
        if self.plan in ("lengths", "static") or (self.plan == "lower_right" and device.type != "cuda"):
            starts_dev = self.position_ids[:, 0]
            if self.backend == "flex":
                self._mask = flex_block_mask(starts_dev, T, self.S)
            else:
                self._mask = dense_mask(starts_dev, T, self.S)

    def _write(self, buf: torch.Tensor, new: torch.Tensor) -> None:
        rows = buf[self.start : self.start + self.B]
        if self._uniform_start is not None:
            s0 = self._uniform_start
            rows[:, :, s0 : s0 + self.T] = new
        else:
            rows[self._rows, :, self._pos] = new.transpose(1, 2)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, Hq, T, D); k, v: (B, Hkv, T, D) new keys (after RoPE) and values -> (B, Hq, T, D).

        A cache of another dtype than q (ModelRunner(kv_dtype=...)): q, k, v are rounded to the cache's
        dtype, attention runs in it (every plan, so a prompt's first chunk sees the same rounded keys as
        later tokens), and the result is cast back to q's dtype."""
        cache = self.cache
        if cache.k.dtype != q.dtype:
            out_dtype, kv = q.dtype, cache.k.dtype
            return self.attend(layer_idx, q.to(kv), k.to(kv), v.to(kv)).to(out_dtype)
        self._write(cache.k[layer_idx], k)
        self._write(cache.v[layer_idx], v)
        gqa = q.shape[1] != k.shape[1]
        if self.plan == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        rows = slice(self.start, self.start + self.B)
        keys, values = cache.k[layer_idx, rows, :, : self.S], cache.v[layer_idx, rows, :, : self.S]
        if self.plan == "lower_right" and self._mask is None:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(self.T, self.S)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        if self.backend == "flex":
            return _flex_attention(q.device)(q, keys, values, block_mask=self._mask, enable_gqa=gqa)
        if self.T == 1 and gqa:  # fold the query heads of each kv head into the query axis
            B, Hq, _, D = q.shape
            Hkv = k.shape[1]
            folded = q.reshape(B, Hkv, Hq // Hkv, D)
            y = F.scaled_dot_product_attention(folded, keys, values, attn_mask=self._mask)
            return y.reshape(B, Hq, 1, D)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._mask, enable_gqa=gqa)

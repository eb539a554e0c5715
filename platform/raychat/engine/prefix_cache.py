"""Prefix cache: keys/values of token blocks already computed, reused by later requests with the same prefix.

Design (fits the engine's per-row contiguous KVCache, kv_cache.py): a pool of fixed-size blocks of
BLOCK_TOKENS tokens, k and v of shape (n_layer, n_blocks, n_kv_head, BLOCK_TOKENS, head_dim), separate
from the slot cache. A request's prompt is cut into full blocks; block i is keyed by its digest, blake2b
over (digest of block i-1, the block's token ids), and block 0's parent is the digest of the weight
version, so a key names the whole prefix up to the block's end under one set of weights (vLLM's
hash-of-block-and-parent scheme). Reusing a prefix COPIES the matched blocks' keys/values into the row's
own slots 0..n-1 (one gather per layer stack, bytes = n * bytes_per_token) and the row prefills only the
rest: the prefill compute (every layer's matmuls and attention over those tokens) is what is saved, and the
attention kernels keep reading the row's dense view. The keys were stored after RoPE at their original
positions 0..n-1 and land at the same slots, so positions are the original ones. At most
(len(prompt) - 1) // BLOCK_TOKENS blocks are reused: the last prompt token is always recomputed, so the
logits of the first completion token exist.

Exactness: a block's keys/values are a function of its tokens and every token before it, under fixed
weights; the digest chain names exactly that, and each entry also stores its own tokens, which a lookup
compares (a digest collision of the 128-bit hash can only cross prefixes that also match the block's own
tokens). Every tensor op runs under torch.inference_mode (the pool is an inference tensor wherever it was
first allocated: generate_batch or a Scheduler step). The only difference from recomputing is the floating-point summation order of the forward that
produced them (the same difference as chunked vs unchunked prefill).

Weights: `sync(version)` with the runner's weight version (a change of any parameter's version counter or
storage, or ModelRunner.refresh_weights) drops every entry: nothing computed under older weights is reused.

Memory and eviction: the pool holds at most `capacity_tokens // BLOCK_TOKENS` blocks and grows (doubling)
as it fills, so an idle engine holds little. Blocks a live request uses carry a reference count (held from
the request's lookup or insert to its end) and are never evicted; the others are evicted least recently used
first, the deepest block of a prefix before its parents. When every block is held or the memory for
growing is not there (an out-of-memory error while growing caps the pool where it is), a block is simply
not cached: caching never fails a request.

Counters (tokens, as vLLM's prefix-cache hit rate): `queries` counts prompt tokens looked up, `hits` the
prompt tokens whose keys/values came from the pool.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

import torch

BLOCK_TOKENS = 16  # tokens per block (vLLM's default block size)
MIN_GROW_BLOCKS = 64  # the pool's first allocation, in blocks (1,024 tokens)


def block_digests(tokens: list[int], num_blocks: int, version: int) -> list[bytes]:
    """Digests of the first `num_blocks` full blocks of `tokens`: 16-byte blake2b of (parent digest, the
    block's token ids as int64); block 0's parent is blake2b of the weight version (a Python int)."""
    parent = hashlib.blake2b(b"raychat-prefix:%d" % version, digest_size=16).digest()
    out = []
    for i in range(num_blocks):
        block = array("q", tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that found no memory: torch.OutOfMemoryError on CUDA; on the CPU,
    whose allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory: ...")."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


class PrefixCache:
    """A pool of cached key/value blocks for one model (see the module docstring).

    Args:
        n_layer, n_kv_head, head_dim: the model's cache shape (KVCache's).
        capacity_tokens: most tokens the pool holds (rounded down to whole blocks); >= BLOCK_TOKENS.
        dtype, device: the slot cache's (blocks are copied to and from it as they are).
    Raises:
        ValueError: capacity_tokens not an int >= BLOCK_TOKENS (named as ModelRunner's prefix_cache_tokens,
            which is how it reaches here).
    """

    def __init__(
        self,
        n_layer: int,
        n_kv_head: int,
        head_dim: int,
        capacity_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if not isinstance(capacity_tokens, int) or capacity_tokens < BLOCK_TOKENS:
            raise ValueError(
                f"prefix_cache_tokens must be 'auto', an int >= {BLOCK_TOKENS} (one block) or 0 (off), got "
                f"{capacity_tokens!r}"
            )
        self.shape = (n_layer, n_kv_head, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_blocks = capacity_tokens // BLOCK_TOKENS
        self.k = self.v = None  # (n_layer, allocated blocks, n_kv_head, BLOCK_TOKENS, head_dim)
        self.version: int | None = None
        self.epoch = 0  # bumped by clear(): holds taken before it are void
        self._index: dict[bytes, int] = {}  # digest -> block id
        self._digest: dict[int, bytes] = {}  # block id -> digest
        self._tokens: dict[int, tuple[int, ...]] = {}  # block id -> its tokens (checked on lookup)
        self._refs: dict[int, int] = {}  # block id -> live holders (absent = 0)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unheld, oldest first
        self._free: list[int] = []
        self.hits = 0
        self.queries = 0

    # ---- sizes -----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks allocated (cached or free)."""
        return 0 if self.k is None else self.k.shape[1]

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix."""
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    # ---- weights -----------------------------------------------------------------------------------------
    def sync(self, version: int) -> None:
        """Drop every entry when `version` (the runner's weight version) differs from the entries'."""
        if version != self.version:
            self.clear()
            self.version = version

    def clear(self) -> None:
        """Forget every entry (memory stays allocated; every hold is void)."""
        self.epoch += 1
        self._free = list(range(self.num_blocks))
        self._index.clear()
        self._digest.clear()
        self._tokens.clear()
        self._refs.clear()
        self._lru.clear()

    def digests(self, tokens: list[int]) -> list[bytes]:
        """Digests of the blocks of `tokens` a request may reuse: (len(tokens) - 1) // BLOCK_TOKENS of them
        (its last token is always recomputed)."""
        return block_digests(tokens, (len(tokens) - 1) // BLOCK_TOKENS, self.version or 0)

    # ---- lookup and load ---------------------------------------------------------------------------------
    def match(self, tokens: list[int], digests: list[bytes], start: int = 0) -> list[int]:
        """Block ids of the longest run of cached blocks start, start+1, ... of `tokens` (each entry's
        stored tokens compared). Marks them most recently used, the first block of the run last."""
        ids = []
        for i in range(start, len(digests)):
            b = self._index.get(digests[i])
            if b is None or self._tokens[b] != tuple(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]):
                break
            ids.append(b)
        for b in reversed(ids):
            if b in self._lru:
                self._lru.move_to_end(b)
        return ids

    @torch.inference_mode()
    def load(self, cache, row: int, ids: list[int], start: int) -> int:
        """Copy blocks `ids` into `cache` row `row` at slots start*BLOCK_TOKENS.. (the row must hold exactly
        that many tokens) and advance its length. Returns the tokens copied. Holds nothing (the caller
        acquires `ids` once this returns).

        Raises:
            ValueError: the row does not hold start * BLOCK_TOKENS tokens.
            whatever the copy raises (e.g. torch.OutOfMemoryError for its temporary): the row's length is
            then unchanged.
        """
        if not ids:
            return 0
        n, pos = len(ids), start * BLOCK_TOKENS
        if int(cache.lengths[row]) != pos:
            raise ValueError(f"row {row} holds {int(cache.lengths[row])} tokens, the blocks start at {pos}")
        index = torch.tensor(ids, device=self.device)
        L, H, D = self.shape
        for pool, buf in ((self.k, cache.k), (self.v, cache.v)):
            dst = buf[:, row, :, pos : pos + n * BLOCK_TOKENS].view(L, H, n, BLOCK_TOKENS, D)
            dst.copy_(pool.index_select(1, index).transpose(1, 2))
        cache.lengths[row] += n * BLOCK_TOKENS
        return n * BLOCK_TOKENS

    # ---- insert ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def insert(self, cache, row: int, tokens: list[int], digests: list[bytes], start: int) -> list[int]:
        """Cache blocks start.. of `digests` (full blocks of `tokens`, whose keys/values are in `cache` row
        `row` at their positions) that are not cached yet, and hold blocks start.. (cached before or now) up
        to the first one that could not be cached (every block held, or no memory). Returns the held ids
        (the caller releases them).

        Raises:
            whatever the copy into the pool raises (e.g. torch.OutOfMemoryError for its temporary): nothing
            of this call is then cached or held, and the blocks it took are free again.
        """
        ids, new = [], []
        for i in range(start, len(digests)):
            b = self._index.get(digests[i])
            if b is None:
                b = self._allocate()  # off the free list and the index: a later block cannot evict it
                if b is None:
                    break
                new.append((i, b))
            else:
                self.acquire([b])  # held from here: a later block of this call cannot evict it
            ids.append(b)
        if new:
            L, H, D = self.shape
            fresh = [b for _, b in new]
            try:
                pos = torch.tensor([i * BLOCK_TOKENS for i, _ in new])[:, None] + torch.arange(BLOCK_TOKENS)
                pos = pos.reshape(-1).to(cache.k.device)
                index = torch.tensor(fresh, device=self.device)
                for pool, buf in ((self.k, cache.k), (self.v, cache.v)):
                    src = buf[:, row].index_select(2, pos).view(L, H, len(new), BLOCK_TOKENS, D)
                    pool.index_copy_(1, index, src.transpose(1, 2).to(self.device))
            except BaseException:
                self._free.extend(fresh)
                self.release([b for b in ids if b not in fresh], self.epoch)
                raise
            for i, b in new:  # in the index only once their keys/values are in the pool
                self._index[digests[i]], self._digest[b] = b, digests[i]
                self._tokens[b] = tuple(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
            self.acquire(fresh)
        return ids

    def _allocate(self) -> int | None:
        if not self._free and self.num_blocks < self.max_blocks:
            self._grow()
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        b, _ = self._lru.popitem(last=False)  # least recently used, unheld
        del self._index[self._digest.pop(b)]
        del self._tokens[b]
        return b

    def _grow(self) -> None:
        old = self.num_blocks
        new = min(self.max_blocks, max(MIN_GROW_BLOCKS, 2 * old))
        L, H, D = self.shape
        try:
            k = torch.empty((L, new, H, BLOCK_TOKENS, D), dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
        except RuntimeError as e:  # memory pressure: keep the pool as it is and evict instead
            if not out_of_memory(e):
                raise
            self.max_blocks = old
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        if old:
            k[:, :old], v[:, :old] = self.k, self.v
        self.k, self.v = k, v
        self._free.extend(range(new - 1, old - 1, -1))

    # ---- references --------------------------------------------------------------------------------------
    def acquire(self, ids: list[int]) -> None:
        """Hold blocks `ids` (not evictable until released)."""
        for b in ids:
            self._refs[b] = self._refs.get(b, 0) + 1
            self._lru.pop(b, None)

    def release(self, ids: list[int], epoch: int) -> None:
        """Drop one hold of each block in `ids`, taken when `self.epoch` was `epoch` (holds from before a
        clear() are void: nothing happens). A block held by nobody becomes evictable, the last block of
        `ids` first (evicted before the blocks before it)."""
        if epoch != self.epoch:
            return
        for b in reversed(ids):
            n = self._refs.get(b)
            if n is None:
                continue
            if n > 1:
                self._refs[b] = n - 1
            else:
                del self._refs[b]
                self._lru[b] = None

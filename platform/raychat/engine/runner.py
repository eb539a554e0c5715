"""Batched generation with a KV cache over the raychat GPT (RL rollouts, evaluation, the chat CLI), and the
forward primitive the Scheduler builds on.

`ModelRunner.forward_rows(cache, start, pieces)` appends pieces[i] (a list of token ids, possibly empty)
to cache row start+i for consecutive rows, in one forward, and returns the fp32 logits at each row's last
new token only (the LM head runs on B positions, not B * T). Attention reads the cache in place
(engine/attention.py); nothing but the new tokens' keys/values is written.

Flow of `ModelRunner.generate_batch`: the prompts are prefilled into rows 0..P-1 (batched forwards of at
most `prefill_chunk_tokens` padded tokens; a longer prompt in chunks of that size), each prompt's row is
copied to its `num_samples` rows, and then each step samples one token for every unfinished row (one
SamplingBatch: one device-to-host transfer) and runs one decode forward over the unfinished rows only.
Rows that finish are filled by the last unfinished row (KVCache.compact), so the decode always covers rows
0..m-1 and never copies history. Rows keep their own lengths: the RoPE position of a row's next token is
its own length and attention covers exactly its own tokens.

Sampling is independent per row from the first token on: the first token of each of the num_samples rows
is drawn from the (replicated) last-prompt-position logits; the rows of one prompt draw from that
prompt's generator in one call per step, in sample order (engine/sampling.py: the noise's shape).
"""

from __future__ import annotations

import hashlib
import logging
import operator
from dataclasses import dataclass

import torch

from raychat.engine.attention import resolve_backend, to_device
from raychat.engine.kv_cache import KVCache, check_budget_bytes
from raychat.engine.packed_weights import PackedGPT
from raychat.engine.packed_weights import available as packed_available
from raychat.engine.packed_weights import supports as packed_supports
from raychat.engine.prefix_cache import PrefixCache
from raychat.engine.row_state import RowState
from raychat.engine.sampling import SamplingBatch, SamplingParams, make_generator
from raychat.engine.scoring import prompt_logprobs
from raychat.engine.stream import TokenLogprob
from raychat.model import fast_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = ("model", "auto", "float32", "bfloat16", "float16")  # kv_dtype names: "model", "auto", DTYPES
COMPILED_LEN_MULTIPLE = 256  # generate_batch's cache length is rounded up to this with compile_decode
PREFIX_CACHE_ROWS = 8  # prefix_cache_tokens="auto": the pool holds at most this many max_seq_len rows

log = logging.getLogger(__name__)


def resolve_dtype(dtype, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype: "model" -> model_dtype; "auto" -> bfloat16 on CUDA, float32 elsewhere; a name in DTYPES or a
    torch.dtype as given. Raises ValueError for anything else."""
    if dtype == "model":
        return model_dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'model', 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")


def resolve_kv_dtype(kv_dtype, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: "model" -> `dtype` (the weights'); "auto" -> bfloat16 where the device has native
    bf16 math (raychat.model.fast_bf16: the rule of Muon's Newton-Schulz dtype), else float32; a name in
    DTYPES or a torch.dtype as given. Raises ValueError naming kv_dtype for anything else."""
    if kv_dtype == "model":
        return dtype
    if kv_dtype == "auto":
        return torch.bfloat16 if fast_bf16(device)[0] else torch.float32
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in DTYPES.values():
        return kv_dtype
    if kv_dtype in DTYPES:
        return DTYPES[kv_dtype]
    raise ValueError(f"kv_dtype must be 'model', 'auto' or one of {sorted(DTYPES)}, got {kv_dtype!r}")


def decode_buckets(max_rows: int) -> list[int]:
    """Row counts a compiled decode step is specialized for: powers of two below max_rows, and max_rows."""
    out = [1]
    while out[-1] * 2 < max_rows:
        out.append(out[-1] * 2)
    return sorted(set(out + [max_rows]))


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of request `index` within a call seeded `seed`: first 8 bytes of sha256("seed:index")."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{index}".encode()).digest()[:8], "little") >> 1


ENCODE_FIRST = (
    "the engine takes token ids: encode text with the tokenizer first (tokenizer.encode(text), or a chat "
    "rendered with raychat.chat_template.render_for_completion(tokenizer, messages))"
)


def is_token_id(t) -> bool:
    """An int (Python's, NumPy's, a one-element integer tensor: anything operator.index takes), not a bool."""
    if isinstance(t, bool):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def token_ids(prompt, name: str = "prompt") -> list[int]:
    """`prompt` as a list of Python ints (`is_token_id` each: never a bool or a float). Raises ValueError
    naming `name` for text (a str or bytes: encode it first), something that is not a sequence, or an item
    that is not a token id."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(
            f"{name} is a {type(prompt).__name__} ({prompt[:40]!r}), not token ids; {ENCODE_FIRST}"
        )
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(
            f"{name} must be a sequence of token ids (ints), got {type(prompt).__name__} {prompt!r}"
        ) from None
    try:
        ids = [operator.index(t) for t in items]
    except TypeError:
        ids = None
    if ids is None or any(isinstance(t, bool) for t in items):
        i, bad = next((i, t) for i, t in enumerate(items) if not is_token_id(t))
        raise ValueError(
            f"{name} must be a sequence of token ids (ints); item {i} is {type(bad).__name__} {bad!r}"
        )
    return ids


def check_prompt(prompt, vocab_size: int, max_seq_len: int, name: str = "prompt") -> list[int]:
    """`prompt` as a list of ints. Raises ValueError (naming `name`) if it is not a sequence of token ids
    (`token_ids`: text must be encoded first), is empty, has ids outside 0..vocab_size-1, or has max_seq_len
    tokens or more (no room to generate)."""
    ids = token_ids(prompt, name)
    if not ids:
        raise ValueError(f"{name} is empty; it needs at least one token (e.g. <|bos|>)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token ids outside 0..{vocab_size - 1}: {bad[:5]}")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"{name} has {len(ids)} tokens; max_seq_len {max_seq_len} leaves no room to generate"
        )
    return ids


@dataclass
class GenerationResult:
    """One completed row. tokens/mask cover prompt + completion; mask 1 = sampled, 0 = prompt or forced."""

    prompt_index: int
    sample_index: int
    tokens: list[int]
    mask: list[int]
    num_prompt_tokens: int
    text: str
    finish_reason: str

    @property
    def completion_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def completion_mask(self) -> list[int]:
        return self.mask[self.num_prompt_tokens :]


class ModelRunner:
    """Generation over `model` (a raychat GPT or anything with its forward signature and `.config`).

    Args:
        model: module with forward(input_ids, position_ids=, kv_cache=, logits_at=) -> (B, V) fp32 logits
            (raychat.model.GPT.forward) and `config` (n_layer, n_kv_head, head_dim, max_seq_len,
            vocab_size). Put it in eval mode yourself.
        tokenizer: raychat Tokenizer.
        kv_budget_bytes: None (no cap) or an int >= 1: cap in bytes on the KV cache of one generate_batch call
            (KVBudgetError beyond).
        dtype: weights and KV cache. "model" (default) keeps the model's parameter dtype (RL rollouts:
            their weights hash is of those parameters); "auto" = bfloat16 on CUDA, float32 on CPU (what the
            serving entry points pass); or "float32" / "bfloat16" / "float16" / a torch.dtype. A dtype that
            differs from the model's casts the model in place.
        attention: kernel for rows of different lengths: "auto" (FlexAttention on CUDA, dense-mask SDPA on
            CPU), "flex" or "dense" (engine/attention.py).
        prefill_chunk_tokens: most padded tokens in one generate_batch prefill forward (>= 1); a longer
            prompt is prefilled in chunks of this size.
        compile_decode: compile the decode step with torch.compile (CUDA graphs on CUDA) for fixed row
            counts (decode_buckets); off by default, meant for GPUs (on CPU it only costs compile time).
        packed_weights: run the engine's forwards through engine/packed_weights.PackedGPT: the model's
            math over weights laid out once for the CPU's kernels (q/k/v and gate/up stacked; oneDNN-packed
            for large products, an (in, out) copy for MKL on small ones), in fewer calls; two more copies
            of the projection weights in memory. "auto" (default) = on for a raychat GPT in fp32 on CPU
            when torch has oneDNN; True = on (ValueError where it does not apply); False = off (the model's
            own forward, as in training).
        kv_dtype: the KV cache's dtype: "model" (default) = the weights' dtype; "auto" = bfloat16 where the
            device has native bf16 math (raychat.model.fast_bf16), else float32; or a name in DTYPES. Keys and
            values are rounded to it when written; attention then runs in it (engine/attention.py).
            Accuracy cost of bfloat16 vs float32, and its decode speed, which differs by CPU (slower than
            float32 on one machine of this kind): bench/results/infer_bench.md.
        prefix_cache_tokens: capacity of the prefix cache (engine/prefix_cache.py) in tokens: "auto"
            (default) = PREFIX_CACHE_ROWS * max_seq_len, allocated as it fills; an int >= 16; 0 = off.
            generate_batch and the Scheduler reuse cached prompt blocks (`self.prefix_cache`).
    Raises:
        ValueError: an unknown dtype, kv_dtype or attention, prefill_chunk_tokens < 1, a bad packed_weights
            or prefix_cache_tokens, kv_budget_bytes not None or an int >= 1 (each naming the argument).
    """

    def __init__(
        self,
        model,
        tokenizer,
        kv_budget_bytes: int | None = None,
        dtype="model",
        attention: str = "auto",
        prefill_chunk_tokens: int = 2048,
        compile_decode: bool = False,
        packed_weights="auto",
        prefix_cache_tokens="auto",
        kv_dtype="model",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.kv_budget_bytes = check_budget_bytes(kv_budget_bytes)
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        model_dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        self.dtype = resolve_dtype(dtype, self.device, model_dtype)
        if self.dtype != model_dtype:
            model.to(self.dtype)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.device, self.dtype)
        self.attention = resolve_backend(attention, self.device)
        if not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be an int >= 1, got {prefill_chunk_tokens!r}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.compile_decode = bool(compile_decode)
        if packed_weights not in ("auto", True, False):
            raise ValueError(f"packed_weights must be 'auto', True or False, got {packed_weights!r}")
        use_packed = packed_available(self.device, self.dtype) and packed_supports(model)
        if packed_weights is True and not use_packed:
            raise ValueError(
                "packed_weights=True needs a raychat GPT of its own module types (packed_weights.supports), "
                "a CPU device, float32 weights and torch with oneDNN; got "
                f"{type(model).__name__}, {self.device.type}, {self.dtype}, "
                f"oneDNN {torch.backends.mkldnn.is_available()}"
            )
        # the engine's forward (prefill, decode, scoring): the packed one, or the model itself
        self._forward = PackedGPT(model) if use_packed and packed_weights is not False else model
        self._compiled = None
        self._weights_epoch = 0  # bumped by refresh_weights: part of weight_version()
        if prefix_cache_tokens == "auto":
            prefix_cache_tokens = PREFIX_CACHE_ROWS * self.config.max_seq_len
        self.prefix_cache = None
        if prefix_cache_tokens != 0:
            cfg = self.config
            self.prefix_cache = PrefixCache(
                cfg.n_layer, cfg.n_kv_head, cfg.head_dim, prefix_cache_tokens, self.kv_dtype, self.device
            )
        if self.compile_decode:  # one graph per (row bucket, cache length), for every runner in the process
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def refresh_weights(self) -> None:
        """Call after writing the model's weights in a way torch's version counter does not record
        (`param.data[...] = ...`, a collective writing raw memory): packed copies are rebuilt (packed_weights.py).
        In-place torch ops (load_state_dict, copy_, optimizer steps) need no call. Also ends the reuse of
        every prefix-cache entry (weight_version changes)."""
        self._weights_epoch += 1
        if isinstance(self._forward, PackedGPT):
            self._forward.refresh()

    def weight_version(self) -> int:
        """An int that changes whenever the weights may have: refresh_weights(), or any parameter's version
        counter (every in-place update: load_state_dict, copy_, optimizer steps) or storage. The prefix
        cache's entries carry it (never reused across versions)."""
        params = tuple((p._version, p.data_ptr()) for p in self.model.parameters())
        return hash((self._weights_epoch, params))

    def prompt_logprobs(self, ids: list[int], top_logprobs: int = 0) -> list[TokenLogprob | None]:
        """Each token's logprob given the ones before it (engine/scoring.py: one forward, no KV cache, the
        model's raw distribution); None for the first. Raises ValueError / RuntimeError as prompt_logprobs."""
        return prompt_logprobs(self._forward, ids, top_logprobs)

    # ---- validation ------------------------------------------------------------------------------
    def check_prompt(self, prompt, name: str = "prompt") -> list[int]:
        """Return the prompt as a list of ints; ValueError if empty, out of vocab, or too long."""
        return check_prompt(prompt, self.config.vocab_size, self.config.max_seq_len, name)

    def new_cache(self, batch_size: int, max_len: int, budget_bytes: int | None = None) -> KVCache:
        cache = KVCache.for_model(self.config, batch_size, max_len, self.kv_dtype, self.device, budget_bytes)
        if self.compile_decode:  # CUDA graphs write into the cache in place: its address must not change
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
        return cache

    # ---- forward primitive (used by the Scheduler) ---------------------------------------------------
    @torch.inference_mode()
    def forward_rows(self, cache: KVCache, start: int, pieces: list[list[int]]) -> torch.Tensor:
        """Append pieces[i] to cache row start+i (consecutive rows) in one forward.

        A piece may be empty: that row takes part as a placeholder (one dummy token written at its next
        slot, not counted, overwritten by its next real token; its logits are meaningless).
        Returns:
            (len(pieces), V) fp32 logits at each row's last new token, on the model's device.
        Raises:
            ValueError: a row would exceed the cache's max_len.
        """
        B = len(pieces)
        lens = [len(p) for p in pieces]
        T = max(1, *lens)
        if T == 1:  # decode: one tensor from one list, no per-row copies
            ids = torch.tensor([[p[0] if p else 0] for p in pieces], dtype=torch.long)
        else:
            ids = torch.zeros(B, T, dtype=torch.long)
            for i, p in enumerate(pieces):
                if p:
                    ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        if self.compile_decode and T == 1:
            logits = self._static_decode(cache, start, ids)
        else:
            batch = cache.batch(start, B, T, self.attention)
            ids = to_device(ids, self.device)
            if T == 1:  # a decode step: each row's only position
                logits = self._forward(ids, position_ids=batch.position_ids, kv_cache=batch)[:, 0]
            else:
                at = to_device(torch.tensor([max(n - 1, 0) for n in lens]), self.device)
                logits = self._forward(ids, position_ids=batch.position_ids, kv_cache=batch, logits_at=at)
        if min(lens) == 1 and T == 1:
            cache.lengths[start : start + B] += 1
        else:
            cache.lengths[start : start + B] += torch.tensor(lens, dtype=torch.long)
        return logits if logits.dtype == torch.float32 else logits.float()

    def _static_decode(self, cache: KVCache, start: int, ids: torch.Tensor) -> torch.Tensor:
        """Decode through the compiled step: rows padded up to a bucket with the free rows after them."""
        B = ids.shape[0]
        Bp = next(
            (b for b in decode_buckets(cache.batch_size) if b >= B and start + b <= cache.batch_size), B
        )
        padded = torch.zeros(Bp, 1, dtype=torch.long)
        padded[:B] = ids
        batch = cache.batch(start, Bp, 1, static=True)
        if self._compiled is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self._compiled = torch.compile(self._decode_step, mode=mode, dynamic=False)
        return self._compiled(to_device(padded, self.device), batch)[:B].clone()

    def _decode_step(self, ids: torch.Tensor, batch) -> torch.Tensor:
        return self.model(ids, position_ids=batch.position_ids, kv_cache=batch)[:, -1]

    def _prefill_rows(self, cache: KVCache, start: int, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` into empty consecutive rows start..; (len(prompts), V) logits at last tokens."""
        budget, out, i = self.prefill_chunk_tokens, [], 0
        while i < len(prompts):
            j, longest = i + 1, len(prompts[i])
            while j < len(prompts) and (j - i + 1) * max(longest, len(prompts[j])) <= budget:
                longest = max(longest, len(prompts[j]))
                j += 1
            if j - i > 1 or longest <= budget:
                out.append(self.forward_rows(cache, start + i, prompts[i:j]))
            else:  # one prompt longer than the budget: chunks of `budget` tokens
                for c in range(0, longest, budget):
                    logits = self.forward_rows(cache, start + i, [prompts[i][c : c + budget]])
                out.append(logits)
            i = j
        return torch.cat(out)

    def _prefill_cached(self, cache: KVCache, prompts: list[list[int]]) -> torch.Tensor:
        """_prefill_rows(cache, 0, prompts) with the prefix cache: each prompt's cached blocks are copied
        into its row first and only the rest is computed; the prompts' full blocks are cached after. A copy
        that raises (e.g. torch.OutOfMemoryError) is logged and costs that prompt the cache, never the call."""
        pc = self.prefix_cache
        if pc is None:
            return self._prefill_rows(cache, 0, prompts)
        pc.sync(self.weight_version())
        digests = [pc.digests(p) for p in prompts]
        done = []
        for i, (p, d) in enumerate(zip(prompts, digests)):
            pc.queries += len(p)
            try:
                done.append(pc.load(cache, i, pc.match(p, d), 0))
            except Exception:  # the row's length is unchanged: the whole prompt is computed
                log.warning(
                    "prefix cache: loading prompt %d's blocks failed; computing them", i, exc_info=True
                )
                done.append(0)
            pc.hits += done[-1]
        logits, i = [], 0
        while i < len(prompts):  # rows with a hit alone (padding to a longer piece could overflow them)
            j = i + 1
            while not done[i] and j < len(prompts) and not done[j]:
                j += 1
            logits.append(self._prefill_rows(cache, i, [p[k:] for p, k in zip(prompts[i:j], done[i:j])]))
            i = j
        logits = torch.cat(logits)
        for i, (p, d) in enumerate(zip(prompts, digests)):
            try:
                pc.release(pc.insert(cache, i, p, d, 0), pc.epoch)
            except Exception:  # insert caches and holds nothing when its copy raises
                log.warning("prefix cache: caching prompt %d's blocks failed", i, exc_info=True)
        return logits

    # ---- row-list helpers (any rows; one forward per run of consecutive rows) ----------------------------
    @torch.inference_mode()
    def prefill(self, cache: KVCache, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Write `prompts` into cache `rows` (emptied first); return (len(rows), V) fp32 logits at each
        prompt's last token. Consecutive rows share forwards."""
        cache.reset_rows(rows)
        out = [None] * len(rows)
        for idx in _runs(rows):
            logits = self._prefill_rows(cache, rows[idx[0]], [prompts[k] for k in idx])
            for k, lg in zip(idx, logits):
                out[k] = lg
        return torch.stack(out)

    @torch.inference_mode()
    def decode(self, cache: KVCache, rows: list[int], token_ids: list[int]) -> torch.Tensor:
        """Append one token per row to the cache; return (len(rows), V) fp32 next-token logits."""
        out = [None] * len(rows)
        for idx in _runs(rows):
            logits = self.forward_rows(cache, rows[idx[0]], [[token_ids[k]] for k in idx])
            for k, lg in zip(idx, logits):
                out[k] = lg
        return torch.stack(out)

    # ---- batched generation ----------------------------------------------------------------------
    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: list[list[int]],
        num_samples: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | tuple[str, ...] | list[str] = (),
        max_rows: int | None = None,
        seed_offset: int = 0,
    ) -> list[GenerationResult]:
        """Generate `num_samples` completions of every prompt; the contract: docs/engine.md. The sampling
        arguments are SamplingParams' fields, checked as it checks them (`stop`: a str is one stop string).
        max_rows: None (one batch of len(prompts) * num_samples rows) or an int >= num_samples: KV-cache rows
        decoded at once; the prompts are generated in batches of max_rows // num_samples whole prompts, each
        prompt seeded from (seed, seed_offset + its index in `prompts`) as in one batch.
        seed_offset: an int >= 0; a call of prompts[k:] of a list with seed_offset k samples what a call of the
        whole list samples for them (RL's evaluation, issued in chunks: raychat.rl.dispatcher).

        Returns:
            list of len(prompts) * num_samples GenerationResult, results[i * num_samples + j].
        Raises:
            ValueError: prompts not a non-empty list of token-id sequences (text must be encoded first;
                check_prompt), num_samples < 1, max_rows not None or an int >= num_samples, seed_offset not an
                int >= 0, bad sampling parameters (naming the argument).
            KVBudgetError: a batch's cache exceeds kv_budget_bytes.
        """
        params = SamplingParams(max_tokens, temperature, top_k, top_p, seed, stop)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        if max_rows is not None and (type(max_rows) is not int or max_rows < num_samples):
            raise ValueError(
                f"max_rows must be None or an int >= num_samples {num_samples} (a prompt's samples are decoded "
                f"together), got {max_rows!r}"
            )
        if type(seed_offset) is not int or seed_offset < 0:
            raise ValueError(f"seed_offset must be an int >= 0, got {seed_offset!r}")
        if isinstance(prompts, (str, bytes)):
            raise ValueError(f"prompts is a {type(prompts).__name__}, not lists of token ids; {ENCODE_FIRST}")
        if not prompts:
            raise ValueError("prompts is empty; pass at least one list of token ids")
        prompts = [self.check_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        per = len(prompts) if max_rows is None else max_rows // num_samples
        results = []
        for first in range(0, len(prompts), per):
            results += self._generate(prompts[first : first + per], num_samples, params, first, seed_offset)
        return results

    def _generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, first: int, seed_offset: int = 0
    ) -> list[GenerationResult]:
        """generate_batch of checked `prompts` in one batch of len(prompts) * n rows; prompt i is prompt
        first + i of the call (its results' prompt_index), seeded from (seed, seed_offset + first + i)."""
        P = len(prompts)
        max_len = max(len(p) for p in prompts) + params.max_tokens
        if self.compile_decode:  # compiled graphs are specialized on the cache length: reuse a few
            max_len = -(-max_len // COMPILED_LEN_MULTIPLE) * COMPILED_LEN_MULTIPLE
        max_len = min(max_len, self.config.max_seq_len)
        cache = self.new_cache(P * n, max_len, self.kv_budget_bytes)

        logits = self._prefill_cached(cache, prompts)  # prompt i in row i
        for i in reversed(range(P)):  # row i -> rows i*n .. i*n+n-1 (never over a row still to copy)
            cache.replicate(i, list(range(i * n, (i + 1) * n)))
        logits = logits.repeat_interleave(n, dim=0)
        gens = [
            make_generator(derive_seed(params.seed, seed_offset + first + i), self.device) for i in range(P)
        ]
        states = [RowState(self.tokenizer, prompts[r // n], params, max_len) for r in range(P * n)]

        slot = list(range(P * n))  # logical row r (= i * n + j) lives in cache row slot[r]
        active = list(range(P * n))  # rows that still generate, in logical order; logits[k] is active[k]'s
        while active:
            batch = SamplingBatch()
            for r in active:
                batch.add(
                    params.temperature, params.top_k, params.top_p, gens[r // n], states[r].forced_token
                )
            for r, s in zip(active, batch.sample(logits)):
                if s.error:
                    raise RuntimeError(f"prompt {first + r // n} sample {r % n}: {s.error}")
                states[r].step(s.token)
            done = [slot[r] for r in active if states[r].finished]
            active = [r for r in active if not states[r].finished]
            if not active:
                break
            cache.reset_rows(done)
            moves = cache.compact([slot[r] for r in active])
            slot = [moves.get(row, row) for row in slot]
            by_row = sorted(active, key=lambda r: slot[r])  # cache rows 0..len(active)-1
            out = self.forward_rows(cache, 0, [[states[r].tokens[-1]] for r in by_row])
            logits = out[to_device(torch.tensor([slot[r] for r in active]), out.device)]

        return [
            GenerationResult(
                prompt_index=first + r // n,
                sample_index=r % n,
                tokens=s.tokens,
                mask=s.mask,
                num_prompt_tokens=s.num_prompt_tokens,
                text=s.decoder.text,
                finish_reason=s.finish_reason,
            )
            for r, s in enumerate(states)
        ]


def _runs(rows: list[int]) -> list[list[int]]:
    """Indices into `rows` grouped into runs of consecutive row numbers (rows[k+1] == rows[k] + 1)."""
    runs: list[list[int]] = []
    for k, r in enumerate(rows):
        if runs and rows[runs[-1][-1]] + 1 == r:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs

"""Batched generation with a KV cache over the raychat GPT (RL rollouts, evaluation, the chat CLI).

Flow of `ModelRunner.generate_batch`: every prompt is prefilled once (prompts right-padded into one forward,
positions 0..len-1, causal mask; padding is written to the cache but not counted), its cache row is copied
to `num_samples` rows, and then each step samples one token per unfinished row and runs one decode forward
over the unfinished rows only (finished rows cost no compute). Rows keep their own lengths, so the RoPE
position of a row's next token is its own length and its attention mask covers exactly its own tokens.

Sampling is independent per row from the first token on: the first token of each of the num_samples rows
is drawn from the (replicated) last-prompt-position logits with one multinomial call over all rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from raychat.engine.kv_cache import KVCache
from raychat.engine.sampling import SamplingParams, make_generator, sample_next
from raychat.engine.sequence import RowState

# Upper bound on the logits a batched prefill may materialize at once (the model returns logits for every
# position; see the lead-facing note in the engine report about a last-position-only option).
PREFILL_LOGITS_BYTES = 256 * 2**20


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of request `index` within a call seeded `seed`: first 8 bytes of sha256("seed:index")."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{index}".encode()).digest()[:8], "little") >> 1


def check_prompt(prompt, vocab_size: int, max_seq_len: int, name: str = "prompt") -> list[int]:
    """`prompt` as a list of ints. Raises ValueError (naming `name`) if it is empty, has ids outside
    0..vocab_size-1, or has max_seq_len tokens or more (no room to generate)."""
    ids = [int(t) for t in prompt]
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
        model: module with forward(input_ids, position_ids=, attn_mask=, kv_cache=) -> (B, T, V) logits and
            `config` (n_layer, n_kv_head, head_dim, max_seq_len, vocab_size). Put it in eval mode yourself.
        tokenizer: raychat Tokenizer.
        kv_budget_bytes: optional cap on the KV cache of one generate_batch call (KVBudgetError beyond).
    """

    def __init__(self, model, tokenizer, kv_budget_bytes: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.kv_budget_bytes = kv_budget_bytes
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32

    # ---- validation ------------------------------------------------------------------------------
    def check_prompt(self, prompt, name: str = "prompt") -> list[int]:
        """Return the prompt as a list of ints; ValueError if empty, out of vocab, or too long."""
        return check_prompt(prompt, self.config.vocab_size, self.config.max_seq_len, name)

    def new_cache(self, batch_size: int, max_len: int, budget_bytes: int | None = None) -> KVCache:
        return KVCache.for_model(self.config, batch_size, max_len, self.dtype, self.device, budget_bytes)

    # ---- forward helpers (also used by the Scheduler) --------------------------------------------
    @torch.inference_mode()
    def prefill(self, cache: KVCache, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Write `prompts` into empty cache `rows`; return (len(rows), V) fp32 logits at each last token.

        Prompts are right-padded into chunks whose logits stay under PREFILL_LOGITS_BYTES.
        """
        cache.reset_rows(rows)
        out = []
        V = self.config.vocab_size
        T = max(len(p) for p in prompts)
        chunk = max(1, PREFILL_LOGITS_BYTES // (T * V * 4))
        for c in range(0, len(rows), chunk):
            r, ps = rows[c : c + chunk], prompts[c : c + chunk]
            T = max(len(p) for p in ps)
            ids = torch.zeros(len(ps), T, dtype=torch.long)
            for i, p in enumerate(ps):
                ids[i, : len(p)] = torch.tensor(p)
            lens = torch.tensor([len(p) for p in ps])
            logits = self.model(
                ids.to(self.device),
                position_ids=cache.position_ids(r, T),
                attn_mask=cache.attention_mask(r, T),
                kv_cache=cache.view(r, T),
            )
            cache.advance(r, lens)
            out.append(logits[torch.arange(len(ps), device=logits.device), (lens - 1).to(logits.device)])
        return torch.cat(out).float()

    @torch.inference_mode()
    def decode(self, cache: KVCache, rows: list[int], token_ids: list[int]) -> torch.Tensor:
        """Append one token per row to the cache; return (len(rows), V) fp32 next-token logits."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]
        logits = self.model(
            ids,
            position_ids=cache.position_ids(rows, 1),
            attn_mask=cache.attention_mask(rows, 1),
            kv_cache=cache.view(rows, 1),
        )
        cache.advance(rows, 1)
        return logits[:, -1].float()

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
        stop: tuple[str, ...] | list[str] = (),
    ) -> list[GenerationResult]:
        """Generate `num_samples` completions of every prompt; see the package docstring for the contract.

        Returns:
            list of len(prompts) * num_samples GenerationResult, results[i * num_samples + j].
        Raises:
            ValueError: empty/invalid prompts, num_samples < 1, bad sampling parameters.
            KVBudgetError: the batch's cache exceeds kv_budget_bytes.
        """
        params = SamplingParams(max_tokens, temperature, top_k, top_p, seed, tuple(stop))
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        if not prompts:
            raise ValueError("prompts is empty; pass at least one list of token ids")
        prompts = [self.check_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        n, P = num_samples, len(prompts)
        max_len = min(max(len(p) for p in prompts) + max_tokens, self.config.max_seq_len)
        cache = self.new_cache(P * n, max_len, self.kv_budget_bytes)

        sources = [i * n for i in range(P)]
        logits = self.prefill(cache, sources, prompts)
        for i in range(P):
            cache.replicate(i * n, list(range(i * n + 1, (i + 1) * n)))
        logits = logits.repeat_interleave(n, dim=0)
        gens = [make_generator(derive_seed(seed, i), self.device) for i in range(P)]
        states = [RowState(self.tokenizer, prompts[r // n], params, max_len) for r in range(P * n)]

        active = list(range(P * n))  # rows that still generate; logits[k] belongs to active[k]
        while active:
            sampled: dict[int, int] = {}
            for i in range(P) if temperature > 0 else ():
                ks = [k for k, r in enumerate(active) if r // n == i and states[r].needs_sample]
                if ks:
                    draw = sample_next(logits[ks], temperature, top_k, top_p, gens[i]).tolist()
                    sampled.update({active[k]: t for k, t in zip(ks, draw)})
            if temperature == 0:  # greedy needs no generator: one argmax over every row
                sampled = dict(zip(active, torch.argmax(logits, dim=-1).tolist()))
            for r in active:
                states[r].step(sampled.get(r))
            active = [r for r in active if not states[r].finished]
            if active:
                logits = self.decode(cache, active, [states[r].tokens[-1] for r in active])

        return [
            GenerationResult(
                prompt_index=r // n,
                sample_index=r % n,
                tokens=s.tokens,
                mask=s.mask,
                num_prompt_tokens=s.num_prompt_tokens,
                text=s.decoder.text,
                finish_reason=s.finish_reason,
            )
            for r, s in enumerate(states)
        ]

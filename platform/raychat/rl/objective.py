"""Policy-gradient objective: group advantages, per-token surrogate loss, and the loss normalization choice.

Sequences are stored as the engine returns them (`tokens`, `mask`; mask 1 = sampled by the policy, 0 = prompt
or a forced tool output). The label shift happens once, here: inputs = tokens[:-1], labels = tokens[1:],
loss_mask = mask[1:] (eligibility follows the PREDICTED token), so only sampled tokens carry loss.

Per-token surrogate (PPO clip, Schulman et al. 2017, eq. 7), with ratio r_t = pi(y_t) / pi_behavior(y_t):
    loss_t = -min(r_t * A, clip(r_t, 1 - eps, 1 + eps) * A)
On-policy (behavior log-probs None) r_t = exp(logp_t - stopgrad(logp_t)) = 1, so loss_t = -A and its
gradient is -A * d logp_t (REINFORCE). Asynchronous rollouts pass the behavior policy's log-probs; the clip
bounds the importance ratio of stale samples.

Normalization of the step loss (an explicit choice, logged with every step):
    "token"     sum_t loss_t / N,   N = sampled tokens in the whole step (all micro-batches, all ranks)
    "sequence"  (1 / S) * sum_i (sum_{t in i} loss_t / n_i),   S = sequences in the step (all ranks)
    "constant"  sum_t loss_t / (S * L),   L = a fixed length (the generation budget; Dr. GRPO, Liu et al. 2025)
Advantages (GRPO, Shao et al. 2024): A_i = r_i - mean(group); with scale_by_std, divided by (std(group) + eps)
(population std); Dr. GRPO drops the std division (the default here).
PolicyGradientLoss is this loss as the training step runs it (raychat.train.step.forward_backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NORMALIZATIONS = ("token", "sequence", "constant")  # --normalization: normalized_loss
# per_token_loss clamps log(r_t) here: a sampled token's learner and behavior log-probs may be ~100 nats apart
# at a low asynchronous --temperature, whose exp is inf in fp32; A > 0 then picks the clipped branch (value
# 1 + eps, right) but exp's backward multiplied its 0 by inf: NaN. exp(20) ~ 4.9e8 is far beyond any clip
# range: with A > 0 the value is unchanged; beyond the clamp the ratio is capped and the token adds no
# gradient, whatever the sign of A (with A < 0 its loss is -A * exp(20), finite, where it was up to inf).
MAX_LOG_RATIO = 20.0


def group_advantages(
    rewards: Sequence[float], group_size: int, scale_by_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """Advantages of prompt-major rewards (rewards[i * group_size + j] = sample j of prompt i).

    Returns a list of len(rewards) floats: r - group mean, divided by (population std + eps) if scale_by_std.
    Raises ValueError when group_size < 1 or len(rewards) is not a multiple of group_size.
    """
    r = _groups(rewards, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.flatten().tolist()


def zero_advantage_frac(rewards: Sequence[float], group_size: int) -> float:
    """Fraction (0..1) of the prompt-major reward groups (as group_advantages) whose rewards are all equal:
    every advantage of such a group is 0, scaled or not, so it adds nothing to the policy gradient.
    Raises ValueError as group_advantages."""
    r = _groups(rewards, group_size)
    return float((r.amax(dim=1) == r.amin(dim=1)).double().mean())


def _groups(rewards: Sequence[float], group_size: int) -> torch.Tensor:
    """Prompt-major rewards as a (prompts, group_size) float64 tensor; ValueError when group_size < 1 or
    len(rewards) is not a multiple of it."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(
            f"len(rewards)={len(rewards)} must be a positive multiple of group_size={group_size}"
        )
    return torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)


def collate(samples: Sequence[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples into tensors with the label shift applied.

    Args:
        samples: dicts with "tokens" (list[int], length >= 2), "mask" (same length, 0/1), "advantage" (float),
            optionally "behavior_logprobs" (list[float], one per token of tokens[1:], i.e. per label).
    Returns:
        input_ids (B, T) int64, labels (B, T) int64, loss_mask (B, T) bool, advantages (B,) float32,
        behavior_logprobs (B, T) float32 or absent; T = longest len(tokens) - 1. Padding has loss_mask False.
    Raises:
        ValueError: empty batch, a sequence shorter than 2 tokens, or mask/tokens/logprob lengths that differ.
    """
    if not samples:
        raise ValueError("samples is empty")
    T = max(len(s["tokens"]) for s in samples) - 1
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    has_behavior = all(s.get("behavior_logprobs") is not None for s in samples)
    behavior = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        tok, mask = s["tokens"], s["mask"]
        if len(tok) < 2 or len(mask) != len(tok):
            raise ValueError(
                f"sample {i}: tokens ({len(tok)}) must have >= 2 ids and equal mask ({len(mask)})"
            )
        n = len(tok) - 1
        input_ids[i, :n] = torch.tensor(tok[:-1])
        labels[i, :n] = torch.tensor(tok[1:])
        loss_mask[i, :n] = torch.tensor(mask[1:], dtype=torch.bool)
        if has_behavior:
            lp = s["behavior_logprobs"]
            if len(lp) != n:
                raise ValueError(f"sample {i}: behavior_logprobs has {len(lp)} values, expected {n}")
            behavior[i, :n] = torch.tensor(lp, dtype=torch.float32)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "advantages": torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float32),
    }
    if has_behavior:
        out["behavior_logprobs"] = behavior
    return out


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[labels]: (B, T, V) float, (B, T) int64 -> (B, T) float32.

    The rollout samples from softmax(logits / temperature), so the policy's log-prob uses the same scale.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_sum(logits: torch.Tensor, loss_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Sum over the mask-True tokens of the policy's entropy -sum_v p_v log p_v, p = softmax(logits /
    temperature) (the distribution the rollout sampled from), in nats: (B, T, V) float, (B, T) bool -> float64
    scalar, no grad. From the logits the loss already has (no extra forward pass), a row at a time, so it holds
    at most T x V floats more."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    with torch.no_grad():
        for row, mask in zip(logits, loss_mask.bool()):
            p = F.softmax(row[mask].float() / temperature, dim=-1)
            total += torch.special.entr(p).sum().double()  # -p log p, 0 where p is 0 (a -inf logit)
    return total


def per_token_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    behavior_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip surrogate per token (module docstring). Returns (loss (B, T), ratio (B, T) detached).

    logprobs (B, T) with grad; advantages (B,); behavior_logprobs (B, T) or None (on-policy, ratio 1);
    loss_mask (B, T) bool or None: where False the ratio is 1 (the behavior log-prob is not used). A prompt or
    tool-output token's behavior log-prob may be ~100 nats from the learner's at a low temperature: its
    exp overflowed to inf, and though masked_sums zeroes that position's loss, the backward pass multiplied
    0 by inf there and every gradient became NaN. A sampled token's log-ratio is clamped at MAX_LOG_RATIO
    before exp, so a policy that moved that far gives a capped ratio and no gradient through it, whatever
    the sign of its advantage.
    """
    old = logprobs.detach()
    if behavior_logprobs is not None:
        old = (
            behavior_logprobs if loss_mask is None else torch.where(loss_mask.bool(), behavior_logprobs, old)
        )
    ratio = torch.exp((logprobs - old).clamp(max=MAX_LOG_RATIO))
    adv = advantages[:, None].to(logprobs.dtype)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    return loss, ratio.detach()


def masked_sums(loss: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of loss over mask-True tokens per row (B,), tokens per row (B,) float). Masked positions add
    exactly 0 (torch.where, so NaN/inf there cannot leak)."""
    mask = loss_mask.bool()
    per_row = torch.where(mask, loss, torch.zeros_like(loss)).sum(dim=1)
    return per_row, mask.sum(dim=1).to(loss.dtype)


def normalized_loss(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    normalization: str,
    num_tokens: int,
    num_sequences: int,
    constant_length: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss; summed over micro-batches and ranks it is the step loss.

    Args:
        loss: (B, T) per-token loss; loss_mask: (B, T) bool.
        normalization: one of NORMALIZATIONS (module docstring).
        num_tokens: N, sampled tokens in the whole step (all micro-batches, all ranks) -- "token".
        num_sequences: S, sequences in the whole step (all ranks) -- "sequence" and "constant".
        constant_length: L for "constant" (e.g. the generation budget max_tokens).
    Returns:
        scalar tensor with grad. Zero tokens or sequences give 0, never NaN.
    Raises:
        ValueError: unknown normalization, or "constant" without constant_length >= 1.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {list(NORMALIZATIONS)}, got {normalization!r}")
    per_row, n_row = masked_sums(loss, loss_mask)
    if normalization == "token":
        return per_row.sum() / max(num_tokens, 1)
    if normalization == "sequence":
        return (per_row / n_row.clamp(min=1)).sum() / max(num_sequences, 1)
    if constant_length is None or constant_length < 1:
        raise ValueError(f"normalization 'constant' needs constant_length >= 1, got {constant_length}")
    return per_row.sum() / (max(num_sequences, 1) * constant_length)


@dataclass(frozen=True)
class PolicyGradientLoss:
    """The RL loss component of raychat.train.step.forward_backward (its StepLoss): the masked surrogate of
    per_token_loss, normalized over the step by normalized_loss.

    counts(batch) -> int64 (2,): [sampled tokens (loss_mask True), sequences] of the micro-batch.
    __call__(logits, batch, totals) -> (share, stats): share = normalized_loss of the micro-batch with
    N, S = totals (all micro-batches and ranks), a float32 scalar with grad; stats = float64 (5,) [share,
    sum of the importance ratios over sampled tokens, sampled tokens whose ratio is clipped, sampled tokens,
    sum of the policy's entropy over sampled tokens (entropy_sum)].
    batch: collate's tensors; logits (B, T, V).

    Fields: normalization (NORMALIZATIONS), temperature (the rollout's, > 0), clip_eps (PPO clip),
    constant_length (L of "constant").
    """

    normalization: str
    temperature: float
    clip_eps: float
    constant_length: int | None = None

    def counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["loss_mask"].bool()
        return torch.stack([mask.sum(), torch.tensor(mask.shape[0], device=mask.device)])

    def __call__(
        self, logits: torch.Tensor, batch: dict[str, torch.Tensor], totals: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_sequences = totals
        logp = token_logprobs(logits, batch["labels"], self.temperature)
        mask = batch["loss_mask"].bool()
        loss, ratio = per_token_loss(
            logp, batch["advantages"], batch.get("behavior_logprobs"), self.clip_eps, loss_mask=mask
        )
        share = normalized_loss(
            loss, mask, self.normalization, num_tokens, num_sequences, self.constant_length
        )
        clipped = ((ratio - 1).abs() > self.clip_eps) & mask
        entropy = entropy_sum(logits, mask, self.temperature)
        stats = (share.detach(), ratio[mask].sum(), clipped.sum(), mask.sum(), entropy)
        return share, torch.stack([x.double() for x in stats])

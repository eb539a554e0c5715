"""Decoder-only transformer with the Qwen3 parameter layout (exports to Hugging Face without renaming).

Per layer: x += o_proj(attn(q_norm(q_proj(rms(x))), k_norm(k_proj(...)), v_proj(...)))  with RoPE on q, k
           x += down_proj(silu(gate_proj(rms(x))) * up_proj(rms(x)))                    (SwiGLU)
RMSNorm has weights, there are no biases, embeddings and LM head are untied, GQA is optional.
References: Qwen3 (transformers `Qwen3ForCausalLM`), RoPE (Su et al. 2021, rotate-half form),
SwiGLU (Shazeer 2020), QK-norm (Dehghani et al. 2023).

Initialization (documented because it matters for Muon): embeddings N(0, 1); q/k/v/gate/up weights
U(-a, a) with a = sqrt(3 / fan_in) (unit-variance outputs); o_proj and down_proj zero, so every block
starts as the identity; lm_head N(0, 0.001); norm weights 1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raychat.masks import document_causal_mask


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in (
            "vocab_size",
            "n_layer",
            "n_embd",
            "n_head",
            "n_kv_head",
            "head_dim",
            "intermediate_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")

    @classmethod
    def from_depth(
        cls,
        depth: int,
        vocab_size: int,
        max_seq_len: int,
        aspect_ratio: int = 64,
        head_dim: int = 64,
        kv_group: int = 1,
    ) -> ModelConfig:
        """Derive every size from `depth` (the one knob).

        width = depth * aspect_ratio rounded up to a multiple of head_dim; n_head = width / head_dim;
        n_kv_head = n_head / kv_group (GQA when kv_group > 1); SwiGLU hidden = 8/3 width rounded up to 64.

        Raises:
            ValueError: depth <= 0, or kv_group does not divide n_head.
        """
        if depth <= 0:
            raise ValueError(f"depth must be a positive integer, got {depth}")
        width = math.ceil(depth * aspect_ratio / head_dim) * head_dim
        n_head = width // head_dim
        if n_head % kv_group:
            raise ValueError(f"kv_group={kv_group} must divide n_head={n_head}")
        return cls(
            vocab_size=vocab_size,
            n_layer=depth,
            n_embd=width,
            n_head=n_head,
            n_kv_head=n_head // kv_group,
            head_dim=head_dim,
            intermediate_size=math.ceil(8 * width / 3 / 64) * 64,
            max_seq_len=max_seq_len,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (as Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's rms_norm: the same ops in one call (bitwise equal)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fast_bf16(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether `device` has native bfloat16 matrix math, and why (a short phrase).

    CUDA: compute capability >= 8.0 (bf16 tensor cores: A100, H100, L4, ...). CPU: the AVX512-BF16
    instructions (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later; torch's cpuinfo check
    torch.cpu._is_avx512_bf16_supported), where oneDNN's bf16 kernels beat fp32; without them bf16 is
    emulated, far slower than fp32 (bench/results/muon_step.md). Any other device: False. One rule for every
    "auto" bf16 choice (Muon's Newton-Schulz dtype, the engine's KV-cache dtype), a capability check rather
    than a timing so every run on a machine chooses the same.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        fast = (major, minor) >= (8, 0)
        return fast, f"compute capability {major}.{minor} {'>=' if fast else '<'} 8.0"
    if dev.type == "cpu":
        if torch.cpu._is_avx512_bf16_supported():
            return True, "the CPU has AVX512-BF16"
        return False, "the CPU has no AVX512-BF16: bf16 matmul is emulated"
    return False, "no bf16 capability check for this device"


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each (B, 1, T, head_dim) in `dtype`, for integer position_ids (B, T), broadcast
    over the heads of (B, H, T, D). Rotate-half layout (Hugging Face Llama/Qwen): angle j of position p is
    p * theta^(-2j/D) for j < D/2, repeated for the second half. The signed sin has its first half negated
    (-sin, sin), so apply_rope needs no negation. Computed in fp32, rounded once per forward, not per layer."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.float()[:, None, :, None] * inv_freq  # (B, 1, T, D/2)
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos, signed_sin: (B, 1, T, D) from rope_cos_sin. Returns x * cos + rotate_half(x) *
    sin with rotate_half(x) = (-x2, x1), computed as x * cos + (x2, x1) * (-sin, sin) (bitwise the same:
    negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x, cos, signed_sin, attn_mask, kv_cache):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        # inference: the cache stores k, v and picks the kernel (raychat.engine.attention)
        if kv_cache is not None:
            y = kv_cache.attend(self.layer_idx, q, k, v)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        gqa = self.n_kv_head != self.n_head
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, signed_sin, attn_mask, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, attn_mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)


class GPT(nn.Module):
    """The raychat language model. Parameter names equal Qwen3ForCausalLM's (model.*, lm_head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> GPT:
        """Initialize as described in the module docstring; returns self."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.001)
            else:
                a = math.sqrt(3.0 / p.shape[1])
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * a - a)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache=None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position, or for one position per row (`logits_at`).

        Args:
            input_ids: (B, T) int64 token ids.
            position_ids: (B, T) int64 RoPE positions; default 0..T-1 per row.
            segment_ids: (B, T) int; when given (and attn_mask is not), attention is causal AND same-segment.
            attn_mask: (B or 1, 1, T, S) bool, True = may attend; overrides segment_ids. Ignored with kv_cache.
            kv_cache: incremental decoding: an object with `attend(layer_idx, q, k, v) -> y` that stores the
                new keys/values and attends over the cached ones (raychat.engine.attention.CacheBatch);
                q: (B, n_head, T, head_dim), k, v: (B, n_kv_head, T, head_dim) after RoPE, y like q.
            logits_at: (B,) int64 position of each row whose logits are wanted (the LM head then runs on
                B positions, not B * T).
        Returns:
            (B, T, vocab_size) float32 logits; (B, vocab_size) with logits_at.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if attn_mask is None and segment_ids is not None:
            attn_mask = document_causal_mask(segment_ids)
        x = self.model.embed_tokens(input_ids)
        cos, signed_sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for block in self.model.layers:
            x = block(x, cos, signed_sin, attn_mask, kv_cache)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at]
        return self.lm_head(self.model.norm(x)).float()

    # ---- accounting --------------------------------------------------------------------------------
    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.model.embed_tokens.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6 * (non-embedding params) + 12 * n_layer * n_head * head_dim * T.

        Source: Kaplan et al. 2020 (6N) plus the attention term of Chinchilla (Hoffmann et al. 2022, App. F).
        """
        c = self.config
        t = seq_len or c.max_seq_len
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * t


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode inside the block, back in the mode it was in (train or eval) after it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)

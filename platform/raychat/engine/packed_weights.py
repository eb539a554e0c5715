"""The engine's forward on CPU in fp32: GPT.forward's math over weights laid out once for the CPU's kernels
("packed"), in fewer, larger calls.

Why: a decode step of a small model is hundreds of small eager calls with a fixed cost of a few microseconds
each (nn.Module dispatch, Python, ATen), beside matmuls that read each weight once. `PackedGPT` computes what
GPT.forward computes (raychat/model.py) with:
  - q, k and v projected by one matmul over their weights stacked ((out_q + out_k + out_v, in)), and the
    MLP's gate and up projections by one;
  - the q and k RMSNorms in one call over the heads of both (each head then scaled by its own weight), and
    RoPE applied to q's and k's heads in one pass;
  - no nn.Module calls: the parameters are read once per weight change.
Each matmul picks its kernel by size (`small_matmul`): at most SMALL_MATMUL_MACS (2**22) multiply-adds
(rows * in * out) run MKL's sgemm on an (in, out) copy of the weight; larger ones oneDNN on the weight
reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the weight prepacking
torch.compile's CPU backend applies when it freezes a model). oneDNN's packed matmul is the fastest kernel
for large products (a prefill chunk, many rows on a wide model) but costs ~20-30 us a call, which dominates
small ones (a decode step of a few rows). Everything stays fp32: the result equals GPT.forward's up to
summation order (~1e-6 relative). Measured: bench/results/decode_overhead.md.

Memory: oneDNN keeps what it builds for each input shape it has met, ~0.5-0.7 MiB a shape whatever the
weight's size, up to ~1,024 shapes (bench/results/serve_hostile_soak.md), and an engine meets a new row count
at nearly every prefill (rows x tokens of its chunks) and decode step (busy rows). Called at each row count
as it came, a serving engine's memory grew by several hundred MiB, and past the cap the evicted and rebuilt
entries fragmented the heap further. So a oneDNN call runs at `onednn_rows(rows)` rows, the rows beyond
`rows` zero and their outputs dropped: at most 8 shapes per power of two per weight (rows 1..8,192: 88), for
< 12.5% more rows (0-16% more CPU time for a forward at a row count that pads).

The copies (twice the projection weights' memory again) are re-made whenever a weight changed: a
parameter's version counter (every in-place update: load_state_dict, optimizer steps, copy_) or storage (a
new tensor assigned) differs from when they were made; `refresh()` forces that after writes the counter does
not see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from raychat.model import GPT, MLP, Attention, Block, Decoder, RMSNorm, apply_rope, rope_cos_sin

SMALL_MATMUL_MACS = 2**22  # rows * in * out at or below which MKL on the (in, out) copy beats oneDNN
_GPT_MODULES = (GPT, Decoder, nn.ModuleList, Block, Attention, MLP, RMSNorm, nn.Embedding, nn.Linear)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing applies: a CPU device, fp32 weights, torch built with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def supports(model: nn.Module) -> bool:
    """True for a raychat GPT made of exactly its own module types (no subclass: torchao's Float8Linear is an
    nn.Linear subclass; no parametrization), its Linears without bias, and no forward hooks: PackedGPT reads
    the weights and never calls the modules, so anything else would be bypassed."""
    if type(model) is not GPT:
        return False
    modules = list(model.modules())
    return (
        all(type(m) in _GPT_MODULES and not parametrize.is_parametrized(m) for m in modules)
        and all(m.bias is None for m in modules if type(m) is nn.Linear)
        and not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
    )


def small_matmul(rows: int, in_features: int, out_features: int) -> bool:
    """True when a (out_features, in_features) weight on `rows` rows runs MKL on the (in, out) copy:
    rows * in_features * out_features <= SMALL_MATMUL_MACS; False: oneDNN on the packed weight."""
    return rows * in_features * out_features <= SMALL_MATMUL_MACS


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs at (the rows past `rows` are zeros): `rows` rounded up
    to the next of 8 evenly spaced sizes per power of two, 2**n + j * 2**(n - 3) (j = 0..7); exact below 16.
    So padding is < 12.5% of the rows, and rows 1..8192 take 88 distinct shapes (module docstring: Memory)."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedMatmul:
    """x (..., in) -> x @ weight.T (..., out) for an fp32 weight (out, in), by the kernel rule of
    small_matmul; holds the oneDNN-packed weight and the (in, out) copy."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.in_out = weight.t().contiguous()
        self.small_rows = SMALL_MATMUL_MACS // (weight.shape[0] * weight.shape[1])  # small_matmul for rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.small_rows:
            return torch.matmul(x, self.in_out)
        x2, padded = x.reshape(rows, -1), onednn_rows(rows)
        if padded > rows:  # zero rows up to the bucket's shape (module docstring: Memory)
            x2 = F.pad(x2, (0, 0, 0, padded - rows))
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")
        return y[:rows].view(*x.shape[:-1], -1)


@dataclass
class _PackedBlock:
    input_norm: torch.Tensor  # (n_embd,)
    qkv: PackedMatmul  # n_embd -> (n_head + 2 * n_kv_head) * head_dim: q, k, v
    qk_norm: torch.Tensor  # (n_head + n_kv_head, head_dim): q_norm's weight per q head, k_norm's per k head
    o: PackedMatmul
    post_norm: torch.Tensor  # (n_embd,)
    gate_up: PackedMatmul  # n_embd -> 2 * intermediate_size: gate, up
    down: PackedMatmul


class PackedGPT:
    """Called like the GPT it wraps (`packed(input_ids, position_ids, kv_cache, logits_at)`), with the same
    result up to summation order, through packed weight copies (module docstring).

    Args:
        model: a raychat GPT with fp32 weights on CPU (`supports(model)` and `available(...)`).
    Raises:
        ValueError: a model `supports` rejects.
    Every call notices a parameter updated in place or assigned, and a submodule replaced (re-packing; a
    replacement PackedGPT cannot compute sends the call to the model's own forward). A hook registered on an
    existing module after construction is not seen: build a new PackedGPT (a new ModelRunner) then.
    """

    def __init__(self, model: GPT):
        if not supports(model):
            raise ValueError(
                "PackedGPT needs a raychat GPT of its own module types (no subclass, parametrization, Linear "
                f"bias or forward hook), got {type(model).__name__}"
            )
        self.model = model
        self._scan()
        self._key: list | None = None
        self._blocks: list[_PackedBlock] = []
        self._lm_head: PackedMatmul | None = None

    def parameters(self):
        """The wrapped model's parameters (as nn.Module.parameters: callers read the device from them)."""
        return self.model.parameters()

    def refresh(self) -> None:
        """Re-make every copy at the next forward: for writes the version counter does not see (into
        `weight.data`, or raw memory from a communication library)."""
        self._key = None

    def _scan(self) -> None:
        """Read the module tree: the live dicts of submodules and parameters (a parameter assigned later is
        seen through them), and whether PackedGPT can compute this tree (`supports`)."""
        modules = list(self.model.modules())
        self._module_dicts = [m._modules for m in modules if m._modules]
        self._param_dicts = [m._parameters for m in modules if m._parameters]
        self._tree = [id(m) for d in self._module_dicts for m in d.values()]
        self._supported = supports(self.model)

    def _pack(self) -> bool:
        """Make the copies if a submodule was replaced or a parameter changed since they were made (one pass
        over the module ids and the parameters' versions). Returns False when the tree is no longer one
        PackedGPT computes (a module replaced by another type): the model's own forward runs instead."""
        if [id(m) for d in self._module_dicts for m in d.values()] != self._tree:
            self._scan()
            self._key = None
        if not self._supported:
            return False
        key = [(p._version, p.data_ptr()) for ps in self._param_dicts for p in ps.values() if p is not None]
        if key == self._key:
            return True
        self._blocks, self._lm_head = [], None  # the old copies go first: never two sets in memory
        with torch.no_grad():
            blocks = []
            for block in self.model.model.layers:
                att, mlp = block.self_attn, block.mlp
                qk_norm = [
                    att.q_norm.weight.expand(att.n_head, -1),
                    att.k_norm.weight.expand(att.n_kv_head, -1),
                ]
                blocks.append(
                    _PackedBlock(
                        input_norm=block.input_layernorm.weight.detach(),
                        qkv=PackedMatmul(
                            torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
                        ),
                        qk_norm=torch.cat(qk_norm).detach(),
                        o=PackedMatmul(att.o_proj.weight),
                        post_norm=block.post_attention_layernorm.weight.detach(),
                        gate_up=PackedMatmul(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                        down=PackedMatmul(mlp.down_proj.weight),
                    )
                )
            self._blocks, self._lm_head = blocks, PackedMatmul(self.model.lm_head.weight)
        self._key = key
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache=None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """GPT.forward's contract (raychat/model.py) without segment_ids / attn_mask: input_ids (B, T) int64,
        position_ids (B, T) int64 (default 0..T-1), kv_cache an engine/attention.CacheBatch (None: causal
        attention over the T tokens), logits_at (B,) int64. Returns (B, T, vocab_size) fp32 logits, or
        (B, vocab_size) with logits_at."""
        if not self._pack():
            return self.model(input_ids, position_ids=position_ids, kv_cache=kv_cache, logits_at=logits_at)
        cfg, embed = self.model.config, self.model.model.embed_tokens.weight
        B, T = input_ids.shape
        Hq, Hkv, D, C, inter = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd, cfg.intermediate_size
        eps = cfg.norm_eps
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = F.embedding(input_ids, embed)
        cos, signed_sin = rope_cos_sin(position_ids, D, cfg.rope_theta, x.dtype)
        for i, block in enumerate(self._blocks):
            qkv = block.qkv(F.rms_norm(x, (C,), block.input_norm, eps))
            qk = qkv[..., : (Hq + Hkv) * D].view(B, T, Hq + Hkv, D)
            qk = apply_rope(
                (F.rms_norm(qk, (D,), None, eps) * block.qk_norm).transpose(1, 2), cos, signed_sin
            )
            q, k = qk[:, :Hq], qk[:, Hq:]
            v = qkv[..., (Hq + Hkv) * D :].view(B, T, Hkv, D).transpose(1, 2)
            if kv_cache is not None:
                y = kv_cache.attend(i, q, k, v)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
            x = x + block.o(y.transpose(1, 2).reshape(B, T, Hq * D))
            gate_up = block.gate_up(F.rms_norm(x, (C,), block.post_norm, eps))
            x = x + block.down(F.silu(gate_up[..., :inter]) * gate_up[..., inter:])
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at]
        return self._lm_head(F.rms_norm(x, (C,), self.model.model.norm.weight, eps)).float()

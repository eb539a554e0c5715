"""CPU matmuls of the engine: oneDNN with weights reordered once ("packed") for large products, MKL on an
(in, out) copy of the weight for small ones; both instead of MKL on the plain (out, in) layout.

Why: on CPU a Linear in the engine runs at 1 to 64 rows (decode) or one prefill chunk. oneDNN's matmul with
the weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the weight
prepacking torch.compile's CPU backend applies when it freezes a model) is the fastest kernel for large
products (a prefill chunk, decode of many rows on a wide model), but each call has a fixed cost of ~20-30 us,
which dominates small products: a decode step of one row, or of a few rows on a narrow model. There MKL's
sgemm on the weight stored (in, out) (`x @ w_t`, contiguous rows of the output) is 1.2-2x faster per
Linear. The rule, per call: rows * in * out multiply-adds <= SMALL_MATMUL_MACS (2**22) -> MKL on the (in,
out) copy, else oneDNN packed. The crossover and the whole-step numbers (depth 4 / depth 8 models at 1, 8
and 32 rows) are in bench/results/decode_overhead.md. Either way the multiply stays in the weight's dtype
(fp32 stays fp32: the kernels differ only in summation order, about 1e-6 relative).

`PackedLinears(model)` holds both copies per nn.Linear weight (twice as much memory again as those weights)
and re-makes them whenever the weight changed: the parameter's version counter (every in-place update:
load_state_dict, optimizer steps, copy_) or its storage (a new tensor assigned) differs from when they were
made; `refresh()` forces that after writes that bypass the counter. `with packed:` routes those Linears'
forward through the copies for the duration of the block only (the engine's forwards); outside it the model
is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

SMALL_MATMUL_MACS = 2**22  # rows * in * out at or below which MKL on the (in, out) copy beats oneDNN


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing applies: a CPU device, fp32 weights, torch built with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinears:
    """A oneDNN-packed copy and an (in, out) copy of every nn.Linear weight of `model`, used inside
    `with self:` only (each call picks one by small_matmul).

    Args:
        model: any nn.Module; its nn.Linear submodules (weight (out, in), optional bias (out,)) are packed.
    Shapes: each packed Linear maps (..., in) -> (..., out) in the weight's dtype, as nn.Linear.
    """

    def __init__(self, model: nn.Module):
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]
        self._packed: dict[int, tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
        self._forwards: dict[int, tuple] = {}  # id(linear) -> (weights, bias, forward)
        self._params = [m._parameters for m in self.linears]  # read without nn.Module.__getattr__ (slow)
        self._key: list | None = None  # the weights' (version, storage, bias) when the forwards were made

    def _weight(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(oneDNN-packed weight, (in, out) contiguous copy) of `linear`, re-made when the weight changed."""
        w = linear.weight
        key = (w._version, w.data_ptr())
        hit = self._packed.get(id(linear))
        if hit is None or hit[0] != key:
            with torch.no_grad():
                w = w.detach()
                hit = (key, (torch.ops.mkldnn._reorder_linear_weight(w, None), w.t().contiguous()))
            self._packed[id(linear)] = hit
        return hit[1]

    def refresh(self) -> None:
        """Re-pack every weight at the next forward: for writes the version counter does not see (into
        `weight.data`, or raw memory from a communication library)."""
        self._packed.clear()

    def __enter__(self) -> PackedLinears:
        # one pass over the weights' version counters and storages decides whether anything changed (every
        # forward of the engine enters; a decode step is ~2 ms); only then are copies and closures remade.
        # The bound forwards are set in the instance __dict__ directly (nn.Module.__setattr__ is slow per call)
        key = [(w._version, w.data_ptr(), id(ps["bias"])) for ps in self._params for w in (ps["weight"],)]
        if key != self._key or len(self._packed) < len(self.linears):
            for linear in self.linears:
                weights, bias = self._weight(linear), linear.bias
                fn = self._forwards.get(id(linear))
                if fn is None or fn[0] is not weights or fn[1] is not bias:
                    small = SMALL_MATMUL_MACS // (linear.in_features * linear.out_features)
                    fn = (weights, bias, lambda x, w=weights, b=bias, s=small: _linear(x, w, b, s))
                    self._forwards[id(linear)] = fn
            self._key = key
            self._installed = [(linear.__dict__, self._forwards[id(linear)][2]) for linear in self.linears]
        for attrs, forward in self._installed:
            attrs["forward"] = forward
        return self

    def __exit__(self, *exc) -> None:
        for attrs, _ in self._installed:
            attrs.pop("forward", None)


def small_matmul(rows: int, in_features: int, out_features: int) -> bool:
    """True when a Linear of (out_features, in_features) on `rows` rows runs MKL on the (in, out) copy:
    rows * in_features * out_features <= SMALL_MATMUL_MACS; False: oneDNN on the packed weight."""
    return rows * in_features * out_features <= SMALL_MATMUL_MACS


def _linear(x: torch.Tensor, weights: tuple, bias: torch.Tensor | None, small_rows: int) -> torch.Tensor:
    """x (..., in) -> (..., out): MKL on the (in, out) copy when x has at most `small_rows` rows (the rule of
    small_matmul, solved for rows once per Linear), else oneDNN on the packed weight."""
    if x.numel() <= small_rows * x.shape[-1]:
        y = torch.matmul(x, weights[1])
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, weights[0], bias, "none", [], "")

"""CPU matmuls of the engine through oneDNN with weights reordered once ("packed"), instead of MKL on the
plain layout.

Why: on CPU a Linear in the engine runs at 1 to 64 rows (decode) or one prefill chunk, shapes at which
MKL's sgemm on the plain (out, in) weight runs far below its large-matrix rate. oneDNN's matmul with the
weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the weight
prepacking torch.compile's CPU backend applies when it freezes a model) is faster at these shapes, most per
Linear with the weights in cache, less per whole decode step, whose weights come from memory
(bench/results/engine_step_profile.md has the numbers). The multiply
stays in the weight's dtype (fp32 stays fp32: results differ from MKL's only in summation order, about
1e-6 relative).

`PackedLinears(model)` holds one packed copy per nn.Linear weight (as much memory again as those weights)
and re-packs a weight whenever it changed: the parameter's version counter (every in-place update:
load_state_dict, optimizer steps, copy_) or its storage (a new tensor assigned) differs from when it was
packed; `refresh()` forces a re-pack after writes that bypass the counter. `with packed:` routes those
Linears' forward through the packed copies for the duration of the block only (the engine's forwards);
outside it the model is untouched.
"""

from __future__ import annotations

import torch
from torch import nn


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing applies: a CPU device, fp32 weights, torch built with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinears:
    """oneDNN-packed copies of every nn.Linear weight of `model`, used inside `with self:` only.

    Args:
        model: any nn.Module; its nn.Linear submodules (weight (out, in), optional bias (out,)) are packed.
    Shapes: each packed Linear maps (..., in) -> (..., out) in the weight's dtype, as nn.Linear.
    """

    def __init__(self, model: nn.Module):
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]
        self._packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
        self._forwards: dict[int, tuple] = {}  # id(linear) -> (packed weight, bias, forward)

    def _weight(self, linear: nn.Linear) -> torch.Tensor:
        w = linear.weight
        key = (w._version, w.data_ptr())
        hit = self._packed.get(id(linear))
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
            self._packed[id(linear)] = hit
        return hit[1]

    def refresh(self) -> None:
        """Re-pack every weight at the next forward: for writes the version counter does not see (into
        `weight.data`, or raw memory from a communication library)."""
        self._packed.clear()

    def __enter__(self) -> PackedLinears:
        # the bound forwards are kept with the packed weight they close over (one closure per packing, not
        # per forward) and set in the instance __dict__ directly (nn.Module.__setattr__ is slow per call)
        for linear in self.linears:
            weight, bias = self._weight(linear), linear.bias
            fn = self._forwards.get(id(linear))
            if fn is None or fn[0] is not weight or fn[1] is not bias:
                fn = (weight, bias, lambda x, w=weight, b=bias: _linear(x, w, b))
                self._forwards[id(linear)] = fn
            linear.__dict__["forward"] = fn[2]
        return self

    def __exit__(self, *exc) -> None:
        for linear in self.linears:
            linear.__dict__.pop("forward", None)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

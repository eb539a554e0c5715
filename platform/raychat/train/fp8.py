"""FP8 training through torchao's float8 Linear (tensorwise / rowwise scaling).

Only Linear layers whose in and out features are multiples of 16 and at least `min_features` are
converted (smaller GEMMs lose more to casting than FP8 gains); the LM head stays in high precision.
`high_precision_linears` swaps plain nn.Linear layers sharing the SAME weight tensors in for evaluation
and sampling, and puts the FP8 layers back afterwards. On CPU, torchao runs the same code with emulated
FP8 matmuls (Float8LinearConfig(emulate=True)), which is how the tests exercise it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # --fp8-recipe: torchao's recipe names


def fp8_filter(min_features: int = 64):
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.endswith("lm_head"):
            return False
        i, o = module.in_features, module.out_features
        return i % 16 == 0 and o % 16 == 0 and min(i, o) >= min_features

    return keep


def convert_to_fp8(
    model: nn.Module, recipe: str = "tensorwise", emulate: bool | None = None, min_features: int = 64
) -> int:
    """Convert eligible Linear layers in place; returns how many were converted.

    emulate defaults to True when CUDA is unavailable (CPU tests) and False on GPUs. Raises ValueError for a
    recipe outside FP8_RECIPES.
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {list(FP8_RECIPES)}, got {recipe!r}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate is None:
        emulate = not torch.cuda.is_available()
    if emulate:
        config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter(min_features))
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")


@contextlib.contextmanager
def high_precision_linears(model: nn.Module):
    """Temporarily replace every Float8Linear by an nn.Linear sharing its weight (no copy)."""
    from torchao.float8.float8_linear import Float8Linear

    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Float8Linear):
                plain = nn.Linear(
                    child.in_features, child.out_features, bias=child.bias is not None, device="meta"
                )
                plain.weight = child.weight
                plain.bias = child.bias
                setattr(parent, name, plain)
                swapped.append((parent, name, child))
    try:
        yield model
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def fp8_line(model: nn.Module, recipe: str, min_features: int = 64) -> str:
    """The line a run logs once `model` is converted (convert_to_fp8): how many of its Linear layers train in
    FP8 and why the others do not; a warning when none does (a model too narrow: --fp8 then changes nothing)."""
    from torchao.float8.float8_linear import Float8Linear

    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, Float8Linear))]
    converted = sum(1 for m in linears if isinstance(m, Float8Linear))
    why = f"lm_head and layers with a dimension below {min_features} or not a multiple of 16 stay in high precision"
    if not converted:
        return f"warning: --fp8: none of the model's {len(linears)} Linear layers trains in FP8 ({why})"
    return f"FP8 ({recipe}): {converted} of the model's {len(linears)} Linear layers train in FP8 ({why})"

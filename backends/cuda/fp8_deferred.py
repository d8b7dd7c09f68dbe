"""Tensors that an fp8 linear's cast computes itself: the hand-off between an op and the fp8
linear after it (ops fp8_swiglu and fp8_norm).

Under delayed scaling the scale of the next cast is known before the tensor is, so the op in
front of an fp8 linear (SwiGLU before fc2, the norm before QKV / fc1, SwiGLU's backward before
fc1's dgrad cast) can hand on its output unevaluated: a `Deferred` has the right shape and dtype and
no storage. The fp8 linear (backends/cuda/fp8.py) calls its `fp8_quantize`, which runs the op inside
the cast kernel, so the op's bf16 output is never written and read back. Anything else that
touches one gets the bf16 tensor, computed then and reported as a fallback under the subclass's op.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from megatron_adapt import report
from megatron_adapt.backends.fp8_scaling import Fp8Scaling

# the same tensor again (autograd's view of a custom function's input returned as is, e.g. by
# Megatron's copy_to_tensor_model_parallel_region at one rank): a deferred alias, not a fallback
_ALIASES = {torch.ops.aten.view.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default}


def delayed_state(scaling: Fp8Scaling, direction: str, slot: int):
    """(scale, amax slot of the history's current row) for a fused cast: delayed scaling only."""
    if scaling.recipe.recipe != "delayed":
        raise ValueError(f"fused fp8 casts serve delayed scaling only, not {scaling.recipe.recipe}")
    return scaling.scale[direction][slot:slot + 1], scaling.amax_history[direction][0, slot:slot + 1]


class Deferred(torch.Tensor):
    """A tensor of this shape and dtype, not computed yet (see the module doc). Subclasses set
    `op` and `fallback` (the report's names) and define materialize() and fp8_quantize()."""
    op = fallback = ""

    @staticmethod
    def __new__(cls, shape, like: torch.Tensor, *parts):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)
        t.parts = parts
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        if func in _ALIASES and isinstance(t, Deferred) and tuple(args[1] if len(args) > 1 else t.shape) == t.shape:
            return type(t)(t.shape, t, *t.parts)
        report.fell_back(cls.op, cls.fallback, f"{func.__name__} on the deferred {cls.__name__}")

        def real(t):
            return t.materialize() if isinstance(t, Deferred) else t
        return func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs or {}))

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError

    def fp8_quantize(self, dtype, transpose: bool, scaling: Fp8Scaling, direction: str, slot: int):
        """(t8 [rows, last dim], t8^T or None, 1/scale): quantize(self) without writing self."""
        raise NotImplementedError

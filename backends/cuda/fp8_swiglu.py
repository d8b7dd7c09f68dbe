"""SwiGLU fused into the fp8 casts on either side of it (delayed scaling): op `fp8_swiglu`.

Between fc1 and fc2 of a gated MLP in fp8, the unfused path moves every activation twice: SwiGLU
writes its bf16 output, and fc2's cast reads it again to write the fp8 copies; in the backward,
SwiGLU's backward writes d(fc1 output) in bf16 and fc1's cast reads it again. Those two casts are
about half the cast traffic of a llama layer (docs/fp8.md). Here SwiGLU hands on its output, and
later its input gradient, unevaluated: `SwigluOutput` and `SwigluGrad` are tensors with the right
shape and dtype and no storage of their own. The fp8 linear that receives one (backends/cuda/fp8.py,
through `fp8_quantize`) runs the activation, or its backward, inside the cast kernel: fc1's output
(and fc2's dgrad) is read once, and only the fp8 copies are written.

- Delayed scaling only (the scale is known before the tensor is): the caller decides
  (patches/activations). The amax goes into the consuming linear's history as its own cast's would.
- The value cast is the bf16 SwiGLU (or its gradient) that the unfused path would compute: fp32
  math, rounded once to the input dtype, then scaled and saturated, so the fp8 bytes are the same.
- Anything else that touches one of these tensors gets the bf16 tensor, computed then and reported
  as a fallback (op `fp8_swiglu`): a bias on fc1 without skip-bias-add, bf16 wgrad
  (--no-fp8-wgrad), a consumer that is not an fp8 linear.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from megatron_adapt import report
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Scaling

from ._common import cdiv, interpreting
from .fp8 import _cast_torch, _triton_here, cast_outputs, delayed_state, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swiglu_at(x_ptr, r, c, F, mask):
        """SwiGLU of x [M, 2F] at rows r, columns c (< F), rounded to x's dtype, as fp32."""
        a = tl.load(x_ptr + r * 2 * F + c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + r * 2 * F + F + c, mask=mask, other=0.0).to(tl.float32)
        return (a * tl.sigmoid(a) * b).to(x_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _swiglu_grad_at(x_ptr, d_ptr, r, c, F, mask):
        """d(SwiGLU)/d(a, b) times d [M, F], each rounded to x's dtype, as fp32."""
        a = tl.load(x_ptr + r * 2 * F + c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + r * 2 * F + F + c, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + r * F + c, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da = (d * b * sig * (1.0 + a * (1.0 - sig))).to(x_ptr.dtype.element_ty).to(tl.float32)
        db = (d * a * sig).to(x_ptr.dtype.element_ty).to(tl.float32)
        return da, db

    @triton.jit
    def _swiglu_cast_kernel(x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, F,
                            FP8_MAX: tl.constexpr, TRANSPOSE: tl.constexpr, ONE_PASS: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr):
        """y [M, F] (and y^T [F, M]) = fp8(SwiGLU(x) * scale); its amax into amax_ptr."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = pn * BN + tl.arange(0, BN)
        s = tl.load(scale_ptr)
        mask = (rm[:, None] < M) & (rn[None, :] < F)
        v = _swiglu_at(x_ptr, rm[:, None], rn[None, :], F, mask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(v), 1), 0))
        q = tl.minimum(tl.maximum(v * s, -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + rm[:, None] * F + rn[None, :], q.to(y_ptr.dtype.element_ty), mask=mask)
        if TRANSPOSE:
            mt = (rn[:, None] < F) & (rm[None, :] < M)
            if ONE_PASS:   # this tile transposed in registers (see ONE_PASS_INPUTS)
                qt = tl.trans(q)
            else:          # loaded and computed again in transposed order
                qt = tl.minimum(tl.maximum(_swiglu_at(x_ptr, rm[None, :], rn[:, None], F, mt) * s, -FP8_MAX), FP8_MAX)
            tl.store(yt_ptr + rn[:, None] * M + rm[None, :], qt.to(yt_ptr.dtype.element_ty), mask=mt)
        if (pm == 0) & (pn == 0):
            tl.store(scale_inv_ptr, 1.0 / s)

    @triton.jit
    def _swiglu_grad_cast_kernel(x_ptr, d_ptr, g_ptr, gt_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, F,
                                 FP8_MAX: tl.constexpr, TRANSPOSE: tl.constexpr, ONE_PASS: tl.constexpr,
                                 BM: tl.constexpr, BN: tl.constexpr):
        """g [M, 2F] (and g^T [2F, M]) = fp8(SwiGLU backward(x, d) * scale); its amax into amax_ptr."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = pn * BN + tl.arange(0, BN)
        s = tl.load(scale_ptr)
        mask = (rm[:, None] < M) & (rn[None, :] < F)
        da, db = _swiglu_grad_at(x_ptr, d_ptr, rm[:, None], rn[None, :], F, mask)
        tl.atomic_max(amax_ptr, tl.maximum(tl.max(tl.max(tl.abs(da), 1), 0), tl.max(tl.max(tl.abs(db), 1), 0)))
        qa = tl.minimum(tl.maximum(da * s, -FP8_MAX), FP8_MAX)
        qb = tl.minimum(tl.maximum(db * s, -FP8_MAX), FP8_MAX)
        tl.store(g_ptr + rm[:, None] * 2 * F + rn[None, :], qa.to(g_ptr.dtype.element_ty), mask=mask)
        tl.store(g_ptr + rm[:, None] * 2 * F + F + rn[None, :], qb.to(g_ptr.dtype.element_ty), mask=mask)
        if TRANSPOSE:
            mt = (rn[:, None] < F) & (rm[None, :] < M)
            if ONE_PASS:
                qat, qbt = tl.trans(qa), tl.trans(qb)
            else:
                dat, dbt = _swiglu_grad_at(x_ptr, d_ptr, rm[None, :], rn[:, None], F, mt)
                qat = tl.minimum(tl.maximum(dat * s, -FP8_MAX), FP8_MAX)
                qbt = tl.minimum(tl.maximum(dbt * s, -FP8_MAX), FP8_MAX)
            tl.store(gt_ptr + rn[:, None] * M + rm[None, :], qat.to(gt_ptr.dtype.element_ty), mask=mt)
            tl.store(gt_ptr + (F + rn[:, None]) * M + rm[None, :], qbt.to(gt_ptr.dtype.element_ty), mask=mt)
        if (pm == 0) & (pn == 0):
            tl.store(scale_inv_ptr, 1.0 / s)


def swiglu_reference(x2: torch.Tensor) -> torch.Tensor:
    """SwiGLU of [M, 2F] in fp32, rounded once to x2's dtype (the Triton kernels' math)."""
    a, b = x2.float().chunk(2, -1)
    return (a * torch.sigmoid(a) * b).to(x2.dtype)


def swiglu_grad_reference(x2: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
    a, b = x2.float().chunk(2, -1)
    d, sig = d2.float(), torch.sigmoid(a)
    return torch.cat([(d * b * sig * (1.0 + a * (1.0 - sig))).to(x2.dtype), (d * a * sig).to(x2.dtype)], -1)


TILES = (32, 128, 4)   # BM, BN, num_warps on a GPU: the best of scripts/fp8_swiglu_bench.py --tiles on an H100

# Input dtypes whose transposed fp8 copy is the computed tile transposed in registers (tl.trans), one read
# of the input. scripts/fp8_transpose_probe.py (one H200, Triton 3.6 with its bundled ptxas 12.8) found every
# byte right for bf16 inputs at four tile shapes, and wrong bytes for fp32 inputs (in the transposed copy and
# at times in the plain one): Triton issue #11111, a ptxas bug with an fp8 tile stored twice. Other inputs
# load and compute their tile again in transposed order.
ONE_PASS_INPUTS = (torch.bfloat16,)


def _tiles():
    return (16, 16, 4) if interpreting() else TILES


def _state(scaling: Fp8Scaling, direction: str, slot: int):
    if scaling.recipe.recipe != "delayed":
        raise ValueError(f"fp8_swiglu serves delayed scaling only, not {scaling.recipe.recipe}")
    return delayed_state(scaling, direction, slot)


def _fused_cast(kernel, inputs, f, cols, dtype, transpose, scaling, direction, slot):
    """Launch one of the fused kernels over [M, F] tiles of inputs[0] ([M, 2F]); its fp8 output has
    `cols` columns (and a transposed copy where asked): (out, out^T or None, 1/scale)."""
    scale, amax = _state(scaling, direction, slot)
    x2 = inputs[0]
    M = x2.shape[0]
    out, out_t, scale_inv = cast_outputs(M, cols, dtype, transpose, x2.device)
    BM, BN, warps = _tiles()
    kernel[(cdiv(M, BM), cdiv(f, BN))](*inputs, out, out if out_t is None else out_t, scale, amax, scale_inv,
                                       M, f, FP8_MAX=FP8_MAX[dtype], TRANSPOSE=transpose,
                                       ONE_PASS=x2.dtype in ONE_PASS_INPUTS, BM=BM, BN=BN,
                                       num_warps=warps)
    return out, out_t, scale_inv


class _Deferred(torch.Tensor):
    """A tensor of this shape and dtype, not computed yet (see the module doc)."""

    @staticmethod
    def __new__(cls, shape, like: torch.Tensor, *parts):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)
        t.parts = parts
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        report.fell_back("fp8_swiglu", "SwiGLU in bf16, then its own cast",
                         f"{func.__name__} on the deferred {cls.__name__}")

        def real(t):
            return t.materialize() if isinstance(t, _Deferred) else t
        return func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs or {}))

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError


class SwigluOutput(_Deferred):
    """SwiGLU(x) for x [..., 2F] (fc1's output): [..., F]."""

    def materialize(self):
        (x2,) = self.parts
        return swiglu_reference(x2).view(self.shape)

    def fp8_quantize(self, dtype, transpose: bool, scaling: Fp8Scaling, direction: str, slot: int):
        """(y8 [M, F], y8^T [F, M] or None, 1/scale): quantize(SwiGLU(x)) in one read of x."""
        (x2,) = self.parts
        if not _triton_here(x2):
            report.ran("fp8_swiglu", "torch (swiglu, then cast)")
            return _cast_torch(swiglu_reference(x2), dtype, transpose, *_state(scaling, direction, slot))
        report.ran("fp8_swiglu", "cuda.triton(swiglu + fp8 cast)")
        return _fused_cast(_swiglu_cast_kernel, (x2,), x2.shape[1] // 2, x2.shape[1] // 2, dtype, transpose,
                           scaling, direction, slot)


class SwigluGrad(_Deferred):
    """SwiGLU's input gradient for x [..., 2F] and the output gradient d [..., F]: [..., 2F]."""

    def materialize(self):
        x2, d2 = self.parts
        return swiglu_grad_reference(x2, d2).view(self.shape)

    def fp8_quantize(self, dtype, transpose: bool, scaling: Fp8Scaling, direction: str, slot: int):
        """(g8 [M, 2F], g8^T [2F, M] or None, 1/scale): quantize(SwiGLU backward) in one read."""
        x2, d2 = self.parts
        if not _triton_here(x2):
            report.ran("fp8_swiglu", "torch (swiglu backward, then cast)")
            return _cast_torch(swiglu_grad_reference(x2, d2), dtype, transpose, *_state(scaling, direction, slot))
        report.ran("fp8_swiglu", "cuda.triton(swiglu backward + fp8 cast)")
        return _fused_cast(_swiglu_grad_cast_kernel, (x2, d2), x2.shape[1] // 2, x2.shape[1], dtype, transpose,
                           scaling, direction, slot)


class _DeferredSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(x2)
        ctx.x_shape = x.shape
        return SwigluOutput((*x.shape[:-1], x.shape[-1] // 2), x, x2)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        d2 = dy.reshape(x2.shape[0], -1).contiguous()
        return SwigluGrad(ctx.x_shape, dy, x2, d2)


def fp8_swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of x [..., 2F] (no bias) for an fp8 linear under delayed scaling to consume: the
    output, and the gradient it sends back to x, are computed inside the casts that take them."""
    if x.shape[-1] % 2:
        raise ValueError(f"fp8_swiglu: the last dimension ({x.shape[-1]}) must be even")
    return _DeferredSwiglu.apply(x)

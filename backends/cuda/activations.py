"""SwiGLU, bias-SwiGLU and bias-GeLU (tanh) forward and backward as Triton elementwise kernels.

Each kernel reads its inputs once and writes its output once (fp32 math in registers): the
forward never materialises x + bias or silu(a); the backward recomputes the activation from the
saved input instead of saving intermediates. The bias gradient is one column reduction of the
input gradient (torch .sum(0)).
"""
import torch
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import NATIVE, cdiv, eager_native, launch, fallback, kernel_reason
from . import providers

BLOCK = 1024


@triton.jit
def _swiglu_fwd(X, BIAS, Y, F, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    a = tl.load(X + row * 2 * F + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(X + row * 2 * F + F + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=m, other=0.0).to(tl.float32)
        b += tl.load(BIAS + F + cols, mask=m, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + row * F + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(X, BIAS, DY, DX, F, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    a = tl.load(X + row * 2 * F + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(X + row * 2 * F + F + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=m, other=0.0).to(tl.float32)
        b += tl.load(BIAS + F + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * F + cols, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    db = dy * a * sig
    tl.store(DX + row * 2 * F + cols, da.to(DX.dtype.element_ty), mask=m)
    tl.store(DX + row * 2 * F + F + cols, db.to(DX.dtype.element_ty), mask=m)


@triton.jit
def _gelu(Y, BIAS, DY, OUT, H, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    z = (tl.load(Y + row * H + cols, mask=m, other=0.0).to(tl.float32) +
         tl.load(BIAS + cols, mask=m, other=0.0).to(tl.float32))
    u = 0.7978845608028654 * z * (1.0 + 0.044715 * z * z)
    t = 2.0 * tl.sigmoid(2.0 * u) - 1.0  # tanh(u)
    if BACKWARD:
        dy = tl.load(DY + row * H + cols, mask=m, other=0.0).to(tl.float32)
        g = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        out = dy * g
    else:
        out = 0.5 * z * (1.0 + t)
    tl.store(OUT + row * H + cols, out.to(OUT.dtype.element_ty), mask=m)


# The kernels read rows of contiguous elements: a contiguous input of any rank is used as it is,
# and outputs are allocated in their final shape (no reshape / view calls: each is host time).

class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        f = x.shape[-1] // 2
        x2 = x if x.is_contiguous() else x.contiguous()
        b = bias.contiguous() if bias is not None else None
        y = torch.empty((*x.shape[:-1], f), dtype=x.dtype, device=x.device)
        if y.numel():
            launch(_swiglu_fwd, (x2.numel() // (2 * f), cdiv(f, BLOCK)), x2, b if b is not None else x2,
                   y, f, HAS_BIAS=b is not None, BLOCK=BLOCK)
        ctx.save_for_backward(x2, b)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, b = ctx.saved_tensors
        f = x2.shape[-1] // 2
        dy2 = dy if dy.is_contiguous() else dy.contiguous()
        dx = torch.empty_like(x2)
        if dx.numel():
            launch(_swiglu_bwd, (x2.numel() // (2 * f), cdiv(f, BLOCK)), x2, b if b is not None else x2,
                   dy2, dx, f, HAS_BIAS=b is not None, BLOCK=BLOCK)
        db = (dx.reshape(-1, 2 * f).sum(0, dtype=torch.float32).to(b.dtype)
              if b is not None and ctx.needs_input_grad[1] else None)
        return dx, db


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, y):
        h = y.shape[-1]
        y2 = y if y.is_contiguous() else y.contiguous()
        b = bias.contiguous()
        out = torch.empty_like(y2)
        if out.numel():
            launch(_gelu, (y2.numel() // h, cdiv(h, BLOCK)), y2, b, y2, out, h, BACKWARD=False, BLOCK=BLOCK)
        ctx.save_for_backward(y2, b)
        return out

    @staticmethod
    def backward(ctx, dout):
        y2, b = ctx.saved_tensors
        h = y2.shape[-1]
        d2 = dout if dout.is_contiguous() else dout.contiguous()
        dy = torch.empty_like(y2)
        if dy.numel():
            launch(_gelu, (y2.numel() // h, cdiv(h, BLOCK)), y2, b, d2, dy, h, BACKWARD=True, BLOCK=BLOCK)
        db = dy.reshape(-1, h).sum(0, dtype=torch.float32).to(b.dtype) if ctx.needs_input_grad[0] else None
        return db, dy


@providers.selectable("swiglu")
def swiglu(x):
    if eager_native(x) and x.size(-1) % 2 == 0:
        report.ran("swiglu", NATIVE)
        a, b = torch.chunk(x, 2, -1)
        return torch.nn.functional.silu(a) * b
    why = kernel_reason(x) or (None if x.size(-1) % 2 == 0 else "odd last dim")
    if why:
        return fallback("swiglu", why, x)
    report.ran("swiglu", "cuda.triton")
    return _SwiGLU.apply(x, None)


def bias_swiglu(x, bias):
    if eager_native(x) and x.size(-1) % 2 == 0:
        report.ran("bias_swiglu", NATIVE)
        a, b = torch.chunk(x + bias, 2, -1)
        return torch.nn.functional.silu(a) * b
    why = kernel_reason(x, bias) or (None if x.size(-1) % 2 == 0 else "odd last dim")
    if why:
        return fallback("bias_swiglu", why, x, bias)
    report.ran("bias_swiglu", "cuda.triton")
    return _SwiGLU.apply(x, bias)


def bias_gelu(bias, y):
    if eager_native(y):
        report.ran("bias_gelu", NATIVE)
        return torch.nn.functional.gelu(y + bias, approximate="tanh")
    why = kernel_reason(y, bias)
    if why:
        return fallback("bias_gelu", why, bias, y)
    report.ran("bias_gelu", "cuda.triton")
    return _BiasGeLU.apply(bias, y)

"""Bias-dropout-add (Megatron's residual step in training) as one Triton kernel each way.

out = residual + dropout(x + bias, p). The keep mask comes from Philox inside the kernel, keyed by
one seed drawn per call from the default CUDA generator (`torch.randint` on the device, so a
CUDA-graph replay draws a fresh seed, as PyTorch's own dropout does) and the element's index. The
backward regenerates the mask from the saved seed, so no mask is stored: the forward reads x and
residual and writes out, the backward reads dout and writes dx. Megatron's own version is
torch.compile'd (Inductor: a seed kernel, a fused kernel writing the mask, and a Python runtime
wrapper on the host for every call).
"""
import torch
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import NATIVE, cdiv, eager_native, launch, fallback, kernel_reason

BLOCK = 4096
WIDE_FROM = 2 ** 31  # from this many elements, Philox counters are 64-bit (the tests lower it)


@triton.jit
def _quarter(X, BIAS, R, OUT, offs, N, H, rnd, p, scale, HAS_BIAS: tl.constexpr,
             DROPOUT: tl.constexpr, BACKWARD: tl.constexpr, WIDE: tl.constexpr):
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)    # x, or dout in the backward
    if HAS_BIAS and not BACKWARD:
        col = offs % H if WIDE else offs.to(tl.int32) % H    # (64-bit division is slow)
        x += tl.load(BIAS + col, mask=m, other=0.0).to(tl.float32)
    if DROPOUT:
        x = tl.where(tl.uint_to_uniform_float(rnd) >= p, x * scale, 0.0)
    if not BACKWARD:
        x += tl.load(R + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + offs, x.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _bias_dropout_add(X, BIAS, R, OUT, SEED, N, H, p, scale, HAS_BIAS: tl.constexpr,
                      DROPOUT: tl.constexpr, BACKWARD: tl.constexpr, WIDE: tl.constexpr,
                      BLOCK: tl.constexpr):
    # One Philox call yields four 32-bit numbers: counter c serves element j of each quarter of
    # the block (Philox's arithmetic, not memory, would otherwise bound the kernel).
    Q: tl.constexpr = BLOCK // 4
    pid = tl.cast(tl.program_id(0), tl.int64)
    j = tl.arange(0, Q)
    base = pid * BLOCK + j
    r0 = j.to(tl.uint32)   # (unused without dropout)
    r1 = r0
    r2 = r0
    r3 = r0
    if DROPOUT:
        seed = tl.load(SEED)
        if WIDE:
            r0, r1, r2, r3 = tl.randint4x(seed, pid * Q + j)
        else:
            r0, r1, r2, r3 = tl.randint4x(seed, (pid * Q + j).to(tl.int32))
    _quarter(X, BIAS, R, OUT, base, N, H, r0, p, scale, HAS_BIAS, DROPOUT, BACKWARD, WIDE)
    _quarter(X, BIAS, R, OUT, base + Q, N, H, r1, p, scale, HAS_BIAS, DROPOUT, BACKWARD, WIDE)
    _quarter(X, BIAS, R, OUT, base + 2 * Q, N, H, r2, p, scale, HAS_BIAS, DROPOUT, BACKWARD, WIDE)
    _quarter(X, BIAS, R, OUT, base + 3 * Q, N, H, r3, p, scale, HAS_BIAS, DROPOUT, BACKWARD, WIDE)


def _run(src, bias, residual, out, seed, p, backward):
    n = out.numel()
    if n == 0:
        return
    h = src.size(-1) if src.dim() else 1
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    launch(_bias_dropout_add, (cdiv(n, BLOCK),), src, bias if bias is not None else src,
           residual if residual is not None else src, out, seed if seed is not None else src, n, h,
           float(p), scale, HAS_BIAS=bias is not None, DROPOUT=seed is not None, BACKWARD=backward,
           WIDE=n >= WIDE_FROM, BLOCK=BLOCK)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p):
        x, residual = x.contiguous(), residual.contiguous()
        b = bias.contiguous() if bias is not None else None
        seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=x.device) if p > 0 else None
        out = torch.empty_like(x)
        _run(x, b, residual, out, seed, p, backward=False)
        ctx.save_for_backward(seed)
        ctx.p, ctx.bias_dtype = p, None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        (seed,) = ctx.saved_tensors
        dout = dout.contiguous()
        if seed is None:
            dx = dout
        else:
            dx = torch.empty_like(dout)
            _run(dout, None, None, dx, seed, ctx.p, backward=True)
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[1]:
            db = dx.reshape(-1, dx.size(-1)).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, db, dout, None


def bias_dropout_add(x, bias, residual, prob):
    """residual + dropout(x + bias, prob) in training; bias may be None."""
    if eager_native(x):
        report.ran("bias_dropout_add", NATIVE)
        return residual + torch.nn.functional.dropout(x if bias is None else x + bias, prob, training=True)
    why = kernel_reason(x, bias, residual)
    if why is None and (x.shape != residual.shape or x.dtype != residual.dtype):
        why = "x and residual differ in shape or dtype"
    if why is None and bias is not None and (bias.dim() != 1 or bias.numel() != x.size(-1)):
        why = "bias is not one vector over the last dim"
    if why is None and not 0.0 <= prob <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {prob}")
    if why:
        return fallback("bias_dropout_add", why, x, bias, residual, prob)
    report.ran("bias_dropout_add", "cuda.triton")
    return _BiasDropoutAdd.apply(x, bias, residual, float(prob))

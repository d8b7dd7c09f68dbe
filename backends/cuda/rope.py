"""Rotary position embedding (Megatron bshd layout) forward and backward in one Triton kernel.

One program per (s, b) position and block of heads: the angles of that position are read once
and cos/sin computed in registers (fp32, times mscale), the head block is read once (the rotation
partner x[p(c)] is a second load of the same lines, served from L1) and written once; channels
past rot_dim are copied through. Input strides are honoured (Megatron's q/k are views into the
fused QKV output), so no .contiguous() copy is made. Backward is the transposed rotation:
dx[c] = dy[c] cos[c] - sign[c] dy[p(c)] sin[p(c)].
"""
import torch
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import cdiv, launch, fallback, kernel_reason, next_pow2


@triton.jit
def _rope_kernel(X, F, Y, B, H, D, R, sx_s, sx_b, sx_h, mscale,
                 INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    pos = tl.program_id(0)
    s = pos // B
    b = pos % B
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    cols = tl.arange(0, BD)
    rot = cols < R
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where((cols % 2) == 0, -1.0, 1.0)
    else:
        half = R // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    partner = tl.where(rot, partner, cols)
    f = tl.load(F + s * R + cols, mask=rot, other=0.0).to(tl.float32)
    cos = tl.cos(f) * mscale
    if BACKWARD:
        fp = tl.load(F + s * R + partner, mask=rot, other=0.0).to(tl.float32)
        sin = tl.sin(fp) * mscale * -sign
    else:
        sin = tl.sin(f) * mscale * sign
    hm = heads < H
    m2 = hm[:, None] & (cols < D)[None, :]
    xrow = X + tl.cast(s, tl.int64) * sx_s + tl.cast(b, tl.int64) * sx_b + heads[:, None] * sx_h
    x = tl.load(xrow + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    xp = tl.load(xrow + partner[None, :], mask=m2 & rot[None, :], other=0.0).to(tl.float32)
    y = tl.where(rot[None, :], x * cos[None, :] + xp * sin[None, :], x)
    yrow = Y + (tl.cast(pos, tl.int64) * H + heads[:, None]) * D
    tl.store(yrow + cols[None, :], y.to(Y.dtype.element_ty), mask=m2)


def _launch(x, f, interleaved, mscale, backward):
    s, b, h, d = x.shape
    r = f.size(-1)
    y = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    bd = next_pow2(d)
    bh = max(1, min(next_pow2(h), max(1, 4096 // bd)))
    if x.numel():
        launch(_rope_kernel, (s * b, cdiv(h, bh)),
            x, f, y, b, h, d, r, x.stride(0), x.stride(1), x.stride(2), mscale,
            INTERLEAVED=interleaved, BACKWARD=backward, BH=bh, BD=bd,
            num_warps=4 if bh * bd >= 2048 else 2)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, f, interleaved, mscale):
        ctx.save_for_backward(f)
        ctx.args = (interleaved, mscale)
        return _launch(t, f, interleaved, mscale, False)

    @staticmethod
    def backward(ctx, dy):
        (f,) = ctx.saved_tensors
        interleaved, mscale = ctx.args
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _launch(dy, f, interleaved, mscale, True), None, None, None


def rope(t, freqs, interleaved=False, mscale=1.0):
    why = kernel_reason(t)
    r = freqs.size(-1)
    if why is None:
        if t.dim() != 4:
            why = f"t of rank {t.dim()} (kernel takes [s, b, h, d])"
        elif r > t.size(-1) or r % 2:
            why = f"rot_dim {r} odd or larger than head dim {t.size(-1)}"
        elif freqs.numel() != t.size(0) * r:
            why = f"freqs of shape {tuple(freqs.shape)} is not [s, 1, 1, r] for s={t.size(0)}"
    if why:
        return fallback("rope", why, t, freqs, interleaved, mscale)
    report.ran("rope", "cuda.triton")
    f = freqs.reshape(t.size(0), r).float().contiguous()
    x = t if t.stride(-1) == 1 else t.contiguous()
    return _Rope.apply(x, f, bool(interleaved), float(mscale))

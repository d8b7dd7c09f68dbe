"""Scaled, masked, causal / sliding-window softmax (Megatron's FusedScaleMaskSoftmax) in Triton.

One program per row of [b, np, sq, sk]. The causal / sliding-window masks are computed from the
row and column indices (no mask tensor is read); an explicit bool mask is read through its
broadcast strides (no expand copy). Masked scores get Megatron's -10000 fill (after scaling), so
a fully masked row stays finite (uniform), exactly as the reference. Rows up to MAX_FUSED stay
in registers: one read, one write. Wider rows use an online-softmax loop.
Backward: dx = scale * y * (dy - sum(dy * y)), zero where masked (masked_fill has no gradient).
Math is fp32 in both cases of softmax_in_fp32 (the fp16/bf16 reference only differs by rounding).
"""
import torch
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import launch, fallback, kernel_reason, next_pow2, warps_for

MAX_FUSED = 16384
CHUNK = 4096
MASK_VALUE = tl.constexpr(-10000.0)


@triton.jit
def _masked(cols, q, SQ, SK, MASK_ROW, ms_k, m, HAS_MASK: tl.constexpr, MODE: tl.constexpr,
            LEFT, RIGHT):
    """True where masked. MODE: 0 none, 1 causal, 2 sliding window (bottom-right aligned)."""
    rel = cols - q
    if MODE == 1:
        dead = rel > SK - SQ
    elif MODE == 2:
        dead = (rel < SK - SQ - LEFT) | (rel > SK - SQ + RIGHT)
    else:
        dead = cols < 0
    if HAS_MASK:
        mk = tl.load(MASK_ROW + cols * ms_k, mask=m, other=0)
        dead = dead | (mk != 0)
    return dead


@triton.jit
def _softmax_fwd(X, Y, MASK, NP, SQ, SK, scale, ms_b, ms_h, ms_q, ms_k, LEFT, RIGHT,
                 HAS_MASK: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    row = tl.program_id(0)
    q = row % SQ
    bh = row // SQ
    mask_row = MASK + (bh // NP) * ms_b + (bh % NP) * ms_h + q * ms_q
    base = tl.cast(row, tl.int64) * SK
    if not LOOP:
        cols = tl.arange(0, BLOCK)
        m = cols < SK
        x = tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32) * scale
        dead = _masked(cols, q, SQ, SK, mask_row, ms_k, m, HAS_MASK, MODE, LEFT, RIGHT)
        x = tl.where(dead, MASK_VALUE, x)
        x = tl.where(m, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        y = e / tl.sum(e, axis=0)
        tl.store(Y + base + cols, y.to(Y.dtype.element_ty), mask=m)
    else:
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        sm = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, SK, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < SK
            x = tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32) * scale
            dead = _masked(cols, q, SQ, SK, mask_row, ms_k, m, HAS_MASK, MODE, LEFT, RIGHT)
            x = tl.where(m, tl.where(dead, MASK_VALUE, x), float("-inf"))
            new = tl.maximum(mx, x)
            safe = tl.where(new == float("-inf"), 0.0, new)
            sm = sm * tl.exp(mx - safe) + tl.exp(x - safe)
            mx = new
        gmax = tl.max(mx, axis=0)
        tot = tl.sum(sm * tl.exp(tl.where(mx == float("-inf"), gmax, mx) - gmax) *
                     (mx != float("-inf")), axis=0)
        for off in range(0, SK, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < SK
            x = tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32) * scale
            dead = _masked(cols, q, SQ, SK, mask_row, ms_k, m, HAS_MASK, MODE, LEFT, RIGHT)
            x = tl.where(m, tl.where(dead, MASK_VALUE, x), float("-inf"))
            tl.store(Y + base + cols, (tl.exp(x - gmax) / tot).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _softmax_bwd(Y, DY, DX, MASK, NP, SQ, SK, scale, ms_b, ms_h, ms_q, ms_k, LEFT, RIGHT,
                 HAS_MASK: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    row = tl.program_id(0)
    q = row % SQ
    bh = row // SQ
    mask_row = MASK + (bh // NP) * ms_b + (bh % NP) * ms_h + q * ms_q
    base = tl.cast(row, tl.int64) * SK
    if not LOOP:
        cols = tl.arange(0, BLOCK)
        m = cols < SK
        y = tl.load(Y + base + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=0)
        dx = scale * y * (dy - dot)
        if HAS_MASK or MODE != 0:
            dead = _masked(cols, q, SQ, SK, mask_row, ms_k, m, HAS_MASK, MODE, LEFT, RIGHT)
            dx = tl.where(dead, 0.0, dx)
        tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, SK, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < SK
            acc += (tl.load(Y + base + cols, mask=m, other=0.0).to(tl.float32) *
                    tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32))
        dot = tl.sum(acc, axis=0)
        for off in range(0, SK, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < SK
            y = tl.load(Y + base + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
            dx = scale * y * (dy - dot)
            if HAS_MASK or MODE != 0:
                dead = _masked(cols, q, SQ, SK, mask_row, ms_k, m, HAS_MASK, MODE, LEFT, RIGHT)
                dx = tl.where(dead, 0.0, dx)
            tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=m)


def _cfg(sk):
    if sk <= MAX_FUSED:
        block = next_pow2(sk)
        return block, False, warps_for(block)
    return CHUNK, True, 8


def _mask_args(mask, b, np_, sq, sk):
    if mask is None:
        return None, (0, 0, 0, 0)
    if mask.dtype != torch.bool:
        mask = mask != 0
    m = mask.expand(b, np_, sq, sk)  # a view: broadcast dims get stride 0
    return m.view(torch.uint8), tuple(m.stride())


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, mask, scale, mode, left, right):
        b, np_, sq, sk = scores.shape
        x = scores.contiguous()
        y = torch.empty_like(x)
        mk, strides = _mask_args(mask, b, np_, sq, sk)
        block, loop, warps = _cfg(sk)
        rows = b * np_ * sq
        if rows:
            launch(_softmax_fwd, (rows,), x, y, mk if mk is not None else x, np_, sq, sk, scale, *strides,
                                  left, right, HAS_MASK=mk is not None, MODE=mode, BLOCK=block,
                                  LOOP=loop, num_warps=warps)
        # The mask is an input, often one [b, 1, sq, sk] tensor shared by every layer: kept on ctx,
        # not among the saved tensors, so an activation offloader (Megatron's fine-grained one,
        # megatron-adapt's layer-wise one) neither copies it nor counts it; its broadcast view
        # would be materialised there at b * np * sq * sk bytes.
        ctx.save_for_backward(y)
        ctx.mask = mask
        ctx.args = (scale, mode, left, right)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, = ctx.saved_tensors
        scale, mode, left, right = ctx.args
        b, np_, sq, sk = y.shape
        mk, strides = _mask_args(ctx.mask, b, np_, sq, sk)
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        block, loop, warps = _cfg(sk)
        rows = b * np_ * sq
        if rows:
            launch(_softmax_bwd, (rows,), y, dy, dx, mk if mk is not None else y, np_, sq, sk, scale, *strides,
                                  left, right, HAS_MASK=mk is not None, MODE=mode, BLOCK=block,
                                  LOOP=loop, num_warps=warps)
        return dx, None, None, None, None, None


def scaled_masked_softmax(scores, mask, scale, causal, window_size=None, softmax_in_fp32=True):
    why = kernel_reason(scores)
    if why is None and scores.dim() != 4:
        why = f"scores of rank {scores.dim()} (kernel takes [b, np, sq, sk])"
    if why:
        return fallback("scaled_masked_softmax", why, scores, mask, scale, causal, window_size,
                        softmax_in_fp32)
    report.ran("scaled_masked_softmax", "cuda.triton")
    sq = scores.size(-2)
    if window_size is not None:
        mode, left, right = 2, int(window_size[0]), int(window_size[1])
    elif causal and sq > 1:
        mode, left, right = 1, 0, 0
    else:
        mode, left, right = 0, 0, 0
    scale = 1.0 if scale is None else float(scale)
    return _Softmax.apply(scores, mask, scale, mode, left, right)

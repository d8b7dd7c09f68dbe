"""RMSNorm / LayerNorm forward and backward as Triton kernels.

Forward: one program per row; rows up to MAX_FUSED wide stay in registers (one read of x, one
write of y); wider rows (any width, 65536+ included) loop over the row in chunks.
Backward: a persistent grid; each program walks rows pid, pid+G, ... and keeps its weight/bias
gradient partial sums in registers (wide rows: in its own row of a global fp32 buffer), so the
[G, h] partials are reduced once at the end instead of re-reading dy and x.
Statistics are fp32; mean/rstd are saved so the backward does not recompute them.
"""
import torch
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import fallback, kernel_reason, next_pow2, num_programs, warps_for

MAX_FUSED = 16384   # widest row kept whole in registers (bf16 16K x 16 warps: no spills)
CHUNK = 4096        # chunk width for wider rows


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, N, eps,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = X + row * N
    y_ptr = Y + row * N
    if not LOOP:
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if IS_RMS:
            mean = 0.0
            xc = x
        else:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(m, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + cols, y.to(Y.dtype.element_ty), mask=m)
    else:
        mean = 0.0
        if not IS_RMS:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for off in range(0, N, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / N
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, N, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < N
            xc = tl.where(m, tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
            acc2 += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc2, axis=0) / N + eps)
        for off in range(0, N, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < N
            x = tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(y_ptr + cols, y.to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + row, rstd)
    if not IS_RMS:
        tl.store(MEAN + row, mean)


@triton.jit
def _norm_bwd(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, M, N, G,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    pid = tl.program_id(0)
    if not LOOP:
        cols = tl.arange(0, BLOCK)
        m = cols < N
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, G):
            base = tl.cast(row, tl.int64) * N
            x = tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            if IS_RMS:
                xhat = x * rstd
            else:
                xhat = tl.where(m, (x - tl.load(MEAN + row)) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / N
                dx = (wdy - xhat * c1 - c2) * rstd
            tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=m)
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        tl.store(DW_PART + pid * N + cols, dw_acc, mask=m)
        if HAS_BIAS:
            tl.store(DB_PART + pid * N + cols, db_acc, mask=m)
    else:
        # Wide rows: two passes per row; partials live in this program's row of DW_PART/DB_PART.
        for row in range(pid, M, G):
            base = tl.cast(row, tl.int64) * N
            rstd = tl.load(RSTD + row)
            mean = 0.0
            if not IS_RMS:
                mean = tl.load(MEAN + row)
            a1 = tl.zeros([BLOCK], dtype=tl.float32)
            a2 = tl.zeros([BLOCK], dtype=tl.float32)
            for off in range(0, N, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                m = cols < N
                x = tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
                wdy = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) * dy
                a1 += tl.where(m, (x - mean) * rstd, 0.0) * wdy
                a2 += wdy
            c1 = tl.sum(a1, axis=0) / N
            c2 = tl.sum(a2, axis=0) / N
            for off in range(0, N, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                m = cols < N
                x = tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
                xhat = (x - mean) * rstd
                wdy = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) * dy
                if IS_RMS:
                    dx = (wdy - xhat * c1) * rstd
                else:
                    dx = (wdy - xhat * c1 - c2) * rstd
                tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=m)
                p = DW_PART + pid * N + cols
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy * xhat, mask=m)
                if HAS_BIAS:
                    q = DB_PART + pid * N + cols
                    tl.store(q, tl.load(q, mask=m, other=0.0) + dy, mask=m)


def _launch_cfg(n):
    if n <= MAX_FUSED:
        block = next_pow2(n)
        return block, False, warps_for(block)
    return CHUNK, True, 8


_RESIDENT: dict = {}  # backward config -> programs that fit on one SM at once


def _resident_programs(kernel, warps):
    """How many programs of the compiled backward fit on one SM together (registers, threads),
    so the persistent grid is exactly one wave: a second partial wave would cost a whole row
    pass. Two (safe up to 128 registers a thread) until a compiled kernel says otherwise."""
    regs = getattr(kernel, "n_regs", 0)
    if not regs:
        return 2
    threads = 32 * warps
    return max(1, min(65536 // (regs * threads), 2048 // threads, 8))


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        shape, n = x.shape, x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else None
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        mean = rstd if is_rms else torch.empty_like(rstd)
        block, loop, warps = _launch_cfg(n)
        if rows:
            _norm_fwd[(rows,)](x2, w, b if b is not None else w, y, mean, rstd, n, eps,
                               IS_RMS=is_rms, HAS_BIAS=b is not None, BLOCK=block, LOOP=loop,
                               num_warps=warps)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.is_rms, ctx.has_bias, ctx.shape = is_rms, b is not None, shape
        ctx.wdtype = weight.dtype
        ctx.bdtype = bias.dtype if bias is not None else None
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        block, loop, warps = _launch_cfg(n)
        key = (ctx.is_rms, ctx.has_bias, block, loop, warps, x2.dtype, w.dtype, x2.device)
        g = num_programs(x2.device, rows, per_sm=_RESIDENT.get(key, 2))
        alloc = torch.zeros if loop else torch.empty
        dw_part = alloc((g, n), dtype=torch.float32, device=x2.device)
        db_part = alloc((g, n), dtype=torch.float32, device=x2.device) if ctx.has_bias else dw_part
        if rows:
            k = _norm_bwd[(g,)](x2, w, dy2, dx, mean, rstd, dw_part, db_part, rows, n, g,
                                IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BLOCK=block, LOOP=loop,
                                num_warps=warps)
            if key not in _RESIDENT:
                _RESIDENT[key] = _resident_programs(k, warps)
            dw = dw_part.sum(0).to(ctx.wdtype)
            db = db_part.sum(0).to(ctx.bdtype) if ctx.has_bias else None
        else:
            dw = torch.zeros(n, dtype=ctx.wdtype, device=x2.device)
            db = torch.zeros(n, dtype=ctx.bdtype, device=x2.device) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None, None


def rms_norm(x, weight, eps):
    why = kernel_reason(x, weight)
    if why:
        return fallback("rms_norm", why, x, weight, eps)
    report.ran("rms_norm", "cuda.triton")
    return _Norm.apply(x, weight, None, float(eps), True)


def layer_norm(x, weight, bias, eps):
    why = kernel_reason(x, weight, bias)
    if why:
        return fallback("layer_norm", why, x, weight, bias, eps)
    report.ran("layer_norm", "cuda.triton")
    return _Norm.apply(x, weight, bias, float(eps), False)

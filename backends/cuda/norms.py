"""RMSNorm / LayerNorm forward and backward as Triton kernels.

Rows up to MAX_FUSED wide stay in registers:
- Forward: each program normalises a tile of ROWS rows (one read of x, one write of y). The
  LayerNorm statistics come from ONE fused reduction of (sum d, sum d^2), d = x - x[row, 0] (a
  shifted one-pass variance: the shift keeps it free of the cancellation of E[x^2] - E[x]^2).
- Backward: a persistent grid sized to one wave; each program walks row tiles pid, pid+G, ...
  and loads the NEXT tile before it reduces the current one (software prefetch), so a row's
  loads are always in flight while the previous row is being reduced. Both LayerNorm
  coefficients come from one fused reduction. Weight/bias gradient partials stay in registers
  and are written once per program as fp32 rows [G, h]; one small kernel sums them and writes
  dw/db in the weight's dtype.
LayerNorm rows 8193-16384 wide (block MAX_FUSED) take a split backward: dx one row a program, then
dw/db as a column reduction over groups of rows.
Wider rows (more than MAX_FUSED) loop over the row in CHUNK-wide pieces (the partials live
in the program's row of a global fp32 buffer).
Statistics are fp32; mean/rstd are saved so the backward does not recompute them.
"""
import torch
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import NATIVE, cdiv, eager_native, launch, fallback, kernel_reason, next_pow2, num_programs, warps_for
from . import providers

MAX_FUSED = 16384   # widest row kept whole in registers
# LayerNorm rows whose block is MAX_FUSED take the split backward (dx per row, then dw/db as a
# column reduction): its whole-row backward spills registers there. Measurements behind this and
# every launch configuration below: docs/cuda-backend.md, "Norm launch configuration".
SPLIT_DX_WARPS = 16
SPLIT_TILE = (64, 64)   # rows x columns of a dw/db reduction tile
CHUNK = 4096        # chunk width for wider rows


@triton.jit
def _add2(a1, b1, a2, b2):
    """tl.reduce's combine function for pairs: one reduction gives two sums."""
    return a1 + a2, b1 + b2


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, M, N, eps,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Forward of a tile of ROWS rows, each whole in registers (N <= BLOCK):

        RMSNorm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
        LayerNorm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var(x) + eps)

    LayerNorm's mean and var come from one reduction of (sum d, sum d^2), d = x - x[0] (shifted,
    so no cancellation of E[x^2] - E[x]^2). rstd (and mean) are saved per row, fp32."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        y = x * rstd[:, None] * w[None, :]
    else:
        shift = tl.load(X + rows.to(tl.int64) * N, mask=rmask, other=0.0).to(tl.float32)
        d = tl.where(m, x - shift[:, None], 0.0)
        s1, s2 = tl.reduce((d, d * d), 1, _add2)
        md = s1 / N
        var = tl.maximum(s2 / N - md * md, 0.0)
        rstd = 1.0 / tl.sqrt(var + eps)
        mean = shift + md
        y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _norm_fwd_loop(X, W, B, Y, MEAN, RSTD, N, eps,
                   IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Forward of one row wider than MAX_FUSED, in BLOCK-wide chunks: mean (LayerNorm), then
    var = mean((x - mean)^2), then y as in _norm_fwd."""
    row = tl.program_id(0).to(tl.int64)
    x_ptr = X + row * N
    y_ptr = Y + row * N
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
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              PREFETCH: tl.constexpr):
    """Backward, rows whole in registers, on a persistent grid of G programs (program pid takes
    tiles pid, pid + G, ...; PREFETCH loads the next tile before reducing this one). With
    xhat = (x - mean) * rstd (RMSNorm: x * rstd) and g = w * dy:

        RMSNorm:   dx = rstd * (g - xhat * mean(xhat * g))
        LayerNorm: dx = rstd * (g - xhat * mean(xhat * g) - mean(g))
        dw = sum over rows of dy * xhat,  db = sum over rows of dy

    This program's dw/db sums are written once, fp32, to row pid of DW_PART / DB_PART;
    _sum_partials adds the rows up."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    r = tl.arange(0, ROWS)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    db_acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    step = G * ROWS
    rows = pid * ROWS + r
    m = (rows < M)[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if PREFETCH:
        x_n = tl.load(X + offs, mask=m, other=0.0)
        dy_n = tl.load(DY + offs, mask=m, other=0.0)
    for start in range(pid * ROWS, M, step):
        rows = start + r
        rmask = rows < M
        m = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if PREFETCH:
            x = x_n.to(tl.float32)
            dy = dy_n.to(tl.float32)
            nrows = rows + step
            nm = (nrows < M)[:, None] & cmask[None, :]
            noffs = nrows.to(tl.int64)[:, None] * N + cols[None, :]
            x_n = tl.load(X + noffs, mask=nm, other=0.0)
            dy_n = tl.load(DY + noffs, mask=nm, other=0.0)
        else:
            x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
            xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        if IS_RMS:
            c1 = tl.sum(xhat * wdy, axis=1) / N
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            s1, s2 = tl.reduce((xhat * wdy, wdy), 1, _add2)
            dx = (wdy - xhat * (s1 / N)[:, None] - (s2 / N)[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


@triton.jit
def _norm_bwd_loop(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, M, N, G,
                   IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Backward of rows wider than MAX_FUSED, the formulas of _norm_bwd in two passes a row:
    mean(xhat * g) and mean(g) first, then dx. dw/db partials accumulate in this program's row of
    DW_PART / DB_PART (zeroed by the caller)."""
    pid = tl.program_id(0)
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


@triton.jit
def _norm_bwd_dx(X, W, DY, DX, MEAN, RSTD, N,
                 IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
    """Split backward, part 1 (wide rows): dx of one row as in _norm_bwd; no weight-gradient
    partials held."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=m, other=0.0).to(tl.float32)
    wdy = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) * dy
    rstd = tl.load(RSTD + row)
    if IS_RMS:
        xhat = x * rstd
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)) * rstd
    else:
        xhat = tl.where(m, (x - tl.load(MEAN + row)) * rstd, 0.0)
        # two tl.sum, not one tl.reduce of a pair: the same speed compiled, and the Triton
        # interpreter (CI) runs a custom combine function 40x slower
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N) - tl.sum(wdy, axis=0) / N) * rstd
    tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=m)


@triton.jit
def _norm_bwd_dwdb(X, DY, MEAN, RSTD, DW_PART, DB_PART, M, N, ROWS_PER,
                   IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """Split backward, part 2: DW_PART[g] = sum of dy * xhat (DB_PART[g]: of dy) over the rows of
    group g, fp32. Grid (cdiv(N, BN), groups)."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < N
    first = tl.program_id(1) * ROWS_PER
    last = tl.minimum(first + ROWS_PER, M)
    acc_w = tl.zeros([BR, BN], dtype=tl.float32)
    acc_b = tl.zeros([BR, BN], dtype=tl.float32)
    for r0 in range(first, last, BR):
        rows = r0 + tl.arange(0, BR)
        rm = rows < last
        m = rm[:, None] & cm[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rm, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = (x - tl.load(MEAN + rows, mask=rm, other=0.0)[:, None]) * rstd[:, None]
        acc_w += dy * xhat
        if HAS_BIAS:
            acc_b += dy
    tl.store(DW_PART + tl.program_id(1) * N + cols, tl.sum(acc_w, axis=0), mask=cm)
    if HAS_BIAS:
        tl.store(DB_PART + tl.program_id(1) * N + cols, tl.sum(acc_b, axis=0), mask=cm)


@triton.jit
def _sum_partials(DW_PART, DB_PART, DW, DB, G, N,
                  HAS_BIAS: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr):
    """dw[c] = sum_g DW_PART[g, c] (and db), written in the parameter's dtype. Grid (cdiv(N, BN), 1|2)."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < N
    src = DW_PART
    if HAS_BIAS:
        if which == 1:
            src = DB_PART
    acc = tl.zeros([BG, BN], dtype=tl.float32)
    for g0 in range(0, G, BG):
        g = g0 + tl.arange(0, BG)
        acc += tl.load(src + g.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(g < G)[:, None] & cm[None, :], other=0.0)
    tot = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(DW + cols, tot.to(DW.dtype.element_ty), mask=cm)
    else:
        tl.store(DB + cols, tot.to(DB.dtype.element_ty), mask=cm)


def _fwd_cfg(block, is_rms):
    """(rows a tile, warps) of _norm_fwd: at least 8K elements a program, 16 elements a thread;
    rows 8193-16384 wide set per norm."""
    if block >= MAX_FUSED:
        return (1, 8) if is_rms else (2, 32)
    rows = max(1, min(16, 8192 // block))
    tile = rows * block
    return rows, 16 if tile >= 8192 else warps_for(tile)


def _bwd_cfg(block, is_rms):
    """(rows a tile, warps, prefetch) of _norm_bwd: about 2048 elements a tile, the next tile
    prefetched; at block MAX_FUSED two rows do not fit in registers, so no prefetch."""
    if block >= MAX_FUSED:
        return 1, 16 if is_rms else 32, False
    rows = max(1, min(16, 2048 // block))
    return rows, warps_for(block * rows), True


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
        # The kernels read rows of n contiguous elements: a contiguous x of any rank is used as it
        # is (no reshape / view calls: each is host time on a slow host, per call).
        n = x.shape[-1]
        x2 = x if x.is_contiguous() else x.contiguous()
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else None
        rows = x2.numel() // n if n else 0
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        mean = rstd if is_rms else torch.empty_like(rstd)
        if rows:
            has_bias = b is not None
            bb = b if has_bias else w
            if n <= MAX_FUSED:
                block = next_pow2(n)
                tile, warps = _fwd_cfg(block, is_rms)
                launch(_norm_fwd, (cdiv(rows, tile),), x2, w, bb, y, mean, rstd, rows, n, eps,
                       IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK=block, ROWS=tile, num_warps=warps)
            else:
                launch(_norm_fwd_loop, (rows,), x2, w, bb, y, mean, rstd, n, eps, IS_RMS=is_rms,
                       HAS_BIAS=has_bias, BLOCK=CHUNK, num_warps=8)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.is_rms, ctx.has_bias = is_rms, b is not None
        ctx.wdtype = weight.dtype
        ctx.bdtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        n = x2.shape[-1]
        rows = rstd.shape[0]
        dev = x2.device
        dy2 = dy if dy.is_contiguous() else dy.contiguous()
        dx = torch.empty_like(x2)
        dw = torch.empty(n, dtype=ctx.wdtype, device=dev)
        db = torch.empty(n, dtype=ctx.bdtype, device=dev) if ctx.has_bias else None
        if not rows:
            return dx, dw.zero_(), db.zero_() if db is not None else None, None, None
        if not ctx.is_rms and next_pow2(n) == MAX_FUSED:
            return _split_backward(ctx, x2, w, dy2, mean, rstd, dx, dw, db)
        loop = n > MAX_FUSED
        if loop:
            block, tile, warps, prefetch = CHUNK, 1, 8, False
        else:
            block = next_pow2(n)
            tile, warps, prefetch = _bwd_cfg(block, ctx.is_rms)
        key = (ctx.is_rms, ctx.has_bias, block, loop, tile, warps, prefetch, x2.dtype, w.dtype, dev)
        g = num_programs(dev, cdiv(rows, tile), per_sm=_RESIDENT.get(key, 2))
        dw_part, db_part = _partials(torch.zeros if loop else torch.empty, ctx.has_bias, g, n, dev)
        if loop:
            k = launch(_norm_bwd_loop, (g,), x2, w, dy2, dx, mean, rstd, dw_part, db_part, rows, n, g,
                       IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BLOCK=block, num_warps=warps)
        else:
            k = launch(_norm_bwd, (g,), x2, w, dy2, dx, mean, rstd, dw_part, db_part, rows, n, g,
                       IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BLOCK=block, ROWS=tile,
                       PREFETCH=prefetch, num_warps=warps)
        if key not in _RESIDENT:
            _RESIDENT[key] = _resident_programs(k, warps)
        bn = 32
        launch(_sum_partials, (cdiv(n, bn), 2 if ctx.has_bias else 1),
               dw_part, db_part, dw, db if db is not None else dw, g, n,
               HAS_BIAS=ctx.has_bias, BG=64, BN=bn, num_warps=4)
        return dx, dw, db, None, None


def _partials(alloc, has_bias, groups, n, dev):
    """fp32 [groups, n] weight-gradient partials for dw and db, in one allocation (db's is dw's
    buffer when there is no bias: the kernels do not write it then)."""
    if not has_bias:
        part = alloc((groups, n), dtype=torch.float32, device=dev)
        return part, part
    part = alloc((2, groups, n), dtype=torch.float32, device=dev)
    return part[0], part[1]


def _split_backward(ctx, x2, w, dy2, mean, rstd, dx, dw, db):
    """Wide rows: dx one row a program, then dw/db as a column reduction over row groups (x and
    dy read twice, but no program holds a row's weight-gradient partials next to the row)."""
    n = x2.shape[-1]
    rows = rstd.shape[0]
    launch(_norm_bwd_dx, (rows,), x2, w, dy2, dx, mean, rstd, n, IS_RMS=ctx.is_rms,
           BLOCK=next_pow2(n), num_warps=SPLIT_DX_WARPS)
    br, bn = SPLIT_TILE
    col_blocks = cdiv(n, bn)
    groups = max(1, min(cdiv(rows, br), num_programs(x2.device, rows, 4) // col_blocks + 1))
    rows_per = cdiv(cdiv(rows, groups), br) * br
    groups = cdiv(rows, rows_per)
    dw_part, db_part = _partials(torch.empty, ctx.has_bias, groups, n, x2.device)
    launch(_norm_bwd_dwdb, (col_blocks, groups), x2, dy2, mean, rstd, dw_part, db_part, rows, n,
           rows_per, IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BR=br, BN=bn, num_warps=4)
    launch(_sum_partials, (cdiv(n, 32), 2 if ctx.has_bias else 1),
           dw_part, db_part, dw, db if db is not None else dw, groups, n,
           HAS_BIAS=ctx.has_bias, BG=64, BN=32, num_warps=4)
    return dx, dw, db, None, None


@providers.selectable("rms_norm")
def rms_norm(x, weight, eps):
    if eager_native(x):
        report.ran("rms_norm", NATIVE)
        return torch.nn.functional.rms_norm(x, (x.size(-1),), weight, eps)
    why = kernel_reason(x, weight)
    if why:
        return fallback("rms_norm", why, x, weight, eps)
    report.ran("rms_norm", "cuda.triton")
    return _Norm.apply(x, weight, None, float(eps), True)


@providers.selectable("layer_norm")
def layer_norm(x, weight, bias, eps):
    if eager_native(x):
        report.ran("layer_norm", NATIVE)
        return torch.nn.functional.layer_norm(x, (x.size(-1),), weight, bias, eps)
    why = kernel_reason(x, weight, bias)
    if why:
        return fallback("layer_norm", why, x, weight, bias, eps)
    report.ran("layer_norm", "cuda.triton")
    return _Norm.apply(x, weight, bias, float(eps), False)

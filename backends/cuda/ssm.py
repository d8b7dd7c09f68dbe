"""Mamba-2 ops as Triton kernels: the chunked SSD scan (forward and backward), the causal
depthwise conv1d and the gated RMSNorm.

SSD scan (x [b, l, h, p], dt [b, l, h], A [h], B / C [b, l, g, n]), chunks of Q steps, fp32 math:
forward, four kernels
  1. _dt_cumsum      per (b, chunk, head): dt' = clamp(softplus(dt + dt_bias)), a = cumsum(dt' A)
  2. _chunk_state    per (b, chunk, head, p-block, n-block): S_c = sum_j exp(a_Q - a_j) dt'_j x_j B_j^T
  3. _state_pass     per (b, head, block of p*n): H_c = exp(a_Q) H_{c-1} + S_c, sequential over
                     chunks; stores the state entering each chunk and the final state
  4. _chunk_out      per (b, chunk, head, row block, p-block): y_i = sum_{j<=i} (C_i.B_j)
                     exp(a_i - a_j) dt'_j x_j + exp(a_i) H_{c-1} C_i + D x_i, then * silu(z_i)
backward: the same _chunk_state (weights exp(a_i), on dy and C) and _state_pass run in reverse
give dL/dH per chunk; _chunk_bwd_dx (per column block: dx, dB, d dt', d a) and _chunk_bwd_dc (per
row block: dC, d a) do the rest; the d a -> d dt', dA, d dt_bias chain and the group sums of dB /
dC are small PyTorch reductions over [b, l, h] (deterministic: no atomics).
Every x-sized tensor is read with its strides (no copies of Megatron's in_proj views).
seq_idx (packed sequences) and head / state sizes above 256 take the reference, reported.

causal conv1d (x [b, l, d], weight [d, w]): per (b, time block, channel block), the w taps from
shifted loads; backward recomputes the pre-activation, dx from shifted loads of the gradient, dW /
d bias as per-time-block partials summed afterwards.

gated RMSNorm: one program per (row, group), the group whole in registers; fp32 statistics.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import cdiv, fallback, kernel_reason, next_pow2

MAX_DIM = 256   # head dim p and state dim n held whole in a program


# ----------------------------------------------------------------------------- SSD: kernels
@triton.jit
def _dt_cumsum(DT, s_db, s_dl, s_dh, BIAS, A, DTP, ACS, L, H, NC, lo, hi,
               HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
               Q: tl.constexpr):
    """dt' and a = cumsum(dt' A) of one chunk of one head -> DTP, ACS [b, h, c, Q] fp32."""
    c, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t = c * Q + tl.arange(0, Q)
    m = t < L
    dt = tl.load(DT + b.to(tl.int64) * s_db + t.to(tl.int64) * s_dl + h * s_dh, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(BIAS + h).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, lo), hi)
    dt = tl.where(m, dt, 0.0)
    a = tl.cumsum(dt * tl.load(A + h).to(tl.float32), axis=0)
    o = (bh.to(tl.int64) * NC + c) * Q + tl.arange(0, Q)
    tl.store(DTP + o, dt)
    tl.store(ACS + o, a)


@triton.jit
def _chunk_state(X, s_xb, s_xl, s_xh, s_xp, Y, s_yb, s_yl, s_yg, s_yn, DTP, ACS, OUT,
                 L, H, G, P, N, NC,
                 REVERSE: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr,
                 BN: tl.constexpr, PREC: tl.constexpr):
    """OUT[b, c, h] (p x n) = sum_j w_j X_j^T Y_j over the chunk: forward (X = x, Y = B)
    w_j = exp(a_Q - a_j) dt'_j; REVERSE (X = dy, Y = C) w_j = exp(a_j)."""
    pid, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    nb = tl.cdiv(N, BN)
    ip, jn = pid // nb, pid % nb
    b, h = bh // H, bh % H
    g = h // (H // G)
    rp = ip * BP + tl.arange(0, BP)
    rn = jn * BN + tl.arange(0, BN)
    base = (bh.to(tl.int64) * NC + c) * Q
    a_last = tl.load(ACS + base + Q - 1)
    acc = tl.zeros((BP, BN), dtype=tl.float32)
    for q0 in range(0, Q, BQ):
        rq = q0 + tl.arange(0, BQ)
        t = c * Q + rq
        mt = t < L
        a = tl.load(ACS + base + rq)
        if REVERSE:
            w = tl.exp(a)
        else:
            w = tl.exp(a_last - a) * tl.load(DTP + base + rq)
        w = tl.where(mt, w, 0.0)
        x = tl.load(X + b.to(tl.int64) * s_xb + t.to(tl.int64)[:, None] * s_xl + h * s_xh + rp[None, :] * s_xp,
                    mask=mt[:, None] & (rp[None, :] < P), other=0.0).to(tl.float32)
        y = tl.load(Y + b.to(tl.int64) * s_yb + t.to(tl.int64)[:, None] * s_yl + g * s_yg + rn[None, :] * s_yn,
                    mask=mt[:, None] & (rn[None, :] < N), other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(x * w[:, None]), y, input_precision=PREC)
    o = (((b.to(tl.int64) * NC + c) * H + h) * P + rp[:, None]) * N + rn[None, :]
    tl.store(OUT + o, acc, mask=(rp[:, None] < P) & (rn[None, :] < N))


@triton.jit
def _state_pass(S, ACS, INIT, FINAL, STATES, H, NC, PN,
                HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, Q: tl.constexpr, BLOCK: tl.constexpr):
    """Forward: STATES[b, c, h] = H_{c-1} (entering chunk c), H_c = exp(a_Q^c) H_{c-1} + S_c,
    FINAL = H_{last}. REVERSE (gradients, INIT = dL/dH_last): STATES[b, c, h] = G_c,
    G_{c-1} = exp(a_Q^c) G_c + S_c, FINAL = G_{-1} (the initial state's gradient)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    r = pid * BLOCK + tl.arange(0, BLOCK)
    m = r < PN
    if HAS_INIT:
        state = tl.load(INIT + bh.to(tl.int64) * PN + r, mask=m, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, NC):
        if REVERSE:
            c = NC - 1 - k
        else:
            c = k
        o = ((b.to(tl.int64) * NC + c) * H + h) * PN + r
        tl.store(STATES + o, state, mask=m)
        decay = tl.exp(tl.load(ACS + (bh.to(tl.int64) * NC + c) * Q + Q - 1))
        state = decay * state + tl.load(S + o, mask=m, other=0.0)
    tl.store(FINAL + bh.to(tl.int64) * PN + r, state, mask=m)


@triton.jit
def _chunk_out(X, s_xb, s_xl, s_xh, s_xp, Bm, Cm, s_bb, s_bl, s_bg, s_bn, Z, s_zb, s_zl, s_zh, s_zp,
               D, DTP, ACS, STATES, OUT, YPRE, L, H, G, P, N, NC,
               HAS_D: tl.constexpr, D_PER_P: tl.constexpr, HAS_Z: tl.constexpr,
               Q: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
               BN: tl.constexpr, PREC: tl.constexpr):
    """out rows [i0, i0 + BM) x columns of a p-block of one chunk of one head (OUT, YPRE
    contiguous [b, l, h, p]; YPRE = y before the z gate, kept for the backward)."""
    pid, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    npb = tl.cdiv(P, BP)
    im, ip = pid // npb, pid % npb
    b, h = bh // H, bh % H
    g = h // (H // G)
    ri = im * BM + tl.arange(0, BM)
    rp = ip * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    base = (bh.to(tl.int64) * NC + c) * Q
    ti = c * Q + ri
    mi = ti < L
    a_i = tl.load(ACS + base + ri)
    cm = tl.load(Cm + b.to(tl.int64) * s_bb + ti.to(tl.int64)[:, None] * s_bl + g * s_bg + rn[None, :] * s_bn,
                 mask=mi[:, None] & (rn[None, :] < N), other=0.0).to(tl.float32)
    # the state entering the chunk, H [p, n]: y_i += exp(a_i) H C_i
    so = ((b.to(tl.int64) * NC + c) * H + h) * P * N
    hs = tl.load(STATES + so + rp[None, :] * N + rn[:, None], mask=(rp[None, :] < P) & (rn[:, None] < N),
                 other=0.0)                                                        # [n, p]
    acc = tl.dot(cm, hs, input_precision=PREC) * tl.exp(a_i)[:, None]
    for k0 in range(0, (im + 1) * BM, BK):
        rk = k0 + tl.arange(0, BK)
        tk = c * Q + rk
        mk = tk < L
        a_k = tl.load(ACS + base + rk)
        dt_k = tl.load(DTP + base + rk)
        bk = tl.load(Bm + b.to(tl.int64) * s_bb + tk.to(tl.int64)[:, None] * s_bl + g * s_bg + rn[None, :] * s_bn,
                     mask=mk[:, None] & (rn[None, :] < N), other=0.0).to(tl.float32)
        cb = tl.dot(cm, tl.trans(bk), input_precision=PREC)  # [BM, BK]
        keep = ri[:, None] >= rk[None, :]
        cb = tl.where(keep, cb * tl.exp(tl.where(keep, a_i[:, None] - a_k[None, :], 0.0)), 0.0) * dt_k[None, :]
        xk = tl.load(X + b.to(tl.int64) * s_xb + tk.to(tl.int64)[:, None] * s_xl + h * s_xh + rp[None, :] * s_xp,
                     mask=mk[:, None] & (rp[None, :] < P), other=0.0).to(tl.float32)
        acc += tl.dot(cb, xk, input_precision=PREC)
    mo = mi[:, None] & (rp[None, :] < P)
    if HAS_D:
        xi = tl.load(X + b.to(tl.int64) * s_xb + ti.to(tl.int64)[:, None] * s_xl + h * s_xh + rp[None, :] * s_xp,
                     mask=mo, other=0.0).to(tl.float32)
        if D_PER_P:
            d = tl.load(D + h * P + rp, mask=rp < P, other=0.0).to(tl.float32)[None, :]
        else:
            d = tl.load(D + h).to(tl.float32)
        acc += d * xi
    o = ((b.to(tl.int64) * L + ti.to(tl.int64)[:, None]) * H + h) * P + rp[None, :]
    if HAS_Z:
        tl.store(YPRE + o, acc, mask=mo)
        z = tl.load(Z + b.to(tl.int64) * s_zb + ti.to(tl.int64)[:, None] * s_zl + h * s_zh + rp[None, :] * s_zp,
                    mask=mo, other=0.0).to(tl.float32)
        acc = acc * z * tl.sigmoid(z)
    tl.store(OUT + o, acc.to(OUT.dtype.element_ty), mask=mo)


@triton.jit
def _chunk_bwd_dx(X, s_xb, s_xl, s_xh, s_xp, Bm, Cm, s_bb, s_bl, s_bg, s_bn, DY, D, DTP, ACS, GS,
                  DX, DB, DDT, DACOL, PEND, DDP, L, H, G, P, N, NC,
                  HAS_D: tl.constexpr, D_PER_P: tl.constexpr, Q: tl.constexpr, BJ: tl.constexpr,
                  BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """Column block j of one chunk of one head: dx_j, dB_j (this head's part), d dt'_j, and the
    column part of d a_j. DY: contiguous [b, l, h, p] fp32; GS[b, c, h] = dL/dH_c."""
    jb, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    g = h // (H // G)
    rj = jb * BJ + tl.arange(0, BJ)
    rp = tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    base = (bh.to(tl.int64) * NC + c) * Q
    tj = c * Q + rj
    mj = tj < L
    a_j = tl.load(ACS + base + rj)
    dt_j = tl.load(DTP + base + rj)
    a_last = tl.load(ACS + base + Q - 1)
    xj = tl.load(X + b.to(tl.int64) * s_xb + tj.to(tl.int64)[:, None] * s_xl + h * s_xh + rp[None, :] * s_xp,
                 mask=mj[:, None] & mp[None, :], other=0.0).to(tl.float32)
    bj = tl.load(Bm + b.to(tl.int64) * s_bb + tj.to(tl.int64)[:, None] * s_bl + g * s_bg + rn[None, :] * s_bn,
                 mask=mj[:, None] & mn[None, :], other=0.0).to(tl.float32)
    dx = tl.zeros((BJ, BP), dtype=tl.float32)
    db = tl.zeros((BJ, BN), dtype=tl.float32)
    coln = tl.zeros((BJ,), dtype=tl.float32)
    for i0 in range(jb * BJ, Q, BI):
        ri = i0 + tl.arange(0, BI)
        ti = c * Q + ri
        mi = ti < L
        a_i = tl.load(ACS + base + ri)
        ci = tl.load(Cm + b.to(tl.int64) * s_bb + ti.to(tl.int64)[:, None] * s_bl + g * s_bg + rn[None, :] * s_bn,
                     mask=mi[:, None] & mn[None, :], other=0.0).to(tl.float32)
        dyi = tl.load(DY + ((b.to(tl.int64) * L + ti.to(tl.int64)[:, None]) * H + h) * P + rp[None, :],
                      mask=mi[:, None] & mp[None, :], other=0.0)
        keep = rj[:, None] <= ri[None, :]
        e = tl.where(keep, tl.exp(tl.where(keep, a_i[None, :] - a_j[:, None], 0.0)), 0.0)   # [BJ, BI]
        w = tl.dot(bj, tl.trans(ci), input_precision=PREC) * e                                           # (C_i.B_j) E_ij
        v = tl.dot(xj, tl.trans(dyi), input_precision=PREC) * e                                          # (dy_i.x_j) E_ij
        dx += tl.dot(w * dt_j[:, None], dyi, input_precision=PREC)
        db += tl.dot(v, ci, input_precision=PREC)
        coln += tl.sum(w * tl.dot(xj, tl.trans(dyi), input_precision=PREC), axis=1)
    # through the chunk's state S_c = sum_j exp(a_Q - a_j) dt'_j x_j B_j^T
    go = ((b.to(tl.int64) * NC + c) * H + h) * P * N
    gs = tl.load(GS + go + rp[:, None] * N + rn[None, :], mask=mp[:, None] & mn[None, :], other=0.0)  # [p, n]
    s = tl.where(mj, tl.exp(a_last - a_j), 0.0)
    xg = tl.dot(xj, gs, input_precision=PREC)                                                            # [BJ, n]
    db = db * dt_j[:, None] + (s * dt_j)[:, None] * xg
    dx += (s * dt_j)[:, None] * tl.dot(bj, tl.trans(gs), input_precision=PREC)
    pj = s * tl.sum(xg * bj, axis=1)
    ddt = coln + pj
    if HAS_D:
        dyj = tl.load(DY + ((b.to(tl.int64) * L + tj.to(tl.int64)[:, None]) * H + h) * P + rp[None, :],
                      mask=mj[:, None] & mp[None, :], other=0.0)
        if D_PER_P:
            d = tl.load(D + h * P + rp, mask=mp, other=0.0).to(tl.float32)[None, :]
        else:
            d = tl.load(D + h).to(tl.float32)
        dx += d * dyj
        part = tl.sum(dyj * xj, axis=0)                                            # [BP]
        po = ((bh.to(tl.int64) * NC + c) * tl.num_programs(0) + jb) * BP + rp
        tl.store(DDP + po, part)
    o = ((b.to(tl.int64) * L + tj.to(tl.int64)[:, None]) * H + h)
    tl.store(DX + o * P + rp[None, :], dx.to(DX.dtype.element_ty), mask=mj[:, None] & mp[None, :])
    tl.store(DB + o * N + rn[None, :], db, mask=mj[:, None] & mn[None, :])
    tl.store(DDT + base + rj, tl.where(mj, ddt, 0.0))
    tl.store(DACOL + base + rj, tl.where(mj, -(coln + pj) * dt_j, 0.0))
    tl.store(PEND + base + rj, tl.where(mj, pj * dt_j, 0.0))


@triton.jit
def _chunk_bwd_dc(X, s_xb, s_xl, s_xh, s_xp, Bm, Cm, s_bb, s_bl, s_bg, s_bn, DY, DTP, ACS, STATES,
                  DC, DAROW, L, H, G, P, N, NC,
                  Q: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                  BN: tl.constexpr, PREC: tl.constexpr):
    """Row block i of one chunk of one head: dC_i (this head's part) and the row part of d a_i."""
    ib, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    g = h // (H // G)
    ri = ib * BI + tl.arange(0, BI)
    rp = tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    base = (bh.to(tl.int64) * NC + c) * Q
    ti = c * Q + ri
    mi = ti < L
    a_i = tl.load(ACS + base + ri)
    ci = tl.load(Cm + b.to(tl.int64) * s_bb + ti.to(tl.int64)[:, None] * s_bl + g * s_bg + rn[None, :] * s_bn,
                 mask=mi[:, None] & mn[None, :], other=0.0).to(tl.float32)
    dyi = tl.load(DY + ((b.to(tl.int64) * L + ti.to(tl.int64)[:, None]) * H + h) * P + rp[None, :],
                  mask=mi[:, None] & mp[None, :], other=0.0)
    dc = tl.zeros((BI, BN), dtype=tl.float32)
    rowm = tl.zeros((BI,), dtype=tl.float32)
    for j0 in range(0, (ib + 1) * BI, BJ):
        rj = j0 + tl.arange(0, BJ)
        tj = c * Q + rj
        mj = tj < L
        a_j = tl.load(ACS + base + rj)
        dt_j = tl.load(DTP + base + rj)
        bj = tl.load(Bm + b.to(tl.int64) * s_bb + tj.to(tl.int64)[:, None] * s_bl + g * s_bg + rn[None, :] * s_bn,
                     mask=mj[:, None] & mn[None, :], other=0.0).to(tl.float32)
        xj = tl.load(X + b.to(tl.int64) * s_xb + tj.to(tl.int64)[:, None] * s_xl + h * s_xh + rp[None, :] * s_xp,
                     mask=mj[:, None] & mp[None, :], other=0.0).to(tl.float32)
        keep = ri[:, None] >= rj[None, :]
        e = tl.where(keep, tl.exp(tl.where(keep, a_i[:, None] - a_j[None, :], 0.0)), 0.0)   # [BI, BJ]
        v = tl.dot(dyi, tl.trans(xj), input_precision=PREC) * e * dt_j[None, :]
        dc += tl.dot(v, bj, input_precision=PREC)
        rowm += tl.sum(v * tl.dot(ci, tl.trans(bj), input_precision=PREC), axis=1)
    so = ((b.to(tl.int64) * NC + c) * H + h) * P * N
    hs = tl.load(STATES + so + rp[:, None] * N + rn[None, :], mask=mp[:, None] & mn[None, :], other=0.0)  # [p, n]
    t = tl.dot(dyi, hs, input_precision=PREC) * tl.where(mi, tl.exp(a_i), 0.0)[:, None]                  # [BI, n]
    dc += t
    rowm += tl.sum(t * ci, axis=1)
    o = ((b.to(tl.int64) * L + ti.to(tl.int64)[:, None]) * H + h)
    tl.store(DC + o * N + rn[None, :], dc, mask=mi[:, None] & mn[None, :])
    tl.store(DAROW + base + ri, tl.where(mi, rowm, 0.0))


# ----------------------------------------------------------------------------- SSD: host side
def _prec(x):
    """tl.dot's precision for fp32 operands: IEEE fp32 for fp32 inputs (Triton's default, TF32,
    misses the fp32 reference by ~1e-3), TF32 for the fp32 intermediates of bf16 / fp16 inputs."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _strides4(t):
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def _blocks(Q, P, N, interp):
    BP, BN = max(16, next_pow2(P)), max(16, next_pow2(N))
    BM = min(Q, 64 if BN <= 128 else 32)
    return BM, BP, BN


def _forward(x, dt, A, B, C, Q, D, z, dt_bias, dt_softplus, dt_limit, init):
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc = cdiv(l, Q)
    dev = x.device
    f32 = dict(device=dev, dtype=torch.float32)
    dtp = torch.empty(b, h, nc, Q, **f32)
    acs = torch.empty(b, h, nc, Q, **f32)
    clamp = tuple(dt_limit) != (0.0, float("inf"))
    _dt_cumsum[(nc, b * h)](dt, *dt.stride(), dt_bias if dt_bias is not None else dt, A, dtp, acs,
                            l, h, nc, float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
                            HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), CLAMP=clamp, Q=Q)
    BM, BP, BN = _blocks(Q, p, n, False)
    chunk_states = torch.empty(b, nc, h, p, n, **f32)
    bp_s, bn_s = min(BP, 64), min(BN, 64)
    grid = (cdiv(p, bp_s) * cdiv(n, bn_s), nc, b * h)
    _chunk_state[grid](x, *_strides4(x), B, *_strides4(B), dtp, acs, chunk_states, l, h, g, p, n, nc,
                       REVERSE=False, Q=Q, BQ=min(Q, 32), BP=bp_s, BN=bn_s, PREC=_prec(x))
    states = torch.empty(b, nc, h, p, n, **f32)
    final = torch.empty(b, h, p, n, **f32)
    blk = 256
    _state_pass[(cdiv(p * n, blk), b * h)](chunk_states, acs, init if init is not None else final, final,
                                           states, h, nc, p * n, HAS_INIT=init is not None,
                                           REVERSE=False, Q=Q, BLOCK=blk)
    out = torch.empty(b, l, h, p, device=dev, dtype=x.dtype)
    ypre = torch.empty(b, l, h, p, **f32) if z is not None else out
    zz = z if z is not None else x
    bp_o = min(BP, 64)
    grid = (cdiv(Q, BM) * cdiv(p, bp_o), nc, b * h)
    _chunk_out[grid](x, *_strides4(x), B, C, *_strides4(B), zz, *_strides4(zz),
                     D if D is not None else x, dtp, acs, states, out, ypre, l, h, g, p, n, nc,
                     HAS_D=D is not None, D_PER_P=D is not None and D.dim() == 2, HAS_Z=z is not None,
                     Q=Q, BM=BM, BK=BM, BP=bp_o, BN=BN, PREC=_prec(x))
    return out, final, (dtp, acs, states, ypre if z is not None else None)


class _SSDScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, Q, D, z, dt_bias, dt_softplus, dt_limit, init):
        out, final, (dtp, acs, states, ypre) = _forward(x, dt, A, B, C, Q, D, z, dt_bias, dt_softplus,
                                                        dt_limit, init)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, init, dtp, acs, states, ypre)
        ctx.Q, ctx.dt_softplus, ctx.dt_limit = Q, dt_softplus, dt_limit
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, dt, A, B, C, D, z, dt_bias, init, dtp, acs, states, ypre = ctx.saved_tensors
        Q = ctx.Q
        b, l, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        nc = cdiv(l, Q)
        dev = x.device
        f32 = dict(device=dev, dtype=torch.float32)
        dout = dout.float()
        dz = None
        if z is not None:
            zf = z.float()
            sig = torch.sigmoid(zf)
            dy = (dout * zf * sig).contiguous()
            dz = (dout * ypre * sig * (1 + zf * (1 - sig))).to(z.dtype)
        else:
            dy = dout.contiguous()
        BM, BP, BN = _blocks(Q, p, n, False)
        # dL/dH_c, chunk by chunk from the end
        dstate_in = torch.empty(b, nc, h, p, n, **f32)
        bp_s, bn_s = min(BP, 64), min(BN, 64)
        dy4 = dy
        _chunk_state[(cdiv(p, bp_s) * cdiv(n, bn_s), nc, b * h)](
            dy4, *_strides4(dy4), C, *_strides4(C), dtp, acs, dstate_in, l, h, g, p, n, nc,
            REVERSE=True, Q=Q, BQ=min(Q, 32), BP=bp_s, BN=bn_s, PREC=_prec(x))
        gstates = torch.empty(b, nc, h, p, n, **f32)
        dinit = torch.empty(b, h, p, n, **f32)
        dlast = dfinal.float().contiguous() if dfinal is not None else None
        blk = 256
        _state_pass[(cdiv(p * n, blk), b * h)](dstate_in, acs, dlast if dlast is not None else dinit, dinit,
                                               gstates, h, nc, p * n, HAS_INIT=dlast is not None,
                                               REVERSE=True, Q=Q, BLOCK=blk)
        dx = torch.empty(b, l, h, p, device=dev, dtype=x.dtype)
        dBh = torch.empty(b, l, h, n, **f32)
        dCh = torch.empty(b, l, h, n, **f32)
        ddt = torch.empty(b, h, nc, Q, **f32)
        dacol = torch.empty(b, h, nc, Q, **f32)
        darow = torch.empty(b, h, nc, Q, **f32)
        pend = torch.empty(b, h, nc, Q, **f32)
        BJ = BM
        nj = cdiv(Q, BJ)
        ddp = torch.empty(b, h, nc, nj, BP, **f32) if D is not None else dacol
        _chunk_bwd_dx[(nj, nc, b * h)](x, *_strides4(x), B, C, *_strides4(B), dy, D if D is not None else x,
                                       dtp, acs, gstates, dx, dBh, ddt, dacol, pend, ddp, l, h, g, p, n, nc,
                                       HAS_D=D is not None, D_PER_P=D is not None and D.dim() == 2,
                                       Q=Q, BJ=BJ, BI=BJ, BP=BP, BN=BN, PREC=_prec(x))
        _chunk_bwd_dc[(nj, nc, b * h)](x, *_strides4(x), B, C, *_strides4(B), dy, dtp, acs, states,
                                       dCh, darow, l, h, g, p, n, nc, Q=Q, BI=BJ, BJ=BJ, BP=BP, BN=BN, PREC=_prec(x))
        # d a -> d (dt' A): the state carried across each chunk and the chunk-state terms meet at a_Q
        da = darow + dacol
        decay = torch.exp(acs[..., -1])                                             # [b, h, nc]
        carry = decay * torch.einsum("bchpn,bchpn->bhc", gstates, states)
        da[..., -1] += pend.sum(-1) + carry
        dda = da.flip(-1).cumsum(-1).flip(-1)                                       # d (dt' A) per step
        Af = A.float()
        ddtp = ddt + dda * Af[None, :, None, None]
        dA = (dda * dtp).sum(dim=(0, 2, 3)).to(A.dtype)
        ddtp = ddtp.reshape(b, h, nc * Q)[..., :l].permute(0, 2, 1)                # [b, l, h]
        raw = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        if ctx.dt_softplus:
            ddtp = ddtp * torch.where(raw <= 20.0, torch.sigmoid(raw), torch.ones_like(raw))
            val = F.softplus(raw)
        else:
            val = raw
        if tuple(ctx.dt_limit) != (0.0, float("inf")):
            ddtp = ddtp * ((val >= ctx.dt_limit[0]) & (val <= ctx.dt_limit[1])).float()
        ddt_raw = ddtp.to(dt.dtype)
        ddt_bias = ddtp.sum(dim=(0, 1)).to(dt_bias.dtype) if dt_bias is not None else None
        dB = dBh.view(b, l, g, h // g, n).sum(3).to(B.dtype)
        dC = dCh.view(b, l, g, h // g, n).sum(3).to(C.dtype)
        dD = None
        if D is not None:
            part = ddp.sum(dim=(0, 2, 3))[:, :p]                                    # [h, p]
            dD = (part if D.dim() == 2 else part.sum(-1)).to(D.dtype)
        dinit_out = dinit.to(init.dtype) if init is not None else None
        return dx, ddt_raw, dA, dB, dC, None, dD, dz, ddt_bias, None, None, dinit_out


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None,
             return_final_states=False):
    why = kernel_reason(x, dt, B, C, z)
    Q = int(chunk_size)
    if why is None and seq_idx is not None:
        why = "seq_idx (packed sequences) has no kernel here"
    if why is None and (x.size(-1) > MAX_DIM or B.size(-1) > MAX_DIM):
        why = f"head dim {x.size(-1)} / state dim {B.size(-1)} above {MAX_DIM}"
    if why is None and (Q < 16 or Q & (Q - 1)):
        why = f"chunk_size {Q} is not a power of two >= 16"
    if why is not None:
        return fallback("ssd_scan", why, x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                        dt_softplus=dt_softplus, dt_limit=dt_limit, initial_states=initial_states,
                        seq_idx=seq_idx, return_final_states=return_final_states)
    report.ran("ssd_scan", "cuda.triton.ssd_scan")
    if B.stride() != C.stride():   # the kernels read B and C with one set of strides
        B, C = B.contiguous(), C.contiguous()
    out, final = _SSDScan.apply(x, dt, A, B, C, Q, D, z, dt_bias, dt_softplus, tuple(dt_limit),
                                initial_states)
    return (out, final) if return_final_states else out


# ----------------------------------------------------------------------------- causal conv1d
@triton.jit
def _conv_fwd(X, s_xb, s_xl, s_xd, W, BIAS, Y, L, Dm,
              HAS_BIAS: tl.constexpr, SILU: tl.constexpr, WIDTH: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr):
    """y[b, t, d] = act(bias[d] + sum_k W[d, k] x[b, t - (WIDTH - 1) + k, d]) (Y contiguous)."""
    it, idd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rt = it * BT + tl.arange(0, BT)
    rd = idd * BD + tl.arange(0, BD)
    md = rd < Dm
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        src = rt - (WIDTH - 1) + k
        m = (src >= 0) & (src < L)
        xv = tl.load(X + b.to(tl.int64) * s_xb + src.to(tl.int64)[:, None] * s_xl + rd[None, :] * s_xd,
                     mask=m[:, None] & md[None, :], other=0.0).to(tl.float32)
        acc += xv * tl.load(W + rd * WIDTH + k, mask=md, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rd, mask=md, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    o = (b.to(tl.int64) * L + rt.to(tl.int64)[:, None]) * Dm + rd[None, :]
    tl.store(Y + o, acc.to(Y.dtype.element_ty), mask=(rt[:, None] < L) & md[None, :])


@triton.jit
def _conv_bwd(X, s_xb, s_xl, s_xd, W, BIAS, DY, DX, DWP, DBP, L, Dm, NT,
              HAS_BIAS: tl.constexpr, SILU: tl.constexpr, WIDTH: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr):
    """dx[t] = sum_k W[k] g[t + WIDTH - 1 - k], g = dy * act'(pre) (pre recomputed); dW / d bias
    partials of this (b, time block) in DWP [b, NT, d, WIDTH], DBP [b, NT, d]."""
    it, idd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rt = it * BT + tl.arange(0, BT)
    rd = idd * BD + tl.arange(0, BD)
    md = rd < Dm
    mt = rt < L
    dx = tl.zeros((BT, BD), dtype=tl.float32)
    dbias = tl.zeros((BD,), dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        # output step u = t + (WIDTH - 1) - k reads x[t] through tap k
        u = rt + (WIDTH - 1) - k
        mu = (u < L)
        pre = tl.zeros((BT, BD), dtype=tl.float32)
        for kk in tl.static_range(WIDTH):
            src = u - (WIDTH - 1) + kk
            m = (src >= 0) & (src < L)
            xv = tl.load(X + b.to(tl.int64) * s_xb + src.to(tl.int64)[:, None] * s_xl + rd[None, :] * s_xd,
                         mask=m[:, None] & md[None, :], other=0.0).to(tl.float32)
            pre += xv * tl.load(W + rd * WIDTH + kk, mask=md, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            pre += tl.load(BIAS + rd, mask=md, other=0.0).to(tl.float32)[None, :]
        gv = tl.load(DY + (b.to(tl.int64) * L + u.to(tl.int64)[:, None]) * Dm + rd[None, :],
                     mask=mu[:, None] & md[None, :], other=0.0).to(tl.float32)
        if SILU:
            s = tl.sigmoid(pre)
            gv = gv * s * (1 + pre * (1 - s))
        dx += gv * tl.load(W + rd * WIDTH + k, mask=md, other=0.0).to(tl.float32)[None, :]
        # dW[d, k] += sum_u g[u] x[u - (WIDTH - 1) + k] = sum_t g[t + WIDTH - 1 - k] x[t]
        xt = tl.load(X + b.to(tl.int64) * s_xb + rt.to(tl.int64)[:, None] * s_xl + rd[None, :] * s_xd,
                     mask=mt[:, None] & md[None, :], other=0.0).to(tl.float32)
        tl.store(DWP + ((b.to(tl.int64) * NT + it) * Dm + rd) * WIDTH + k, tl.sum(gv * xt, axis=0), mask=md)
        if k == WIDTH - 1:
            dbias = tl.sum(gv, axis=0)   # u = t: each output step once
    o = (b.to(tl.int64) * L + rt.to(tl.int64)[:, None]) * Dm + rd[None, :]
    tl.store(DX + o, dx.to(DX.dtype.element_ty), mask=mt[:, None] & md[None, :])
    if HAS_BIAS:
        tl.store(DBP + (b.to(tl.int64) * NT + it) * Dm + rd, dbias, mask=md)


_CONV_BT, _CONV_BD = 32, 64


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, silu):
        b, l, d = x.shape
        w = weight.contiguous()
        y = torch.empty(b, l, d, device=x.device, dtype=x.dtype)
        grid = (cdiv(l, _CONV_BT), cdiv(d, _CONV_BD), b)
        _conv_fwd[grid](x, *x.stride(), w, bias if bias is not None else w, y, l, d,
                        HAS_BIAS=bias is not None, SILU=silu, WIDTH=w.size(1), BT=_CONV_BT, BD=_CONV_BD)
        ctx.save_for_backward(x, w, bias)
        ctx.silu, ctx.weight_dtype = silu, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, bias = ctx.saved_tensors
        b, l, d = x.shape
        nt = cdiv(l, _CONV_BT)
        dy = dy.contiguous()
        dx = torch.empty(b, l, d, device=x.device, dtype=x.dtype)
        dwp = torch.empty(b, nt, d, w.size(1), device=x.device, dtype=torch.float32)
        dbp = torch.empty(b, nt, d, device=x.device, dtype=torch.float32) if bias is not None else dwp
        _conv_bwd[(nt, cdiv(d, _CONV_BD), b)](x, *x.stride(), w, bias if bias is not None else w, dy, dx,
                                              dwp, dbp, l, d, nt, HAS_BIAS=bias is not None, SILU=ctx.silu,
                                              WIDTH=w.size(1), BT=_CONV_BT, BD=_CONV_BD)
        dw = dwp.sum(dim=(0, 1)).to(ctx.weight_dtype)
        db = dbp.sum(dim=(0, 1)).to(bias.dtype) if bias is not None else None
        return dx, dw, db, None


def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r}: None, 'silu' or 'swish'")
    why = kernel_reason(x, weight, bias)
    if why is None and seq_idx is not None:
        why = "seq_idx (packed sequences) has no kernel here"
    if why is not None:
        return fallback("causal_conv1d", why, x, weight, bias, activation, seq_idx)
    report.ran("causal_conv1d", "cuda.triton.causal_conv1d")
    return _CausalConv1d.apply(x, weight, bias, activation is not None)


# ----------------------------------------------------------------------------- gated RMSNorm
@triton.jit
def _gnorm_fwd(X, Z, W, Y, RSTD, GS, D, eps, HAS_Z: tl.constexpr, BEFORE: tl.constexpr,
               BLOCK: tl.constexpr):
    row, grp = tl.program_id(0), tl.program_id(1)
    cols = grp * GS + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < GS
    o = row.to(tl.int64) * D + cols
    x = tl.load(X + o, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + o, mask=m, other=0.0).to(tl.float32)
        if not BEFORE:
            x = x * z * tl.sigmoid(z)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / GS + eps)
    y = x * rstd * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        if BEFORE:
            y = y * z * tl.sigmoid(z)
    tl.store(Y + o, y.to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + row.to(tl.int64) * (D // GS) + grp, rstd)


@triton.jit
def _gnorm_bwd(X, Z, W, DY, RSTD, DX, DZ, DWP, GS, D, HAS_Z: tl.constexpr, BEFORE: tl.constexpr,
               BLOCK: tl.constexpr):
    """One (row, group): dx, dz, and this row's dw part (DWP [rows, d] fp32, summed afterwards)."""
    row, grp = tl.program_id(0), tl.program_id(1)
    cols = grp * GS + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < GS
    o = row.to(tl.int64) * D + cols
    x = tl.load(X + o, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + o, mask=m, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row.to(tl.int64) * (D // GS) + grp)
    if HAS_Z:
        z = tl.load(Z + o, mask=m, other=0.0).to(tl.float32)
        sz = tl.sigmoid(z)
        dsilu = sz * (1 + z * (1 - sz))
        if BEFORE:
            xhat = x * rstd
            dz = dy * xhat * w * dsilu
            dy = dy * z * sz
        else:
            xg = x * z * sz
            xhat = xg * rstd
    else:
        xhat = x * rstd
    dxhat = dy * w
    c = tl.sum(dxhat * xhat, axis=0) / GS
    dxin = (dxhat - xhat * c) * rstd          # gradient wrt the normalised input
    if HAS_Z:
        if not BEFORE:
            dz = dxin * x * dsilu
            dxin = dxin * z * sz
        tl.store(DZ + o, dz.to(DZ.dtype.element_ty), mask=m)
    tl.store(DX + o, dxin.to(DX.dtype.element_ty), mask=m)
    tl.store(DWP + o, dy * xhat, mask=m)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, z, eps, group_size, norm_before_gate):
        shape = x.shape
        d = shape[-1]
        x2 = x.reshape(-1, d).contiguous()
        z2 = z.reshape(-1, d).contiguous() if z is not None else None
        rows = x2.size(0)
        gs = d if group_size is None else int(group_size)
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, d // gs, device=x.device, dtype=torch.float32)
        _gnorm_fwd[(rows, d // gs)](x2, z2 if z2 is not None else x2, weight, y, rstd, gs, d, eps,
                                    HAS_Z=z is not None, BEFORE=bool(norm_before_gate), BLOCK=next_pow2(gs))
        ctx.save_for_backward(x2, z2, weight, rstd)
        ctx.gs, ctx.before, ctx.shape = gs, bool(norm_before_gate), shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, z2, weight, rstd = ctx.saved_tensors
        d = x2.size(1)
        dy2 = dy.reshape(-1, d).contiguous()
        dx = torch.empty_like(x2)
        dz = torch.empty_like(z2) if z2 is not None else None
        dwp = torch.empty(x2.shape, device=x2.device, dtype=torch.float32)
        _gnorm_bwd[(x2.size(0), d // ctx.gs)](x2, z2 if z2 is not None else x2, weight, dy2, rstd, dx,
                                              dz if dz is not None else dx, dwp, ctx.gs, d,
                                              HAS_Z=z2 is not None, BEFORE=ctx.before,
                                              BLOCK=next_pow2(ctx.gs))
        dw = dwp.sum(0).to(weight.dtype)
        return (dx.view(ctx.shape), dw, dz.view(ctx.shape) if dz is not None else None, None, None, None)


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    why = kernel_reason(x, weight, z)
    gs = x.size(-1) if group_size is None else int(group_size)
    if why is None and gs > 16384:
        why = f"group size {gs} above 16384"
    if why is not None:
        return fallback("rms_norm_gated", why, x, weight, z, eps, group_size, norm_before_gate)
    report.ran("rms_norm_gated", "cuda.triton.rms_norm_gated")
    return _GatedRMSNorm.apply(x, weight, z, float(eps), group_size, norm_before_gate)



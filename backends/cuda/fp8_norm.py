"""The norm before an fp8 linear, computed inside that linear's cast (delayed scaling): op `fp8_norm`.

Under fp8, the RMSNorm / LayerNorm in front of QKV and fc1 (TE's LayerNormLinear, megatron-adapt's
AdaptLayerNormColumnParallelLinear) wrote its bf16 output, and the linear's cast read it back to
write the e4m3 copy and its transposed copy. Here the norm hands on a `NormOutput` (see
fp8_deferred): the linear's cast finds each row's statistics (one read of the norm's input; they are
the mean / rstd the norm's backward, norms.norm_backward, reads as it reads its own), then its cast
kernel reads the input again and writes only the fp8 copies and the amax: the bf16 output is never
written and read back.

- The values cast are the norm's bf16 output as the norm kernel computes it (fp32 statistics,
  rounded once to the input dtype).
- Anything else that touches a NormOutput computes the norm in bf16 (reported under fp8_norm).
"""
from __future__ import annotations

import torch

from megatron_adapt import report
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Scaling

from ._common import cdiv, interpreting
from .fp8 import _cast_torch, _cast_triton, _triton_here, triton
from .fp8_deferred import Deferred, delayed_state

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _norm_stats_kernel(x_ptr, mean_ptr, rstd_ptr, M, N, eps, IS_RMS: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK: tl.constexpr):
        """mean (LayerNorm) and rstd of ROWS rows of x [M, N], each row whole in registers, as the
        norm kernel finds them (norms._norm_fwd: LayerNorm from shifted sums, fp32)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        cols = tl.arange(0, BLOCK)
        m = rmask[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        else:
            shift = tl.load(x_ptr + rows.to(tl.int64) * N, mask=rmask, other=0.0).to(tl.float32)
            d = tl.where(m, x - shift[:, None], 0.0)
            md = tl.sum(d, axis=1) / N
            rstd = 1.0 / tl.sqrt(tl.maximum(tl.sum(d * d, axis=1) / N - md * md, 0.0) + eps)
            tl.store(mean_ptr + rows, shift + md, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)

    @triton.jit
    def _norm_at(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r, c, N, mask, IS_RMS: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
        """The norm of x [M, N] at rows r, columns c from the rows' statistics, rounded to x's
        dtype, as fp32."""
        x = tl.load(x_ptr + r * N + c, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=mask, other=0.0)
        if IS_RMS:
            y = x * rstd
        else:
            y = (x - tl.load(mean_ptr + r, mask=mask, other=0.0)) * rstd
        y = y * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
        return y.to(x_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _norm_cast_kernel(x_ptr, w_ptr, b_ptr, y_ptr, yt_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr,
                          scale_inv_ptr, M, N, FP8_MAX: tl.constexpr, IS_RMS: tl.constexpr,
                          HAS_BIAS: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """y [M, N] (and y^T [N, M]) = fp8(norm(x) * scale) over BM x BN tiles; its amax into amax_ptr."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = pn * BN + tl.arange(0, BN)
        s = tl.load(scale_ptr)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        v = _norm_at(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rm[:, None], rn[None, :], N, mask, IS_RMS, HAS_BIAS)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(v), 1), 0))
        q = tl.minimum(tl.maximum(v * s, -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], q.to(y_ptr.dtype.element_ty), mask=mask)
        if TRANSPOSE:   # recomputed in transposed order (no tl.trans, and no store through
            # transposed addresses: both stored wrong elements of fp32 tiles on an H100, Triton 3.6)
            mt = (rn[:, None] < N) & (rm[None, :] < M)
            vt = _norm_at(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rm[None, :], rn[:, None], N, mt, IS_RMS, HAS_BIAS)
            qt = tl.minimum(tl.maximum(vt * s, -FP8_MAX), FP8_MAX)
            tl.store(yt_ptr + rn[:, None] * M + rm[None, :], qt.to(yt_ptr.dtype.element_ty), mask=mt)
        if (pm == 0) & (pn == 0):
            tl.store(scale_inv_ptr, 1.0 / s)


TILES = (32, 128, 4)   # BM, BN, num_warps of the cast kernel on a GPU (scripts/fp8_norm_bench.py --tiles)
STATS_ELEMENTS = 8192   # elements a program of the statistics kernel holds (whole rows)
STATS_MAX = 16384       # the widest row it holds in registers


def norm_reference(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float, is_rms: bool):
    """(norm of x2 [M, N] in fp32 rounded once to x2's dtype, mean [M], rstd [M]) fp32 statistics."""
    xf = x2.float()
    if is_rms:
        mean = torch.zeros(xf.shape[0], dtype=torch.float32, device=x2.device)
        rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    else:
        mean = xf.mean(-1)
        rstd = torch.rsqrt((xf - mean[:, None]).square().mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * w.float()
    if b is not None:
        y = y + b.float()
    return y.to(x2.dtype), mean, rstd


class NormOutput(Deferred):
    """RMSNorm / LayerNorm of x [..., N]: [..., N]. parts: x2 [M, N], w, b | None, eps, is_rms, and
    the mean / rstd buffers [M] that whoever computes it fills for the norm's backward."""
    op, fallback = "fp8_norm", "the norm in bf16, then the linear's own cast"

    def _stats_into(self, mean, rstd):
        held_mean, held_rstd = self.parts[5], self.parts[6]
        held_rstd.copy_(rstd)
        if held_mean is not held_rstd:
            held_mean.copy_(mean)

    def materialize(self):
        x2, w, b, eps, is_rms = self.parts[:5]
        y, mean, rstd = norm_reference(x2, w, b, eps, is_rms)
        with torch.no_grad():
            self._stats_into(mean, rstd)
        return y.view(self.shape)

    def fp8_quantize(self, dtype, transpose: bool, scaling: Fp8Scaling, direction: str, slot: int):
        """(y8 [M, N], y8^T [N, M] or None, 1/scale): quantize(norm(x)) in one kernel."""
        x2, w, b, eps, is_rms, mean, rstd = self.parts
        scale, amax = delayed_state(scaling, direction, slot)
        if not _triton_here(x2):
            report.ran("fp8_norm", "torch (norm, then cast)")
            y, m, r = norm_reference(x2, w, b, eps, is_rms)
            with torch.no_grad():
                self._stats_into(m, r)
            return _cast_torch(y, dtype, transpose, scale, amax)
        M, N = x2.shape
        if N > STATS_MAX:
            report.fell_back("fp8_norm", "the norm in fp32 (torch), then the cast kernel",
                             f"rows of {N} elements: the statistics kernel holds rows up to {STATS_MAX}")
            y = self.materialize().reshape(M, N)
            return _cast_triton(y, dtype, transpose, scale, amax)
        report.ran("fp8_norm", "cuda.triton(norm + fp8 cast)")
        out = torch.empty(M, N, dtype=dtype, device=x2.device)
        out_t = torch.empty(N, M, dtype=dtype, device=x2.device) if transpose else None
        scale_inv = torch.empty(1, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(N)
        rows = max(1, STATS_ELEMENTS // block)
        _norm_stats_kernel[(cdiv(M, rows),)](x2, mean, rstd, M, N, eps, IS_RMS=is_rms, ROWS=rows, BLOCK=block,
                                             num_warps=4 if interpreting() else 8)
        bm, bn, warps = (16, 16, 4) if interpreting() else TILES
        _norm_cast_kernel[(cdiv(M, bm), cdiv(N, bn))](
            x2, w, w if b is None else b, out, out if out_t is None else out_t, mean, rstd, scale, amax,
            scale_inv, M, N, FP8_MAX=FP8_MAX[dtype], IS_RMS=is_rms, HAS_BIAS=b is not None,
            TRANSPOSE=transpose, BM=bm, BN=bn, num_warps=warps)
        return out, out_t, scale_inv


class _DeferredNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else None
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        mean = rstd if is_rms else torch.empty_like(rstd)
        ctx.save_for_backward(x2, w, b)
        # written by whoever computes the output (its consumer's cast, or a fallback), which runs
        # before this backward; kept off save_for_backward, which would see those writes as in-place
        ctx.stats = (mean, rstd)
        ctx.is_rms, ctx.x_shape, ctx.eps = is_rms, x.shape, eps
        ctx.wdtype, ctx.bdtype = weight.dtype, bias.dtype if bias is not None else None
        return NormOutput(x.shape, x, x2, w, b, eps, is_rms, mean, rstd)

    @staticmethod
    def backward(ctx, dy):
        x2, w, b = ctx.saved_tensors
        mean, rstd = ctx.stats
        d2 = dy.reshape(x2.shape)
        if _triton_here(x2):
            from .norms import norm_backward

            dx, dw, db = norm_backward(x2, w, d2, mean, rstd, ctx.is_rms, ctx.wdtype, ctx.bdtype)
        else:   # CPU tensors (the tests' torch path): autograd through the reference
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() if t is not None else None for t in (x2, w, b)]
                y = norm_reference(*leaves, ctx.eps, ctx.is_rms)[0]
                grads = torch.autograd.grad(y, [t for t in leaves if t is not None], d2)
            dx, dw, db = (*grads, None) if b is None else grads
        return dx.view(ctx.x_shape), dw, db, None, None


def fp8_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool):
    """RMSNorm (is_rms, bias None) or LayerNorm of x [..., N] for an fp8 linear under delayed scaling
    to consume: computed inside that linear's cast (its backward is the norm's own)."""
    return _DeferredNorm.apply(x, weight, bias, float(eps), bool(is_rms))

"""fp8 linears: forward, dgrad and wgrad GEMMs in fp8 through `torch._scaled_mm` (cuBLASLt).

`fp8_linear(x, weight, bias, scaling, wgrad_sink)` is an autograd function:
- forward  y  = x @ W^T      e4m3 x e4m3, bf16/fp16 out, fast accumulation (as TE's fprop);
- dgrad    dx = dy @ W       dy in e5m2 (`hybrid`) or e4m3, W e4m3, split accumulation;
- wgrad    dW = dy^T @ x     the same operands, fp32 out (handed to `wgrad_sink`, e.g. Megatron's
                             main_grad accumulation) or weight.dtype; where the sink exposes an fp32
                             main_grad, added into it by cuBLASLt itself (fp8_wgrad.py, beta = 1).
Scales follow `scaling` (megatron_adapt.backends.fp8_scaling: tensorwise = current scaling,
delayed = amax history; blockwise = a scale per 1 x 128 run and 128 x 128 weight block, served by
`_Fp8BlockLinear` below through cuBLASLt's block-scaled GEMMs on Hopper). cuBLASLt wants A row-major and B column-major with every dimension a
multiple of 16: the cast kernel writes each tensor once row-major and, where a backward GEMM needs
it, once transposed (x^T and dy^T for wgrad, W^T for dgrad), so no GEMM operand is copied again.

The cast (`quantize`) is one Triton kernel on CUDA tensors: saturate(x * scale) to fp8, the
transposed copy, the amax (delayed: atomically into the history's current row) and 1/scale
(tensorwise: the scale is computed in the kernel from the amax that one Triton pass found first).
On CPU tensors it is the same math in PyTorch (torch's CPU build has `_scaled_mm` for float8:
the tests run this module's autograd function there).
"""
from __future__ import annotations

import torch

from megatron_adapt import report
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Scaling, Fp8WeightCache, current_scale

from . import fp8_wgrad
from ._common import cdiv, interpreting
from .moe import group_offsets, grouped_gemm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the cuda backend needs Triton for its other kernels too
    triton = None

ALIGN = 16   # cuBLASLt fp8: every GEMM dimension a multiple of 16
ROWS_IN_ONE_READ = 8192   # rowwise quantization holds rows up to this many elements in registers


def fp8_unavailable(recipe: str = "tensorwise") -> str | None:
    """None if this process's CUDA device runs fp8 GEMMs for `recipe`, else why not."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm / float8 dtypes"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name()} is sm{major}{minor}; fp8 GEMMs (cuBLASLt through "
                f"torch._scaled_mm) need sm89 (Ada) or sm90 (Hopper) and newer")
    if recipe == "blockwise":
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        if (major, minor) != (9, 0) or cuda < (12, 9):
            return (f"{torch.cuda.get_device_name()} (sm{major}{minor}), CUDA {torch.version.cuda}: the "
                    f"1x128 / 128x128 block-scaled fp8 GEMMs (cuBLASLt through torch._scaled_mm) are "
                    f"served on Hopper (sm90) with CUDA 12.9 or newer only (the GPUs they were checked on)")
    return None


if triton is not None:
    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, scale_inv_ptr, skip_ptr, M, N, stride_xm,
                     FP8_MAX: tl.constexpr, CURRENT: tl.constexpr, TRANSPOSE: tl.constexpr,
                     HAS_SKIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        if HAS_SKIP:   # a cached weight, recorded in a CUDA graph: cast only where the flag is 0
            if tl.load(skip_ptr) != 0:
                return
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if CURRENT:   # tensorwise: scale from this tensor's amax (found by the pass before)
            amax = tl.load(amax_ptr)
            ok = (amax > 0.0) & (amax < float("inf"))
            s = tl.where(ok, FP8_MAX / tl.where(ok, amax, 1.0), 1.0)
        else:         # delayed: the state's scale; this tensor's amax into the history row
            s = tl.load(scale_ptr)
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), 1), 0))
        yc = tl.minimum(tl.maximum(x * s, -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], yc.to(y_ptr.dtype.element_ty), mask=mask)
        if TRANSPOSE:   # the tile loaded again in transposed order (from L2: 83-90 % of the copy) and
            # cast the same way. A one-pass store is wrong for fp32 inputs under Triton 3.6's ptxas
            # (Triton #11111; scripts/fp8_transpose_probe.py); fp8_swiglu uses it for bf16 only.
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + rn[:, None],
                         mask=(rn[:, None] < N) & (rm[None, :] < M), other=0.0).to(tl.float32)
            yct = tl.minimum(tl.maximum(xt * s, -FP8_MAX), FP8_MAX)
            tl.store(yt_ptr + rn[:, None] * M + rm[None, :], yct.to(yt_ptr.dtype.element_ty),
                     mask=(rn[:, None] < N) & (rm[None, :] < M))
        if (pm == 0) & (pn == 0):
            tl.store(scale_inv_ptr, 1.0 / s)


    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, skip_ptr, M, N, stride_xm, HAS_SKIP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
        if HAS_SKIP:
            if tl.load(skip_ptr) != 0:
                return
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        a = tl.abs(tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32))
        a = tl.where(a == a, a, float("inf"))   # a NaN makes the amax inf: not finite, as torch's is
        tl.atomic_max(amax_ptr, tl.max(tl.max(a, 1), 0))


    @triton.jit
    def _delayed_update_kernel(h_ptr, s_ptr, N, K, fp8_max, margin_scale, set_scale,
                               USE_MAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rn = tl.arange(0, BN)[:, None]
        rk = tl.arange(0, BK)[None, :]
        inb = (rn < N) & (rk < K)
        h = tl.load(h_ptr + rn * K + rk, mask=inb, other=0.0)
        if USE_MAX:   # max over the history; a NaN anywhere keeps the scale (torch's max is NaN)
            nan = tl.max(tl.where(inb & (h != h), 1, 0), 0)
            amax = tl.max(tl.where(h == h, h, 0.0), 0)
            ok = (nan == 0) & (amax > 0.0) & (amax < float("inf"))
        else:         # most_recent: row 0 (NaN fails both comparisons)
            amax = tl.sum(tl.where(rn == 0, h, 0.0), 0)
            ok = (amax > 0.0) & (amax < float("inf"))
        # roll one row back (row 0 to the end), then zero row 0
        rolled = tl.load(h_ptr + ((rn + 1) % N) * K + rk, mask=inb, other=0.0)
        rolled = tl.where(rn == 0, 0.0, rolled)
        tl.debug_barrier()    # every read of the history before any write (one program)
        tl.store(h_ptr + rn * K + rk, rolled, mask=inb)
        if set_scale != 0:
            k1 = tl.arange(0, BK)
            old = tl.load(s_ptr + k1, mask=k1 < K, other=1.0)
            sf = tl.minimum((fp8_max / tl.where(ok, amax, 1.0)) / margin_scale, 3.4028234663852886e38)
            tl.store(s_ptr + k1, tl.where(ok, sf, old), mask=k1 < K)


def _delayed_update(scaling: Fp8Scaling, direction: str) -> None:
    """`Fp8Scaling.update(direction)` (TE's delayed-scaling step: amax from the history, roll, new
    scales) as one Triton launch on device state, where PyTorch takes ~14 small kernels: after
    each fp8 linear's forward and backward, 512 updates a step at the bench's 0.95B model
    (docs/fp8.md). The reference stays `Fp8Scaling.update`, which CPU state takes."""
    hist, scale, r = scaling.amax_history[direction], scaling.scale[direction], scaling.recipe
    if not _triton_here(hist) or (direction == "fwd" and scaling.recomputing):
        scaling.update(direction)
        return
    scaling.reduce_amax(direction)   # over Megatron's amax reduction group, where it has > 1 rank
    scaling.updates[direction] += 1
    set_scale = (scaling.updates[direction] - 1) % r.interval == 0
    n, k = hist.shape
    _delayed_update_kernel[(1,)](hist, scale, n, k, scaling.fp8_max(direction), 2.0 ** r.margin,
                                 int(set_scale), USE_MAX=r.amax_compute_algo == "max",
                                 BN=triton.next_power_of_2(n), BK=triton.next_power_of_2(k), num_warps=4)


def _amax_triton(x, skip=None):
    """max |x| of a row-major [M, N] (rows may be strided) as a [1] fp32 tensor, in one read: one
    tile per program, its max atomically into the result. torch's inf-norm reduction ran these
    tensors at about 40 % of the copy bandwidth on an H100 (docs/fp8.md)."""
    M, N = x.shape
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    if interpreting():
        BM, BN = 16, 16
    else:
        BN = min(1024, triton.next_power_of_2(N))
        BM = max(1, 16384 // BN)
    _amax_kernel[(cdiv(M, BM), cdiv(N, BN))](x, amax, amax if skip is None else skip, M, N, x.stride(0),
                                             HAS_SKIP=skip is not None, BM=BM, BN=BN, num_warps=8)
    return amax


def cast_outputs(M, N, dtype, transpose, device):
    """What a tensorwise / delayed cast writes: (x8 [M, N], x8^T [N, M] or None, 1/scale [1] fp32)."""
    return (torch.empty(M, N, dtype=dtype, device=device),
            torch.empty(N, M, dtype=dtype, device=device) if transpose else None,
            torch.empty(1, dtype=torch.float32, device=device))


def delayed_state(scaling: Fp8Scaling, direction: str, slot: int):
    """(scale [1], the amax slot [1] of the history's current row) of a delayed-scaling cast."""
    return scaling.scale[direction][slot:slot + 1], scaling.amax_history[direction][0, slot:slot + 1]


CAST_TILES = (64, 128, 4)   # BM, BN, num_warps of _cast_kernel on a GPU (scripts/fp8_cast_tiles.py)


def _cast_triton(x, dtype, transpose, scale, amax, out=None, skip=None):
    M, N = x.shape
    if out is None:
        out = cast_outputs(M, N, dtype, transpose, x.device)
    y, yt, scale_inv = out
    current = scale is None
    BM, BN, warps = (16, 16, 4) if interpreting() else CAST_TILES
    _cast_kernel[(cdiv(M, BM), cdiv(N, BN))](
        x, y, y if yt is None else yt, amax if current else scale, amax, scale_inv,
        amax if skip is None else skip, M, N, x.stride(0), FP8_MAX=FP8_MAX[dtype], CURRENT=current,
        TRANSPOSE=transpose, HAS_SKIP=skip is not None, BM=BM, BN=BN, num_warps=warps)
    return out


def _cast_torch(x, dtype, transpose, scale, amax, out=None, skip=None):
    fp8_max = FP8_MAX[dtype]
    xf = x.float()
    keep = None if skip is None else skip.reshape(1) != 0
    if scale is None:
        scale = current_scale(amax, fp8_max)
    else:
        seen = xf.abs().amax().reshape(amax.shape)
        amax.copy_(torch.maximum(amax, seen if keep is None else torch.where(keep, amax, seen)))
    y = (xf * scale).clamp_(-fp8_max, fp8_max).to(dtype)
    return _kept(out, (y, (y.t().contiguous() if transpose else None), scale.float().reciprocal().reshape(1)), skip)


def quantize(x: torch.Tensor, dtype: torch.dtype, transpose: bool, scaling: Fp8Scaling | None,
             direction: str = "fwd", slot: int = 0, out=None, skip=None):
    """x [M, N] (row-major rows) -> (x8 [M, N], x8^T [N, M] contiguous or None, scale_inv [1] fp32).

    scaling None or tensorwise: current scaling (amax of x now); delayed: scaling's scale for
    (direction, slot), this amax recorded into its history row. `out`: those three tensors to write
    (a weight cache); `skip`: a device flag, nonzero to leave `out` and the amax as they are."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    delayed = scaling is not None and scaling.recipe.recipe == "delayed"
    if delayed:
        scale, amax = delayed_state(scaling, direction, slot)
    else:
        scale = None
        amax = (_amax_triton(x, skip) if _triton_here(x)
                else torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1))
    if _triton_here(x):
        return _cast_triton(x, dtype, transpose, scale, amax, out, skip)
    return _cast_torch(x, dtype, transpose, scale, amax, out, skip)


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype, transpose: bool, scaling: Fp8Scaling,
                    cache: Fp8WeightCache | None):
    """quantize(weight) for the forward (slot 1), through the linear's weight cache where it has
    one: cast into the cache, reuse it (no kernel at all), or -- inside a CUDA-graph capture -- a
    cast that the replay runs or skips by the cache's device flag (see Fp8WeightCache)."""
    if cache is None:
        return quantize(weight, dtype, transpose, scaling, "fwd", 1)
    key = (weight.data_ptr(), weight._version)
    held = cache.tensors
    if (held is None or held[0].shape != weight.shape or held[0].dtype != dtype
            or held[0].device != weight.device or (transpose and held[1] is None)):
        report.ran("fp8_weight_cast", "cast (cache made)")
        cache.tensors, cache.key = quantize(weight, dtype, transpose, scaling, "fwd", 1), key
        return cache.tensors
    skip = cache.skip
    if skip is True and cache.key == key:
        report.ran("fp8_weight_cast", "cached (later micro-batch)")
        return held
    flagged = torch.is_tensor(skip)
    report.ran("fp8_weight_cast", "cast, or cached by the graph's flag" if flagged else "cast into the cache")
    quantize(weight, dtype, held[1] is not None, scaling, "fwd", 1, held, skip if flagged else None)
    cache.key = key
    return held


def _gemm(a, b, scale_a, scale_b, out_dtype, fast_accum):
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum and a.is_cuda)


def _wgrad(ctx, dy2, xs, fp8_gemm, accumulate=None):
    """The weight gradient: fp8_gemm(out_dtype) with fp8 wgrad on (Megatron's --fp8-wgrad), else
    dy^T x in the gradient's dtype; fp32 when it goes to the sink (main_grad), which returns it.
    `accumulate(main_grad)`, where given and the sink exposes main_grad, adds the fp8 GEMM into it
    in place; the sink is then called with None (already added)."""
    target = getattr(ctx.sink, "main_grad", None)
    if ctx.fp8_wgrad and target is not None and accumulate is not None and accumulate(target):
        return ctx.sink(None)
    out_dtype = torch.float32 if ctx.sink is not None else ctx.w_dtype
    dw = fp8_gemm(out_dtype) if ctx.fp8_wgrad else torch.matmul(dy2.t(), xs.to(dy2.dtype)).to(out_dtype)
    return ctx.sink(dw) if ctx.sink is not None else dw


def _deferred_or_2d(t, can_defer: bool):
    """None for a deferred tensor this GEMM casts itself (fp8_swiglu: it has `fp8_quantize`),
    else t as [rows, last dim] (a deferred one computed first where only fp8 copies won't do)."""
    if hasattr(t, "fp8_quantize"):
        if can_defer:
            return None
        report.fell_back("fp8_swiglu", "SwiGLU in bf16, then its own cast",
                         "the linear also needs it in high precision (bf16 wgrad or a bias gradient)")
        t = t.materialize()
    return t.reshape(-1, t.shape[-1])


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, scaling, wgrad_sink, weight_cache):
        r = scaling.recipe
        shape = x.shape
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and r.wgrad
        x2 = _deferred_or_2d(x, fp8_wgrad or not need_wgrad)
        if x2 is None:   # computed inside its cast (fp8_swiglu.SwigluOutput)
            x8, x8t, sx_inv = x.fp8_quantize(r.fwd_dtype, fp8_wgrad, scaling, "fwd", 0)
        else:
            x8, x8t, sx_inv = quantize(x2, r.fwd_dtype, fp8_wgrad, scaling, "fwd", 0)
        w8, w8t, sw_inv = quantize_weight(weight, r.fwd_dtype, need_dgrad, scaling, weight_cache)
        y = _gemm(x8, w8.t(), sx_inv, sw_inv, x.dtype, True)
        if bias is not None:
            y = y + bias
        if r.recipe == "delayed":
            _delayed_update(scaling, "fwd")
        ctx.save_for_backward(x8t if fp8_wgrad else (x2 if need_wgrad else None), w8t, sx_inv, sw_inv)
        ctx.scaling, ctx.sink, ctx.fp8_wgrad, ctx.use_bias = scaling, wgrad_sink, fp8_wgrad, bias is not None
        ctx.x_shape, ctx.w_dtype = shape, weight.dtype
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xs, w8t, sx_inv, sw_inv = ctx.saved_tensors
        scaling, r = ctx.scaling, ctx.scaling.recipe
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2 = _deferred_or_2d(dy, (ctx.fp8_wgrad or not need_wgrad) and not ctx.use_bias)
        if dy2 is None:   # computed inside its cast (fp8_swiglu.SwigluGrad)
            dy8, dy8t, sg_inv = dy.fp8_quantize(r.bwd_dtype, ctx.fp8_wgrad, scaling, "bwd", 0)
        else:
            dy8, dy8t, sg_inv = quantize(dy2, r.bwd_dtype, ctx.fp8_wgrad, scaling, "bwd", 0)
        dx = dw = db = None
        if need_dgrad:
            dx = _gemm(dy8, w8t.t(), sg_inv, sw_inv, dy.dtype, False).reshape(ctx.x_shape)
        if need_wgrad:
            dw = _wgrad(ctx, dy2, xs, lambda out: _gemm(dy8t, xs.t(), sg_inv, sx_inv, out, False),
                        lambda mg: fp8_wgrad.into_main_grad(mg, dy8t, xs, sg_inv, sx_inv))
        if ctx.use_bias:
            db = dy2.sum(0)
        if r.recipe == "delayed":
            _delayed_update(scaling, "bwd")
        return dx, dw, db, None, None, None


# ---------------------------------------------------------------- blockwise (TE's Float8BlockScaling)
BLOCK = 128
BLOCKWISE_ALIGN = 4 * BLOCK   # every reduction a whole number of 4 blocks (16-byte aligned scale rows)


if triton is not None:
    @triton.jit
    def _runs_kernel(x_ptr, y_ptr, s_ptr, R, C, stride_r, stride_c, FP8_MAX: tl.constexpr,
                     BR: tl.constexpr, BLK: tl.constexpr):
        """One program: BR rows x one 1 x BLK run each; x read through its strides (a transposed
        view needs no copy), y written row-major, 1 / scale at (row, run) R-contiguous."""
        pr, pc = tl.program_id(0), tl.program_id(1)
        rr = pr * BR + tl.arange(0, BR)
        rc = pc * BLK + tl.arange(0, BLK)
        mask = rr[:, None] < R
        x = tl.load(x_ptr + rr[:, None] * stride_r + rc[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        ok = (amax > 0.0) & (amax < float("inf"))
        s = tl.minimum(tl.where(ok, FP8_MAX / tl.where(ok, amax, 1.0), 1.0), 3.4028234663852886e38)
        y = tl.minimum(tl.maximum(x * s[:, None], -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + rr[:, None] * C + rc[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rr + pc * R, 1.0 / s, mask=rr < R)

    @triton.jit
    def _blocks_kernel(x_ptr, y_ptr, s_ptr, C, FP8_MAX: tl.constexpr, BLK: tl.constexpr):
        """One program: one BLK x BLK block of a row-major [R, C] weight; 1 / scale at (block row, block col)."""
        pr, pc = tl.program_id(0), tl.program_id(1)
        rr = pr * BLK + tl.arange(0, BLK)
        rc = pc * BLK + tl.arange(0, BLK)
        x = tl.load(x_ptr + rr[:, None] * C + rc[None, :]).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), 1), 0)
        ok = (amax > 0.0) & (amax < float("inf"))
        s = tl.minimum(tl.where(ok, FP8_MAX / tl.where(ok, amax, 1.0), 1.0), 3.4028234663852886e38)
        y = tl.minimum(tl.maximum(x * s, -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + rr[:, None] * C + rc[None, :], y.to(y_ptr.dtype.element_ty))
        tl.store(s_ptr + pr * (C // BLK) + pc, 1.0 / s)


def _triton_here(x) -> bool:
    return triton is not None and (x.is_cuda or (interpreting() and x.device.type == "cpu"))


def quantize_runs(x: torch.Tensor, dtype: torch.dtype):
    """x [R, C] -> (x8 [R, C], scale_inv [R, C / 128] fp32): one current scale per 1 x 128 run along
    C. The scales are laid out R-contiguous, as cuBLASLt reads 1 x 128 scales. One Triton pass on
    CUDA tensors (x may be a transposed view: read through its strides); PyTorch on CPU tensors."""
    r, c = x.shape
    if _triton_here(x):
        y = torch.empty(r, c, dtype=dtype, device=x.device)
        s_inv = torch.empty(c // BLOCK, r, dtype=torch.float32, device=x.device).t()
        br = 16 if interpreting() else 32
        _runs_kernel[(cdiv(r, br), c // BLOCK)](x, y, s_inv, r, c, x.stride(0), x.stride(1),
                                                FP8_MAX=FP8_MAX[dtype], BR=br, BLK=BLOCK, num_warps=4)
        return y, s_inv
    t = x.float().contiguous().view(r, c // BLOCK, BLOCK)    # x may be a transposed view: row-major out
    scale = current_scale(t.abs().amax(-1), FP8_MAX[dtype])
    x8 = (t * scale[..., None]).clamp_(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).view(r, c)
    return x8, scale.reciprocal().t().contiguous().t()


def quantize_blocks(w: torch.Tensor, dtype: torch.dtype):
    """w [R, C] -> (w8 [R, C], scale_inv [R / 128, C / 128] fp32): one current scale per 128 x 128
    block. One Triton pass on CUDA tensors; PyTorch on CPU tensors."""
    r, c = w.shape
    if _triton_here(w):
        w = w.contiguous()
        y = torch.empty(r, c, dtype=dtype, device=w.device)
        s_inv = torch.empty(r // BLOCK, c // BLOCK, dtype=torch.float32, device=w.device)
        _blocks_kernel[(r // BLOCK, c // BLOCK)](w, y, s_inv, c, FP8_MAX=FP8_MAX[dtype], BLK=BLOCK, num_warps=8)
        return y, s_inv
    t = w.float().contiguous().view(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    scale = current_scale(t.abs().amax(dim=(1, 3)), FP8_MAX[dtype])
    w8 = (t * scale[:, None, :, None]).clamp_(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).view(r, c)
    return w8, scale.reciprocal()


def _dequant(q, s):
    """An operand with its scale_inv back in fp32 (1 x 128 runs or 128 x 128 blocks, from s's shape)."""
    r, c = q.shape
    if s.shape == (r, c // BLOCK):
        return (q.float().view(r, c // BLOCK, BLOCK) * s[..., None]).view(r, c)
    return (q.float().view(r // BLOCK, BLOCK, c // BLOCK, BLOCK) * s[:, None, :, None]).view(r, c)


def _block_gemm(a, sa, b_rows, sb_rows, out_dtype):
    """a [M, K] @ b_rows[N, K]^T with block scales along K (sa [M, K/128]; sb_rows [N, K/128] for
    1 x 128 runs or [N/128, K/128] for 128 x 128 blocks). cuBLASLt on a GPU (no fast accumulation:
    it does not take it with block scales); on CPU tensors the same product from the dequantized
    operands (torch's CPU _scaled_mm has no block scales)."""
    if a.is_cuda:
        # scale_b for b = b_rows^T [K, N]: blocks [K/128, N/128] with K contiguous, runs [K/128, N]
        # with N contiguous (the layouts cuBLASLt reads; scripts/fp8_blockwise_probe.py). Its rows
        # must be 16-byte aligned: K/128 a multiple of 4, which BLOCKWISE_ALIGN makes sure of (with
        # K/128 = 3 torch accepted the layout and cuBLASLt's product was wrong; padded, torch refused it)
        blocks = sb_rows.shape[0] != b_rows.shape[0]
        sb = sb_rows.contiguous().t() if blocks else sb_rows.t().contiguous()
        return torch._scaled_mm(a, b_rows.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=False)
    return (_dequant(a, sa) @ _dequant(b_rows, sb_rows).t()).to(out_dtype)


class _Fp8BlockLinear(torch.autograd.Function):
    """The three GEMMs with block scales along each one's reduction: forward x (1 x 128 along in) by
    W (128 x 128); dgrad dy (1 x 128 along out) by W^T (the same blocks); wgrad dy^T by x^T, both
    1 x 128 along the tokens."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling, wgrad_sink):
        r = scaling.recipe
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        x8, sx = quantize_runs(x2, r.fwd_dtype)
        w8, sw = quantize_blocks(weight, r.fwd_dtype)
        y = _block_gemm(x8, sx, w8, sw, x.dtype)
        if bias is not None:
            y = y + bias
        need_wgrad = ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and r.wgrad
        xt8, sxt = quantize_runs(x2.t(), r.fwd_dtype) if fp8_wgrad else (None, None)
        w8t = w8.t().contiguous() if ctx.needs_input_grad[0] else None
        ctx.save_for_backward(xt8 if fp8_wgrad else (x2 if need_wgrad else None), sxt, w8t, sw)
        ctx.sink, ctx.fp8_wgrad, ctx.use_bias, ctx.bwd_dtype = wgrad_sink, fp8_wgrad, bias is not None, r.bwd_dtype
        ctx.x_shape, ctx.w_dtype = shape, weight.dtype
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xs, sxt, w8t, sw = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dy8, sdy = quantize_runs(dy2, ctx.bwd_dtype)
            dx = _block_gemm(dy8, sdy, w8t, sw.t(), dy.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(ctx, dy2, xs, lambda out: _block_gemm(*quantize_runs(dy2.t(), ctx.bwd_dtype), xs, sxt, out))
        if ctx.use_bias:
            db = dy2.sum(0)
        return dx, dw, db, None, None


def unsupported_shape(x: torch.Tensor, weight: torch.Tensor, align: int = ALIGN) -> str | None:
    """Why cuBLASLt's fp8 GEMM cannot take these operands, or None (blockwise: align 512)."""
    tokens = x.numel() // x.shape[-1]
    dims = {"tokens": tokens, "in_features": weight.shape[1], "out_features": weight.shape[0]}
    odd = {k: v for k, v in dims.items() if v % align}
    if odd:
        return f"fp8 GEMM dimensions must be multiples of {align}: " + ", ".join(f"{k}={v}" for k, v in odd.items())
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {x.dtype}"
    return None


def fp8_linear(x, weight, bias, scaling: Fp8Scaling, wgrad_sink=None, weight_cache: Fp8WeightCache | None = None):
    """y = x @ weight^T (+ bias) with fp8 GEMMs forward and backward; see the module doc.
    weight_cache: the linear's fp8 weight kept across a step's micro-batches (tensorwise and delayed;
    blockwise casts its weight blocks at every call)."""
    blockwise = scaling.recipe.recipe == "blockwise"
    why = unsupported_shape(x, weight, BLOCKWISE_ALIGN if blockwise else ALIGN)
    if why is not None:
        report.fell_back("fp8_linear", f"{x.dtype} matmul (not fp8)", why)
        return _HighPrecisionLinear.apply(x, weight, bias, wgrad_sink)
    report.ran("fp8_linear", f"{'cuda' if x.is_cuda else x.device.type}.scaled_mm"
                             f"({scaling.recipe.format}, {scaling.recipe.recipe})")
    if blockwise:
        return _Fp8BlockLinear.apply(x, weight, bias, scaling, wgrad_sink)
    return _Fp8Linear.apply(x, weight, bias, scaling, wgrad_sink, weight_cache)


class _HighPrecisionLinear(torch.autograd.Function):
    """The reported fallback for shapes cuBLASLt's fp8 GEMM cannot take: the same interface
    (wgrad_sink included) in the input's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, wgrad_sink):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.use_bias = wgrad_sink, bias is not None
        y = torch.matmul(x, weight.t())
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = torch.matmul(dy, weight) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if ctx.sink is not None:
                dw = ctx.sink(torch.matmul(dy2.t(), x2).float())
            else:
                dw = torch.matmul(dy2.t(), x2).to(weight.dtype)
        db = dy2.sum(0) if ctx.use_bias else None
        return dx, dw, db, None


# ---------------------------------------------------------------- grouped (MoE experts)
GROUP_ALIGN = 16   # every expert's rows a multiple of 16 (Megatron pads them: Fp8Padding)


def grouped_unavailable(device=None) -> str | None:
    """None where torch's grouped fp8 GEMM runs (sm90: the rowwise-scaled CUTLASS kernel), else why."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) not in ((9, 0), (10, 0)):
            return (f"{torch.cuda.get_device_name(device)} is sm{major}{minor}; torch._scaled_grouped_mm "
                    f"runs on sm90 (Hopper) and sm100 only")
    return None


if triton is not None:
    @triton.jit
    def _scale_from_amax(amax, FP8_MAX: tl.constexpr):
        """Current scaling: FP8_MAX / amax, 1 where amax is 0 or not finite."""
        ok = (amax > 0.0) & (amax < float("inf"))
        return tl.where(ok, FP8_MAX / tl.where(ok, amax, 1.0), 1.0)

    @triton.jit
    def _rows_kernel(x_ptr, y_ptr, s_ptr, skip_ptr, a_ptr, C, FP8_MAX: tl.constexpr, HAS_SKIP: tl.constexpr,
                     STORE_AMAX: tl.constexpr, BC: tl.constexpr):
        """One row of a contiguous [R, C]: its amax, then the cast with scale = FP8_MAX / amax."""
        if HAS_SKIP:   # a cached expert weight, recorded in a CUDA graph: cast only where the flag is 0
            if tl.load(skip_ptr) != 0:
                return
        base = tl.program_id(0).to(tl.int64) * C
        acc = tl.zeros([BC], dtype=tl.float32)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            acc = tl.maximum(acc, tl.abs(tl.load(x_ptr + base + cols, mask=cols < C, other=0.0).to(tl.float32)))
        amax = tl.max(acc, 0)
        if STORE_AMAX:   # the row's amax too (an expert's amax for its wgrad casts, without another read)
            tl.store(a_ptr + tl.program_id(0), amax)
        s = _scale_from_amax(amax, FP8_MAX)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            v = tl.load(x_ptr + base + cols, mask=cols < C, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(v * s, -FP8_MAX), FP8_MAX)
            tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=cols < C)
        tl.store(s_ptr + tl.program_id(0), 1.0 / s)

    @triton.jit
    def _rows_tile_kernel(x_ptr, y_ptr, s_ptr, skip_ptr, a_ptr, R, C, FP8_MAX: tl.constexpr, HAS_SKIP: tl.constexpr,
                          STORE_AMAX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """BR whole rows (C <= BC) of a contiguous [R, C] in one read: each row's amax from the
        registers, then its cast with scale = FP8_MAX / amax."""
        if HAS_SKIP:
            if tl.load(skip_ptr) != 0:
                return
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BC)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        off = rows[:, None].to(tl.int64) * C + cols[None, :]
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        if STORE_AMAX:
            tl.store(a_ptr + rows, amax, mask=rows < R)
        s = _scale_from_amax(amax, FP8_MAX)
        y = tl.minimum(tl.maximum(x * s[:, None], -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + rows, 1.0 / s, mask=rows < R)

    @triton.jit
    def _group_split(ends_ptr, g, sp, SPLITS, BT: tl.constexpr):
        """Rows of group g (ends[g-1]..ends[g]) that split sp of SPLITS takes: whole BT tiles."""
        r0 = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        r1 = tl.load(ends_ptr + g)
        chunk = tl.cdiv(tl.cdiv(r1 - r0, SPLITS), BT) * BT
        lo = r0 + sp * chunk
        return lo, tl.minimum(r1, lo + chunk)

    @triton.jit
    def _group_columns_amax_kernel(x_ptr, amax_ptr, ends_ptr, skip_ptr, C, SPLITS, HAS_SKIP: tl.constexpr,
                                   BT: tl.constexpr, BC: tl.constexpr):
        """Pass 1: the amax of each column of one block over a split of group g's rows of a
        contiguous [R, C], max-combined atomically into amax[g, c]."""
        if HAS_SKIP:
            if tl.load(skip_ptr) != 0:
                return
        g, sp = tl.program_id(0), tl.program_id(2)
        lo, hi = _group_split(ends_ptr, g, sp, SPLITS, BT)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        acc = tl.zeros([BC], dtype=tl.float32)
        for t0 in range(lo, hi, BT):
            rows = t0 + tl.arange(0, BT)
            m = (rows[:, None] < hi) & cm[None, :]
            v = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0)
            acc = tl.maximum(acc, tl.max(tl.abs(v.to(tl.float32)), 0))
        tl.atomic_max(amax_ptr + g * C + cols, acc, mask=cm)

    @triton.jit
    def _group_columns_cast_kernel(x_ptr, y_ptr, s_ptr, amax_ptr, ends_ptr, skip_ptr, C, stride_oc, group_shift,
                                   SPLITS, FP8_MAX: tl.constexpr, HAS_SKIP: tl.constexpr, BT: tl.constexpr,
                                   BC: tl.constexpr):
        """Pass 2: the same split cast with scale = FP8_MAX / amax[g, c], stored transposed: element
        (r, c) of group g at c * stride_oc + r + g * group_shift; scale_inv of (g, c) at g * C + c."""
        if HAS_SKIP:
            if tl.load(skip_ptr) != 0:
                return
        g, sp = tl.program_id(0), tl.program_id(2)
        lo, hi = _group_split(ends_ptr, g, sp, SPLITS, BT)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        s = _scale_from_amax(tl.load(amax_ptr + g * C + cols, mask=cm, other=0.0), FP8_MAX)
        for t0 in range(lo, hi, BT):
            rows = t0 + tl.arange(0, BT)
            m = (rows[:, None] < hi) & cm[None, :]
            v = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0)
            y = tl.minimum(tl.maximum(v.to(tl.float32) * s[None, :], -FP8_MAX), FP8_MAX)
            out = cols[None, :].to(tl.int64) * stride_oc + rows[:, None] + g.to(tl.int64) * group_shift
            tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=m)
        if sp == 0:
            tl.store(s_ptr + g * C + cols, 1.0 / s, mask=cm)


GROUP_COLUMN_PROGRAMS = 1024   # split each expert's rows until about this many programs run


def _group_columns_triton(x, ends, num_groups, dtype, stride_oc, group_shift, out_shape, out=None, skip=None,
                          per_group=False, group_amax=None):
    """Two launches over (expert, column block, row split): the amaxes, then the cast. Splitting an
    expert's rows keeps enough programs in flight at 8 experts (one program per expert and
    column block left a 2048-column tensor 256 programs: under half the copy bandwidth).
    out: (y, s_inv) to write (a weight cache); skip: a device flag, nonzero to leave them.
    per_group: each expert's column amaxes replaced by their max between the launches (one scale
    per expert, still written per (expert, column)); group_amax [E]: those maxes, known already
    (from the rowwise cast's row amaxes), so the amax launch and its read of x are skipped."""
    c = x.shape[1]
    y, s_inv = out if out is not None else (
        torch.empty(out_shape, dtype=dtype, device=x.device),
        torch.empty(num_groups * c, dtype=torch.float32, device=x.device))
    s_inv = s_inv.view(-1)
    flag = skip if skip is not None else s_inv
    bt, bc = (16, 16) if interpreting() else (64, 64)
    blocks = cdiv(c, bc)
    splits = max(1, min(16, GROUP_COLUMN_PROGRAMS // max(1, num_groups * blocks)))
    grid = (num_groups, blocks, splits)
    if group_amax is None:
        amax = torch.zeros(num_groups * c, dtype=torch.float32, device=x.device)
        _group_columns_amax_kernel[grid](x, amax, ends, flag, c, splits, HAS_SKIP=skip is not None, BT=bt, BC=bc,
                                         num_warps=4)
    if per_group:
        amax = (group_amax if group_amax is not None else amax.view(num_groups, c).amax(1))
        amax = amax.view(num_groups, 1).expand(num_groups, c).contiguous().view(-1)
    _group_columns_cast_kernel[grid](x, y, s_inv, amax, ends, flag, c, stride_oc, group_shift, splits,
                                     FP8_MAX=FP8_MAX[dtype], HAS_SKIP=skip is not None, BT=bt, BC=bc, num_warps=4)
    return y, s_inv


def _kept(out, made, skip):
    """Torch path of a flagged cast: `made` written into `out` (a weight cache) where the device
    flag `skip` is 0, `out` left as it is where it is nonzero; no flag: `made`, or copied into `out`."""
    if out is None:
        return made
    keep = None if skip is None else skip.reshape(()) != 0
    for held, new in zip(out, made):
        if held is not None:   # (a cast without its transposed copy)
            held.copy_(new if keep is None else torch.where(keep, held, new))
    return out


def quantize_rowwise(t: torch.Tensor, dtype: torch.dtype, out=None, skip=None, row_amax: bool = False):
    """t [..., C] -> (t8 [..., C] contiguous, scale_inv [...] fp32): one current scale per row (the
    amax of the row along C, the GEMM's reduction). One Triton pass on CUDA tensors.
    out: (t8, scale_inv) to write (a weight cache); skip: a device flag, nonzero to leave them.
    row_amax: also return each row's amax [...] fp32 (written by the same pass)."""
    if _triton_here(t):
        t = t.contiguous()
        y, s_inv = out if out is not None else (
            torch.empty(t.shape, dtype=dtype, device=t.device),
            torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device))
        amax = torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device) if row_amax else s_inv
        flag = skip if skip is not None else s_inv
        c = t.shape[-1]
        r = t.numel() // c
        bc = triton.next_power_of_2(c)
        if bc <= ROWS_IN_ONE_READ:   # whole rows held in registers: x read once
            br = max(1, min(ROWS_IN_ONE_READ // bc, triton.next_power_of_2(r)))
            if interpreting():
                br = min(br, 4)
            _rows_tile_kernel[(cdiv(r, br),)](t, y, s_inv, flag, amax, r, c, FP8_MAX=FP8_MAX[dtype],
                                              HAS_SKIP=skip is not None, STORE_AMAX=row_amax, BR=br, BC=bc,
                                              num_warps=8 if br * bc >= 4096 else 4)
        else:                        # longer rows: two passes over each row (the second from cache)
            _rows_kernel[(r,)](t, y, s_inv, flag, amax, c, FP8_MAX=FP8_MAX[dtype], HAS_SKIP=skip is not None,
                               STORE_AMAX=row_amax, BC=32 if interpreting() else 1024, num_warps=4)
        return (y, s_inv, amax) if row_amax else (y, s_inv)
    fp8_max = FP8_MAX[dtype]
    tf = t.float()
    amax = tf.abs().amax(-1)
    scale = current_scale(amax, fp8_max)
    t8 = (tf * scale[..., None]).clamp_(-fp8_max, fp8_max).to(dtype).contiguous()
    made = _kept(out, (t8, scale.reciprocal()), skip)
    return (*made, amax) if row_amax else made


def quantize_group_columns(t: torch.Tensor, groups: torch.Tensor, num_groups: int, dtype: torch.dtype,
                           ends: torch.Tensor | None = None, per_group: bool = False,
                           row_amax: torch.Tensor | None = None):
    """t [T, C], rows grouped by expert (groups [T] int64; ends: the int32 end offsets) -> (t8^T
    [C, T] contiguous, scale_inv [E * C] fp32): one scale per (expert, column), the amax over that
    expert's rows: the operand layout of the wgrad GEMM, whose reduction runs over each expert's
    tokens. per_group: one scale per expert instead (the amax of all its rows; TE's per-tensor
    current scaling of each expert's GEMM), still written E * C. row_amax [T] (per_group only): each
    row's amax, as quantize_rowwise(..., row_amax=True) gave it; the experts' amaxes are then its
    maxes over their rows and t is read once, by the cast. Two Triton launches (amaxes, then the
    cast) on CUDA tensors, one with row_amax."""
    group_amax = (_group_max(row_amax, groups, num_groups) if per_group and row_amax is not None else None)
    if ends is not None and _triton_here(t):
        t = t.contiguous()
        return _group_columns_triton(t, ends, num_groups, dtype, t.shape[0], 0, (t.shape[1], t.shape[0]),
                                     per_group=per_group, group_amax=group_amax)
    fp8_max = FP8_MAX[dtype]
    tf = t.float()
    if per_group:
        if group_amax is None:
            group_amax = _group_max(tf.abs().amax(-1), groups, num_groups)
        amax = group_amax[:, None].expand(num_groups, t.shape[1])
    else:
        amax = tf.new_zeros(num_groups, t.shape[1]).scatter_reduce_(
            0, groups[:, None].expand(-1, t.shape[1]), tf.abs(), "amax")
    scale = current_scale(amax, fp8_max)
    t8 = (tf * scale.index_select(0, groups)).clamp_(-fp8_max, fp8_max).to(dtype)
    return t8.t().contiguous(), scale.reciprocal().reshape(-1)


def _group_max(row_values, groups, num_groups):
    """[E] fp32: the max of each group's rows of row_values [T] (0 for an empty group)."""
    return row_values.new_zeros(num_groups).scatter_reduce_(0, groups, row_values, "amax")


def quantize_weight_columns(w: torch.Tensor, dtype: torch.dtype, out=None, skip=None):
    """w [E, N, K] -> (w^T 8 [E, K, N] contiguous, scale_inv [E, K]): one scale per (expert, input
    channel), the dgrad GEMM's operand. The group-columns kernel with every expert N rows.
    out / skip: as quantize_rowwise's."""
    e, n, k = w.shape
    if _triton_here(w):
        ends = torch.arange(n, e * n + 1, n, device=w.device, dtype=torch.int32)
        y, s_inv = _group_columns_triton(w.contiguous().view(e * n, k), ends, e, dtype, n, k * n - n, (e, k, n),
                                         out, skip)
        return y, s_inv.view(e, k)
    return _kept(out, quantize_rowwise(w.transpose(-2, -1), dtype), skip)


def quantize_expert_weights(w: torch.Tensor, dtype: torch.dtype, cache: Fp8WeightCache | None):
    """w [E, out, in] -> ((w8 [E, out, in], sw [E, out]), (wt8 [E, in, out], swt [E, in]) or None): the
    forward GEMM's operand and the dgrad's, through the grouped linear's weight cache (as TE keeps
    its grouped linears' fp8 weights across a step's micro-batches). No cache: the forward operand
    only (the dgrad's is cast in the backward). With one, as quantize_weight: cast both into it at a
    step's first micro-batch, reuse them later in the step (no kernel), or -- inside a CUDA-graph
    capture -- casts that each replay runs or skips by the cache's device flag. The caller says
    whether the experts' weights changed (cache.skip False)."""
    if cache is None:
        return quantize_rowwise(w, dtype), None
    held = cache.tensors
    if held is None or held[0][0].shape != w.shape or held[0][0].dtype != dtype or held[0][0].device != w.device:
        report.ran("fp8_weight_cast", "experts: cast (cache made)")
        cache.tensors = (quantize_rowwise(w, dtype), quantize_weight_columns(w, dtype))
        return cache.tensors
    skip = cache.skip
    if skip is True:
        report.ran("fp8_weight_cast", "experts: cached (later micro-batch)")
        return held
    flagged = torch.is_tensor(skip)
    report.ran("fp8_weight_cast", "experts: cast, or cached by the graph's flag" if flagged
               else "experts: cast into the cache")
    flag = skip if flagged else None
    quantize_rowwise(w, dtype, held[0], flag)
    quantize_weight_columns(w, dtype, held[1], flag)
    return held


def _grouped_scaled_mm(a, b, sa, sb, offs, out_dtype, fast_accum):
    """torch._scaled_grouped_mm on a GPU. On CPU tensors (tests) the same product from the
    dequantized operands: torch's CPU build has no grouped fp8 GEMM.
    2d x 3d: a [T, K] rows grouped, b [E, K, N], sa [T], sb [E, N] -> [T, N];
    2d x 2d: a [M, T], b [T, N], groups along T, sa [E * M], sb [E * N] -> [E, M, N]."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accum)
    ends = [0] + offs.tolist()
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype)
        for e, (r0, r1) in enumerate(zip(ends, ends[1:])):
            out[r0:r1] = ((a[r0:r1].float() * sa[r0:r1, None]) @ (b[e].float() * sb[e][None, :])).to(out_dtype)
        return out
    m, n = a.shape[0], b.shape[1]
    out = a.new_empty(len(ends) - 1, m, n, dtype=out_dtype)
    for e, (r0, r1) in enumerate(zip(ends, ends[1:])):
        out[e] = ((a[:, r0:r1].float() * sa[e * m:(e + 1) * m, None])
                  @ (b[r0:r1].float() * sb[e * n:(e + 1) * n][None, :])).to(out_dtype)
    return out


def _experts_wgrad_into_main_grads(main_grads, dyt8, xt8, sdyt, sxt, offs, sizes, static_sizes):
    """main_grads[e] += dy_e^T x_e from the per-expert-scaled fp8 operands (dyt8 [out, T], xt8 [in, T]):
    one cuBLASLt GEMM per expert with beta = 1 (fp8_wgrad.accumulate), where fp8_wgrad.experts_why_not
    allows, as TE's grouped linear accumulates with fuse_wgrad_accumulation; else the grouped GEMM's
    bf16 dW added by one `_foreach_add_` (a second pass over every main_grad). The report names the
    path (op fp8_wgrad)."""
    n, k = dyt8.shape[0], xt8.shape[0]
    ends = [0]
    for size in sizes:
        ends.append(ends[-1] + size)
    work = [(mg, dyt8[:, a:b], xt8[:, a:b], sdyt[e * n:e * n + 1], sxt[e * k:e * k + 1])
            for e, (mg, a, b) in enumerate(zip(main_grads, ends, ends[1:])) if b > a]
    why = fp8_wgrad.experts_why_not([w[:3] for w in work], static_sizes)
    if why is None:
        report.ran("fp8_wgrad", "experts: " + fp8_wgrad.IN_PLACE + " per expert")
        for mg, a, b, sa, sb in work:
            fp8_wgrad.accumulate(mg, a, b, sa, sb)
        return
    report.ran("fp8_wgrad", f"experts: {dyt8.device.type}.scaled_grouped_mm+main_grad._foreach_add_"
                            f" ({fp8_wgrad.short(why)})")
    fp8_wgrad.say_if_missing(why)
    _add_into(main_grads, _grouped_scaled_mm(dyt8, xt8.t(), sdyt, sxt, offs, torch.bfloat16, False))


class _Fp8GroupedLinear(torch.autograd.Function):
    """y_e = x_e @ w[e]^T for each expert's rows, w [E, out, in] (TE's weight layout), all three GEMMs
    e4m3: forward x per token and w per (expert, output channel); dgrad dy per token and w per
    (expert, input channel); wgrad dy and x per expert (TE's per-tensor current scaling of each
    expert's GEMM, which lets cuBLASLt add the product into main_grad itself; the wgrad's reduction
    runs over the expert's tokens). torch's grouped fp8 GEMM on sm90 takes e4m3 operands only, so
    gradients are e4m3 in every format. The GEMMs write bf16 (the kernel's only output type),
    cast to the input's and weight's dtypes. With a weight cache (quantize_expert_weights) both
    weight operands come from it and the stacked weight is not kept for the backward. With
    main_grads (Megatron's fp32 gradient buffers, one per expert) the fp8 wgrad is added into them
    (_experts_wgrad_into_main_grads) and w's gradient is an unwritten placeholder: the caller
    marks the weights grad_added_to_main_grad."""

    @staticmethod
    def forward(ctx, x, w, offs, groups, fp8_wgrad, cache, main_grads, sizes, static_sizes):
        e4m3 = torch.float8_e4m3fn
        x8, sx, ctx.x_amax = quantize_rowwise(x, e4m3, row_amax=True)   # row amaxes: the wgrad's x cast
        (w8, sw), ctx.dgrad_weight = quantize_expert_weights(w, e4m3, cache)
        y = _grouped_scaled_mm(x8, w8.transpose(-2, -1), sx, sw, offs, torch.bfloat16, True).to(x.dtype)
        # the stacked weight only for a dgrad operand cast in the backward (no cache)
        ctx.save_for_backward(x, w if ctx.dgrad_weight is None else None, offs, groups)
        ctx.fp8_wgrad, ctx.w_meta = fp8_wgrad, (tuple(w.shape), w.dtype)
        ctx.main_grads, ctx.sizes, ctx.static_sizes = main_grads, sizes, static_sizes
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs, groups = ctx.saved_tensors
        e4m3 = torch.float8_e4m3fn
        dy = dy.contiguous()
        dx = dw = dy_amax = None
        x_amax, ctx.x_amax = ctx.x_amax, None
        if ctx.needs_input_grad[0]:
            dy8, sdy, dy_amax = quantize_rowwise(dy, e4m3, row_amax=True)
            # [E, in, out], per (expert, in): the cache's, else cast now
            wt8, swt = ctx.dgrad_weight or quantize_weight_columns(w, e4m3)
            dx = _grouped_scaled_mm(dy8, wt8.transpose(-2, -1), sdy, swt, offs, torch.bfloat16, False).to(dy.dtype)
        ctx.dgrad_weight = None
        shape, w_dtype = ctx.w_meta
        main_grads, ctx.main_grads = ctx.main_grads, None
        if ctx.needs_input_grad[1]:
            if ctx.fp8_wgrad:
                dyt8, sdyt = quantize_group_columns(dy, groups, shape[0], e4m3, offs, True, dy_amax)  # [out, T]
                xt8, sxt = quantize_group_columns(x, groups, shape[0], e4m3, offs, True, x_amax)      # [in, T]
                if main_grads is not None:
                    _experts_wgrad_into_main_grads(main_grads, dyt8, xt8, sdyt, sxt, offs, ctx.sizes,
                                                   ctx.static_sizes)
                else:
                    dw = _grouped_scaled_mm(dyt8, xt8.t(), sdyt, sxt, offs, torch.bfloat16, False).to(w_dtype)
            elif dy.is_cuda and dy.dtype == torch.bfloat16:
                dw = torch._grouped_mm(dy.t(), x, offs=offs)
            else:
                ends = [0] + offs.tolist()
                dw = torch.stack([dy[a:b].t().float() @ x[a:b].float() for a, b in zip(ends, ends[1:])]).to(w_dtype)
            if main_grads is not None:   # w's gradient is in the buffers: a placeholder stands for it
                if dw is not None:       # a high-precision dW (--no-fp8-wgrad)
                    _add_into(main_grads, dw)
                dw = torch.empty(shape, dtype=w_dtype, device=dy.device)
        return dx, dw, None, None, None, None, None, None, None


def _add_into(main_grads, dw):
    """dW [E, out, in] added into the experts' main_grads by one `_foreach_add_`."""
    torch._foreach_add_(list(main_grads), list(dw.unbind(0)))


class _IntoMainGrads(torch.autograd.Function):
    """Identity on w; its backward adds w's gradient into the experts' main_grads and passes the
    placeholder on: the bf16 fallback of an fp8_grouped_gemm call that was given main_grads."""

    @staticmethod
    def forward(ctx, w, main_grads):
        ctx.main_grads = main_grads
        return w.view_as(w)

    @staticmethod
    def backward(ctx, dw):
        main_grads, ctx.main_grads = ctx.main_grads, None
        _add_into(main_grads, dw)
        return torch.empty_like(dw), None


def fp8_grouped_gemm(x, w, tokens_per_expert, recipe, weight_cache: Fp8WeightCache | None = None,
                     main_grads=None, static_sizes: bool = False):
    """y [T, out] = each expert's rows of x [T, in] times w[e]^T, w [E, out, in], in fp8 (see
    _Fp8GroupedLinear). tokens_per_expert: host ints (Megatron's m_splits); every group a multiple of
    16 rows (Megatron's Fp8Padding), in_features and out_features multiples of 16; otherwise a
    reported bf16 grouped GEMM. weight_cache: the grouped linear's fp8 weights across a step's
    micro-batches (quantize_expert_weights). main_grads: the experts' fp32 gradient buffers, E
    tensors [out, in]: the weight gradient is added into them (fp8 or not) and w's gradient is an
    unwritten placeholder: the caller marks the weights grad_added_to_main_grad. static_sizes: the
    row counts are the same at every call (capacity-padded dispatch), so an eager call may plan the
    per-expert in-place GEMMs (dropless sizes change every step: a plan per size would be made at
    every call)."""
    sizes = [int(n) for n in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                              else tokens_per_expert)]
    odd = [n for n in sizes if n % GROUP_ALIGN]
    why = (grouped_unavailable(x.device) if x.is_cuda else None)
    if why is None and odd:
        why = f"expert row counts {odd[:4]} not multiples of {GROUP_ALIGN}"
    if why is None and (x.shape[1] % GROUP_ALIGN or w.shape[1] % GROUP_ALIGN):
        why = f"in_features={x.shape[1]}, out_features={w.shape[1]} not multiples of {GROUP_ALIGN}"
    if why is not None:
        report.fell_back("fp8_grouped_gemm", f"{x.dtype} grouped GEMM (not fp8)", why)
        return grouped_gemm(x, w if main_grads is None else _IntoMainGrads.apply(w, main_grads), sizes, True)
    report.ran("fp8_grouped_gemm", f"{'cuda' if x.is_cuda else x.device.type}.scaled_grouped_mm"
                                   f"(e4m3, rowwise; recipe {recipe.recipe} read as rowwise)")
    offs = group_offsets(sizes, x.device)
    # each row's expert, by device kernels alone (a CUDA graph may be capturing)
    groups = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device, dtype=torch.int32),
                                right=True).long()
    return _Fp8GroupedLinear.apply(x.contiguous(), w, offs, groups, bool(recipe.wgrad), weight_cache, main_grads,
                                   sizes, static_sizes)

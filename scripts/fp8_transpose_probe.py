#!/usr/bin/env python3
"""Which way of writing the transposed fp8 copy is both right and fast on the GPU at hand.

The fp8 cast kernels write x8 [M, N] and its transpose x8^T [N, M] (the wgrad operand). Today each
kernel loads and recomputes its tile a second time in transposed order (mode 0), because a one-pass
transposed store gave wrong bytes on an H100 with Triton 3.6 (docs/fp8.md). Triton issue #11111
describes a ptxas 12.9 bug with that signature: an fp8 tile stored both as it is and through a layout
conversion gets bytes the kernel never wrote; the same kernel storing int8 is clean. This script runs
copies of the three kernels (`fp8._cast_kernel`, `fp8_swiglu._swiglu_cast_kernel`, `_grad_cast_kernel`)
with the transposed copy written each way below, checks every byte of both outputs against torch's
cast at several shapes, tiles, input dtypes and fp8 formats, and times the correct ones as CUDA-graph
replays at the 0.95B / 2.9B shapes against the device copy of the same run.

    OUT=/tmp/probe python3 scripts/fp8_transpose_probe.py     # $OUT/fp8_transpose_probe.json
    TRITON_INTERPRET=1 python3 scripts/fp8_transpose_probe.py --check-only   # the logic, on the CPU
"""
import argparse
import json
import os
import subprocess

import torch
import triton
import triton.language as tl

from megatron_adapt.backends.cuda.fp8_swiglu import (_swiglu_at, _swiglu_grad_at, swiglu_grad_reference,
                                                    swiglu_reference)

MODES = {0: "reload: the tile loaded and computed again in transposed order",
         1: "tl.trans of the fp32 tile, stored as fp8",
         2: "tl.trans of the fp32 tile, its fp8 bits stored as int8",
         3: "fp8 bits as int8, stored through transposed addresses (no tl.trans)",
         4: "fp8 bits as int8, tl.trans of the int8 tile"}


@triton.jit
def _clamp(v, s, FP8_MAX: tl.constexpr):
    return tl.minimum(tl.maximum(v * s, -FP8_MAX), FP8_MAX)


@triton.jit
def _tile(scale_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows and columns of an [M, N] tile, the scale, and the masks as is and transposed."""
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    return (rm, rn, tl.load(scale_ptr), (rm[:, None] < M) & (rn[None, :] < N),
            (rn[:, None] < N) & (rm[None, :] < M))


@triton.jit
def _store_t(yt_ptr, yt8_ptr, q, q8, rm, rn, M, mask, mt, col0, MODE: tl.constexpr):
    """Modes 1-4: the transposed copy of the fp32 tile q (its fp8 cast q8) at yt[col0 + rn, rm]."""
    t_off = (col0 + rn[:, None]) * M + rm[None, :]
    if MODE == 1:
        tl.store(yt_ptr + t_off, tl.trans(q).to(yt_ptr.dtype.element_ty), mask=mt)
    elif MODE == 2:
        tl.store(yt8_ptr + t_off, tl.trans(q).to(yt_ptr.dtype.element_ty).to(tl.int8, bitcast=True), mask=mt)
    elif MODE == 3:
        tl.store(yt8_ptr + (col0 + rn[None, :]) * M + rm[:, None], q8.to(tl.int8, bitcast=True), mask=mask)
    elif MODE == 4:
        tl.store(yt8_ptr + t_off, tl.trans(q8.to(tl.int8, bitcast=True)), mask=mt)


@triton.jit
def cast_kernel(x_ptr, y_ptr, yt_ptr, yt8_ptr, scale_ptr, M, N, FP8_MAX: tl.constexpr, MODE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, s, mask, mt = _tile(scale_ptr, M, N, BM, BN)
    q = _clamp(tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32), s, FP8_MAX)
    q8 = q.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], q8, mask=mask)
    if MODE == 0:
        qt = _clamp(tl.load(x_ptr + rm[None, :] * N + rn[:, None], mask=mt, other=0.0).to(tl.float32), s, FP8_MAX)
        tl.store(yt_ptr + rn[:, None] * M + rm[None, :], qt.to(yt_ptr.dtype.element_ty), mask=mt)
    else:
        _store_t(yt_ptr, yt8_ptr, q, q8, rm, rn, M, mask, mt, 0, MODE)


@triton.jit
def swiglu_kernel(x_ptr, y_ptr, yt_ptr, yt8_ptr, scale_ptr, M, F, FP8_MAX: tl.constexpr, MODE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, s, mask, mt = _tile(scale_ptr, M, F, BM, BN)
    q = _clamp(_swiglu_at(x_ptr, rm[:, None], rn[None, :], F, mask), s, FP8_MAX)
    q8 = q.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * F + rn[None, :], q8, mask=mask)
    if MODE == 0:
        qt = _clamp(_swiglu_at(x_ptr, rm[None, :], rn[:, None], F, mt), s, FP8_MAX)
        tl.store(yt_ptr + rn[:, None] * M + rm[None, :], qt.to(yt_ptr.dtype.element_ty), mask=mt)
    else:
        _store_t(yt_ptr, yt8_ptr, q, q8, rm, rn, M, mask, mt, 0, MODE)


@triton.jit
def swiglu_grad_kernel(x_ptr, d_ptr, g_ptr, gt_ptr, gt8_ptr, scale_ptr, M, F, FP8_MAX: tl.constexpr,
                       MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, s, mask, mt = _tile(scale_ptr, M, F, BM, BN)
    da, db = _swiglu_grad_at(x_ptr, d_ptr, rm[:, None], rn[None, :], F, mask)
    qa, qb = _clamp(da, s, FP8_MAX), _clamp(db, s, FP8_MAX)
    qa8, qb8 = qa.to(g_ptr.dtype.element_ty), qb.to(g_ptr.dtype.element_ty)
    tl.store(g_ptr + rm[:, None] * 2 * F + rn[None, :], qa8, mask=mask)
    tl.store(g_ptr + rm[:, None] * 2 * F + F + rn[None, :], qb8, mask=mask)
    if MODE == 0:
        dat, dbt = _swiglu_grad_at(x_ptr, d_ptr, rm[None, :], rn[:, None], F, mt)
        tl.store(gt_ptr + rn[:, None] * M + rm[None, :], _clamp(dat, s, FP8_MAX).to(gt_ptr.dtype.element_ty), mask=mt)
        tl.store(gt_ptr + (F + rn[:, None]) * M + rm[None, :], _clamp(dbt, s, FP8_MAX).to(gt_ptr.dtype.element_ty),
                 mask=mt)
    else:
        _store_t(gt_ptr, gt8_ptr, qa, qa8, rm, rn, M, mask, mt, 0, MODE)
        _store_t(gt_ptr, gt8_ptr, qb, qb8, rm, rn, M, mask, mt, F, MODE)


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def reference(kind, x, d, s, dtype):
    """torch's cast of what each kernel computes (the SwiGLU math of fp8_swiglu's references)."""
    v = {"cast": lambda: x, "swiglu": lambda: swiglu_reference(x),
         "swiglu_grad": lambda: swiglu_grad_reference(x, d)}[kind]().float()
    return (v * s).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def outputs(kind, x, dtype):
    """(out, out^T), out^T filled with NaN bytes so that an element never written shows."""
    M = x.shape[0]
    cols = x.shape[1] if kind != "swiglu" else x.shape[1] // 2
    y = torch.empty(M, cols, dtype=dtype, device=x.device)
    return y, torch.full((cols, M), float("nan"), dtype=torch.float32, device=x.device).to(dtype)


def launch(kind, mode, tiles, x, d, scale, dtype, outs):
    """One kernel into outs = (out, out^T); the transposed copy is written as fp8 or through its int8 view."""
    BM, BN, warps = tiles
    M = x.shape[0]
    f = x.shape[1] // 2
    y, yt = outs
    cols = y.shape[1]
    yt8 = yt.view(torch.int8)
    kw = dict(FP8_MAX=FP8_MAX[dtype], MODE=mode, BM=BM, BN=BN)
    if not os.environ.get("TRITON_INTERPRET"):
        kw["num_warps"] = warps
    if kind == "cast":
        cast_kernel[(triton.cdiv(M, BM), triton.cdiv(cols, BN))](x, y, yt, yt8, scale, M, cols, **kw)
    elif kind == "swiglu":
        swiglu_kernel[(triton.cdiv(M, BM), triton.cdiv(f, BN))](x, y, yt, yt8, scale, M, f, **kw)
    else:
        swiglu_grad_kernel[(triton.cdiv(M, BM), triton.cdiv(f, BN))](x, d, y, yt, yt8, scale, M, f, **kw)
    return y, yt


def inputs(kind, m, n, in_dtype, dev, gen):
    """x [m, n] (cast) or [m, 2n] (the SwiGLU kernels) and d [m, n]; exact powers of two in a quarter of
    the rows, so that a foreign byte cannot hide in rounding."""
    cols = n if kind == "cast" else 2 * n
    x = torch.randn(m, cols, generator=gen, device="cpu").to(in_dtype)
    x[: m // 4] = torch.ldexp(torch.ones_like(x[: m // 4]).float(),
                              torch.randint(-6, 3, x[: m // 4].shape, generator=gen)).to(in_dtype)
    d = (torch.randn(m, n, generator=gen) * 1e-2).to(in_dtype)
    return x.to(dev), d.to(dev)


def check(kind, mode, tiles, shape, in_dtype, dtype, dev):
    """Bytes that differ: out against torch's cast (the interpreter: against mode 0, as its fp8 rounding
    is off at ties, docs/fp8.md), out^T against this run's own out, out against mode 0's."""
    gen = torch.Generator().manual_seed(hash((kind, shape)) % 1000)
    x, d = inputs(kind, *shape, in_dtype, dev, gen)
    scale = torch.tensor([2.0 if dtype == torch.float8_e4m3fn else 64.0], device=dev)
    y, yt = launch(kind, mode, tiles, x, d, scale, dtype, outputs(kind, x, dtype))
    y0 = launch(kind, 0, tiles, x, d, scale, dtype, outputs(kind, x, dtype))[0]
    ref = y0 if os.environ.get("TRITON_INTERPRET") else reference(kind, x, d, scale, dtype)

    def differ(a, b):
        return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())
    return differ(y, ref), differ(yt, y.t()), differ(y, y0)


def graphed_ms(fn):
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=50)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    interp = bool(os.environ.get("TRITON_INTERPRET"))
    dev = "cpu" if interp else "cuda"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    result = dict(modes=MODES)
    if not interp:
        from bench_host import cpu_model, device_copy_gbs
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        result.update(gpu=torch.cuda.get_device_name(), host_cpu=cpu_model(), triton=triton.__version__,
                      torch=torch.__version__, ptxas=ver[-1] if ver else "?")
        print(f"GPU: {result['gpu']} | host CPU: {result['host_cpu']} | Triton {triton.__version__} | {result['ptxas']}")
    tiles_all = [(16, 16, 4)] if interp else [(64, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8)]
    shapes = [(48, 40), (33, 24)] if interp else [(1000, 776), (8192, 5632), (4096, 3072)]
    checks, ok, torch_diff = [], {}, {}
    for kind in ("cast", "swiglu", "swiglu_grad"):
        for mode in MODES:
            for tiles in tiles_all:
                for in_dtype in (torch.bfloat16, torch.float32):
                    for dtype in (e4, e5):
                        if in_dtype == torch.float32 and tiles != tiles_all[0] and dtype == e5:
                            continue
                        for shape in shapes:
                            vs_torch, t_vs_own, vs_mode0 = check(kind, mode, tiles, shape, in_dtype, dtype, dev)
                            checks.append(dict(kernel=kind, mode=mode, tiles=list(tiles), shape=list(shape),
                                               input=str(in_dtype), fp8=str(dtype), differ_from_torch=vs_torch,
                                               transposed_differs_from_own=t_vs_own, differ_from_mode0=vs_mode0))
                            key = (kind, mode, tiles)
                            ok[key] = ok.get(key, True) and t_vs_own == 0 and vs_mode0 == 0
                            torch_diff[kind] = max(torch_diff.get(kind, 0), vs_torch)
            print(f"{kind:12} mode {mode}: " + ", ".join(
                f"{t}: {'ok' if ok[(kind, mode, t)] else 'WRONG'}" for t in tiles_all), flush=True)
    print("largest count of bytes differing from torch's cast, any mode:", torch_diff)
    result["checks"] = checks
    if not interp and not args.check_only:
        copy_gbs = device_copy_gbs("cuda")
        result["copy_gbs"] = round(copy_gbs)
        print(f"device copy {copy_gbs:.0f} GB/s")
        rows = []
        bench_shapes = {"cast": {"0.95B x": (8192, 2048), "2.9B fc1 dy": (4096, 16384)},
                        "swiglu": {"0.95B": (8192, 5632), "2.9B": (4096, 8192)},
                        "swiglu_grad": {"0.95B": (8192, 5632), "2.9B": (4096, 8192)}}
        for kind, shapes_k in bench_shapes.items():
            for name, (m, n) in shapes_k.items():
                x, d = inputs(kind, m, n, torch.bfloat16, "cuda", torch.Generator().manual_seed(0))
                scale = torch.tensor([1.0], device="cuda")
                dtype = e5 if kind == "swiglu_grad" else e4
                moved = {"cast": m * n * 2 + 2 * m * n, "swiglu": m * 2 * n * 2 + 2 * m * n,
                         "swiglu_grad": m * 2 * n * 2 + m * n * 2 + 2 * m * 2 * n}[kind]
                outs = outputs(kind, x, dtype)
                for mode in MODES:
                    for tiles in tiles_all:
                        if not ok[(kind, mode, tiles)]:
                            continue
                        ms = graphed_ms(lambda: launch(kind, mode, tiles, x, d, scale, dtype, outs))
                        gbs = moved / ms / 1e6
                        rows.append(dict(kernel=kind, shape=name, mode=mode, tiles=list(tiles), ms=round(ms, 4),
                                         gbs=round(gbs), pct_copy=round(100 * gbs / copy_gbs, 1)))
                        print(f"{kind:12} {name:12} mode {mode} {str(tiles):14} {ms:7.4f} ms {gbs:6.0f} GB/s "
                              f"{rows[-1]['pct_copy']:5.1f} %", flush=True)
        result["timings"] = rows
        result["timing"] = "cuda-graph replays (triton.testing.do_bench_cudagraph), outputs allocated before"
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_transpose_probe.json"), "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

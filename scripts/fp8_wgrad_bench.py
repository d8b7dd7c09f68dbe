#!/usr/bin/env python3
"""The fp8 wgrad into fp32 main_grad, three ways, at the wgrad shapes of the bench's 0.95B and 2.9B
models (dW [out, in] += dy^T [out, tokens] @ x [tokens, in], tokens = micro-batch x sequence):

- `torch._scaled_mm` (cuBLASLt, fp32 dW) then `main_grad.add_` (megatron-adapt's path before
  2026-11-27, and its path without nvmath-python);
- cuBLASLt with beta = 1 in place through nvmath-python (backends/cuda/fp8_wgrad.py, the path now):
  GPU time, host time per call, and two replays of a CUDA graph that captured it;
- with --triton: Triton GEMMs whose epilogue adds into main_grad (defined below, not used by the
  library): a pointer-based tiled kernel and a TMA one (persistent or not), over tile configs;
- with --compile: torch.compile (max-autotune) of `main_grad + _scaled_mm(...)`, inductor's own
  epilogue fusion.

    OUT=/tmp/bench python3 scripts/fp8_wgrad_bench.py [--triton] [--compile] [--only 0.95B:fc1 ...]

Numerics: the largest error against the fp32 product of the same fp8 operands, relative to its
largest value. triton.testing.do_bench medians; the host CPU and the GPU printed; $OUT/$NAME.json
(default fp8_wgrad_bench) written.
"""
import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from bench_host import bench, cpu_model, device_copy_gbs
from megatron_adapt.backends.cuda import fp8_wgrad


def cdiv(a, b):
    return -(-a // b)


# ---- the Triton GEMMs with the add in their epilogue (measured here; not used by the library) ----
@triton.jit
def _gemm_accumulate_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, stride_c,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                            PROMOTE: tl.constexpr):
    """c[M, N] (fp32) += sa * sb * a[M, K] @ b[N, K]^T, a and b fp8 and K-major (as the wgrad's
    dy^T and x^T are). Tiles in groups of GROUP_M rows for L2 reuse; the fp8 products are added
    into the fp32 accumulator every PROMOTE elements of K (cuBLAS's split accumulation)."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    pm = first_m + (pid % in_group) % rows
    pn = (pid % in_group) // rows
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * stride_a + rk[None, :]
    b_ptrs = b_ptr + rn[None, :] * stride_b + rk[:, None]      # b^T tile [BK, BN], K contiguous
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        left = K - k * BK
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & (rk[:, None] < left), other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BK
        b_ptrs += BK
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptrs = c_ptr + rm[:, None] * stride_c + rn[None, :]
    scale = tl.load(sa_ptr) * tl.load(sb_ptr)
    tl.store(c_ptrs, tl.load(c_ptrs, mask=mask, other=0.0) + acc * scale, mask=mask)


@triton.jit
def _gemm_accumulate_tma_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                                PROMOTE: tl.constexpr, NUM_SMS: tl.constexpr, EPI_SPLIT: tl.constexpr,
                                FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The same GEMM through TMA descriptors (Hopper's bulk tile loads, OOB zero-filled), persistent:
    NUM_SMS programs walk the output tiles. EPI_SPLIT: the epilogue in two halves of BN."""
    start = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    scale = tl.load(sa_ptr) * tl.load(sb_ptr)
    for tile in tl.range(start, num_m * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        rows = min(num_m - first_m, GROUP_M)
        om = (first_m + (tile % in_group) % rows) * BM
        on = ((tile % in_group) // rows) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([on, ki * BK])
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        if EPI_SPLIT:
            acc = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            c_desc.store([om, on], c_desc.load([om, on]) + acc0 * scale)
            c_desc.store([om, on + BN // 2], c_desc.load([om, on + BN // 2]) + acc1 * scale)
        else:
            c_desc.store([om, on], c_desc.load([om, on]) + acc * scale)


GEMM_ACCUMULATE_TMA_CONFIG = dict(BM=128, BN=128, BK=128, GROUP_M=8, PROMOTE=128, EPI_SPLIT=False,
                                  FLATTEN=False, WARP_SPECIALIZE=False, num_warps=8, num_stages=4)


def gemm_accumulate_tma(c, a, b, scale_a, scale_b, persistent=True, **config):
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = a.shape
    N = b.shape[0]
    cfg = dict(GEMM_ACCUMULATE_TMA_CONFIG, **config)
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = cdiv(M, BM) * cdiv(N, BN)
    sms = _sm_count(a.device) if persistent else tiles
    grid = (min(sms, tiles),)
    a_d = TensorDescriptor.from_tensor(a, [BM, BK])
    b_d = TensorDescriptor.from_tensor(b, [BN, BK])
    c_d = TensorDescriptor.from_tensor(c, [BM, BN // 2 if cfg["EPI_SPLIT"] else BN])
    _gemm_accumulate_tma_kernel[grid](a_d, b_d, c_d, scale_a, scale_b, M, N, K, NUM_SMS=grid[0], **cfg)
    return c


_SMS: dict = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


GEMM_ACCUMULATE_CONFIG = dict(BM=128, BN=128, BK=128, GROUP_M=8, PROMOTE=128, num_warps=8, num_stages=5)


def gemm_accumulate(c, a, b, scale_a, scale_b, **config):
    """c += scale_a * scale_b * a @ b^T in one Triton GEMM whose epilogue adds into c: the fp8 wgrad
    straight into fp32 main_grad, where torch._scaled_mm (no beta) writes an fp32 dW that a second
    pass adds (docs/fp8.md). a [M, K], b [N, K] fp8 with unit stride along K; c [M, N] fp32."""
    M, K = a.shape
    N = b.shape[0]
    cfg = dict(GEMM_ACCUMULATE_CONFIG, **config)
    grid = (cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]),)
    _gemm_accumulate_kernel[grid](a, b, c, scale_a, scale_b, M, N, K, a.stride(0), b.stride(0), c.stride(0), **cfg)
    return c


E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

# (model, linear, out, in, tokens)
SHAPES = [
    ("0.95B", "qkv", 6144, 2048, 8192), ("0.95B", "proj", 2048, 2048, 8192),
    ("0.95B", "fc1", 11264, 2048, 8192), ("0.95B", "fc2", 2048, 5632, 8192),
    ("2.9B", "qkv", 9216, 3072, 4096), ("2.9B", "proj", 3072, 3072, 4096),
    ("2.9B", "fc1", 16384, 3072, 4096), ("2.9B", "fc2", 3072, 8192, 4096),
]
SWEEP = [   # (label, kernel, config): the pointer kernel's tiles, then the TMA kernel's
    ("ptr 128x128x128 s5 w8", "ptr", dict(BM=128, BN=128, BK=128, num_stages=5, num_warps=8)),
    ("ptr 256x128x128 s3 w8", "ptr", dict(BM=256, BN=128, BK=128, num_stages=3)),
    ("tma persistent 128x128x128 s4 w8", "tma", dict()),
    ("tma persistent 128x128x128 s5 w8", "tma", dict(num_stages=5)),
    ("tma grid 128x128x128 s4 w8", "tma", dict(persistent=False)),
    ("tma persistent 128x256x128 s3 w8 split", "tma", dict(BN=256, EPI_SPLIT=True, num_stages=3)),
    ("tma persistent 128x256x64 s4 w8 split", "tma", dict(BN=256, BK=64, PROMOTE=64, EPI_SPLIT=True)),
    ("tma persistent 256x128x64 s4 w8", "tma", dict(BM=256, BK=64, PROMOTE=64)),
    ("tma persistent 128x128x128 flatten", "tma", dict(FLATTEN=True)),
    ("tma persistent 128x128x128 warp-specialized", "tma", dict(WARP_SPECIALIZE=True, num_warps=4)),
    ("tma persistent 128x256x128 s3 w8 split ws", "tma", dict(BN=256, EPI_SPLIT=True, num_stages=3,
                                                             WARP_SPECIALIZE=True, num_warps=4)),
    ("tma persistent 128x128x128 fast accumulation", "tma", dict(PROMOTE=None)),
    ("tma persistent 128x128x128 promote every 32", "tma", dict(PROMOTE=0)),
]
KERNELS = {"ptr": gemm_accumulate, "tma": gemm_accumulate_tma}


def host_us(fn, n=50):
    """Host microseconds per call (launch cost; the GPU queue absorbs the work)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def rel_err(c, ref):
    return float((c - ref).abs().max() / ref.abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="store_true", help="also the Triton GEMM-accumulate kernels, over tile configs")
    ap.add_argument("--compile", action="store_true", help="also torch.compile(max-autotune) of main_grad + _scaled_mm")
    ap.add_argument("--only", nargs="*", help="model:linear pairs, e.g. 0.95B:fc1 (default: all)")
    args = ap.parse_args()
    dev = "cuda"
    host = f"{cpu_model()}, {os.cpu_count()} vCPU"
    print(f"GPU {torch.cuda.get_device_name()}; host {host}; torch {torch.__version__}; triton {triton.__version__}")
    if fp8_wgrad.unavailable():
        raise SystemExit(f"the library path needs nvmath-python: {fp8_wgrad.unavailable()}")
    rows = []
    copy_gbs = device_copy_gbs(dev)
    print(f"device copy: {copy_gbs:.0f} GB/s")
    for model, name, out, inp, tokens in SHAPES:
        if args.only and f"{model}:{name}" not in args.only:
            continue
        torch.manual_seed(0)
        dyt = (torch.randn(out, tokens, device=dev) * 4).to(E5)
        xt = (torch.randn(inp, tokens, device=dev) * 40).to(E4)
        sa = torch.tensor([0.25], device=dev)
        sb = torch.tensor([0.01], device=dev)
        mg0 = torch.randn(out, inp, device=dev)
        flop = 2 * out * inp * tokens
        ref = mg0 + (dyt.float() @ xt.float().t()) * (sa * sb)
        row = dict(model=model, linear=name, out=out, inp=inp, tokens=tokens)

        def cublas():
            return torch._scaled_mm(dyt, xt.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=False)

        def inplace(c):
            fp8_wgrad.accumulate(c, dyt, xt, sa, sb)
            return c
        mg = mg0.clone()
        row["err_cublas"] = rel_err(mg.add_(cublas()), ref)
        row["ms_cublas_gemm"] = bench(cublas)
        row["ms_cublas_gemm_add"] = bench(lambda: mg.add_(cublas()))
        row["host_us_cublas_gemm_add"] = host_us(lambda: mg.add_(cublas()))
        mg = mg0.clone()
        row["err_inplace"] = rel_err(inplace(mg), ref)
        row["ms_inplace"] = bench(lambda: inplace(mg))
        row["host_us_inplace"] = host_us(lambda: inplace(mg))
        # inside a CUDA graph (Megatron's --cuda-graph-impl): captured once, replayed twice
        mg, mg_ref = mg0.clone(), mg0.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            inplace(mg)
        mg.copy_(mg0)
        graph.replay()
        graph.replay()
        mg_ref.add_(cublas()).add_(cublas())
        torch.cuda.synchronize()
        row["err_inplace_graph_two_replays_vs_gemm_add"] = rel_err(mg, mg_ref)
        if args.triton:
            row["triton"] = []
            for label, kernel, cfg in SWEEP:
                mg, fn = mg0.clone(), KERNELS[kernel]
                try:
                    err = rel_err(fn(mg, dyt, xt, sa, sb, **cfg), ref)
                    ms = bench(lambda: fn(mg, dyt, xt, sa, sb, **cfg))
                except Exception as e:   # noqa: BLE001 - a config that does not compile here
                    err, ms = None, f"{type(e).__name__}: {str(e)[-300:]}"
                row["triton"].append(dict(label=label, err=err, ms=ms))
                print(f"  triton {label:<48} {ms if isinstance(ms, str) else f'{ms:.3f} ms  err {err:.1e}'}")
        if args.compile:
            def add_mm(c, a, b, s1, s2):
                return c + torch._scaled_mm(a, b.t(), scale_a=s1, scale_b=s2, out_dtype=torch.float32)
            try:
                comp = torch.compile(add_mm, mode="max-autotune-no-cudagraphs", dynamic=False)
                row["err_compile"] = rel_err(comp(mg0, dyt, xt, sa, sb), ref)
                row["ms_compile"] = bench(lambda: comp(mg0, dyt, xt, sa, sb))
            except Exception as e:   # noqa: BLE001
                row["ms_compile"] = f"{type(e).__name__}: {str(e)[:200]}"
        for k in [k for k in row if k.startswith("ms_") and isinstance(row[k], float)]:
            row["tflops" + k[2:]] = flop / row[k] / 1e9
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "triton"}))
    print(f"\n{'shape':<14}{'gemm':>8}{'gemm+add':>10}{'in place':>10}{'speed-up':>9}{'TFLOP/s':>9}"
          f"{'host us':>9}  err gemm+add / in place / graph")
    for r in rows:
        print(f"{r['model'] + ' ' + r['linear']:<14}{r['ms_cublas_gemm']:8.3f}{r['ms_cublas_gemm_add']:10.3f}"
              f"{r['ms_inplace']:10.3f}{r['ms_cublas_gemm_add'] / r['ms_inplace']:8.2f}x{r['tflops_inplace']:9.0f}"
              f"{r['host_us_inplace']:9.1f}  {r['err_cublas']:.1e} / {r['err_inplace']:.1e} / "
              f"{r['err_inplace_graph_two_replays_vs_gemm_add']:.1e}")
    res = dict(gpu=torch.cuda.get_device_name(), host=host, torch=torch.__version__, triton=triton.__version__,
               copy_gbs=copy_gbs, rows=rows)
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, os.environ.get("NAME", "fp8_wgrad_bench") + ".json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

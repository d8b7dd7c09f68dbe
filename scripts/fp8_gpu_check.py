#!/usr/bin/env python3
"""fp8 linears on one GPU: numerics of the cuda backend's fp8 op, then fp8 against bf16 timings.

    OUT=/tmp/fp8 python3 scripts/fp8_gpu_check.py          # from the repository root

Needs torch with CUDA and Triton (no Transformer Engine, no megatron-core); megatron-adapt is
imported from this checkout if it is not installed. Prints the host CPU model, the GPU, and:

1. numerics (exit code 1 if any fails): the Triton cast kernel equal to torch's cast element for
   element (e4m3 / e5m2, tensorwise and delayed, with the transposed copy); `fp8_linear` forward,
   dgrad and wgrad against an explicit emulation (the same fp8 tensors dequantized, an fp32
   matmul) and against the fp32 product at fp8 tolerances, for hybrid / e4m3 and tensorwise /
   delayed, bf16 inputs; the delayed state (amax history, scale) after two steps.
2. timing at the bench model's shapes (tokens 8192, hidden 2048, ffn 8192): per linear (qkv,
   proj, fc1, fc2) the bf16 GEMM and the fp8 GEMM alone (torch._scaled_mm, forward), and the whole
   linear forward + backward (bf16 autograd F.linear against fp8_linear tensorwise and delayed,
   casts included); the cast kernel (fused cast + transpose + amax) against torch.compile of the
   same math and PyTorch eager, in GB/s.

Writes $OUT/fp8_gpu_check.json (or ./fp8_gpu_check.json without OUT).
Timing: triton.testing.do_bench (CUDA events, L2 flushed), median of the repetitions.
"""
import json
import os
import platform
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("MEGATRON_ADAPT_AUTO", "0")
try:
    from megatron_adapt.backends.cuda import fp8
except ImportError:
    sys.path.insert(0, os.path.dirname(HERE))   # a source checkout (megatron_adapt/__init__ maps backends/)
    from megatron_adapt.backends.cuda import fp8
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Recipe, Fp8Scaling  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
RESULT = {"numerics": [], "gemm": [], "linear": [], "cast": []}
FAILED = []


def cpu_model():
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def check(name, ok, **info):
    RESULT["numerics"].append({"check": name, "ok": bool(ok), **info})
    print(f"  {'ok  ' if ok else 'FAIL'} {name} {info if info else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def torch_cast(x, scale, dtype):
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------------------------- numerics
def numerics():
    print("numerics", flush=True)
    torch.manual_seed(0)
    for dtype in (E4, E5):
        x = torch.randn(1000, 776, device="cuda", dtype=torch.bfloat16) * 3
        amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1)
        y, yt, sinv = fp8._cast_triton(x, dtype, True, None, amax)
        scale = FP8_MAX[dtype] / amax
        check(f"cast tensorwise {dtype}", torch.equal(y.float(), torch_cast(x, scale, dtype).float())
              and torch.equal(yt.float(), y.float().t()) and torch.allclose(sinv, 1 / scale))
        s = torch.tensor([FP8_MAX[dtype] / 4.0], device="cuda")
        slot = torch.zeros(1, device="cuda")
        y, _, _ = fp8._cast_triton(x, dtype, False, s, slot)
        check(f"cast delayed (saturating) {dtype}", torch.equal(y.float(), torch_cast(x, s, dtype).float())
              and torch.equal(slot, amax))
    for fmt in ("hybrid", "e4m3"):
        for recipe in ("tensorwise", "delayed"):
            r = Fp8Recipe(fmt, recipe, amax_history_len=4, amax_compute_algo="max")
            state = Fp8Scaling(r, "cuda")
            x = (torch.randn(512, 1024, device="cuda") * 2).bfloat16().requires_grad_()
            w = (torch.randn(768, 1024, device="cuda") * 0.02).bfloat16().requires_grad_()
            dy = (torch.randn(512, 768, device="cuda") * 1e-2).bfloat16()
            for step in range(2):
                # scales this step casts with: tensorwise = current amax; delayed = the state's
                if recipe == "tensorwise":
                    sx, sw = FP8_MAX[E4] / x.detach().float().abs().max(), FP8_MAX[E4] / w.detach().float().abs().max()
                    sg = FP8_MAX[r.bwd_dtype] / dy.float().abs().max()
                else:
                    sx, sw = state.scale["fwd"][0].clone(), state.scale["fwd"][1].clone()
                    sg = None
                x.grad = w.grad = None
                y = fp8.fp8_linear(x, w, None, state)
                if recipe == "delayed":
                    sg = state.scale["bwd"][0].clone()
                y.backward(dy)
            xq = torch_cast(x.detach(), sx, E4).float() / sx
            wq = torch_cast(w.detach(), sw, E4).float() / sw
            dq = torch_cast(dy, sg, r.bwd_dtype).float() / sg
            xf, wf, df = x.detach().float(), w.detach().float(), dy.float()
            info = {"fwd_vs_emulation": rel(y, xq @ wq.t()), "dgrad_vs_emulation": rel(x.grad, dq @ wq),
                    "wgrad_vs_emulation": rel(w.grad, dq.t() @ xq), "fwd_vs_fp32": rel(y, xf @ wf.t()),
                    "dgrad_vs_fp32": rel(x.grad, df @ wf), "wgrad_vs_fp32": rel(w.grad, df.t() @ xf)}
            gtol = 0.1 if fmt == "hybrid" else 0.06
            ok = (max(info["fwd_vs_emulation"], info["dgrad_vs_emulation"], info["wgrad_vs_emulation"]) < 1e-2
                  and info["fwd_vs_fp32"] < 0.05 and info["dgrad_vs_fp32"] < gtol and info["wgrad_vs_fp32"] < gtol)
            check(f"fp8_linear {fmt} {recipe}", ok, **{k: round(v, 5) for k, v in info.items()})
            if recipe == "delayed":
                hist = state.amax_history["fwd"]
                check(f"delayed state {fmt}", hist[0].eq(0).all().item() and hist[-1].gt(0).all().item()
                      and torch.allclose(state.scale["fwd"], FP8_MAX[E4] / hist.max(0).values))


# ---------------------------------------------------------------------------------- timing
def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200)


SHAPES = {"qkv": (2048, 3 * 2048), "proj": (2048, 2048), "fc1": (2048, 8192), "fc2": (8192, 2048)}


def timing(tokens=8192):
    print(f"timing: tokens {tokens}", flush=True)
    for name, (k, n) in SHAPES.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * tokens * k * n
        one = torch.ones(1, device="cuda")
        x8, w8 = x.to(E4), w.to(E4)
        t_bf16 = bench(lambda: torch.matmul(x, w.t()))
        t_fp8 = bench(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                               use_fast_accum=True))
        row = {"linear": name, "tokens": tokens, "in": k, "out": n, "bf16_ms": t_bf16, "fp8_ms": t_fp8,
               "bf16_tflops": flops / t_bf16 / 1e9, "fp8_tflops": flops / t_fp8 / 1e9, "speedup": t_bf16 / t_fp8}
        RESULT["gemm"].append(row)
        print(f"  gemm {name:5} [{tokens}x{k}] x [{k}x{n}]: bf16 {t_bf16:.3f} ms ({row['bf16_tflops']:.0f} TFLOP/s), "
              f"fp8 {t_fp8:.3f} ms ({row['fp8_tflops']:.0f} TFLOP/s), {row['speedup']:.2f}x", flush=True)

        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

        def bf16_step():
            y = torch.nn.functional.linear(xr, wr)
            torch.autograd.grad(y, (xr, wr), dy)
        res = {"linear": name, "bf16_fwd_bwd_ms": bench(bf16_step)}
        for recipe in ("tensorwise", "delayed"):
            state = Fp8Scaling(Fp8Recipe("hybrid", recipe), "cuda")

            def fp8_step():
                y = fp8.fp8_linear(xr, wr, None, state)
                torch.autograd.grad(y, (xr, wr), dy)
            res[f"fp8_{recipe}_fwd_bwd_ms"] = bench(fp8_step)
            res[f"speedup_{recipe}"] = res["bf16_fwd_bwd_ms"] / res[f"fp8_{recipe}_fwd_bwd_ms"]
        RESULT["linear"].append(res)
        print(f"  linear {name:5} fwd+bwd: bf16 {res['bf16_fwd_bwd_ms']:.3f} ms, fp8 tensorwise "
              f"{res['fp8_tensorwise_fwd_bwd_ms']:.3f} ms ({res['speedup_tensorwise']:.2f}x), delayed "
              f"{res['fp8_delayed_fwd_bwd_ms']:.3f} ms ({res['speedup_delayed']:.2f}x)", flush=True)


def cast_timing(tokens=8192):
    print("cast kernel: Triton (cast + transpose + amax, one pass) vs torch.compile vs eager", flush=True)

    def eager(x, scale):   # delayed-scaling cast: saturate(x * scale), its transpose, amax
        y = (x.float() * scale).clamp(-448.0, 448.0).to(E4)
        return y, y.t().contiguous(), x.abs().amax().float()
    compiled = torch.compile(eager, dynamic=False)
    for k in (2048, 8192):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([2.0], device="cuda")
        slot = torch.zeros(1, device="cuda")
        compiled(x, scale)   # compile outside the timing
        nbytes = x.numel() * (2 + 1 + 1)   # read bf16, write fp8 twice
        row = {"shape": [tokens, k], "bytes": nbytes}
        for label, fn in (("triton", lambda: fp8._cast_triton(x, E4, True, scale, slot)),
                          ("torch_compile", lambda: compiled(x, scale)), ("eager", lambda: eager(x, scale))):
            ms = bench(fn)
            row[f"{label}_ms"], row[f"{label}_gbps"] = ms, nbytes / ms / 1e6
        y_t, yt_t, _ = fp8._cast_triton(x, E4, True, scale, slot)
        y_c, yt_c, _ = compiled(x, scale)
        row["triton_equals_compile"] = bool(torch.equal(y_t.float(), y_c.float()) and torch.equal(yt_t.float(), yt_c.float()))
        RESULT["cast"].append(row)
        print(f"  [{tokens}x{k}]: triton {row['triton_ms']:.3f} ms ({row['triton_gbps']:.0f} GB/s), torch.compile "
              f"{row['torch_compile_ms']:.3f} ms ({row['torch_compile_gbps']:.0f} GB/s), eager {row['eager_ms']:.3f} ms "
              f"({row['eager_gbps']:.0f} GB/s); equal outputs: {row['triton_equals_compile']}", flush=True)


def main():
    if not torch.cuda.is_available():
        sys.exit("fp8_gpu_check needs a CUDA GPU")
    RESULT["host_cpu"] = f"{cpu_model()}, {os.cpu_count()} vCPU"
    RESULT["gpu"] = torch.cuda.get_device_name()
    RESULT["capability"] = list(torch.cuda.get_device_capability())
    RESULT["torch"] = torch.__version__
    import triton
    RESULT["triton"] = triton.__version__
    print(f"host CPU: {RESULT['host_cpu']}\nGPU: {RESULT['gpu']} sm{''.join(map(str, RESULT['capability']))}, "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    why = fp8.fp8_unavailable()
    RESULT["fp8_unavailable"] = why
    if why:
        print(f"fp8 cannot run here: {why}")
    else:
        numerics()
        timing()
        cast_timing()
    RESULT["failed"] = FAILED
    path = os.path.join(os.environ.get("OUT", "."), "fp8_gpu_check.json")
    with open(path, "w") as f:
        json.dump(RESULT, f, indent=1)
    print(f"wrote {path}; numerics {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all ok'}")
    sys.exit(1 if FAILED or why else 0)


if __name__ == "__main__":
    main()

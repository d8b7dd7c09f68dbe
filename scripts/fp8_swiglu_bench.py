#!/usr/bin/env python3
"""SwiGLU and the fp8 casts around it, unfused against fused (op fp8_swiglu), at the bench models'
MLP shapes (fc1's output [tokens, 2F], tokens = micro-batch x sequence; delayed scaling):

- forward: unfused = the Triton SwiGLU kernel (bf16 out) then the cast kernel (e4m3 + transposed
  copy); fused = SwigluOutput.fp8_quantize (one kernel);
- backward: unfused = the Triton SwiGLU backward (bf16 d(fc1 out)) then the cast (e5m2 + transposed);
  fused = SwigluGrad.fp8_quantize;
- with --compile: torch.compile of the same unfused math (inductor's own fusion), forward and
  backward, each writing the fp8 tensor and its transposed copy.

    OUT=/tmp/bench python3 scripts/fp8_swiglu_bench.py [--compile] [--tiles]

--tiles also times the fused kernels at other tile sizes and warp counts (fp8_swiglu.TILES).

GB/s counts the bytes the fused kernel must move (reads of fc1's output and the incoming gradient,
writes of the fp8 copies), the same count for every path, against the device copy measured here.
triton.testing.do_bench medians; host CPU and GPU printed; $OUT/fp8_swiglu_bench.json written.
"""
import argparse
import json
import os

import torch

from bench_host import bench, cpu_model, device_copy_gbs
from megatron_adapt.backends.cuda import activations, fp8, fp8_swiglu
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Recipe, Fp8Scaling

SHAPES = {"0.95B": (8192, 5632), "2.9B": (4096, 8192)}   # tokens per micro-batch, F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tiles", action="store_true")
    args = ap.parse_args()
    dev = "cuda"
    print(f"GPU: {torch.cuda.get_device_name()} | host CPU: {cpu_model()}")
    copy_gbs = device_copy_gbs(dev)
    print(f"device copy: {copy_gbs:.0f} GB/s")
    scaling = Fp8Scaling(Fp8Recipe(format="hybrid", recipe="delayed"), device=dev)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    rows = []
    for name, (t, f) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16)
        d = torch.randn(t, f, device=dev, dtype=torch.bfloat16) * 1e-3

        def fwd_unfused():
            y = activations._SwiGLU.forward(_Ctx(), x, None)
            return fp8.quantize(y, e4, True, scaling, "fwd", 0)

        def bwd_unfused():
            ctx = _Ctx()
            ctx.saved_tensors = (x, None)
            ctx.needs_input_grad = (True, False)
            g = activations._SwiGLU.backward(ctx, d)[0]
            return fp8.quantize(g, e5, True, scaling, "bwd", 0)

        out, grad = fp8_swiglu.SwigluOutput((t, f), x, x), fp8_swiglu.SwigluGrad((t, 2 * f), x, x, d)
        paths = {"forward": {"unfused": fwd_unfused,
                             "fused": lambda: out.fp8_quantize(e4, True, scaling, "fwd", 0)},
                 "backward": {"unfused": bwd_unfused,
                              "fused": lambda: grad.fp8_quantize(e5, True, scaling, "bwd", 0)}}
        if args.compile:
            s4, s5 = scaling.scale["fwd"][0:1], scaling.scale["bwd"][0:1]

            @torch.compile
            def fwd_compiled(x):
                a, b = x.float().chunk(2, -1)
                y = (a * torch.sigmoid(a) * b).to(x.dtype).float()
                q = (y * s4).clamp(-FP8_MAX[e4], FP8_MAX[e4]).to(e4)
                return q, q.t().contiguous(), y.abs().amax()

            @torch.compile
            def bwd_compiled(x, d):
                a, b = x.float().chunk(2, -1)
                sig = torch.sigmoid(a)
                g = torch.cat([(d.float() * b * sig * (1 + a * (1 - sig))).to(x.dtype),
                               (d.float() * a * sig).to(x.dtype)], -1).float()
                q = (g * s5).clamp(-FP8_MAX[e5], FP8_MAX[e5]).to(e5)
                return q, q.t().contiguous(), g.abs().amax()
            paths["forward"]["torch.compile"] = lambda: fwd_compiled(x)
            paths["backward"]["torch.compile"] = lambda: bwd_compiled(x, d)
        if args.tiles:
            for tiles in ((32, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (32, 128, 4), (128, 128, 8)):
                def tiled(fn, tiles=tiles):
                    def run():
                        held, fp8_swiglu.TILES = fp8_swiglu.TILES, tiles
                        try:
                            return fn()
                        finally:
                            fp8_swiglu.TILES = held
                    return run
                paths["forward"][f"fused {tiles}"] = tiled(paths["forward"]["fused"])
                paths["backward"][f"fused {tiles}"] = tiled(paths["backward"]["fused"])
        moved = {"forward": t * 2 * f * 2 + 2 * t * f, "backward": t * 2 * f * 2 + t * f * 2 + 2 * t * 2 * f}
        for direction, impls in paths.items():
            for impl, fn in impls.items():
                ms = bench(fn)
                gbs = moved[direction] / ms / 1e6
                row = dict(model=name, tokens=t, F=f, direction=direction, impl=impl, ms=round(ms, 4),
                           gbs=round(gbs), pct_copy=round(100 * gbs / copy_gbs, 1))
                rows.append(row)
                print(f"{name:6} {direction:8} {impl:22} {ms:7.3f} ms {gbs:6.0f} GB/s {row['pct_copy']:5.1f} % of copy")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp8_swiglu_bench.json"), "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), host_cpu=cpu_model(), copy_gbs=round(copy_gbs),
                       rows=rows), fh, indent=1)


class _Ctx:
    """Stands for autograd's ctx when a Function's forward / backward is called directly."""

    def save_for_backward(self, *t):
        self.saved_tensors = t


if __name__ == "__main__":
    main()

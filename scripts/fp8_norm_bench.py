#!/usr/bin/env python3
"""The norm before an fp8 linear and that linear's cast, unfused against fused (op fp8_norm), at the
bench models' shapes (the norm's input [tokens, hidden], tokens = micro-batch x sequence; delayed
scaling, e4m3):

- unfused = the cuda backend's norm kernel (bf16 out), then the cast kernel (e4m3 + transposed copy);
- fused = NormOutput.fp8_quantize (the rows' statistics, then one cast kernel);
- with --compile: torch.compile of the same unfused math (inductor's own fusion), writing the fp8
  tensor, its transposed copy and the amax.

    OUT=/tmp/bench python3 scripts/fp8_norm_bench.py [--compile] [--tiles]

--tiles also times the fused kernel at other tile sizes and warp counts (fp8_norm.TILES).
GB/s counts the bytes the fused kernel must move (one read of the input, the two fp8 copies), the
same count for every path, against the device copy measured here. Medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph: these kernels take tens of microseconds, less than a slow host
needs to launch them, and Megatron's layer graphs replay them so); host CPU and GPU printed;
$OUT/fp8_norm_bench.json written.
"""
import argparse
import json
import os

import torch

from bench_host import bench, bench_graphed, cpu_model
from megatron_adapt.backends.cuda import fp8, fp8_norm, norms
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Recipe, Fp8Scaling

SHAPES = {"0.95B": (8192, 2048), "2.9B": (4096, 3072)}   # tokens per micro-batch, hidden
TILE_SWEEP = ((16, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 4), (64, 128, 8))


class _Ctx:
    """Stands for autograd's ctx when a Function's forward is called directly."""

    def save_for_backward(self, *t):
        self.saved_tensors = t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tiles", action="store_true")
    args = ap.parse_args()
    dev = "cuda"
    print(f"GPU: {torch.cuda.get_device_name()} | host CPU: {cpu_model()}")
    n = 1 << 28
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    copy_gbs = 2 * n / bench(lambda: dst.copy_(src)) / 1e6
    print(f"device copy: {copy_gbs:.0f} GB/s")
    scaling = Fp8Scaling(Fp8Recipe(format="hybrid", recipe="delayed"), device=dev)
    e4, eps = torch.float8_e4m3fn, 1e-5
    s4 = scaling.scale["fwd"][0:1]
    rows = []
    for name, (t, h) in SHAPES.items():
        for kind in ("RMSNorm", "LayerNorm"):
            rms = kind == "RMSNorm"
            torch.manual_seed(0)
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            w = torch.rand(h, device=dev, dtype=torch.bfloat16) + 0.5
            b = None if rms else torch.randn(h, device=dev, dtype=torch.bfloat16) * 0.1
            stats = torch.empty(t, device=dev)
            out = fp8_norm.NormOutput((t, h), x, x, w, b, eps, rms, stats if rms else torch.empty_like(stats), stats)

            def unfused():
                y = norms._Norm.forward(_Ctx(), x, w, b, eps, rms)
                return fp8.quantize(y, e4, True, scaling, "fwd", 0)

            paths = {"unfused": unfused, "fused": lambda: out.fp8_quantize(e4, True, scaling, "fwd", 0)}
            if args.compile:
                @torch.compile
                def compiled(x, w, b):
                    xf = x.float()
                    if b is None:
                        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()
                    else:
                        mu = xf.mean(-1, keepdim=True)
                        y = (xf - mu) * torch.rsqrt((xf - mu).square().mean(-1, keepdim=True) + eps) * w.float() + b.float()
                    y = y.to(x.dtype).float()
                    q = (y * s4).clamp(-FP8_MAX[e4], FP8_MAX[e4]).to(e4)
                    return q, q.t().contiguous(), y.abs().amax()
                paths["torch.compile"] = lambda: compiled(x, w, b)
            if args.tiles:
                for tiles in TILE_SWEEP:
                    def tiled(tiles=tiles):
                        held, fp8_norm.TILES = fp8_norm.TILES, tiles
                        try:
                            return paths["fused"]()
                        finally:
                            fp8_norm.TILES = held
                    paths[f"fused {tiles}"] = tiled
            moved = t * h * 2 + 2 * t * h
            for impl, fn in paths.items():
                ms = bench_graphed(fn)
                gbs = moved / ms / 1e6
                row = dict(model=name, norm=kind, tokens=t, hidden=h, impl=impl, ms=round(ms, 4), gbs=round(gbs),
                           pct_copy=round(100 * gbs / copy_gbs, 1))
                rows.append(row)
                print(f"{name:6} {kind:9} {impl:22} {ms:7.4f} ms {gbs:6.0f} GB/s {row['pct_copy']:5.1f} % of copy")
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_norm_bench.json"), "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), host_cpu=cpu_model(), copy_gbs=round(copy_gbs),
                       rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()

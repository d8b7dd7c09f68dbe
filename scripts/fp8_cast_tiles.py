#!/usr/bin/env python3
"""Tile sizes of the fp8 cast kernels on the GPU at hand, timed as CUDA-graph replays (as they run
inside Megatron's graphs): the delayed cast with its transposed copy (`fp8._cast_kernel`,
`fp8.CAST_TILES`) at the 0.95B / 2.9B models' activation shapes, and the two SwiGLU casts
(`fp8_swiglu.TILES`) at their MLP shapes, each with its transposed copy as served
(`fp8_swiglu.ONE_PASS_INPUTS`) and reloaded in transposed order ("(reload)").

    OUT=/tmp/tiles python3 scripts/fp8_cast_tiles.py [--only swiglu] [--tiles 32x128x4 64x128x8]

GB/s counts the fewest bytes each kernel must move (its reads, its fp8 copies), against the device
copy measured in the same run; $OUT/fp8_cast_tiles.json is written.
"""
import argparse
import json
import os

import torch
import triton.testing

from bench_host import bench, cpu_model, device_copy_gbs
from megatron_adapt.backends.cuda import fp8, fp8_swiglu
from megatron_adapt.backends.fp8_scaling import Fp8Recipe, Fp8Scaling

CAST_SHAPES = {"0.95B x": (8192, 2048), "0.95B qkv dy": (8192, 3072), "2.9B x": (4096, 3072),
               "2.9B fc1 dy": (4096, 16384)}
SWIGLU_SHAPES = {"0.95B": (8192, 5632), "2.9B": (4096, 8192)}
TILES = ((64, 128, 4), (32, 128, 4), (64, 64, 4), (128, 64, 8), (64, 128, 8), (128, 128, 8), (32, 256, 4),
         (32, 256, 8), (16, 256, 4), (16, 128, 4), (64, 256, 8), (128, 32, 4))


def graphed(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50)


def with_tiles(module, name, tiles, fn):
    def run():
        held = getattr(module, name)
        setattr(module, name, tiles)
        try:
            return fn()
        finally:
            setattr(module, name, held)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("cast", "swiglu"), help="time one kernel family only")
    ap.add_argument("--tiles", nargs="+", metavar="BMxBNxWARPS", help=f"tiles to time (default: {len(TILES)} choices)")
    args = ap.parse_args()
    tiles_to_time = [tuple(int(v) for v in t.split("x")) for t in args.tiles] if args.tiles else TILES
    dev = "cuda"
    copy_gbs = device_copy_gbs(dev)
    print(f"GPU: {torch.cuda.get_device_name()} | host CPU: {cpu_model()} | device copy {copy_gbs:.0f} GB/s")
    scaling = Fp8Scaling(Fp8Recipe(format="hybrid", recipe="delayed"), device=dev)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    rows = []

    def record(kind, shape, tiles, ms, moved):
        gbs = moved / ms / 1e6
        rows.append(dict(kernel=kind, shape=shape, tiles=list(tiles), ms=round(ms, 4), gbs=round(gbs),
                         pct_copy=round(100 * gbs / copy_gbs, 1)))
        print(f"{kind:25} {shape:14} {str(tiles):16} {ms:7.4f} ms {gbs:6.0f} GB/s {rows[-1]['pct_copy']:5.1f} %")

    for shape, (m, k) in (CAST_SHAPES if args.only != "swiglu" else {}).items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        for tiles in tiles_to_time:
            fn = with_tiles(fp8, "CAST_TILES", tiles, lambda: fp8.quantize(x, e4, True, scaling, "fwd", 0))
            record("cast+transpose", shape, tiles, graphed(fn), m * k * 2 + 2 * m * k)
    for shape, (t, f) in (SWIGLU_SHAPES if args.only != "cast" else {}).items():
        x = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16)
        d = torch.randn(t, f, device=dev, dtype=torch.bfloat16) * 1e-3
        out, grad = fp8_swiglu.SwigluOutput((t, f), x, x), fp8_swiglu.SwigluGrad((t, 2 * f), x, x, d)
        for tiles in tiles_to_time:
            for served, how in ((fp8_swiglu.ONE_PASS_INPUTS, ""), ((), " (reload)")):
                fwd = with_tiles(fp8_swiglu, "TILES", tiles, lambda: out.fp8_quantize(e4, True, scaling, "fwd", 0))
                bwd = with_tiles(fp8_swiglu, "TILES", tiles, lambda: grad.fp8_quantize(e5, True, scaling, "bwd", 0))
                fwd, bwd = (with_tiles(fp8_swiglu, "ONE_PASS_INPUTS", served, fn) for fn in (fwd, bwd))
                record("swiglu fwd cast" + how, shape, tiles, graphed(fwd), t * 2 * f * 2 + 2 * t * f)
                record("swiglu bwd cast" + how, shape, tiles, graphed(bwd), t * 2 * f * 2 + t * f * 2 + 2 * t * 2 * f)
    best = {}
    for r in rows:
        key = (r["kernel"], r["shape"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    print("best:")
    for (kind, shape), r in best.items():
        print(f"  {kind:25} {shape:14} {r['tiles']} {r['ms']} ms ({r['pct_copy']} % of copy)")
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_cast_tiles.json"), "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), host_cpu=cpu_model(), copy_gbs=round(copy_gbs),
                       timing="cuda-graph replays (triton.testing.do_bench_cudagraph)", rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()

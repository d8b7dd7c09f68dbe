#!/usr/bin/env python3
"""The MoE experts' fp8 grouped linear (backends/cuda/fp8.py `fp8_grouped_gemm`) against the bf16
grouped GEMM (`torch._grouped_mm`), forward + backward, at the MoE bench's expert shapes (8 experts,
8192 routed rows, hidden 2048, expert ffn 2816 with SwiGLU: fc1 2048 -> 5632, fc2 2816 -> 2048).

    OUT=/tmp/bench python3 scripts/fp8_grouped_bench.py

For each linear: ms of the bare GEMMs (bf16 and fp8, operands pre-quantized), of the quantizers
alone (GB/s over the bytes they read and write, and % of a device-to-device copy of the same bytes
measured in this run; all six, and the two per-row ones of x and dy), and of the whole autograd op, fwd+bwd; TFLOP/s over the 3 GEMMs' FLOPs.
triton.testing.do_bench medians. Prints the host CPU and the GPU; writes $OUT/fp8_grouped_bench.json.
"""
import json
import os

import torch

from bench_host import bench, cpu_model
from megatron_adapt.backends.cuda import fp8
from megatron_adapt.backends.cuda.moe import group_offsets, grouped_mm
from megatron_adapt.backends.fp8_scaling import Fp8Recipe

E4 = torch.float8_e4m3fn


def main():
    dev = "cuda"
    torch.manual_seed(0)
    sizes = [1088, 960, 1024, 1040, 992, 1008, 1056, 1024]          # 8192 rows, multiples of 16
    t = sum(sizes)
    offs = group_offsets(sizes, dev)
    groups = torch.repeat_interleave(torch.arange(len(sizes), device=dev), torch.tensor(sizes, device=dev))
    copy_src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() / bench(lambda: copy_dst.copy_(copy_src)) / 1e6
    rows = []
    for name, k, n in (("fc1", 2048, 5632), ("fc2", 2816, 2048)):
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(len(sizes), n, k, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
        flops = 3 * 2 * t * k * n

        def step(f):
            def run():
                x.grad = w.grad = None
                f().backward(dy)
            return run
        bf16 = bench(step(lambda: grouped_mm(x, w, sizes, True)))
        f8 = bench(step(lambda: fp8.fp8_grouped_gemm(x, w, sizes, Fp8Recipe())))
        # the quantizers alone: x rows, w rows, w columns, dy rows, dy and x group columns
        quant = bench(lambda: (fp8.quantize_rowwise(x, E4), fp8.quantize_rowwise(w, E4),
                               fp8.quantize_weight_columns(w, E4), fp8.quantize_rowwise(dy, E4),
                               fp8.quantize_group_columns(dy, groups, len(sizes), E4, offs),
                               fp8.quantize_group_columns(x, groups, len(sizes), E4, offs)))
        qbytes = 3 * (2 * x.numel() + 2 * w.numel() + 2 * dy.numel())       # bf16 read + fp8 write, x3 roles
        rows_q = bench(lambda: (fp8.quantize_rowwise(x, E4), fp8.quantize_rowwise(dy, E4)))
        rows_bytes = 3 * (x.numel() + dy.numel())
        x8, sx = fp8.quantize_rowwise(x, E4)
        w8, sw = fp8.quantize_rowwise(w, E4)
        gemm8 = bench(lambda: torch._scaled_grouped_mm(x8, w8.transpose(-2, -1), sx, sw, offs=offs,
                                                       out_dtype=torch.bfloat16, use_fast_accum=True))
        gemm16 = bench(lambda: torch._grouped_mm(x.detach(), w.detach().transpose(-2, -1), offs=offs))
        rows.append({"linear": name, "rows": t, "in": k, "out": n,
                     "bf16_fwd_bwd_ms": bf16, "fp8_fwd_bwd_ms": f8, "speedup": bf16 / f8,
                     "bf16_tflops": flops / bf16 / 1e9, "fp8_tflops": flops / f8 / 1e9,
                     "fwd_gemm_bf16_ms": gemm16, "fwd_gemm_fp8_ms": gemm8,
                     "quantizers_ms": quant, "quantizers_gbs": qbytes / quant / 1e6,
                     "quantizers_pct_copy": 100 * qbytes / quant / 1e6 / copy_gbs,
                     "row_quantizers_ms": rows_q,    # x and dy per row (forward, dgrad)
                     "row_quantizers_pct_copy": 100 * rows_bytes / rows_q / 1e6 / copy_gbs})
    res = {"gpu": torch.cuda.get_device_name(), "host_cpu": f"{cpu_model()}, {os.cpu_count()} vCPU",
           "torch": torch.__version__, "copy_gbs": copy_gbs, "rows": rows}
    print(json.dumps(res, indent=1))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "fp8_grouped_bench.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

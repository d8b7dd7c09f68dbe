#!/usr/bin/env python3
"""Which block-scaled fp8 GEMMs torch's `_scaled_mm` runs on this GPU, how exact and how fast
(issue 23: `--fp8-recipe blockwise` where torch's scaled GEMMs support it; megatron-adapt refuses
that recipe today).

    OUT=/tmp/probe python3 scripts/fp8_blockwise_probe.py

Megatron's `blockwise` recipe is TE's Float8BlockScaling (DeepSeek-V3's): activations and gradients
scaled per 1 x 128 block along the reduction, weights per 128 x 128 block. The three GEMMs of a
linear need: forward x(1x128) @ W(128x128), dgrad dy(1x128) @ W(128x128), wgrad dy^T(1x128) @
x(1x128) with both blocks along the tokens. For each pairing at the 0.95B model's shapes: whether
`_scaled_mm` takes it, its error against the fp32 product of the same dequantized operands, and its
TFLOP/s next to bf16 and tensorwise fp8 (triton.testing.do_bench, median). Quantization here is
plain PyTorch (a probe of the GEMM, not of a cast kernel). Prints the host CPU and the GPU; writes
$OUT/fp8_blockwise_probe.json.
"""
import json
import os

import torch
import triton.testing

from bench_host import cpu_model

E4 = torch.float8_e4m3fn
MAX = 448.0


def quant_rows(x, block=128):
    """[R, C] -> fp8 [R, C], scale_inv [R, C/block] fp32 (one scale per 1 x block along C)."""
    r, c = x.shape
    amax = x.float().view(r, c // block, block).abs().amax(-1).clamp_min(1e-12)
    scale = MAX / amax
    q = (x.float().view(r, c // block, block) * scale[..., None]).clamp(-MAX, MAX).to(E4).view(r, c)
    return q, (1.0 / scale)


def quant_blocks(w, block=128):
    """[R, C] -> fp8 [R, C], scale_inv [R/block, C/block] fp32 (one scale per block x block)."""
    r, c = w.shape
    t = w.float().view(r // block, block, c // block, block)
    amax = t.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = MAX / amax
    q = (t * scale[:, None, :, None]).clamp(-MAX, MAX).to(E4).view(r, c)
    return q, (1.0 / scale)


def deq_rows(q, s, block=128):
    r, c = q.shape
    return (q.float().view(r, c // block, block) * s[..., None]).view(r, c)


def deq_blocks(q, s, block=128):
    r, c = q.shape
    return (q.float().view(r // block, block, c // block, block) * s[:, None, :, None]).view(r, c)


def outer_major(s):
    """The scale layout cuBLASLt wants for 1 x 128 blocks: the outer (row) dimension contiguous."""
    return s.t().contiguous().t()


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def main():
    dev = torch.cuda.get_device_name()
    info = {"gpu": dev, "host_cpu": f"{cpu_model()}, {os.cpu_count()} vCPU", "torch": torch.__version__,
            "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability()), "cases": []}
    print(f"host: {info['host_cpu']}; GPU: {dev}; torch {torch.__version__} (CUDA {torch.version.cuda})", flush=True)
    torch.manual_seed(0)
    tokens, hidden, ffn = 8192, 2048, 5632
    for name, m, k, n in (("qkv fwd", tokens, hidden, 3 * hidden), ("fc1 fwd", tokens, hidden, 2 * ffn),
                          ("fc2 fwd", tokens, ffn, hidden)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        row = {"gemm": name, "m": m, "k": k, "n": n}
        row["bf16_tflops"] = tflops(m, n, k, triton.testing.do_bench(lambda: x @ w.t()))
        xt8, sxt = x.float().abs().amax() / MAX, w.float().abs().amax() / MAX
        x8t, w8t = (x.float() / xt8).to(E4), (w.float() / sxt).to(E4)
        sa, sb = xt8.reshape(()).float(), sxt.reshape(()).float()
        row["tensorwise_tflops"] = tflops(m, n, k, triton.testing.do_bench(
            lambda: torch._scaled_mm(x8t, w8t.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)))
        # forward / dgrad pairing: x 1x128, W 128x128
        x8, sx = quant_rows(x)
        w8, sw = quant_blocks(w)
        ref = deq_rows(x8, sx) @ deq_blocks(w8, sw).t()
        try:
            fn = lambda: torch._scaled_mm(x8, w8.t(), scale_a=outer_major(sx), scale_b=sw.t(),  # noqa: E731
                                          out_dtype=torch.bfloat16, use_fast_accum=False)
            y = fn().float()
            row["1x128_128x128"] = {"ok": True, "rel_err": float((y - ref).norm() / ref.norm()),
                                    "tflops": tflops(m, n, k, triton.testing.do_bench(fn))}
        except Exception as exc:  # noqa: BLE001 (the probe reports what torch refuses)
            row["1x128_128x128"] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        # wgrad pairing: dW[n, k] = dy^T[n, m] @ x[m, k], both 1x128 along m (the tokens)
        dyt8, sdy = quant_rows(dy.t().contiguous())        # [n, m], blocks along m
        xm8, sxm = quant_rows(x.t().contiguous())          # [k, m], blocks along m
        ref_w = deq_rows(dyt8, sdy) @ deq_rows(xm8, sxm).t()
        # the B-side 1 x 128 scale layout is not documented: each candidate is tried
        for layout, sb_w in (("[m/128, k] k-contiguous", outer_major(sxm).t()),
                             ("[m/128, k] m-contiguous", sxm.t()),
                             ("[k, m/128] k-contiguous", outer_major(sxm))):
            key = f"wgrad_1x128_1x128 scale_b {layout}"
            try:
                fn = lambda: torch._scaled_mm(dyt8, xm8.t(), scale_a=outer_major(sdy), scale_b=sb_w,  # noqa: E731
                                              out_dtype=torch.float32, use_fast_accum=False)
                g = fn()
                row[key] = {"ok": True, "rel_err": float((g - ref_w).norm() / ref_w.norm()),
                            "tflops": tflops(n, k, m, triton.testing.do_bench(fn))}
            except Exception as exc:  # noqa: BLE001
                row[key] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        info["cases"].append(row)
        print(json.dumps(row), flush=True)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8_blockwise_probe.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()

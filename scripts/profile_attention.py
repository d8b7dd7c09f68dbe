#!/usr/bin/env python3
"""Kernel-level profile of the cuda backend's attention at the benchmark shape (causal,
b4 h16 s2048 d128 bf16, q/k/v as Megatron's sbhd views), MHA and GQA: per kernel, time per
fwd+bwd and share, with the op's TFLOP/s (flash-attention's convention).

    MEGATRON_ADAPT_AUTO=0 python scripts/profile_attention.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_adapt.backends.cuda.attention import attention

B, H, S, D, STEPS = 4, 16, 2048, 128, 20


def sbhd(heads):
    return torch.randn(S, B, heads, D, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3).requires_grad_()


def main():
    flops = 4 * B * H * S * S * D / 2 * 3.5
    for hkv in (H, 4):
        q, k, v = sbhd(H), sbhd(hkv), sbhd(hkv)
        g = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

        def step():
            torch.autograd.grad(attention(q, k, v, None, True), [q, k, v], g)
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in events) / STEPS   # microseconds
        print(f"== hkv={hkv}: GPU time per fwd+bwd {total / 1e3:.3f} ms -> "
              f"{flops / (total * 1e-6) / 1e12:.0f} TFLOP/s")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
            t = e.self_device_time_total / STEPS
            print(f"  {t / 1e3:8.3f} ms {100 * t / total:5.1f}%  x{e.count // STEPS:<3} {e.key[:110]}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Which implementation backends/cuda/providers.py chooses, per op, shape and dtype (needs a GPU
and Liger-Kernel or apex installed), then a check of its timing method against do_bench.

    MEGATRON_ADAPT_AUTO=0 python scripts/provider_sweep.py
"""
import os

import torch

os.environ["MEGATRON_ADAPT_EXTERNAL"] = "auto"
from megatron_adapt import report  # noqa: E402
from megatron_adapt.backends.cuda import BACKEND, providers  # noqa: E402

NORM_SHAPES = ((1001, 200), (257, 12288), (2048, 5123), (4096, 4096), (16384, 4096), (8192, 2048),
               (4096, 65536))
CE_SHAPES = ((333, 50257), (8192, 32000), (4096, 128256))


def sweep():
    dev = "cuda"
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for t, h in NORM_SHAPES:
            x = torch.randn(t, h, device=dev, dtype=dt, requires_grad=True)
            w = torch.randn(h, device=dev, dtype=dt, requires_grad=True)
            b = torch.randn(h, device=dev, dtype=dt, requires_grad=True)
            BACKEND.op("rms_norm")(x, w, 1e-5)
            BACKEND.op("layer_norm")(x, w, b, 1e-5)
            if h % 2 == 0:
                BACKEND.op("swiglu")(x)
        for t, v in CE_SHAPES:
            x = torch.randn(t, v, device=dev, dtype=dt, requires_grad=True)
            BACKEND.op("vocab_parallel_cross_entropy")(x * 1.0, torch.randint(0, v, (t,), device=dev), 0.0, None)
            del x
            torch.cuda.empty_cache()
    for s in report.as_dict()["selections"]:
        c = s["candidates"]
        print(f"{s['op']:<28} {s['inputs']:<60} -> {s['chosen']:<32} {c}")


def check_timing():
    """The tournament's GPU time against triton's do_bench for the same fwd+bwd."""
    from triton.testing import do_bench
    for t, h in ((16384, 4096), (8192, 2048)):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fn = BACKEND.op("rms_norm").ours
        ms = do_bench(lambda: torch.autograd.grad(fn(x, w, 1e-5), [x, w], dy))
        tour = providers._time_ms(fn, [x, w, 1e-5], dy)
        print(f"rms_norm [{t},{h}] bf16 ours: do_bench {ms:.4f} ms, tournament {tour:.4f} ms "
              "(do_bench times each call alone, so launch cost counts at small sizes)")


if __name__ == "__main__":
    sweep()
    check_timing()

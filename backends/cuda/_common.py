"""Shared helpers for the Triton kernels: where a kernel may run, launch sizes, fallbacks.

A Triton kernel runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the CI path
that checks the numerics without a GPU). Everything else goes to the PyTorch reference op,
reported with `report.fell_back`, never silently.
"""
import os

import torch

from megatron_adapt import report

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_reason(*tensors):
    """None when Triton can serve these tensors here, else why not."""
    for t in tensors:
        if t is None:
            continue
        if not (t.is_cuda or (interpreting() and t.device.type == "cpu")):
            return f"tensor on {t.device} (Triton needs CUDA, or TRITON_INTERPRET=1 on CPU)"
        if t.is_floating_point() and t.dtype not in KERNEL_DTYPES:
            return f"dtype {t.dtype} has no kernel"
    return None


def fallback(op, reason, *args, **kwargs):
    """Run the PyTorch reference op (backends/cpu), reported as a fallback."""
    from megatron_adapt.backends.cpu import BACKEND as CPU
    report.fell_back(op, f"cpu.reference({op})", reason)
    return CPU.op(op)(*args, **kwargs)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_programs(device, rows: int, per_sm: int = 4) -> int:
    """Size of a persistent grid: a few programs per SM (a handful under the interpreter)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * per_sm))
    return max(1, min(rows, 4))


def warps_for(block: int) -> int:
    """Warps per program for a row of `block` elements held in registers."""
    if block >= 16384:
        return 16
    if block >= 4096:
        return 8
    if block >= 1024:
        return 4
    return 2 if block >= 256 else 1

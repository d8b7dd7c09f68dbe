"""The fp8 weight gradient added into fp32 `main_grad` by the GEMM itself: cuBLASLt with beta = 1,
in place, through nvmath-python's stateful `Matmul` (NVIDIA's Python API to cuBLASLt).

`torch._scaled_mm` has no beta: it writes an fp32 dW, and a second kernel adds that into
`main_grad` (Megatron's gradient-accumulation fusion), so the fp32 gradient is written, read twice
and written again. TE's wgrad GEMM accumulates in cuBLASLt's epilogue; this does the same.
Measured on an H100 (`scripts/fp8_wgrad_bench.py`, docs/fp8.md): 1.2-1.5x the GEMM + add at the
bench models' wgrad shapes, the same numerics (the same cuBLASLt fp8 kernels, split accumulation),
and it replays inside CUDA graphs. A Triton GEMM with the add in its epilogue ran at 0.72-0.90x the
GEMM + add there, so it is not used. nvmath's call costs more host time (about 55 against 28 us),
which made the host-bound eager fp8 step slower (0.95B: 556 against 520 ms, one call), so eager calls keep
`_scaled_mm` + `add_` after a shape's first call: the in-place GEMM runs where its host time is
spent once, inside CUDA-graph captures (the default on one GPU), and at each shape's first call,
which makes its plan and workspace before Megatron's capture.

One plan per (shapes, dtypes, device), made at the first call (cuBLASLt's heuristic; not during a
CUDA-graph capture, whose warm-up runs make it first) and kept; later calls swap the operands in
without validation, run on the current stream (a capture's too), and drop the references. A plan
owns one cuBLASLt workspace, so calls of one shape must not run on two streams at once: Megatron
runs a rank's wgrad GEMMs in one stream's order. Without nvmath-python
(`pip install "megatron-adapt[cuda]"`) the caller keeps `_scaled_mm` + `add_`: the report names the
path that ran, and the missing library is said once.
"""
from __future__ import annotations

import functools

import torch

from megatron_adapt import report

_plans: dict = {}
EAGER = ("eager: nvmath's call costs about 25 us more host time than _scaled_mm + add_, and eager fp8 "
         "steps wait on the host (docs/fp8.md); the in-place GEMM runs at a shape's first call (its plan) "
         "and inside CUDA-graph captures")


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None when nvmath-python's cuBLASLt Matmul imports here, else why not."""
    try:
        import nvmath.linalg.advanced  # noqa: F401
    except Exception as e:   # noqa: BLE001 - not installed, or its CUDA bindings do not load
        return f"nvmath-python does not import ({type(e).__name__}: {e})"
    return None


def why_not(c, a, b) -> str | None:
    """None where accumulate(c, a, b, ...) serves this wgrad, else why not."""
    if not (a.is_cuda and b.is_cuda and c.is_cuda):
        return f"tensors on {a.device.type}"
    if c.dtype != torch.float32 or not c.is_contiguous():
        return f"main_grad is {c.dtype}{'' if c.is_contiguous() else ', not contiguous'} (the fused path adds into fp32)"
    if c.shape != (a.shape[0], b.shape[0]) or a.stride(1) != 1 or b.stride(1) != 1:
        return "operand layouts"
    if unavailable() is not None:
        return unavailable()
    planned = _key(c, a, b) in _plans
    if torch.cuda.is_current_stream_capturing():
        return None if planned else "first call inside a CUDA-graph capture (cuBLASLt's planning synchronizes)"
    if planned:
        return EAGER
    return None


IN_PLACE, ADD, ADD_EAGER = ("cuda.cublaslt(beta=1, nvmath)", ".scaled_mm+main_grad.add_",
                             ".scaled_mm+main_grad.add_ (eager)")   # report names


def into_main_grad(c, a, b, scale_a, scale_b) -> bool:
    """c += scale_a * scale_b * a @ b^T in cuBLASLt's GEMM where why_not allows (True); else False,
    and the caller adds _scaled_mm's fp32 dW. Either way the report counts the path (op fp8_wgrad);
    a missing nvmath-python is said once."""
    why = why_not(c, a, b)
    if why is None:
        report.ran("fp8_wgrad", IN_PLACE)
        accumulate(c, a, b, scale_a, scale_b)
        return True
    report.ran("fp8_wgrad", a.device.type + (ADD_EAGER if why is EAGER else ADD))
    say_if_missing(why)
    return False


DROPLESS = ("eager, dropless: the experts' row counts change every step, and a plan per count would be "
            "made at every call (capacity-padded dispatch keeps them fixed)")


def experts_why_not(gemms, static_sizes: bool) -> str | None:
    """None where every expert's (c, a, b) of a grouped linear's wgrad runs in place (one
    accumulate per expert), else why not (the caller then adds the grouped GEMM's dW). The rule of
    why_not for each, and no plan at eager calls unless the row counts are static."""
    if not gemms:
        return None
    if not gemms[0][1].is_cuda:
        return why_not(*gemms[0])
    if not static_sizes and not torch.cuda.is_current_stream_capturing():
        return DROPLESS
    for c, a, b in gemms:
        why = why_not(c, a, b)
        if why is not None:
            return why
    return None


def short(why: str) -> str:
    """A report name's reason: the text before its first colon."""
    return why.split(":")[0]


def say_if_missing(why) -> None:
    """Said once: the second pass runs because nvmath-python does not import."""
    if why is not None and why == unavailable():
        report.say_once(f"the fp8 wgrad GEMM writes a dW that a second pass adds into main_grad, "
                        f"because {why}. pip install \"megatron-adapt[cuda]\" (nvmath-python) for "
                        f"cuBLASLt's in-place accumulation (docs/fp8.md).", key="fp8_wgrad_nvmath")


def _key(c, a, b):
    """A plan's operands: shapes, row strides (an expert's columns of a [C, T] operand have T), dtypes."""
    return (tuple(a.shape), tuple(b.shape), a.stride(0), b.stride(0), a.dtype, b.dtype, c.device)


def accumulate(c, a, b, scale_a, scale_b) -> None:
    """c += scale_a * scale_b * a @ b^T: a [M, K], b [N, K] fp8 (K contiguous: dy^T and x^T),
    c [M, N] fp32 contiguous, the scales [1] fp32 on the device."""
    key = _key(c, a, b)
    scales = {"a": scale_a, "b": scale_b}
    mm = _plans.get(key)
    if mm is None:
        from nvmath.linalg.advanced import Matmul
        mm = Matmul(a, b.t(), c=c, beta=1.0, quantization_scales=scales, options={"inplace": True})
        mm.plan()
        _plans[key] = mm
    else:
        mm.reset_operands_unchecked(a=a, b=b.t(), c=c, quantization_scales=scales)
    mm.execute(stream=torch.cuda.current_stream(c.device))
    mm.release_operands()   # stream-ordered: the caching allocator reuses them only after this GEMM

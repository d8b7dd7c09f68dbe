"""Shared helpers for the Triton kernels: where a kernel may run, launch sizes, fallbacks.

A Triton kernel runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the CI path
that checks the numerics without a GPU). Everything else goes to the PyTorch reference op,
reported with `report.fell_back`, never silently.
"""
import os

import torch

from megatron_adapt.backends import cpu_fallback

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_KERNEL_DTYPES = frozenset(KERNEL_DTYPES)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr function: slow on the host)."""
    return -(-a // b)


def kernel_reason(*tensors):
    """None when Triton can serve these tensors here, else why not."""
    for t in tensors:
        if t is None:
            continue
        if t.is_cuda and (t.dtype in _KERNEL_DTYPES or not t.is_floating_point()):
            continue    # the common case, decided without the checks below
        if not (t.is_cuda or (interpreting() and t.device.type == "cpu")):
            return f"tensor on {t.device} (Triton needs CUDA, or TRITON_INTERPRET=1 on CPU)"
        if t.is_floating_point() and t.dtype not in KERNEL_DTYPES:
            return f"dtype {t.dtype} has no kernel"
    return None


fallback = cpu_fallback   # the reference op, reported as a fallback


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_programs(device, rows: int, per_sm: int = 4) -> int:
    """Size of a persistent grid: a few programs per SM (a handful under the interpreter)."""
    if device.type == "cuda":
        return max(1, min(rows, sm_count(device) * per_sm))
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


# ---- direct launch of compiled Triton kernels -------------------------------------------------
#
# `kernel[grid](*args, **constexprs)` goes through JITFunction.run on every call: it reads several
# knobs, binds and specialises every argument, hashes a cache key, checks the kernel's globals and
# builds launch metadata before the launch itself. On a slow host that is tens of microseconds a
# launch, more than a small kernel's GPU time, so a training step waits on Python. `launch` below
# keeps, per kernel and specialisation, the CompiledKernel that JITFunction.run returned on the
# first call, and on later calls hands the arguments straight to its launcher (the same call that
# JITFunction.run ends with). The key holds everything Triton specialises on (each tensor's dtype
# and 16-byte alignment, each integer's divisibility by 16, value 1 and width, the constexprs and
# launch options), so a key hit means JITFunction.run would have picked the same binary.
#
# Under TRITON_INTERPRET=1 the kernels are InterpretedFunction objects, not JITFunction: `launch`
# then calls them the ordinary way (explicitly: nothing compiled exists to launch). So does a
# Triton older than 3.3 (its launcher took only the non-constexpr arguments).

try:
    import triton as _triton
    from triton.runtime.jit import JITFunction as _JITFunction
    from triton import knobs as _knobs
    _DIRECT = tuple(int(p) for p in _triton.__version__.split(".")[:2]) >= (3, 3)
except Exception:  # no Triton, or one without knobs (< 3.4): the ordinary launcher everywhere
    _JITFunction, _knobs, _DIRECT = None, None, False

_core = None
NATIVE = "torch.native (MEGATRON_ADAPT_EAGER_OPS=torch)"


def eager_native(x) -> bool:
    """Whether this call takes PyTorch's native op instead of our Triton kernel.

    Under MEGATRON_ADAPT_EAGER_OPS=torch, CUDA tensors outside a CUDA-graph capture do: a native
    op's backward is a C++ autograd node, while ours crosses into Python on the autograd thread
    (host time per layer: docs/host-time.md). Inside a capture host time is gone and our kernels
    are the faster ones on the GPU, so a capture always takes Triton."""
    global _core
    if _core is None:   # imported on first use: megatron_adapt.core imports the backends
        from megatron_adapt import core as _c
        _core = _c
    return (_core.active_config().eager_ops == "torch" and x.is_cuda
            and not torch.cuda.is_current_stream_capturing())


_compiled: dict = {}      # (kernel, device, specialisation, options) -> (run, function, packed, compiled, tail)
_I32 = (-2 ** 31, 2 ** 31)


def _spec(args):
    """What Triton specialises a call on, for the positional (non-constexpr) arguments."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            out.append(a)
        elif isinstance(a, int):
            out.append((a == 1, a % 16 == 0, _I32[0] <= a < _I32[1]))
        else:
            out.append(type(a))
    return tuple(out)


def direct_launch_enabled() -> bool:
    return _DIRECT and os.environ.get("MEGATRON_ADAPT_TRITON_DIRECT", "1") != "0"


_DIRECT_ON = None


def launch(kernel, grid, *args, **kw):
    """`kernel[grid](*args, **kw)`, with the compiled kernel launched directly after its first call.

    args: the kernel's non-constexpr parameters, positionally, in order; kw: constexprs and launch
    options (num_warps, num_stages). Returns the CompiledKernel (its n_regs etc.) as
    `kernel[grid](...)` does (the interpreter returns None)."""
    global _DIRECT_ON
    if _DIRECT_ON is None:
        _DIRECT_ON = direct_launch_enabled()
    if not _DIRECT_ON or type(kernel) is not _JITFunction:
        return kernel[grid](*args, **kw)     # interpreter (InterpretedFunction) or direct launch off
    dev = torch.cuda.current_device()
    key = (kernel, dev, _spec(args), tuple(kw.items()))
    hit = _compiled.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kw)
        names = kernel.arg_names
        tail = tuple(names[len(args):])      # constexprs after the positional ones, in order
        missing = [n for n in tail if n not in kw]
        if compiled is None or missing or any(n in kw for n in names[:len(args)]):
            return compiled                  # defaults or out-of-order constexprs: keep Triton's path
        _compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, compiled,
                          tuple(kw[n] for n in tail))
        return compiled
    run, function, packed, compiled, tail = hit
    stream = torch._C._cuda_getCurrentRawStream(dev)
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    n = len(grid)
    meta = compiled.launch_metadata(grid, stream, *args, *tail) if enter is not None else None
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, packed, meta,
        enter, leave, *args, *tail)
    return compiled


_SMS: dict = {}


def sm_count(device) -> int:
    n = _SMS.get(device.index)
    if n is None:
        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n

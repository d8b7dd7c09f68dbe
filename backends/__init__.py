"""Backends know hardware; they never import Megatron.

A backend is a package ``megatron_adapt.backends.<name>`` whose ``BACKEND`` is a `Backend`: a
name, an availability check, a table of backend-neutral ops (see `megatron_adapt.ops` for each op's
contract) and optionally a device layer. Ops are "module:attr" strings loaded on first use, so a
backend whose library is missing fails when it is chosen, with a clear message, not at import.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from megatron_adapt import report
from megatron_adapt.errors import BackendUnavailableError, UnknownBackendError
from megatron_adapt.ops import OPS

NAMES = ("cpu", "cuda", "npu")

# Where each op lives inside a backend package (from megatron_adapt.ops.OPS): one module per op family.
STANDARD_LAYOUT = {name: op.home for name, op in OPS.items()}
# The ops that exist only where fp8 GEMMs run (a backend without them answers fp8_unavailable)
FP8_GEMM_OPS = ("fp8_linear", "fp8_grouped_gemm", "fp8_swiglu")


@dataclass
class Backend:
    name: str
    ops: dict[str, str]                      # op name -> "module:attr" (relative: ".norms:rms_norm")
    package: str
    check: Callable[[], None] = lambda: None  # raises BackendUnavailableError with the reason
    device_layer: str | None = None          # "module" with install()/uninstall(), or None
    describe: Callable[[], str] = lambda: ""
    _loaded: dict[str, Callable] = field(default_factory=dict, repr=False)

    def op(self, name: str) -> Callable:
        """The implementation of op `name` on this backend (imported on first use)."""
        fn = self._loaded.get(name)
        if fn is None:
            try:
                path = self.ops[name]
            except KeyError:
                raise KeyError(f"backend {self.name!r} implements no op {name!r}") from None
            module, attr = path.split(":")
            fn = getattr(importlib.import_module(module, self.package), attr)
            self._loaded[name] = fn
        return fn

    def device(self):
        return importlib.import_module(self.device_layer, self.package) if self.device_layer else None


def load(name: str) -> Backend:
    """Load backend `name` and check it can run here; an explicit choice never falls back."""
    if name not in NAMES:
        raise UnknownBackendError(f"unknown backend {name!r}: choose one of {', '.join(('auto',) + NAMES)}")
    backend = importlib.import_module(f"{__name__}.{name}").BACKEND
    backend.check()
    return backend


def cpu_fallback(op: str, reason: str, *args, **kwargs):
    """Run the cpu backend's `op` (the reference) for a call another backend's kernel cannot
    take, reported as a fallback to "cpu.reference(<op>)" (the cpu op also counts the call under
    its own name)."""
    report.fell_back(op, f"cpu.reference({op})", reason)
    return load("cpu").op(op)(*args, **kwargs)


def auto_select() -> tuple[str, str]:
    """(name, why) for MEGATRON_ADAPT_BACKEND=auto: cuda with a CUDA device, npu with an NPU, else cpu."""
    import torch

    if torch.cuda.is_available():
        return "cuda", f"auto: {torch.cuda.device_count()} CUDA device(s)"
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return "npu", f"auto: {torch.npu.device_count()} NPU(s)"
    except Exception:  # no torch_npu, or no device behind it: not an NPU machine
        pass
    return "cpu", "auto: no CUDA device or NPU found"


__all__ = ["Backend", "BackendUnavailableError", "NAMES", "auto_select", "cpu_fallback", "load"]

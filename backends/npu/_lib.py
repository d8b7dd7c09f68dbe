"""The one place the npu backend imports torch_npu (lazily: importing the backend never needs it)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def torch_npu():
    import torch_npu as module  # noqa: WPS433 (Ascend's PyTorch adapter)

    return module


def version() -> str:
    try:
        return getattr(torch_npu(), "__version__", "unknown")
    except ImportError:
        return "not installed"


def _reset() -> None:
    """Forget the imported module (tests swap the emulation in and out)."""
    torch_npu.cache_clear()

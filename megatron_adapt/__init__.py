"""megatron-adapt: run stock Megatron-LM on cuda, npu or cpu backends.

`import megatron_adapt` applies the patches for MEGATRON_ADAPT_BACKEND (auto by default) unless
MEGATRON_ADAPT_AUTO=0. Public API: apply(backend=None, **switches), revert(), report().
"""
import os as _os

from . import report
from .core import active_backend, apply, revert
from .errors import (BackendUnavailableError, MegatronAdaptError, StrictFallbackError,
                     UnknownBackendError, UnsupportedMegatronVersionError)

__version__ = "0.1.0"
__all__ = ["apply", "revert", "report", "active_backend", "MegatronAdaptError", "BackendUnavailableError",
           "UnknownBackendError", "UnsupportedMegatronVersionError", "StrictFallbackError"]

if _os.environ.get("MEGATRON_ADAPT_AUTO", "1") != "0":
    apply()

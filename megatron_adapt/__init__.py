"""megatron-adapt: run stock Megatron-LM on cuda, npu or cpu backends.

`import megatron_adapt` applies the patches for MEGATRON_ADAPT_BACKEND (auto by default) unless
MEGATRON_ADAPT_AUTO=0. Public API: apply(backend=None, **switches), revert(), report().
"""
import os as _os

# Imported from a source checkout (the checkout on sys.path with megatron-adapt installed by
# `pip install .`, or not installed): `backends/` and `patches/` sit beside this folder, where
# setup.py's package_dir maps them from. Look for subpackages there too, so the checkout's code
# runs whole instead of dying at `from . import backends`.
_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if (not _os.path.isdir(_os.path.join(_here, "backends"))
        and _os.path.isfile(_os.path.join(_checkout, "backends", "__init__.py"))
        and _os.path.isfile(_os.path.join(_checkout, "patches", "__init__.py"))):
    __path__.append(_checkout)

from . import report
from .core import active_backend, apply, revert
from .errors import (BackendUnavailableError, MegatronAdaptError, StrictFallbackError,
                     UnknownBackendError, UnsupportedMegatronVersionError)

__version__ = "0.1.0"
__all__ = ["apply", "revert", "report", "active_backend", "MegatronAdaptError", "BackendUnavailableError",
           "UnknownBackendError", "UnsupportedMegatronVersionError", "StrictFallbackError"]

if _os.environ.get("MEGATRON_ADAPT_AUTO", "1") != "0":
    apply()

"""Loaded at start-up of every Python process under megatron-adapt-run: apply the patches, then
run any other sitecustomize that this one shadows."""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:
    import megatron_adapt  # noqa: F401  (applies on import unless MEGATRON_ADAPT_AUTO=0)
finally:
    _rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    _spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
    if _spec is not None and _spec.origin and os.path.dirname(os.path.abspath(_spec.origin)) != _here:
        _module = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_module)

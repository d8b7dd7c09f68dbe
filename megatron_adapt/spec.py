"""Declarative patch specs: patches/ modules list these; the applier does the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .versions import SUPPORTED_RANGE

REPLACE, WRAP = "replace", "wrap"


class SkipPatch(Exception):
    """Raised by a build function: this patch is not wanted here (the message says why)."""


class ServesPlainInstances(type):
    """Metaclass of a patch's class variant whose constructor returns a plain `plain_class` object
    when its feature is off (fp8 linears built without fp8, delayed-wgrad linears without
    delay_wgrad_compute). Those objects are instances of the variant too: Megatron's code and tests
    ask `isinstance(module, <the class the spec named>)`."""

    plain_class: type

    def __instancecheck__(cls, obj):
        return type.__instancecheck__(cls, obj) or isinstance(obj, cls.plain_class)


@dataclass(frozen=True)
class PatchSpec:
    """One Megatron attribute to replace or wrap; the fields, in order:

    target:   "module:qualname", e.g. "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward".
    area:     the switch that turns it off (MEGATRON_ADAPT_DISABLE=area).
    build:    build(backend, original) -> the replacement (REPLACE) or a wrapt wrapper (WRAP); may raise SkipPatch.
    mode:     REPLACE (set the new object) or WRAP (wrapt.FunctionWrapper(original, built)); default REPLACE.
    versions: megatron-core range it behaves as assumed in; where it changed, one spec per range (no overlap).
    backends: the backends that want it (device-layer patches are cpu-only, say); default all three.
    check_signature: REPLACE only: the replacement must accept every parameter the original accepts.
    optional: a missing target is "skipped", not "failed" (e.g. megatron.training without Megatron-LM).
    create:   an absent module global is created with build(backend, None) and deleted again by revert.
    """

    target: str
    area: str
    build: Callable[[Any, Any], Any]
    mode: str = REPLACE
    versions: str = SUPPORTED_RANGE
    backends: tuple[str, ...] = ("cpu", "cuda", "npu")
    check_signature: bool = True
    optional: bool = False
    create: bool = False

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    def __post_init__(self):
        if self.target.count(":") != 1 or not all(self.target.split(":")):
            raise ValueError(f"patch target must be 'module:qualname', got {self.target!r}")
        if self.mode not in (REPLACE, WRAP):
            raise ValueError(f"mode must be {REPLACE!r} or {WRAP!r}, got {self.mode!r}")

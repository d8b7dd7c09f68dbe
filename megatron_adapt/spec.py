"""Declarative patch specs: patches/ modules list these; the applier does the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .versions import SUPPORTED_RANGE

REPLACE, WRAP = "replace", "wrap"


class SkipPatch(Exception):
    """Raised by a build function: this patch is not wanted here (the message says why)."""


@dataclass(frozen=True)
class PatchSpec:
    """One Megatron attribute to replace or wrap.

    target:   "module:qualname" (e.g. "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward").
    area:     the switch that turns it off (MEGATRON_ADAPT_DISABLE=area).
    build:    build(backend, original) -> the new object (REPLACE), or a wrapt-style wrapper
              ``wrapper(wrapped, instance, args, kwargs)`` (WRAP). Called lazily, once per apply.
    versions: megatron-core range this target is known to exist and behave as assumed in. Where a
              target changed between releases, list one spec per range for the same target (the
              ranges must not overlap): the applier installs the one whose range holds the
              running megatron-core.
    backends: the backends this spec applies to (device-layer patches are cpu-only, say).
    describe: build-independent name of what is installed, for the report when it is not yet built.
    check_signature: the replacement must accept every parameter the original accepts.
    optional: a missing target is "skipped" rather than "failed" (a module only some versions or
              installations have, e.g. megatron.training without a Megatron-LM checkout).
    create:   a module global that may be absent (a name Megatron binds only when an optional
              package imports, e.g. `fused_weight_gradient_mlp_cuda`) is created, with
              build(backend, None); revert deletes it again. Present, it is replaced as usual.
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

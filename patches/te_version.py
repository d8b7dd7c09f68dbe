"""Transformer Engine's version, asked for when TE is absent: "no TE" (0.0.0), not a TypeError.

On megatron-core 0.15-0.16, `megatron.core.utils.get_te_version()` returns None when
`transformer_engine` cannot be imported, and `is_te_min_version("1.3")` then compares None with a
Version and raises TypeError. Megatron's own unit-test conftest asks that in an autouse fixture, so
without TE not one of Megatron's unit tests can start; user code that asks fails the same way.

From 0.17 Megatron itself answers `Version("0.0.0")` when TE is absent (so every
`is_te_min_version(...)` is False): this patch gives 0.15-0.16 that same answer, and has no spec
for 0.17+. With TE importable, the original's answer is returned unchanged. Every module that
imported the name (`from megatron.core.utils import get_te_version`) is rebound by the applier;
`is_te_min_version` calls the module global, so it answers too.
"""
from packaging.version import Version

from megatron_adapt.spec import PatchSpec

NO_TE = Version("0.0.0")


def build(backend, original):
    def get_te_version():
        version = original()
        return NO_TE if version is None else version
    get_te_version.__doc__ = original.__doc__
    return get_te_version


SPECS = [
    PatchSpec("megatron.core.utils:get_te_version", area="te_version", build=build,
              versions=">=0.15.0,<0.17.0"),
]

"""Megatron's optional-package version helpers answer "absent" (Version 0.0.0) instead of raising.

`megatron.core.utils.get_<pkg>_version()` and `is_<pkg>_min_version(...)` are asked at import
time by Megatron's own test modules and conftest (`@pytest.mark.skipif(not is_te_min_version(...))`,
the conftest's autouse `is_te_min_version("1.3")`) and by user code. Without the package:

- `get_te_version()` returns None on megatron-core 0.15-0.16, and `is_te_min_version` then raises
  TypeError (None >= Version): not one of Megatron's unit tests can start. From 0.17 Megatron
  itself answers Version("0.0.0"); this patch gives 0.15-0.16 that same answer.
- `get_fa_version()` (flash-attn, 0.15-0.19), `get_mamba_version()` and
  `get_causal_conv1d_version()` (0.16-0.19) raise ModuleNotFoundError: they get the same answer.

Only a package that is absent (`importlib.util.find_spec` finds nothing) gets 0.0.0; every other
error is raised as before, and an installed package's version is the original's. The first
"absent" answer is kept, as Megatron keeps a found version (and 0.17+ keeps 0.0.0 for TE).
Every module that imported a helper by name is rebound by the applier; `is_<pkg>_min_version`
calls the module global, so it answers too.

`is_te_min_version` is also where a Megatron module gates a feature that megatron-adapt serves
without TE (TransformerConfig's fp8 MoE checks, MIMO's THD split under CP). The applier rebinds a
patched function in every module that imported it, so those answers cannot live in one module's
copy: one wrapper answers True only for the (calling module, version) pairs a patch area
registered with `serve_te_version`, while that area is on and TE is absent, and asks the original
for every other caller and version.
"""
import importlib.util
import sys

from packaging.version import Version

from megatron_adapt.spec import PatchSpec

ABSENT = Version("0.0.0")
UTILS = "megatron.core.utils"


def _absent(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):
        return False  # present but broken: let the original's error through


def helper_for(package: str):
    def build(backend, original):
        absent = False

        def get_version():
            nonlocal absent
            if absent or _absent(package):
                absent = True
                return ABSENT
            version = original()
            if version is None:  # 0.15-0.16 get_te_version: TE present but not importable
                raise ImportError(f"{package} is installed but could not be imported; "
                                  f"megatron.core.utils cannot read its version")
            return version
        get_version.__name__ = get_version.__qualname__ = original.__name__
        get_version.__doc__ = original.__doc__
        return get_version
    return build


_SERVED_TE_VERSIONS: dict[tuple[str, str], str] = {}   # (calling module, version) -> patch area


def serve_te_version(area: str, module: str, *versions: str) -> None:
    """`module`'s is_te_min_version(v) answers True for each of `versions` while `area` is on and TE
    is absent: megatron-adapt serves what that check gates there."""
    for version in versions:
        _SERVED_TE_VERSIONS[(module, version)] = area


def build_te_min_version(backend, original):
    from megatron_adapt import start_checks
    from megatron_adapt.core import active_config

    def is_te_min_version(version, check_equality=True):
        area = _SERVED_TE_VERSIONS.get((sys._getframe(1).f_globals.get("__name__"), version))
        if area and active_config().enabled(area) and not start_checks.te_installed():
            return True
        return original(version, check_equality)
    is_te_min_version.__doc__ = original.__doc__
    return is_te_min_version


SPECS = [
    PatchSpec(f"{UTILS}:is_te_min_version", area="package_versions", build=build_te_min_version),
    PatchSpec(f"{UTILS}:get_te_version", area="package_versions", build=helper_for("transformer_engine"),
              versions=">=0.15.0,<0.17.0"),
    PatchSpec(f"{UTILS}:get_fa_version", area="package_versions", build=helper_for("flash_attn")),
    PatchSpec(f"{UTILS}:get_mamba_version", area="package_versions", build=helper_for("mamba_ssm"),
              versions=">=0.16.0,<0.20.0"),
    PatchSpec(f"{UTILS}:get_causal_conv1d_version", area="package_versions",
              build=helper_for("causal_conv1d"), versions=">=0.16.0,<0.20.0"),
]

"""The megatron-core version gate: read once, without importing Megatron.

SUPPORTED is the range every patch was verified on (each PatchSpec states its own sub-range where a
target moved or changed). A newer megatron-core fails at apply, unless the user opts in with
MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON=1: then it warns once, patches are chosen as for the newest
supported release, and the report lists every patch whose target was not found.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from functools import lru_cache

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .errors import UnsupportedMegatronVersionError

# Every patch was verified on these; a spec may narrow its own range further.
SUPPORTED_RANGE = ">=0.15.0,<0.20.0"
SUPPORTED = SpecifierSet(SUPPORTED_RANGE)
# The newest release line in SUPPORTED: an untested newer megatron-core is patched as this one.
NEWEST_SUPPORTED = Version("0.19.999")
# Which megatron-core each Python gets (0.17 and later need Python >= 3.12); CI runs each of these.
TESTED = {"3.10/3.11": ("0.15.3", "0.16.1"), "3.12+": ("0.17.1", "0.18.2", "0.19.2")}
ENV_ALLOW_UNTESTED = "MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON"


@lru_cache(maxsize=None)
def megatron_core_version() -> Version | None:
    """Version of the megatron.core that `import megatron.core` would load, or None if absent.

    A Megatron-LM checkout on sys.path shadows the wheel and has no dist metadata, so read
    ``megatron/core/package_info.py`` of whatever the import system would find.
    """
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            info = os.path.join(location, "package_info.py")
            if os.path.exists(info):
                with open(info, encoding="utf-8") as f:
                    text = f.read()
                parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)", text, re.M))
                if {"MAJOR", "MINOR", "PATCH"} <= parts.keys():
                    return Version(f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}")
    if spec is None:
        return None
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def is_untested_newer(version: Version | None) -> bool:
    return version is not None and Version(version.base_version) > NEWEST_SUPPORTED


def check_supported(version: Version | None, allow_untested: bool = False) -> bool:
    """Raise before anything is patched if this megatron-core is outside SUPPORTED.

    Returns True when the version is an untested newer release that the user opted into
    (allow_untested): that warns loudly, once per process.
    """
    if version is None:
        return False  # no Megatron here (yet): hooks wait for it and the device layer still works
    if Version(version.base_version) in SUPPORTED:
        return False
    if allow_untested and is_untested_newer(version):
        _warn_untested(str(version))
        return True
    hint = (f" To try it anyway, set {ENV_ALLOW_UNTESTED}=1: the report then lists every patch "
            "whose target was not found." if is_untested_newer(version) else "")
    raise UnsupportedMegatronVersionError(
        f"megatron-adapt supports megatron-core {SUPPORTED_RANGE} but found {version}. "
        f"Install a supported release (pip install 'megatron-core{SUPPORTED_RANGE}'; 0.17 and later need "
        f"Python >= 3.12) or point MEGATRON_LM_PATH at a matching Megatron-LM checkout; nothing was "
        f"patched.{hint}"
    )


@lru_cache(maxsize=None)
def _warn_untested(version: str) -> None:
    message = (f"megatron-adapt: megatron-core {version} is NEWER than the tested range {SUPPORTED_RANGE} "
               f"and was allowed by {ENV_ALLOW_UNTESTED}=1. Patches are chosen as for the newest "
               f"supported release; check the report for patches whose target was not found.")
    print(f"WARNING: {message}", file=sys.stderr, flush=True)  # not a filterable warning: loud


def patching_version(version: Version | None) -> Version | None:
    """The version that selects each patch's spec: an opted-in newer release counts as the newest
    supported one (its targets are then checked, and the missing ones reported)."""
    return Version(str(NEWEST_SUPPORTED)) if is_untested_newer(version) else version


def in_range(spec_range: str, version: Version | None) -> bool:
    if version is None:
        return False
    return Version(version.base_version) in SpecifierSet(spec_range)

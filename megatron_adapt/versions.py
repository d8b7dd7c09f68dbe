"""The megatron-core version gate: read once, without importing Megatron."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from functools import lru_cache

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .errors import UnsupportedMegatronVersionError

# Every patch was verified on these; a spec may narrow its own range further.
SUPPORTED = SpecifierSet(">=0.15.0,<0.17.0")


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
                text = open(info, encoding="utf-8").read()
                parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)", text, re.M))
                if {"MAJOR", "MINOR", "PATCH"} <= parts.keys():
                    return Version(f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}")
    if spec is None:
        return None
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def check_supported(version: Version | None) -> None:
    """Raise before anything is patched if this megatron-core is outside SUPPORTED."""
    if version is None:
        return  # no Megatron here (yet): hooks wait for it and the device layer still works
    if Version(version.base_version) not in SUPPORTED:
        raise UnsupportedMegatronVersionError(
            f"megatron-adapt supports megatron-core {SUPPORTED} but found {version}. "
            f"Install a supported release (pip install 'megatron-core{SUPPORTED}') or point "
            f"MEGATRON_LM_PATH at a matching Megatron-LM checkout; nothing was patched."
        )


def in_range(spec_range: str, version: Version | None) -> bool:
    if version is None:
        return False
    return Version(version.base_version) in SpecifierSet(spec_range)

"""Which Megatron-LM checkout MEGATRON_LM_PATH names, and whether it matches the installed
megatron-core (by major.minor release line). Used by tests/megatron_lm/conftest.py (and by any test
that runs a checkout's code); unit-tested in tests/test_core.py."""
from __future__ import annotations

import importlib.metadata
import os
import re

from packaging.version import Version


def checkout_version(path: str) -> Version | None:
    info = os.path.join(path, "megatron", "core", "package_info.py")
    if not os.path.isfile(info):
        return None
    with open(info, encoding="utf-8") as f:
        text = f.read()
    parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", text, re.M))
    if {"MAJOR", "MINOR", "PATCH"} - parts.keys():
        return None
    return Version(f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}")


def installed_version() -> Version | None:
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def mismatch_reason(path: str | None) -> str | None:
    """Why the checkout at `path` cannot be tested with this Python's megatron-core, or None."""
    if not path:
        return None  # the test modules skip on their own, with their own reason
    checkout = checkout_version(path)
    if checkout is None:
        return f"MEGATRON_LM_PATH={path} has no megatron/core/package_info.py: not a Megatron-LM checkout"
    installed = installed_version()
    if installed is None:
        return None  # no wheel: the checkout's megatron.core is the one imported
    if checkout.release[:2] != installed.release[:2]:
        return (f"MEGATRON_LM_PATH={path} is Megatron-LM {checkout} but this Python has megatron-core "
                f"{installed}: point it at the core_v{installed.major}.{installed.minor}.x checkout "
                f"or install megatron-core=={checkout.major}.{checkout.minor}.*")
    return None

"""The Megatron-LM checkout these tests run must match the installed megatron-core.

MEGATRON_LM_PATH names the checkout; its own version (megatron/core/package_info.py) is read and
compared, by major.minor release line, with the megatron-core distribution installed in this
Python. A mismatch skips every test of a module that sets `NEEDS_CHECKOUT = True`, with both
versions named: running 0.16's pretrain_gpt.py against megatron-core 0.19 (or the reverse) tests
neither.
"""
from __future__ import annotations

import importlib.metadata
import os
import re

import pytest
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))


def checkout_version(path: str) -> Version | None:
    info = os.path.join(path, "megatron", "core", "package_info.py")
    if not os.path.isfile(info):
        return None
    text = open(info, encoding="utf-8").read()
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


def pytest_report_header(config):
    path = os.environ.get("MEGATRON_LM_PATH")
    if path:
        return (f"Megatron-LM checkout {path}: {checkout_version(path)}; "
                f"installed megatron-core: {installed_version()}")
    return None


def pytest_collection_modifyitems(config, items):
    reason = mismatch_reason(os.environ.get("MEGATRON_LM_PATH"))
    if not reason:
        return
    for item in items:
        if str(item.fspath).startswith(HERE) and getattr(item.module, "NEEDS_CHECKOUT", False):
            item.add_marker(pytest.mark.skip(reason=reason))

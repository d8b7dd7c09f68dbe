"""The Megatron-LM checkout these tests run must match the installed megatron-core.

MEGATRON_LM_PATH names the checkout; its own version (megatron/core/package_info.py) is read and
compared, by major.minor release line, with the megatron-core distribution installed in this
Python (tests/megatron_checkout.py). A mismatch skips every test of a module that sets
`NEEDS_CHECKOUT = True`, with both versions named: running 0.16's pretrain_gpt.py against
megatron-core 0.19 (or the reverse) tests neither.
"""
import os

import pytest

from megatron_checkout import checkout_version, installed_version, mismatch_reason

HERE = os.path.dirname(os.path.abspath(__file__))


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

"""Fixtures for the npu backend's tests: the torch_npu EMULATION goes on sys.path only while a
test module that asks for it runs, and everything it changed is undone afterwards."""
import os
import sys

import pytest

os.environ.setdefault("MEGATRON_ADAPT_AUTO", "0")

EMULATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulation")
# The Ascend Extension releases the emulation models: every test that takes the torch_npu fixture
# runs once under each (defined in torch_npu_api: `from conftest import` is ambiguous with several
# conftest.py files in one run).
from torch_npu_api import PROFILES  # noqa: E402


def _drop_emulation():
    import torch

    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    if "npu" in vars(torch):
        delattr(torch, "npu")
    while EMULATION_DIR in sys.path:
        sys.path.remove(EMULATION_DIR)
    from megatron_adapt.backends.npu import _lib

    _lib._reset()


@pytest.fixture(scope="module", params=PROFILES, ids=[f"torch_npu-{p}" for p in PROFILES])
def torch_npu(request):
    """The emulated torch_npu module (see emulation/torch_npu/__init__.py), as one release has it."""
    import megatron_adapt
    from megatron_adapt.backends.npu import _lib, device

    saved = os.environ.get("TORCH_NPU_EMULATION_PROFILE")
    os.environ["TORCH_NPU_EMULATION_PROFILE"] = request.param
    sys.path.insert(0, EMULATION_DIR)
    _lib._reset()
    import torch_npu as module

    assert getattr(module, "EMULATION", False), f"imported a real torch_npu from {module.__file__}?"
    assert module.PROFILE == request.param
    try:
        yield module
    finally:
        megatron_adapt.revert()
        device.uninstall()
        _drop_emulation()
        if saved is None:
            os.environ.pop("TORCH_NPU_EMULATION_PROFILE", None)
        else:
            os.environ["TORCH_NPU_EMULATION_PROFILE"] = saved


@pytest.fixture
def report():
    from megatron_adapt import report as rep

    rep.reset_op_counts()
    rep.set_context(strict=False)
    yield rep
    rep.reset_op_counts()
    rep.set_context(strict=False)


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """These tests seed torch's global RNG; leave it as found for whatever runs next."""
    import torch

    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)

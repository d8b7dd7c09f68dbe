"""EMULATION of Ascend's `torch_npu` for megatron-adapt's tests. NOT torch_npu; never install it.

There is no Ascend NPU (and no torch_npu) on the machines these tests run on. This package has
the same module path, function names, signatures, argument validation and return values as the
torch_npu ops the npu backend calls, with reference math on CPU tensors: the "NPU" *is* the CPU.
It lets the backend be tested against torch_npu's documented op contract (op-plugin docs,
Ascend Extension for PyTorch 6.0 - 7.x). It does not reproduce the kernels' numerics, speed,
memory formats, or any behaviour the documentation leaves open (noted in each op's docstring).

TORCH_NPU_EMULATION_PROFILE picks the release it emulates (default 7.3.0): 6.0.0 (__version__
2.1.0.post10), 7.0.0 (2.5.1), 7.1.0 (2.6.0) or 7.3.0 (2.6.0.post5). Each has that release's
functions and signatures only (tests/npu/torch_npu_api.py holds the real schemas, with sources;
tests/npu/test_npu_api_table.py checks this package against them under every profile).

The tests put its parent directory on sys.path for the duration of a test module (and in the
PYTHONPATH of the processes they spawn); it is never on the path otherwise.

    torch_npu.npu_rms_norm / npu_scaled_masked_softmax / npu_fusion_attention(_grad) / npu_rotary_mul /
        npu_swiglu / _npu_matmul_add_fp32 / npu_grouped_matmul / npu_moe_token_permute /
        npu_moe_token_unpermute -> ._ops (strict validation, CPU math, autograd), per profile
    torch.npu (= torch_npu.npu)         -> is_available / device_count / default_generators ...
                                           mapped to the CPU (TORCH_NPU_EMULATION_DEVICES=n, default 1)
    torch_npu.contrib.transfer_to_npu   -> installs megatron-adapt's CPU device layer
    distributed backend "hccl"          -> registered, creates a gloo process group
"""
import os

import torch
import torch.distributed as dist

from . import npu
from ._ops import PROFILES, EmulatedNPUError, profile_ops

PROFILE = os.environ.get("TORCH_NPU_EMULATION_PROFILE", "7.3.0")
if PROFILE not in PROFILES:
    raise ImportError(f"TORCH_NPU_EMULATION_PROFILE={PROFILE!r}: one of {sorted(PROFILES)}")
__version__ = PROFILES[PROFILE] + "+megatron_adapt.emulation"
EMULATION = True
OPS = profile_ops(PROFILE)
globals().update(OPS)

torch.npu = npu  # what the real torch_npu does on import


def _create_hccl(store, rank, size, timeout):
    """The emulated HCCL process group: gloo over the same store."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if dist.is_available() and "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _create_hccl, devices=["cpu"])

__all__ = ["EmulatedNPUError", "npu", "PROFILE", *OPS]

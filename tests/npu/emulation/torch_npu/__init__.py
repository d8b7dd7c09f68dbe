"""EMULATION of Ascend's `torch_npu` for megatron-adapt's tests. NOT torch_npu; never install it.

There is no Ascend NPU (and no torch_npu) on the machines these tests run on. This package has
the same module path, function names, signatures, argument validation and return values as the
torch_npu ops the npu backend calls, with reference math on CPU tensors: the "NPU" *is* the CPU.
It lets the backend be tested against torch_npu's documented op contract (op-plugin docs,
Ascend Extension for PyTorch 6.0 - 7.x). It does not reproduce the kernels' numerics, speed,
memory formats, or any behaviour the documentation leaves open (noted in each op's docstring).

The tests put its parent directory on sys.path for the duration of a test module (and in the
PYTHONPATH of the processes they spawn); it is never on the path otherwise.

    torch_npu.npu_rms_norm / npu_scaled_masked_softmax / npu_fusion_attention / npu_rotary_mul /
        npu_swiglu / npu_matmul_add_fp32 / npu_grouped_matmul / npu_moe_token_permute /
        npu_moe_token_unpermute -> ._ops (strict validation, CPU math, autograd)
    torch.npu (= torch_npu.npu)         -> is_available / device_count / default_generators ...
                                           mapped to the CPU (TORCH_NPU_EMULATION_DEVICES=n, default 1)
    torch_npu.contrib.transfer_to_npu   -> installs megatron-adapt's CPU device layer
    distributed backend "hccl"          -> registered, creates a gloo process group
"""
import torch
import torch.distributed as dist

from . import npu
from ._ops import (EmulatedNPUError, npu_fusion_attention, npu_grouped_matmul, npu_matmul_add_fp32,
                   npu_moe_token_permute, npu_moe_token_unpermute, npu_rms_norm, npu_rotary_mul,
                   npu_rotary_mul_legacy, npu_scaled_masked_softmax, npu_swiglu)

__version__ = "2.6.0+megatron_adapt.emulation"
EMULATION = True

torch.npu = npu  # what the real torch_npu does on import


def _create_hccl(store, rank, size, timeout):
    """The emulated HCCL process group: gloo over the same store."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if dist.is_available() and "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _create_hccl, devices=["cpu"])

__all__ = ["EmulatedNPUError", "npu", "npu_fusion_attention", "npu_grouped_matmul", "npu_matmul_add_fp32",
           "npu_moe_token_permute", "npu_moe_token_unpermute", "npu_rms_norm",
           "npu_rotary_mul",
           "npu_rotary_mul_legacy", "npu_scaled_masked_softmax", "npu_swiglu"]

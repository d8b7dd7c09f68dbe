"""apex multi_tensor_l2norm / multi_tensor_scale semantics through torch._foreach_* (NPU kernels).

torch_npu implements the _foreach_* family for NPU tensors, so these are multi-tensor launches,
not a Python loop of one kernel per tensor (MindSpeed's fallback).
"""
import torch

from megatron_adapt import report


def l2norm(tensors):
    report.ran("multi_tensor_l2norm", "npu.torch._foreach_norm")
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    try:  # accumulate in fp32 as apex's multi_tensor_l2norm does (bf16 norms lose 3 digits)
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    except TypeError:  # torch < 2.5 (torch_npu 2.1 / 2.4): no dtype argument
        norms = torch._foreach_norm([t.float() for t in tensors], 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


def scale(srcs, dsts, factor):
    report.ran("multi_tensor_scale", "npu.torch._foreach_mul")
    if srcs:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, factor))

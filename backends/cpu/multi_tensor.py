"""apex multi_tensor_l2norm / multi_tensor_scale semantics through torch._foreach_* ops."""
import torch

from megatron_adapt import report


def l2norm(tensors):
    report.ran("multi_tensor_l2norm", "torch._foreach_norm")
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)  # accumulate bf16/fp16 in fp32
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def scale(srcs, dsts, factor):
    report.ran("multi_tensor_scale", "torch._foreach_mul")
    if srcs:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, factor))

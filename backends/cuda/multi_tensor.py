"""apex multi_tensor_l2norm / multi_tensor_scale through torch._foreach_* (multi-tensor-apply
CUDA kernels: a few launches for the whole list, not one per tensor). Results stay on the
tensors' device: no host synchronisation.
"""
import torch

from megatron_adapt import report


def l2norm(tensors):
    report.ran("multi_tensor_l2norm", "cuda.torch._foreach_norm")
    if not tensors:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return torch.zeros((), dtype=torch.float32, device=device)
    try:
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    except TypeError:  # torch without the dtype argument
        norms = [n.float() for n in torch._foreach_norm(tensors, 2.0)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def scale(srcs, dsts, factor):
    report.ran("multi_tensor_scale", "cuda.torch._foreach_mul")
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts)):
        torch._foreach_mul_(dsts, factor)
    else:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, factor))

"""Collectives Megatron asks for that a backend's process-group library lacks.

Megatron-FSDP reduces gradients with NCCL's premultiplied sum (`_make_nccl_premul_sum(scale)`,
`--gradient-reduce-div-fusion`, the default, for non-bf16 gradients). gloo (the cpu backend) refuses
it at the reduce ("Cannot use ReduceOp.PREMUL_SUM with Gloo") and HCCL has no such op. On those
backends the gradients are scaled first and reduced with SUM: Megatron's own unfused branch.

Megatron's inference broadcasts and pipeline sends (`inference/communication_utils.py`) assert
`tensor.is_cuda` on every tensor they move. On the cpu backend the accelerator is the host, so the
check asks for the backend's device (the host) instead; Megatron's other checks (not None,
contiguous) stay as they are. Before, a pipeline-parallel static generation failed that assert on
the last stage and left the other stage waiting in its broadcast.
"""
import inspect

import torch

from megatron_adapt.spec import PatchSpec, WRAP

FSDP_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"


def build_gradient_reduce_preprocessing(backend, original):
    signature = inspect.signature(original)

    def gradient_reduce_preprocessing(wrapped, instance, args, kwargs):
        reduce_op = wrapped(*args, **kwargs)
        if reduce_op != torch.distributed.ReduceOp.PREMUL_SUM:
            return reduce_op
        bound = signature.bind(*args, **kwargs).arguments
        bound["grad_data"].mul_(bound["scaling_factor"])
        return torch.distributed.ReduceOp.SUM
    return gradient_reduce_preprocessing


def build_is_cuda(backend, original):
    def _is_cuda(tensor):
        """Megatron's check that a tensor it sends is on the accelerator (the host, here)."""
        assert tensor is not None
        assert tensor.device.type == "cpu", f"a {tensor.device} tensor, not one of the cpu backend's"
    return _is_cuda


SPECS = [
    PatchSpec("megatron.core.inference.communication_utils:_is_cuda", area="collectives",
              build=build_is_cuda, backends=("cpu",), optional=True),
    PatchSpec(f"{FSDP_BUFFER}:gradient_reduce_preprocessing", area="collectives", mode=WRAP,
              build=build_gradient_reduce_preprocessing, backends=("cpu", "npu"), optional=True),
]

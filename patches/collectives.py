"""Collectives Megatron asks for that a backend's process-group library lacks.

Megatron-FSDP reduces gradients with NCCL's premultiplied sum (`_make_nccl_premul_sum(scale)`,
`--gradient-reduce-div-fusion`, the default, for non-bf16 gradients). gloo (the cpu backend) refuses
it at the reduce ("Cannot use ReduceOp.PREMUL_SUM with Gloo") and HCCL has no such op. On those
backends the gradients are scaled first and reduced with SUM: Megatron's own unfused branch.
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


SPECS = [
    PatchSpec(f"{FSDP_BUFFER}:gradient_reduce_preprocessing", area="collectives", mode=WRAP,
              build=build_gradient_reduce_preprocessing, backends=("cpu", "npu"), optional=True),
]

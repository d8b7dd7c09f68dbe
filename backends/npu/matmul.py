"""Weight-gradient accumulation into the fp32 `main_grad` through torch_npu.npu_matmul_add_fp32.

`torch_npu.npu_matmul_add_fp32(grad_output, total_input, main_grad)` (torch_npu 2.1+ with CANN
8.0+; before that MindSpeed built the same kernel) computes main_grad += grad_output^T @
total_input in place, with fp16/bf16 operands and an fp32 accumulator. Older torch_npu builds
without it use an addmm_ in fp32 (reported as a fallback).
"""
import torch

from megatron_adapt import report
from megatron_adapt.backends import cpu_fallback

from ._lib import torch_npu


def wgrad_accumulate(input, grad_output, main_grad):  # noqa: A002 (apex's argument order)
    npu = torch_npu()
    if (main_grad.dtype == torch.float32 and input.dtype in (torch.bfloat16, torch.float16)
            and hasattr(npu, "npu_matmul_add_fp32")):
        if input.numel() == 0 or grad_output.numel() == 0:
            return  # the kernel rejects empty operands; nothing to add
        report.ran("wgrad_accumulate", "npu.torch_npu.npu_matmul_add_fp32")
        npu.npu_matmul_add_fp32(grad_output, input, main_grad)
        return
    why = ("torch_npu has no npu_matmul_add_fp32" if main_grad.dtype == torch.float32
           else f"main_grad dtype {main_grad.dtype} (npu_matmul_add_fp32 accumulates into fp32 only)")
    cpu_fallback("wgrad_accumulate", why, input, grad_output, main_grad)

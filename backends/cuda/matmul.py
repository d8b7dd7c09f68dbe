"""Weight-gradient accumulation into the fp32 `main_grad` (gradient-accumulation fusion).

apex's `wgrad_gemm_accum_fp32` is one cuBLAS GEMM with bf16/fp16 operands, fp32 accumulation and
beta=1 into the fp32 main_grad. PyTorch's `addmm(..., out_dtype=torch.float32)` is the same GEMM
(cuBLASLt, low-precision inputs, fp32 C), so no fp32 copy of the activations and no separate
`weight.grad` is ever made.
"""
import torch

from megatron_adapt import report
from megatron_adapt.backends import cpu_fallback

_LOW = (torch.bfloat16, torch.float16)


def wgrad_accumulate(input, grad_output, main_grad):  # noqa: A002 (apex's argument order)
    """main_grad += grad_output^T @ input, for input [tokens, in], grad_output [tokens, out]."""
    if not (input.is_cuda and main_grad.is_cuda):
        return cpu_fallback("wgrad_accumulate", "tensors not on a CUDA device", input, grad_output, main_grad)
    if main_grad.dtype == input.dtype == grad_output.dtype:
        report.ran("wgrad_accumulate", "cuda.addmm_")
        main_grad.addmm_(grad_output.t(), input)
    elif main_grad.dtype == torch.float32 and input.dtype in _LOW and grad_output.dtype == input.dtype:
        report.ran("wgrad_accumulate", "cuda.addmm(out_dtype=fp32)")
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=torch.float32, out=main_grad)
    else:
        cpu_fallback("wgrad_accumulate", f"dtypes input={input.dtype} grad_output={grad_output.dtype} "
                     f"main_grad={main_grad.dtype}", input, grad_output, main_grad)

"""Weight-gradient accumulation into Megatron's fp32 `main_grad` (gradient-accumulation fusion).

Megatron's `--gradient-accumulation-fusion` (its default) has each linear layer's backward add
`grad_output^T @ input` straight into `weight.main_grad` instead of materialising `weight.grad`;
apex's `fused_weight_gradient_mlp_cuda` did it. Here it is one `addmm_` in main_grad's dtype.
"""
import torch

from megatron_adapt import report


def wgrad_accumulate(input, grad_output, main_grad):  # noqa: A002 (apex's argument order)
    """main_grad += grad_output^T @ input, for input [tokens, in], grad_output [tokens, out]."""
    report.ran("wgrad_accumulate", "cpu.addmm_")
    dtype = main_grad.dtype
    main_grad.addmm_(grad_output.t().to(dtype), input.to(dtype))

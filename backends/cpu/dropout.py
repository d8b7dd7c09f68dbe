"""Bias-dropout-add in PyTorch ops: Megatron's own arithmetic (x + bias rounded to x's dtype, then
torch's dropout, then the residual added), so the masks are those of the default generator."""
import torch.nn.functional as F

from megatron_adapt import report


def bias_dropout_add_math(x, bias, residual, prob):
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=True)


def bias_dropout_add(x, bias, residual, prob):
    report.ran("bias_dropout_add", "cpu.torch")
    return bias_dropout_add_math(x, bias, residual, prob)

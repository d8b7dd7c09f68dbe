"""SwiGLU, bias-SwiGLU and bias-GeLU (tanh approximation, as Megatron's fused bias_gelu)."""
import torch
import torch.nn.functional as F

from megatron_adapt import report


def swiglu(x):
    report.ran("swiglu", "cpu.torch")
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


def bias_swiglu(x, bias):
    report.ran("bias_swiglu", "cpu.torch")
    a, b = torch.chunk(x + bias, 2, dim=-1)
    return F.silu(a) * b


def bias_gelu(bias, y):
    report.ran("bias_gelu", "cpu.torch")
    return F.gelu(y + bias, approximate="tanh")

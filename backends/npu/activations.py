"""SwiGLU through torch_npu.npu_swiglu(x, dim=-1); bias-GeLU in torch math (NPU GeLU kernel).

npu_swiglu(input, dim=-1) -> silu(A) * B, with A, B the two halves of `input` along `dim`. It
rejects non-contiguous and empty inputs (documented), so the input is made contiguous first.
"""
from megatron_adapt import report
from megatron_adapt.backends import reference

from ._lib import torch_npu


def swiglu(x):
    report.ran("swiglu", "npu.torch_npu.npu_swiglu")
    return torch_npu().npu_swiglu(x.contiguous(), dim=-1)


def bias_swiglu(x, bias):
    report.ran("bias_swiglu", "npu.torch_npu.npu_swiglu")
    return torch_npu().npu_swiglu((x + bias).contiguous(), dim=-1)


def bias_gelu(bias, y):
    report.ran("bias_gelu", "npu.torch.F.gelu")
    return reference.bias_gelu(bias, y)

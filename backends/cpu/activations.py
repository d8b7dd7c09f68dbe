"""SwiGLU, bias-SwiGLU and bias-GeLU (tanh approximation): the references."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def swiglu(x):
    report.ran("swiglu", "cpu.torch")
    return reference.swiglu(x)


def bias_swiglu(x, bias):
    report.ran("bias_swiglu", "cpu.torch")
    return reference.bias_swiglu(x, bias)


def bias_gelu(bias, y):
    report.ran("bias_gelu", "cpu.torch")
    return reference.bias_gelu(bias, y)

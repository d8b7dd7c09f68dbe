"""Bias-dropout-add: the reference, Megatron's own arithmetic with the default generator's masks."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def bias_dropout_add(x, bias, residual, prob):
    report.ran("bias_dropout_add", "cpu.torch")
    return reference.bias_dropout_add(x, bias, residual, prob)

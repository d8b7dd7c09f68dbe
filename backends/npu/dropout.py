"""Bias-dropout-add in torch ops on the NPU (torch_npu's dropout kernel serves F.dropout there);
torch.compile, which Megatron's version relies on, has no NPU backend."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def bias_dropout_add(x, bias, residual, prob):
    report.ran("bias_dropout_add", "npu.torch")
    return reference.bias_dropout_add(x, bias, residual, prob)

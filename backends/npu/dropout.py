"""Bias-dropout-add in torch ops on the NPU (torch_npu's dropout kernel serves F.dropout there);
torch.compile, which Megatron's version relies on, has no NPU backend."""
import torch.nn.functional as F

from megatron_adapt import report


def bias_dropout_add(x, bias, residual, prob):
    report.ran("bias_dropout_add", "npu.torch")
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=True)

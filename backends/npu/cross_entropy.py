"""Vocab-parallel cross entropy in torch math on the NPU, as MindSpeed does (no fused torch_npu op).

The math (fp32, one all-reduce of max and one of the sums over the TP group, gradient written in
place) is the reference implementation's, shared rather than copied.
"""
from megatron_adapt import report
from megatron_adapt.backends import reference


def vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, tp_group=None):
    report.ran("vocab_parallel_cross_entropy", "npu.torch")
    return reference.vocab_parallel_cross_entropy(logits, target, label_smoothing, tp_group)

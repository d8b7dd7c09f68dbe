"""Scaled, masked, causal / sliding-window softmax: the reference (Megatron's masking conventions)."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def scaled_masked_softmax(scores, mask, scale, causal, window_size=None, softmax_in_fp32=True):
    report.ran("scaled_masked_softmax", "cpu.torch")
    return reference.scaled_masked_softmax(scores, mask, scale, causal, window_size, softmax_in_fp32)

"""Vocab-parallel cross entropy: the reference (fp32 math, one all-reduce for the sums, grad in place)."""
from megatron_adapt import report
from megatron_adapt.backends import reference

IMPL = "cpu.torch"


def vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, tp_group=None):
    report.ran("vocab_parallel_cross_entropy", IMPL)
    return reference.vocab_parallel_cross_entropy(logits, target, label_smoothing, tp_group)

"""Rotary position embedding: the reference (Megatron's bshd formula, rotate-half or interleaved)."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def rope(t, freqs, interleaved=False, mscale=1.0):
    report.ran("rope", "cpu.torch")
    return reference.rope(t, freqs, interleaved, mscale)


def rope_cos_sin(t, cos, sin):
    report.ran("rope_cos_sin", "cpu.torch")
    return reference.rope_cos_sin(t, cos, sin)

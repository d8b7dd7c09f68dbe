"""Core attention: the reference, torch's scaled_dot_product_attention (math / flash kernels on CPU)."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    report.ran("attention", "cpu.torch.sdpa")
    return reference.attention(q, k, v, attn_mask, causal, scale, dropout_p, window_size)

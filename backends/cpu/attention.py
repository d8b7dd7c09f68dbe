"""Core attention through torch's scaled_dot_product_attention (math / flash kernels on CPU)."""
import torch.nn.functional as F

from megatron_adapt import report

from .softmax import build_mask


def attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    sq, sk = q.size(-2), k.size(-2)
    use_causal = causal and attn_mask is None and window_size is None and sq == sk
    mask = None if use_causal else build_mask(sq, sk, causal, window_size, attn_mask, q.device)
    report.ran("attention", "cpu.torch.sdpa")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=dropout_p,
        is_causal=use_causal, scale=scale, enable_gqa=k.size(1) != q.size(1))

"""Scaled, masked, causal / sliding-window softmax in PyTorch (Megatron's masking conventions)."""
import torch

from megatron_adapt import report

MASK_VALUE = -10000.0  # Megatron's attention_mask_func fill: a fully masked row stays finite


def build_mask(sq, sk, causal, window_size, mask, device):
    """Combined boolean mask (True = masked) or None, with Megatron's alignment (bottom-right)."""
    m = None
    if window_size is not None:
        ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
        m = ~torch.tril(torch.triu(ones, diagonal=sk - sq - window_size[0]), diagonal=sk - sq + window_size[1])
    elif causal and sq > 1:
        m = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1 + sk - sq)
    if mask is not None:
        m = mask if m is None else (m | mask)
    return m


def scaled_masked_softmax(scores, mask, scale, causal, window_size=None, softmax_in_fp32=True):
    report.ran("scaled_masked_softmax", "cpu.torch")
    return softmax_math(scores, mask, scale, causal, window_size, softmax_in_fp32)


def softmax_math(scores, mask, scale, causal, window_size=None, softmax_in_fp32=True):
    """The math alone (no report entry): other backends' reported fallbacks call it."""
    x = scores.float() if softmax_in_fp32 else scores
    if scale is not None and scale != 1.0:
        x = x * scale
    m = build_mask(x.size(-2), x.size(-1), causal, window_size, mask, x.device)
    if m is not None:
        x = x.masked_fill(m, MASK_VALUE)
    return torch.softmax(x, dim=-1).to(scores.dtype)

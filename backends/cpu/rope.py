"""Rotary position embedding, Megatron's bshd formula (rotate-half or interleaved pairs)."""
import torch

from megatron_adapt import report


def _rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).view(x.shape)


def rope(t, freqs, interleaved=False, mscale=1.0):
    report.ran("rope", "cpu.torch")
    return rope_math(t, freqs, interleaved, mscale)


def rope_math(t, freqs, interleaved=False, mscale=1.0):
    """The formula alone (no report entry): other backends' reported fallbacks call it."""
    rot = freqs.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    out = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((out, t_pass), dim=-1) if t_pass.numel() else out

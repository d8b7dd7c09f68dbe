"""Scaled masked softmax through torch_npu.npu_scaled_masked_softmax, the reference outside its limits.

npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False) -> softmax(mask(x * scale))
along the last dim, output in x's dtype. Documented limits (op-plugin docs): viewed as NCHW, H and
W (sq, sk) must be in [32, 4096] and divisible by 32; `mask` is bool, broadcastable to x.
`fixed_triu_mask` is documented as reserved ("only False is supported"), although older MindSpeed
passes True on its causal path: we always pass False and build the causal / window mask
ourselves (Megatron's bottom-right alignment). We take the kernel for fp16 / bf16 only, the dtypes
Megatron's fused softmax is for; fp32 scores take the reference (reported).
"""
import torch

from megatron_adapt import report
from megatron_adapt.backends import reference

from ._lib import torch_npu

IMPL = "npu.torch_npu.npu_scaled_masked_softmax"
FALLBACK = "npu.torch (reference)"
DTYPES = (torch.float16, torch.bfloat16)
MIN_S, MAX_S, ALIGN = 32, 4096, 32


def unsupported(scores, mask) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if scores.dim() != 4:
        return f"scores must be 4-D [b, np, sq, sk], got {scores.dim()}-D"
    if scores.dtype not in DTYPES:
        return f"dtype {scores.dtype} (kernel used for fp16/bf16)"
    sq, sk = scores.shape[-2:]
    for name, n in (("sq", sq), ("sk", sk)):
        if not (MIN_S <= n <= MAX_S and n % ALIGN == 0):
            return f"{name}={n} outside [{MIN_S}, {MAX_S}] or not a multiple of {ALIGN}"
    if mask is not None and mask.dtype != torch.bool:
        return f"mask dtype {mask.dtype} (must be bool)"
    return None


def scaled_masked_softmax(scores, mask, scale, causal, window_size=None, softmax_in_fp32=True):
    why = unsupported(scores, mask)
    if why:
        report.fell_back("scaled_masked_softmax", FALLBACK, why)
        return reference.scaled_masked_softmax(scores, mask, scale, causal, window_size, softmax_in_fp32)
    sq, sk = scores.shape[-2:]
    m = reference.build_mask(sq, sk, causal, window_size, mask, scores.device)
    if m is None:
        m = torch.zeros((1, 1, sq, sk), dtype=torch.bool, device=scores.device)
    elif m.dim() < 4:
        m = m.view((1,) * (4 - m.dim()) + tuple(m.shape))
    report.ran("scaled_masked_softmax", IMPL)
    return torch_npu().npu_scaled_masked_softmax(scores, m, 1.0 if scale is None else float(scale), False)

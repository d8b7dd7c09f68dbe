"""Rotary position embedding through torch_npu.npu_rotary_mul.

    npu_rotary_mul(Tensor self, Tensor r1, Tensor r2) -> Tensor                         6.0.0
    npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor  7.0.0+
    (Ascend/op-plugin op_plugin_functions.yaml on the 6.0.0 / 7.0.0 - 7.3.0 branches)

output = input * r1 + rotate(input) * r2. Megatron's t is [s, b, h, d] (the kernel's SBND layout)
and freqs [s, 1, 1, r] gives r1 = cos, r2 = sin in S11D, accepted in both modes. Documented limits
(Atlas A2/A3): 4-D input, D even and < 896; half mode B, N < 1000; interleave mode B*N < 1000;
r1/r2 in [-1, 1] -- so mscale is applied to the output (the map is linear), never folded into cos
and sin. Partial rotary (r < d) rotates the first r channels and concatenates the rest.
Interleaved pairs on a release without rotary_mode (chosen once from torch_npu.__version__), on a
build whose first interleave call is refused (TypeError / RuntimeError: the mode is remembered as
unsupported for the process), and shapes outside the limits, take the reference, reported as a
fallback.
"""
import torch

from megatron_adapt import report
from megatron_adapt.backends import reference

from ._lib import PROBES, api, torch_npu

IMPL = "npu.torch_npu.npu_rotary_mul"
FALLBACK = "npu.torch (reference)"
MAX_D, MAX_BN = 896, 1000
PROBE = "rope.interleave"   # in PROBES: True once a call took the mode, or the refusal's reason


def unsupported(t, freqs, interleaved) -> str | None:
    if t.dim() != 4 or freqs.dim() != 4:
        return "t and freqs must be 4-D ([s, b, h, d] and [s, 1, 1, r])"
    r = freqs.size(-1)
    if r > t.size(-1) or r % 2 or r >= MAX_D:
        return f"rotary dim {r} (kernel: even, < {MAX_D}, <= head dim)"
    if tuple(freqs.shape[1:3]) != (1, 1) or freqs.size(0) != t.size(0):
        return f"freqs shape {tuple(freqs.shape)} is not S11D for t {tuple(t.shape)}"
    b, n = t.size(1), t.size(2)
    if interleaved:
        if b * n >= MAX_BN:
            return f"interleaved with B*N={b * n} >= {MAX_BN}"
        if not api().rotary_mode:
            return f"{api().describe()}: npu_rotary_mul has no rotary_mode (Ascend Extension 7.0.0 and later)"
        if isinstance(PROBES.get(PROBE), str):
            return PROBES[PROBE]
    elif b >= MAX_BN or n >= MAX_BN:
        return f"B={b}, N={n} (kernel: each < {MAX_BN})"
    return None


def rope(t, freqs, interleaved=False, mscale=1.0):
    why = unsupported(t, freqs, interleaved)
    if why:
        report.fell_back("rope", FALLBACK, why)
        return reference.rope(t, freqs, interleaved, mscale)
    r = freqs.size(-1)
    t_rot = t if r == t.size(-1) else t[..., :r].contiguous()
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    mul = torch_npu().npu_rotary_mul
    if interleaved:
        if PROBES.get(PROBE) is True:
            out = mul(t_rot, cos, sin, rotary_mode="interleave")
        else:  # the first interleaved call probes the mode; its refusal is not an error for us
            try:
                out = mul(t_rot, cos, sin, rotary_mode="interleave")
            except torch.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError) as exc:
                PROBES[PROBE] = (f"npu_rotary_mul(rotary_mode='interleave') refused by torch_npu "
                                        f"{api().version}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                report.fell_back("rope", FALLBACK, PROBES[PROBE])
                return reference.rope(t, freqs, interleaved, mscale)
            PROBES[PROBE] = True
    else:
        out = mul(t_rot, cos, sin)
    report.ran("rope", IMPL + (".interleave" if interleaved else ""))
    if mscale != 1.0:
        out = out * mscale
    return out if r == t.size(-1) else torch.cat((out, t[..., r:]), dim=-1)


COS_SIN_FALLBACK = ("npu_rotary_mul documents r1 / r2 in [-1, 1], and these cos / sin carry YaRN's "
                    "mscale, unknown here without a device sync")


def rope_cos_sin(t, cos, sin):
    """Multi-latent attention's fused YaRN RoPE: the reference (torch ops on the NPU), reported."""
    report.fell_back("rope_cos_sin", FALLBACK, COS_SIN_FALLBACK)
    return reference.rope_cos_sin(t, cos, sin)

"""RMSNorm through torch_npu.npu_rms_norm; LayerNorm through torch's own F.layer_norm.

npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd): y has x's dtype, rstd is fp32 (1/rms,
used by its backward). gamma must have x's dtype (documented), so a mismatched weight is cast;
autograd casts its gradient back. F.layer_norm dispatches to the NPU's LayerNorm kernel under
torch_npu, exactly what MindSpeed uses when apex is absent (there is no separate torch_npu op).
"""
from megatron_adapt import report
from megatron_adapt.backends import reference

from ._lib import torch_npu


def rms_norm(x, weight, eps):
    report.ran("rms_norm", "npu.torch_npu.npu_rms_norm")
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def layer_norm(x, weight, bias, eps):
    report.ran("layer_norm", "npu.torch.F.layer_norm")
    return reference.layer_norm(x, weight, bias, eps)

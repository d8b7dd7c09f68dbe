"""RMSNorm / LayerNorm: the references (PyTorch's own fused functional ops).

LayerNorm in bf16 / fp16 runs in fp32 and rounds its output to the input dtype: PyTorch's CPU
layer_norm backward sums the weight and bias gradients over the rows in the input dtype (bf16,
16384 rows of 256: cosine 0.991 / 0.987 to an fp64 reference, against 0.999996 in fp32), which
TE and apex accumulate in fp32. RMSNorm's CPU backward accumulates in fp32 already."""
import torch

from megatron_adapt import report
from megatron_adapt.backends import reference

_LOW = (torch.bfloat16, torch.float16)


def rms_norm(x, weight, eps):
    report.ran("rms_norm", "cpu.torch.F.rms_norm")
    return reference.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    if x.dtype not in _LOW:
        report.ran("layer_norm", "cpu.torch.F.layer_norm")
        return reference.layer_norm(x, weight, bias, eps)
    report.ran("layer_norm", "cpu.torch.F.layer_norm(fp32 compute)")
    up = (lambda t: None if t is None else t.float())
    return reference.layer_norm(x.float(), up(weight), up(bias), eps).to(x.dtype)

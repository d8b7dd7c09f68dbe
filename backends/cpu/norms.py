"""RMSNorm / LayerNorm: the references (PyTorch's own fused functional ops)."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def rms_norm(x, weight, eps):
    report.ran("rms_norm", "cpu.torch.F.rms_norm")
    return reference.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    report.ran("layer_norm", "cpu.torch.F.layer_norm")
    return reference.layer_norm(x, weight, bias, eps)

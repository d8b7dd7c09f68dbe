"""Adam/AdamW as torch.optim.Adam/AdamW(fused=True), which torch_npu serves with its fused kernel.

Why not torch_npu.npu_apply_adam_w: it is a per-parameter op (one launch per tensor, step and
bias corrections computed on the host), its signature changed across releases (MindSpeed moved off
it in 2024), and it keeps no optimizer state of its own, so we would re-implement torch.optim's
state handling. torch.optim.AdamW(fused=True) is the path MindSpeed's FusedTorchAdamW takes: torch
lists the PrivateUse1 backend (renamed "npu" by torch_npu) among fused-capable devices and
torch_npu registers _fused_adamw_ / _fused_adam_ for it. The state dict is torch's (exp_avg,
exp_avg_sq, step), so Megatron checkpoints stay interchangeable with every other backend.
"""
import torch

from megatron_adapt import report
from megatron_adapt.backends.reference import make_adam


def Adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
         weight_decay=0.0, amsgrad=False, **kwargs):
    return make_adam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
                     impl_flags={"fused": True}, impl_name="npu.torch.fused", **kwargs)


def SGD(params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kwargs):
    report.ran("sgd", "npu.torch.foreach.SGD")
    return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay, nesterov=nesterov, foreach=True, **kwargs)

"""Adam / SGD with apex FusedAdam's signature, served by torch.optim's multi-tensor (foreach) path."""
import torch

from megatron_adapt import report
from megatron_adapt.backends.reference import make_adam


def Adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
         weight_decay=0.0, amsgrad=False, **kwargs):
    return make_adam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
                     impl_flags={"foreach": True}, impl_name="cpu.torch.foreach", **kwargs)


def SGD(params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kwargs):
    report.ran("sgd", "cpu.torch.foreach.SGD")
    return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay, nesterov=nesterov, foreach=True, **kwargs)

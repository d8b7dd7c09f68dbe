"""Adam / SGD with apex FusedAdam's signature, served by torch.optim's multi-tensor (foreach) path."""
import torch

from megatron_adapt import report


def make_adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
              weight_decay=0.0, amsgrad=False, *, impl_flags, impl_name, capturable=False, **unsupported):
    """apex.optimizers.FusedAdam's constructor, returning the torch optimizer with the same math.

    capturable: Megatron >= 0.17 passes `--optimizer-cuda-graph` here (apex / TE take it too);
    torch.optim's own `capturable` keeps the step count on the device for CUDA-graph capture.
    """
    if unsupported:
        raise TypeError(f"{impl_name} Adam does not support {sorted(unsupported)} "
                        "(precision-aware optimizer options need Transformer Engine's FusedAdam)")
    if not bias_correction:
        raise ValueError("bias_correction=False is not supported by torch.optim Adam/AdamW")
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    report.ran("adam", f"{impl_name}.{cls.__name__}")
    if lr is not None:
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                   capturable=capturable, **impl_flags)
    # lr=None: Megatron's OptimizerConfig default, which apex / TE FusedAdam take (the learning
    # rate comes per param group or from Megatron's scheduler before the first step). torch.optim
    # validates lr at construction: build with a placeholder, then leave None where none was given.
    params = list(params)
    groups_given = bool(params) and isinstance(params[0], dict)
    given = [g.get("lr") for g in params] if groups_given else [None]   # per param group
    opt = cls(params, lr=0.0, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
              capturable=capturable, **impl_flags)
    opt.defaults["lr"] = None
    for group, group_lr in zip(opt.param_groups, given):
        if group_lr is None:
            group["lr"] = None
    return opt


def Adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
         weight_decay=0.0, amsgrad=False, **kwargs):
    return make_adam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
                     impl_flags={"foreach": True}, impl_name="cpu.torch.foreach", **kwargs)


def SGD(params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kwargs):
    report.ran("sgd", "cpu.torch.foreach.SGD")
    return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay, nesterov=nesterov, foreach=True, **kwargs)

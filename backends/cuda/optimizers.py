"""Adam/AdamW through PyTorch's fused CUDA implementation (torch.optim.AdamW(fused=True))."""
from megatron_adapt.backends.cpu.optimizers import make_adam


def Adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
         weight_decay=0.0, amsgrad=False, **kwargs):
    return make_adam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
                     impl_flags={"fused": True}, impl_name="cuda.torch.fused", **kwargs)

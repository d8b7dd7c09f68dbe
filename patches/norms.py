"""LayerNorm / RMSNorm for Megatron's local spec, on the backend's norm ops.

Megatron picks `FusedLayerNorm` (needs apex) or `WrappedTorchNorm`, which refuses
`persist_layer_norm`, sequence parallelism and zero-centred gamma. `AdaptNorm` takes the same
arguments and supports all three: under sequence parallelism its parameters carry
`sequence_parallel=True`, so Megatron all-reduces their gradients across the TP group. Its
state-dict keys (`weight`, `bias`) are torch.nn.LayerNorm's, so checkpoints stay interchangeable.
"""
import torch

from megatron_adapt import report
from megatron_adapt.spec import PatchSpec

NORMS = ("LayerNorm", "RMSNorm")


def build(backend, original):
    rms_norm, layer_norm = backend.op("rms_norm"), backend.op("layer_norm")

    class AdaptNorm(torch.nn.Module):
        __doc__ = __doc__

        def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                    zero_centered_gamma=False, normalization="LayerNorm"):
            if config.normalization not in NORMS:
                report.fell_back("norm", f"megatron.{original.__name__}",
                                 f"normalization={config.normalization!r} has no backend op")
                return original(config, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
            return super().__new__(cls)

        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                     zero_centered_gamma=False, normalization="LayerNorm"):
            super().__init__()
            self.eps = eps
            self.rms = config.normalization == "RMSNorm"
            self.zero_centered_gamma = config.layernorm_zero_centered_gamma or zero_centered_gamma
            init = torch.zeros if self.zero_centered_gamma else torch.ones
            dtype = config.params_dtype  # as TENorm: Megatron may build a bf16 model without Float16Module
            self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
            self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            for p in (self.weight, self.bias):
                if p is not None:
                    p.sequence_parallel = bool(config.sequence_parallel)

        def forward(self, x):
            weight = self.weight + 1 if self.zero_centered_gamma else self.weight
            if self.rms:
                return rms_norm(x, weight, self.eps)
            return layer_norm(x, weight, self.bias, self.eps)

        def extra_repr(self):
            return f"{'RMSNorm' if self.rms else 'LayerNorm'}({self.weight.numel()}, eps={self.eps})"

    AdaptNorm.__qualname__ = AdaptNorm.__name__ = f"Adapt{original.__name__}"
    return AdaptNorm


SPECS = [
    PatchSpec("megatron.core.transformer.torch_norm:WrappedTorchNorm", area="norms", build=build),
    PatchSpec("megatron.core.fusions.fused_layer_norm:FusedLayerNorm", area="norms", build=build),
]

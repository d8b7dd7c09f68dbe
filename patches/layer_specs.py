"""Megatron's default `--transformer-impl transformer_engine`, served without Transformer Engine.

Megatron's TE layer-spec builders (`get_gpt_layer_with_transformer_engine_spec`, the decoder
block, MTP and MoE specs) take their modules from a `TESpecProvider`, and the block spec takes its
final norm from `TENorm`. Without TE, gpt_layer_specs, multi_token_prediction and the experimental
attention specs never bind those names (they import them only when `transformer_engine` imports),
and moe_module_specs imports TE's provider class, whose modules are not there. This area binds
those names to megatron-adapt's provider and norm (creating them where Megatron left them
unbound; where TE's unusable provider class is bound, every Megatron alias of it is rebound).
The `transformer_engine` package is not faked: HAVE_TE stays False, no TE module is imported.

The provider keeps the TE spec's structure and parameter names, so a model built from it has the
state-dict keys of a TE-built one (`linear_qkv.layer_norm_weight`, ...):
- norm fused into the column-parallel linear -> `AdaptLayerNormColumnParallelLinear` (the
  backend's norm op, then Megatron's ColumnParallelLinear);
- linears -> Megatron's ColumnParallelLinear / RowParallelLinear (gradient-accumulation fusion
  through patches/grad_accum_fusion); with config.fp8 set, subclasses that run fp8 GEMMs inside
  Megatron's fp8 context (patches/fp8);
- core attention -> Megatron's DotProductAttention, whose forward patches/attention puts on the
  backend's fused attention op (this is what `--attention-backend auto` gets);
- norms -> the backend norm (patches/norms' replacement of WrappedTorchNorm).
With TE installed every spec here is skipped.
"""
import torch

from megatron_adapt.spec import PatchSpec, SkipPatch

TE_PRESENT = "Transformer Engine is installed: its own spec provider serves"


_built: dict[str, type] = {}  # backend name -> provider class, one per backend for every module


def _require_no_te(original=None):
    """Skip when TE imported (as Megatron decides it: its extension module's HAVE_TE)."""
    from megatron.core.extensions import transformer_engine as te_ext
    if original is not None or getattr(te_ext, "HAVE_TE", False):
        raise SkipPatch(TE_PRESENT)


class BackendNorm:
    """TENorm's constructor, giving the backend norm (whatever WrappedTorchNorm is now)."""

    def __new__(cls, config, hidden_size, eps=1e-5):
        from megatron.core.transformer import torch_norm
        return torch_norm.WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps)


def build_norm_linear_class(backend):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    rms_norm, layer_norm = backend.op("rms_norm"), backend.op("layer_norm")

    class AdaptLayerNormColumnParallelLinear(ColumnParallelLinear):
        """Norm, then ColumnParallelLinear; parameters named as TE's LayerNormColumnParallelLinear.

        Under sequence parallelism the norm runs on the local sequence shard before the linear's
        all-gather, and its parameters carry `sequence_parallel=True` (Megatron all-reduces their
        gradients across the TP group), as TE does.
        """

        def __init__(self, input_size, output_size, *, config, **kwargs):
            if config.normalization not in ("LayerNorm", "RMSNorm"):
                raise ValueError(f"normalization={config.normalization!r}: the backend has "
                                 "LayerNorm and RMSNorm")
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.rms = config.normalization == "RMSNorm"
            self.eps = config.layernorm_epsilon
            self.zero_centered_gamma = config.layernorm_zero_centered_gamma
            init = torch.zeros if self.zero_centered_gamma else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = (None if self.rms else
                                    torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype)))
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:
                    p.sequence_parallel = bool(config.sequence_parallel)

        def forward(self, input_, weight=None, runtime_gather_output=None):
            gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
            normed = (rms_norm(input_, gamma, self.eps) if self.rms
                      else layer_norm(input_, gamma, self.layer_norm_bias, self.eps))
            return super().forward(normed, weight, runtime_gather_output)

    return AdaptLayerNormColumnParallelLinear


def build_provider(backend, original):
    _require_no_te(None)  # moe_module_specs binds TE's provider class even without TE
    if backend.name not in _built:
        _built[backend.name] = _provider_class(backend)
    return _built[backend.name]


def _provider_class(backend):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_adapt.patches.fp8 import fp8_variant

    # Built with config.fp8 set, each linear runs fp8 GEMMs inside Megatron's fp8 context
    # (patches/fp8); otherwise it is Megatron's own class.
    norm_linear = fp8_variant(build_norm_linear_class(backend), backend)
    column, row = fp8_variant(ColumnParallelLinear, backend), fp8_variant(RowParallelLinear, backend)

    class AdaptSpecProvider(LocalSpecProvider):
        """The TE spec's modules on Megatron's local layers and the backend's ops."""

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_linear(self):
            return column

        def row_parallel_linear(self):
            return row

        def column_parallel_layer_norm_linear(self):
            return norm_linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return BackendNorm

        def linear(self):
            return DuplicatedLinearUnavailable

    return AdaptSpecProvider


class DuplicatedLinearUnavailable:
    """What the provider's `linear()` names: TE's TELinear(parallel_mode="duplicated"), a linear
    replicated on every TP rank (MLA's down projections), has no local equivalent here. Naming it
    is allowed, so that specs (and modules listing them, as Megatron's MLA tests do at import) can be
    built; building the layer is a clear error."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "this TE spec needs TE's duplicated (non-parallel) TELinear, which megatron-adapt's "
            "provider has no local equivalent for; use --transformer-impl local")


class BackendResidualNorm:
    """What core_v0.17+'s provider returns for `layer_norm(has_residual=True)` (the norm before a
    residual branch: MLA's input norm, MoE's pre-MLP norm). TE fuses the residual fork into RMSNorm
    only under `fused_residual_rmsnorm` (then its forward returns (out, residual)); otherwise it is
    TENorm, and so is ours."""

    def __new__(cls, config, hidden_size, eps=1e-5):
        if getattr(config, "fused_residual_rmsnorm", False):
            raise NotImplementedError(
                "fused_residual_rmsnorm=True needs Transformer Engine's TEFusedResidualRMSNorm (its "
                "forward returns (output, residual)); megatron-adapt's backend norm does not provide it: "
                "leave fused_residual_rmsnorm off")
        return BackendNorm(config, hidden_size, eps)


def build_provider_with_residual_norms(backend, original):
    """core_v0.17+: BackendSpecProvider.layer_norm takes `has_residual` (and 0.19's GPT and MoE
    specs pass it)."""
    _require_no_te(None)
    key = f"{backend.name}+residual"
    if key not in _built:
        class AdaptSpecProvider(build_provider(backend, original)):
            def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
                return BackendResidualNorm if has_residual else BackendNorm
        _built[key] = AdaptSpecProvider
    return _built[key]


def build_te_norm(backend, original):
    _require_no_te(original)
    return BackendNorm


def _provider_specs(module, optional=False):
    """One spec per release range: the provider's `layer_norm` signature changed in core_v0.17."""
    return [PatchSpec(f"{module}:TESpecProvider", area="layer_specs", build=build_provider,
                      create=True, optional=optional, versions=">=0.15.0,<0.17.0"),
            PatchSpec(f"{module}:TESpecProvider", area="layer_specs", build=build_provider_with_residual_norms,
                      create=True, optional=optional, versions=">=0.17.0,<0.20.0")]


SPECS = [
    *_provider_specs("megatron.core.models.gpt.gpt_layer_specs"),
    PatchSpec("megatron.core.models.gpt.gpt_layer_specs:TENorm", area="layer_specs",
              build=build_te_norm, create=True),
    *_provider_specs("megatron.core.models.gpt.moe_module_specs"),
    *_provider_specs("megatron.core.transformer.multi_token_prediction"),
    *_provider_specs("megatron.core.models.gpt.experimental_attention_variant_module_specs", optional=True),
]

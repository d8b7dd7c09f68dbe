"""Megatron's default `--transformer-impl transformer_engine`, served without Transformer Engine.

Megatron's TE layer-spec builders (`get_gpt_layer_with_transformer_engine_spec`, the decoder
block, MTP and MoE specs) take their modules from a `TESpecProvider`, and the block spec takes its
final norm from `TENorm`. Without TE, gpt_layer_specs, multi_token_prediction and the experimental
attention specs never bind those names (they import them only when `transformer_engine` imports),
and moe_module_specs imports TE's provider class, whose modules are not there. This area binds
those names to megatron-adapt's provider and norm (creating them where Megatron left them
unbound; where TE's unusable provider class is bound, every Megatron alias of it is rebound).
The `transformer_engine` package is not faked: HAVE_TE stays False and no TE module is imported;
the one exception is bert_layer_specs' own HAVE_TE, which guards only its TE spec functions.

Other families' specs (T5, BERT, LLaVA / ViT, heterogeneous layers) name TE's classes as module
globals instead of asking a provider: each such name is bound to the provider's module for it
(TE_NAMES), and TE's gathered norm + linear of heterogeneous blocks to a subclass of the fused one.

The provider keeps the TE spec's structure and parameter names, so a model built from it has the
state-dict keys of a TE-built one (`linear_qkv.layer_norm_weight`, ...):
- norm fused into the column-parallel linear -> `AdaptLayerNormColumnParallelLinear` (the
  backend's norm op, then Megatron's ColumnParallelLinear);
- linears -> Megatron's ColumnParallelLinear / RowParallelLinear (gradient-accumulation fusion
  through patches/grad_accum_fusion), with TE's RNG rule at weight initialization and its
  sharded-state metadata default (`te_linear`); with config.fp8 set, subclasses that run fp8 GEMMs
  inside Megatron's fp8 context (patches/fp8);
- core attention -> Megatron's DotProductAttention taking TEDotProductAttention's k_channels /
  v_channels (multi-latent attention), whose forward patches/attention puts on the backend's fused
  attention op (this is what `--attention-backend auto` gets);
- TE's duplicated TELinear (MLA's down projections) -> AdaptDuplicatedLinear, also bound as
  multi_latent_attention's TELinear (and by patches/moe as moe_layer's, for the latent projections);
- norms -> the backend norm (patches/norms' replacement of WrappedTorchNorm), also as CLIP-ViT's
  default ln_pre / ln_post norm and as NVIDIA ModelOpt's post-training `Norm`.
With TE installed every spec here is skipped.
"""
import torch

from megatron_adapt.spec import WRAP, PatchSpec, SkipPatch

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

    from megatron_adapt.patches.delayed_wgrad import delayed_wgrad_variant
    from megatron_adapt.patches.fp8 import fp8_variant

    # Built with config.fp8 set, each linear runs fp8 GEMMs inside Megatron's fp8 context
    # (patches/fp8); with config.delay_wgrad_compute, it leaves its weight-gradient GEMM to
    # backward_dw() (patches/delayed_wgrad); otherwise it is Megatron's own class.
    def variant(base):
        base = te_linear(base)
        return delayed_wgrad_variant(base, outer=fp8_variant(base, backend))

    norm_linear = variant(build_norm_linear_class(backend))
    column, row = variant(ColumnParallelLinear), variant(RowParallelLinear)

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
            return duplicated_linear_class(backend)

        def core_attention(self):
            return core_attention_class()

        def grouped_mlp_modules(self, *args, **kwargs):
            """Megatron's (patches/moe's on core_v0.17+ for grouped GEMM); SequentialMLP's experts on
            Megatron's local linears get their delayed-wgrad variants, as TE's spec gives them TE
            linears (built without config.delay_wgrad_compute they are Megatron's classes)."""
            return _sequential_experts_delayed(super().grouped_mlp_modules(*args, **kwargs))

    return AdaptSpecProvider


_te_linear_classes: dict[type, type] = {}


def _no_fork(*args, **kwargs):
    import contextlib

    return contextlib.nullcontext()


def te_linear(base):
    """`base` (a Megatron linear class) behaving as TE's linears do where Megatron's own differ.

    - Weights initialized on the device: Megatron's `_initialize_affine_weight_gpu` always forks
      the model-parallel RNG tracker, which raises when the tracker has no states. TE's linears are
      handed the tracker only if it was initialized when they were built, and otherwise draw from
      the default generator; a model built from the TE spec before `model_parallel_cuda_manual_seed`
      (MIMO's 1F1B test on core_v0.19) builds under TE, so it builds here too.
    - Sharded state dicts: TE's linears fill a missing `dp_cp_group` in the metadata
      (`ensure_metadata_has_dp_cp_group`, core_v0.16+); Megatron's read it and raise KeyError
      (dist_checkpointing's test_mlp_glu passes metadata without it on core_v0.16.1).
    With an initialized tracker and complete metadata nothing changes."""
    if base in _te_linear_classes:
        return _te_linear_classes[base]
    from megatron.core.transformer import utils as transformer_utils

    ensure_dp_cp_group = getattr(transformer_utils, "ensure_metadata_has_dp_cp_group", None)

    def __init__(self, *args, **kwargs):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        if tracker.is_initialized():
            base.__init__(self, *args, **kwargs)
            return
        tracker.fork = _no_fork    # an instance attribute, over the class's method, for this build only
        try:
            base.__init__(self, *args, **kwargs)
        finally:
            del tracker.fork

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return base.sharded_state_dict(self, prefix, sharded_offsets, ensure_dp_cp_group(metadata))

    namespace = {"__init__": __init__, "__doc__": base.__doc__, "__module__": __name__,
                 "__qualname__": base.__qualname__}
    if ensure_dp_cp_group is not None:
        namespace["sharded_state_dict"] = sharded_state_dict
    cls = type(base.__name__, (base,), namespace)
    _te_linear_classes[base] = cls
    return cls


def _sequential_experts_delayed(spec):
    """(SequentialMLP, MLPSubmodules) on 0.16, partial(SequentialMLP, submodules=...) from 0.17:
    the local column / row linears replaced by their delayed-wgrad variants; anything else as is."""
    import dataclasses
    from functools import partial

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_adapt.patches.delayed_wgrad import delayed_wgrad_variant

    def delayed(sub):
        if sub is None or (sub.linear_fc1, sub.linear_fc2) != (ColumnParallelLinear, RowParallelLinear):
            return sub
        return dataclasses.replace(sub, linear_fc1=delayed_wgrad_variant(ColumnParallelLinear),
                                   linear_fc2=delayed_wgrad_variant(RowParallelLinear))

    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] is SequentialMLP:
        return SequentialMLP, delayed(spec[1])
    if isinstance(spec, partial) and spec.func is SequentialMLP and "submodules" in spec.keywords:
        return partial(SequentialMLP, *spec.args, **{**spec.keywords, "submodules": delayed(spec.keywords["submodules"])})
    return spec


_classes: dict[str, type] = {}   # backend-independent modules, built once Megatron is importable


def duplicated_linear_class(backend):
    """TE's TELinear as the TE spec uses it (`parallel_mode="duplicated"`: MLA's q / kv down
    projections, MoE's latent projections), built on Megatron's own linear autograd function;
    built with config.fp8 set, it runs the backend's fp8 GEMM inside fp8 contexts as TE's does
    (patches/fp8's variant; the same class object for every caller, so MLA's `in [TELinear]` holds)."""
    from megatron_adapt.patches.fp8 import fp8_variant

    if "duplicated_linear" not in _classes:
        _classes["duplicated_linear"] = _build_duplicated_linear()
    return fp8_variant(_classes["duplicated_linear"], backend)


def _build_duplicated_linear():
    import contextlib

    from megatron.core.tensor_parallel import layers, random
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from megatron_adapt.patches.delayed_wgrad import (DelayedWgradLinear, DelayedWgradLinearMixin, delayed,
                                                      refuse_with_fp8)

    class AdaptDuplicatedLinear(DelayedWgradLinearMixin, torch.nn.Module):
        """A linear replicated on every tensor-parallel rank: TELinear's constructor arguments,
        its parameter names (`weight` [out, in], `bias`) and checkpoint layout (replicated, with an
        empty `_extra_state`).

        As TE does for this mode: the weight is initialised under Megatron's data-parallel RNG
        tracker (the same values on every TP rank), its parameters carry `allreduce=True`,
        `tensor_model_parallel=False` and `sequence_parallel=config.sequence_parallel` (under
        sequence parallelism each TP rank sees its own tokens, so Megatron all-reduces their
        gradients over the TP group), and the matmul is Megatron's
        `linear_with_grad_accumulation_and_async_allreduce` with no communication, so
        gradient-accumulation fusion works as in the parallel linears. Only "duplicated" exists:
        the spec's column / row modes are served by the parallel linears.
        """

        def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias,
                     skip_bias_add, skip_weight_param_allocation, tp_comm_buffer_name=None,
                     is_expert=False, symmetric_ar_type=None, tp_group=None, name=None,
                     gtp_remat_group=None):
            super().__init__()
            if parallel_mode != "duplicated":
                raise NotImplementedError(
                    f"TELinear(parallel_mode={parallel_mode!r}): megatron-adapt serves TE's plain "
                    "linear only as the TE spec uses it, duplicated on every tensor-parallel rank; "
                    "column / row parallel linears come from the spec's column_parallel_linear / "
                    "row_parallel_linear")
            if is_expert or skip_weight_param_allocation or tp_group is not None:
                raise ValueError("a duplicated linear is neither an expert layer nor split over a "
                                 "TP group, and allocates its own weight (as TE's TELinear)")
            self.config = config
            self.input_size, self.output_size = input_size, output_size
            self.skip_bias_add = skip_bias_add
            self.parallel_mode = None   # TE's attribute for the duplicated mode
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.weight = torch.nn.Parameter(
                torch.empty(output_size, input_size, device=device, dtype=config.params_dtype))
            self.bias = (torch.nn.Parameter(torch.zeros(output_size, device=device,
                                                        dtype=config.params_dtype))
                         if bias else None)
            if config.perform_initialization:
                tracker = random.get_cuda_rng_tracker()
                name_ = random.get_data_parallel_rng_tracker_name()
                fork = (tracker.fork(name_) if tracker.is_initialized() and name_ in tracker.get_states()
                        else contextlib.nullcontext())
                with fork:
                    init_method(self.weight)
            for p in self.parameters():
                p.allreduce = True
                p.sequence_parallel = bool(config.sequence_parallel)
                p.tensor_model_parallel = False
            if delayed(config):  # the weight gradient in backward_dw() (patches/delayed_wgrad)
                refuse_with_fp8(config, "duplicated linear")
                self._init_delayed_wgrad()

        def forward(self, x):
            bias = None if self.skip_bias_add else self.bias
            if self.delay_wgrad_compute and self.weight.requires_grad:
                fuse = self.config.gradient_accumulation_fusion and hasattr(self.weight, "main_grad")
                out = DelayedWgradLinear.apply(x, self.weight, bias, self, fuse, False, False, None)
                return out, (self.bias if self.skip_bias_add else None)
            out = self._forward_impl(x, self.weight, bias=bias,
                                     gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
                                     allreduce_dgrad=False, sequence_parallel=False)
            return out, (self.bias if self.skip_bias_add else None)

        def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (Megatron's names)
            """The matmul, under the name Megatron's parallel linears give it, which the fp8
            variant overrides (patches/fp8)."""
            return layers.linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """Replicated across TP and DP, as TE's TELinear in duplicated mode."""
            state_dict = self.state_dict(prefix="", keep_vars=True)
            dp_cp = (metadata or {}).get("dp_cp_group")
            groups = {} if dp_cp is None else {"dp_cp_group": dp_cp, "tp_group": _tp_group()}
            return make_sharded_tensors_for_checkpoint(state_dict, prefix, None, sharded_offsets,
                                                       **groups)

        def set_extra_state(self, state):
            """TE keeps fp8 metadata here; there is none (as Megatron's parallel linears)."""

        def get_extra_state(self):
            return None

    return AdaptDuplicatedLinear


def _tp_group():
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_group()


def core_attention_class():
    """TEDotProductAttention's constructor on Megatron's DotProductAttention (whose forward
    patches/attention puts on the backend's attention op)."""
    if "core_attention" not in _classes:
        _classes["core_attention"] = _build_core_attention()
    return _classes["core_attention"]


def _build_core_attention():
    import math

    from megatron_adapt.patches import context_parallel

    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class AdaptDotProductAttention(DotProductAttention):
        """Megatron's DotProductAttention taking TEDotProductAttention's arguments: `k_channels`
        (the query / key head dim) and `v_channels` (the value head dim) may differ from
        `config.kv_channels` and from each other, as multi-latent attention asks (q/k head dim
        qk_head_dim + qk_pos_emb_head_dim, v head dim v_head_dim). The output is
        [sq, b, heads_per_partition * v_channels]. `num_splits` (flash-attention's split-KV count
        for decoding) only changes how a kernel partitions its work, not the result.

        With --context-parallel-size > 1 it takes the CP group and --cp-comm-type as
        TEDotProductAttention does and runs patches/context_parallel's forward (the backend's
        attention_cp op); Megatron's parent is built with CP 1, its TE-only assertion."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                     num_splits=None, cp_comm_type=None, pg_collection=None):
            cp = context_parallel.served(config)
            super().__init__(context_parallel.construction_config(config) if cp else config, layer_number,
                             attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.adapt_cp = None
            # TEDotProductAttention gives TE the model-parallel RNG tracker for attention dropout
            # only if the tracker was initialized when it was built; patches/attention follows that
            self.adapt_dropout_fork = tensor_parallel.get_cuda_rng_tracker().is_initialized()
            if cp:
                self.config = config
                context_parallel.setup(self, config, cp_comm_type, pg_collection)
            k = k_channels if k_channels is not None else config.kv_channels
            v = v_channels if v_channels is not None else config.kv_channels
            self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = k, v
            if k != config.kv_channels:
                self.hidden_size_per_attention_head = k
                if softmax_scale is None:   # as the parent: 1/sqrt(head dim), then layer scaling
                    self.softmax_scale = 1.0 / math.sqrt(k)
                    if config.apply_query_key_layer_scaling:
                        self.softmax_scale /= max(1, layer_number)
            self.hidden_size_per_partition = v * self.num_attention_heads_per_partition

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if self.adapt_cp is not None:
                return context_parallel.forward(self, query, key, value, attention_mask, attn_mask_type,
                                                attention_bias, packed_seq_params)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)

    return AdaptDotProductAttention


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


def build_clip_vit_init(backend, original):
    """CLIPViTModel's `ln_pre_impl` / `ln_post_impl` default to clip_vit_model's NORM_IMPL, read
    when the module is imported: TENorm with TE, else torch.nn.LayerNorm, which build_module calls
    with TENorm's arguments (`config=`: a TypeError). The same __init__ (same code and closure)
    whose default is the backend norm, with TENorm's constructor. The module global keeps
    torch.nn.LayerNorm: replacing it would rebind torch's class wherever Megatron holds it."""
    import types

    _require_no_te(None)
    defaults = original.__defaults__ or ()
    if not any(d is torch.nn.LayerNorm for d in defaults):
        raise SkipPatch("CLIPViTModel's norm defaults are not torch.nn.LayerNorm here")
    new = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                             tuple(BackendNorm if d is torch.nn.LayerNorm else d for d in defaults),
                             original.__closure__)
    new.__kwdefaults__ = original.__kwdefaults__
    for attr in ("__qualname__", "__module__", "__doc__", "__annotations__"):
        setattr(new, attr, getattr(original, attr))
    new.__dict__.update(original.__dict__)
    return new


def build_mla_te_linear(backend, original):
    """TE's TELinear in duplicated mode (also MoELayer's latent projections, patches/moe).
    multi_latent_attention asks `linear_q_down_proj in [TELinear]` to pass
    parallel_mode="duplicated" (and no TP group). Without TE its TELinear is None (core_v0.17+),
    so the provider's duplicated linear would be refused as "Unsupported linear_q_down_proj", or
    (0.15-0.16, whose extension module subclasses a MagicMock standing in for TE) a MagicMock,
    which MLA's `isinstance(linear_proj, TELinear)` rejects with a TypeError; there every alias of
    that stand-in is rebound too, so calling "TELinear" builds a real module or refuses clearly."""
    _require_no_te(None)
    return duplicated_linear_class(backend)


# The TE class names BERT's and T5's spec modules hold as module globals (None without TE), and what
# the provider gives in their place: the same modules the GPT TE spec gets.
TE_NAMES = {
    "TEDotProductAttention": lambda provider: provider.core_attention(),
    "TELayerNormColumnParallelLinear": lambda provider: provider.column_parallel_layer_norm_linear(),
    "TEColumnParallelLinear": lambda provider: provider.column_parallel_linear(),
    "TERowParallelLinear": lambda provider: provider.row_parallel_linear(),
    "TENorm": lambda provider: provider.layer_norm(),
}


def build_te_name(name):
    """Build for one TE name a spec module holds: the provider's module for it (the same classes on
    every module, so checkpoints and parameter names match the GPT TE spec's)."""
    def build(backend, original):
        _require_no_te(None)   # as Megatron decides it; the original may be None, absent or a stand-in
        return TE_NAMES[name](build_provider(backend, None)())
    build.__name__ = f"build_{name}"
    return build


def build_gathered_norm_linear(backend, original):
    """TELayerNormColumnParallelLinearGathered, the heterogeneous spec's `replace_with_linear`
    attention / MLP: hidden -> hidden through the provider's fused norm + column-parallel linear,
    its tensor-parallel output gathered (reduce-scattered under sequence parallelism) by Megatron's
    own helper, as TE's class does."""
    _require_no_te(None)
    key = f"{backend.name}+gathered"
    if key not in _built:
        from megatron.core.transformer.heterogeneous import linear_replacements

        class AdaptLayerNormColumnParallelLinearGathered(te_linear(build_norm_linear_class(backend))):
            def __init__(self, config, tp_comm_buffer_name=None, *args, **kwargs):
                if getattr(config, "fp8", None):
                    from megatron_adapt.errors import UnsupportedFeatureError
                    raise UnsupportedFeatureError(
                        f"fp8={config.fp8!r} with a heterogeneous block replaced by a linear "
                        f"(replace_with_linear): the {backend.name} backend runs that gathered linear "
                        "in fp8 nowhere; use fp8 without replace_with_linear blocks")
                super().__init__(config.hidden_size, config.hidden_size, config=config,
                                 init_method=config.init_method, gather_output=False,
                                 bias=config.add_bias_linear, skip_bias_add=False, is_expert=False,
                                 tp_comm_buffer_name=tp_comm_buffer_name)

            def forward(self, x, **kwargs):
                out, bias = super().forward(x)
                return linear_replacements._gather_from_tensor_parallel_region(out, self.config), bias

        _built[key] = AdaptLayerNormColumnParallelLinearGathered
    return _built[key]


def build_have_te(backend, original):
    """bert_layer_specs' TE spec functions raise ImportError unless its HAVE_TE is true; every TE
    name they read is bound to the provider's module (TE_NAMES), so they may run."""
    _require_no_te(None)
    return True


def build_t5_masks(backend, original):
    """T5's get_batch shapes its masks by the TE version (`config_attention_mask`). Without TE the
    version reads 0.0.0, and the default --attention-backend auto (NVTE_FLASH_ATTN=1) then trips
    its assertion "Flash and fused attention is not supported with transformer engine version <
    1.7". The served TE spec takes TE 1.10's layout (patches/attention: [b, 1, 1, s] padding masks,
    a causal decoder, a (query, key) padding pair for cross attention): asked for the TE spec's
    masks (use_local false) with no test version, it gets them for TE 1.10."""
    import inspect

    _require_no_te(None)
    signature = inspect.signature(getattr(original, "__func__", original))   # a staticmethod: its function

    def te_layout(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        if not bound.arguments.get("use_local") and bound.arguments.get("test_te_version") is None:
            bound.arguments["test_te_version"] = "1.10.0"
        return wrapped(*bound.args, **bound.kwargs)
    return te_layout


def _is_class(t) -> bool:
    return isinstance(t, type) and not t.__module__.startswith("unittest.mock")


def build_activation_types(backend, original):
    """megatron.training.activation_logging (core_v0.19) hooks every module whose type is in
    LINEAR_TYPES, which appends the TE classes its import finds. Without TE those names are
    Megatron's MagicMock stand-ins (TENorm a MagicMock instance): isinstance raises TypeError as soon
    as activation logging starts. Keep the real classes and add the ones megatron-adapt builds under
    those TE names (TE_NAMES), which a model from the TE spec is made of."""
    _require_no_te(None)
    provider = build_provider(backend, None)()
    served = tuple(TE_NAMES[n](provider) for n in TE_NAMES if n != "TEDotProductAttention")
    kept = tuple(t for t in original if _is_class(t))
    return kept + tuple(t for t in served if _is_class(t) and t not in kept)


def build_grouped_activation_types(backend, original):
    """Its tokens-per-expert capture hooks TE's grouped linears (_GROUPED_LINEAR_TYPES, empty without
    TE): the backend's grouped linears, which TE's spec names build here (patches/moe)."""
    _require_no_te(None)
    from megatron_adapt.patches.moe import grouped_linear_classes

    return tuple(t for t in original if _is_class(t)) + tuple(grouped_linear_classes(backend))


MODELOPT = "megatron.core.post_training.modelopt"


def build_modelopt_linear(backend, original):
    """multi_latent_attention's `Linear`: ModelOpt's own `Linear` (layers.py, a torch.nn.Linear with
    TE's constructor arguments), which it binds only when TE imports."""
    _require_no_te(None)
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


def _te_name_specs(module, names, optional=False, versions=None):
    """create: core 0.15 leaves the names undefined without TE (later releases set them to None).
    optional: the module is not in every release; versions: the releases that have it."""
    extra = {"versions": versions} if versions else {}
    return [PatchSpec(f"{module}:{name}", area="layer_specs", build=build_te_name(name), create=True,
                      optional=optional, **extra)
            for name in names]


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
    PatchSpec("megatron.core.transformer.multi_latent_attention:TELinear", area="layer_specs",
              build=build_mla_te_linear),
    # MLA (and core 0.19's absorbed MLA) take a down / up projection only if it is one of their
    # module's TE names (else "Unsupported linear_qkv_down_proj"): the provider's linears, which the
    # TE specs and the hybrid spec give them.
    *_te_name_specs("megatron.core.transformer.multi_latent_attention",
                    ("TEColumnParallelLinear", "TELayerNormColumnParallelLinear")),
    # core 0.19's --mla-down-proj-fusion: HybridStack._fuse_mla_down_proj gives FusedMLASelfAttention its
    # module's TELayerNormColumnParallelLinear as the fused norm + q/kv down projection.
    *_te_name_specs("megatron.core.models.hybrid.hybrid_block", ("TELayerNormColumnParallelLinear",),
                    optional=True, versions=">=0.19.0,<0.20.0"),
    # absorbed_mla is in core 0.17 on (0.16's package has only dsa.py: its spec would wait forever)
    PatchSpec("megatron.core.transformer.experimental_attention_variant.absorbed_mla:TELinear",
              area="layer_specs", build=build_mla_te_linear, create=True, optional=True,
              versions=">=0.17.0,<0.20.0"),
    *_te_name_specs("megatron.core.transformer.experimental_attention_variant.absorbed_mla",
                    ("TEColumnParallelLinear",), optional=True, versions=">=0.17.0,<0.20.0"),
    # qk_layernorm with a spec that names no q / k norm takes the attention module's TENorm (core
    # 0.19: "qk_layernorm requires Transformer Engine (for TENorm)"): the provider's norm.
    *_te_name_specs("megatron.core.transformer.attention", ("TENorm",)),
    PatchSpec("megatron.core.models.vision.clip_vit_model:CLIPViTModel.__init__", area="layer_specs",
              build=build_clip_vit_init),
    # T5 (t5_spec): TE's linears, attention and TENorm as module globals, in the TE block specs and
    # as every block spec's final norm (the local ones too).
    *_te_name_specs("megatron.core.models.T5.t5_spec", TE_NAMES),
    # BERT (bert_layer_specs): the TE layer spec, which pretrain_bert.py reads at import.
    *_te_name_specs("megatron.core.models.bert.bert_layer_specs",
                    ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear")),
    # LLaVA's language model and the CLIP ViT (pretrain_vlm.py): the same TE names, which core 0.16
    # holds as its extension's MagicMock stand-ins without TE.
    *_te_name_specs("megatron.core.models.multimodal.llava_spec",
                    ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear", "TENorm")),
    *_te_name_specs("megatron.core.models.vision.vit_layer_specs",
                    ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear")),
    # Heterogeneous layers (--heterogeneous-layers-config-path, Nemotron-NAS style): the same names,
    # and TE's gathered norm + linear for the blocks replaced by a linear.
    *_te_name_specs("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs", TE_NAMES),
    PatchSpec("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs:"
              "TELayerNormColumnParallelLinearGathered", area="layer_specs", build=build_gathered_norm_linear,
              create=True),
    PatchSpec("megatron.core.datasets.t5_dataset:T5MaskedWordPieceDataset.config_attention_mask",
              area="layer_specs", mode=WRAP, build=build_t5_masks),
    PatchSpec("megatron.core.models.bert.bert_layer_specs:HAVE_TE", area="layer_specs", build=build_have_te,
              check_signature=False),
    # Flextron's router (core_v0.19, megatron.elastification, Megatron-LM only) imports TE's linears and
    # sets HAVE_TE from that import alone: without TE it built the MagicMock stand-ins.
    *_te_name_specs("megatron.elastification.router.hybrid_flex_router",
                    ("TEColumnParallelLinear", "TERowParallelLinear"), optional=True, versions=">=0.19.0,<0.20.0"),
    # NVIDIA ModelOpt's post-training specs (quantization, distillation, MTP fine-tuning): its Norm
    # builds TE's LayerNorm / RMSNorm only ("Transformer-Engine is not installed" without TE), and
    # its GPT / Mamba / hybrid specs name TE's attention (and the hybrid one TENorm) as module globals.
    # (TE's norms keep an `_extra_state` that ModelOpt's hooks drop; the backend norm has none)
    PatchSpec(f"{MODELOPT}.layers:Norm", area="layer_specs", build=build_te_name("TENorm")),
    # ModelOpt's MLA spec gives the down projections its own plain Linear (no TE in it), which MLA
    # accepts only as its module's `Linear`, imported there only where TE imports
    PatchSpec("megatron.core.transformer.multi_latent_attention:Linear", area="layer_specs",
              build=build_modelopt_linear, create=True, check_signature=False),
    *_te_name_specs(f"{MODELOPT}.gpt.model_specs", ("TEDotProductAttention",)),
    *_te_name_specs(f"{MODELOPT}.mamba.model_specs", ("TEDotProductAttention",), versions=">=0.15.0,<0.18.0"),
    *_te_name_specs(f"{MODELOPT}.hybrid.model_specs", ("TEDotProductAttention", "TENorm"),
                    versions=">=0.18.0,<0.20.0"),
    # Activation logging (core_v0.19, megatron.training): the module types it hooks.
    PatchSpec("megatron.training.activation_logging:LINEAR_TYPES", area="layer_specs",
              build=build_activation_types, check_signature=False, optional=True, versions=">=0.19.0,<0.20.0"),
    PatchSpec("megatron.training.activation_logging:_GROUPED_LINEAR_TYPES", area="layer_specs",
              build=build_grouped_activation_types, check_signature=False, optional=True,
              versions=">=0.19.0,<0.20.0"),
]

"""Megatron's fp8 training (`--fp8-format`, `TransformerConfig(fp8=...)`) without Transformer Engine.

Without TE, Megatron's `get_fp8_context` returns `nullcontext()`: `--fp8-format hybrid` would train
in bf16 and say nothing. This area makes that impossible:

* Refusal at start: a check registered with megatron_adapt.start_checks (run by the start_checks
  area from Megatron-LM's `set_global_variables`, right after its arguments are parsed and
  validated, and from `TransformerConfig.__post_init__` for megatron-core users) checks the fp8 /
  fp4 settings against the backend: a backend whose `fp8_unavailable` op gives a reason (cpu, npu,
  a CUDA GPU before sm89) refuses `--fp8-format` naming the flag, the backend and that reason;
  `--fp4-format` is refused on every backend; so are the fp8 features no linear here serves
  (`--fp8-recipe mxfp8|custom`, blockwise off Hopper, `--fp8-param-gather`, fp8 attention, MoE experts
  other than the grouped ones (`--moe-grouped-gemm`),
  `--transformer-impl local` and `--fp8-interval N` under CUDA graphs.
* The context. `megatron.core.fp8_utils:get_fp8_context` is replaced: Megatron's own callers
  (the transformer block per layer, or once around the block for `delayed`) keep deciding where
  fp8 applies, including `--first-last-layers-bf16` through Megatron's `is_first_last_bf16_layer`;
  the context they enter turns fp8 on for megatron-adapt's linears.
* The linears. The TE layer spec's column-parallel, row-parallel and norm + column-parallel
  linears (patches/layer_specs) are built, when `config.fp8` is set, as subclasses whose
  `_forward_impl` runs the backend's `fp8_linear` op inside an fp8 context: tensor-parallel
  communication through Megatron's own mappings (sequence-parallel all-gather / reduce-scatter,
  dgrad all-reduce), gradient-accumulation fusion into `main_grad` with Megatron's
  `grad_added_to_main_grad` protocol. Delayed-scaling state (amax histories, scales) is kept per
  linear and saved in its `_extra_state`, as TE's modules keep theirs; each update all-reduces the
  amaxes over the group Megatron's context names (`get_amax_reduction_group`, TE's fp8_group), as
  TE's reduce_amax does, so the ranks of a layer agree on its scales. With `config.fp8` unset the
  provider builds Megatron's own classes, unchanged but for a load hook that says once that an fp8
  checkpoint's scaling state is ignored; an fp8 linear loading a checkpoint saved without fp8 says
  once that it starts with fresh scaling state.
* MoE experts (`--moe-grouped-gemm`): Megatron's TEGroupedMLP on megatron-adapt's grouped linears
  (patches/moe), which run the backend's `fp8_grouped_gemm` inside the fp8 context. Megatron asks TE
  for three things there, served in `megatron.core.transformer.moe.experts` and
  `transformer_config` (skipped with TE installed): HAVE_TE, Fp8Padding / Fp8Unpadding (each
  expert's rows padded to 16), and TE >= 1.7 / 1.11 in the config's MoE fp8 version checks.
* Recompute. Megatron recomputes fp8 code (`--recompute-granularity full`, `--recompute-modules
  mlp | moe | shared_experts`, MTP) through TE's `te_checkpoint`, which is served (te_checkpoint
  below): Megatron's own checkpoint function, with the recompute inside the fp8 context the forward
  ran in, and, for delayed scaling, casting with the scales the forward used, recording no amax and
  making no forward update (TE's rule), so the scaling state advances once per step as without
  recompute.
* CUDA graphs. Megatron's local CUDA graphs (`--cuda-graph-impl local`) ask Transformer Engine's
  FP8GlobalStateManager, save_fp8_tensors and restore_fp8_tensors about fp8; without TE those names
  are absent. They are served in `megatron.core.transformer.cuda_graphs` (created, removed by
  revert): the recipe is the innermost fp8 context's, the delayed-scaling state of every fp8 linear
  in a layer is saved before Megatron's warm-up runs and restored after the capture, and the
  capture runs inside the layer's fp8 context. The fp8 linears' work is all on the GPU (cast,
  amax, scale, delayed update), so a replay repeats it.
"""
from __future__ import annotations

import contextlib
import io
import logging

import torch

from megatron_adapt import report, start_checks
from megatron_adapt.errors import UnsupportedFeatureError
from megatron_adapt.patches.package_versions import serve_te_version
from megatron_adapt.spec import WRAP, PatchSpec, ServesPlainInstances, SkipPatch

RECIPES_SERVED = ("tensorwise", "delayed", "blockwise")
_NOT_SERVED = {"mxfp8": "mxfp8 needs the MX block-scaled GEMMs of sm100 (Blackwell)",
               "custom": "a custom recipe is a Transformer Engine quantizer factory"}
_FIX = "Train without it (--bf16), or on the cuda backend on an sm89+ (Ada, Hopper) GPU."


def _value(v):
    return getattr(v, "value", v)


def fp8_refusal(backend, settings: dict) -> str | None:
    """Why these fp8 / fp4 settings cannot run on `backend`, or None. `settings` uses Megatron's
    argument names (its parsed arguments' namespace): fp8, fp8_recipe, fp8_param_gather, fp4, num_experts,
    transformer_impl, fp8_dot_product_attention, fp8_multi_head_attention."""
    where = f"the {backend.name} backend"
    fp4 = settings.get("fp4")
    if fp4:
        return (f"--fp4-format {fp4}: {where} cannot run it: megatron-adapt serves no fp4 (NVFP4) "
                f"GEMM on any backend (Megatron's fp4 is Transformer Engine's). Train without --fp4-format.")
    fp8 = settings.get("fp8")
    if not fp8:
        return None
    flag = f"--fp8-format {fp8}"
    recipe = _value(settings.get("fp8_recipe") or "delayed")
    why = backend.op("fp8_unavailable")()
    if why is not None:
        return f"{flag}: {where} cannot run it: {why}. {_FIX}"
    if recipe not in RECIPES_SERVED:
        return (f"{flag} --fp8-recipe {recipe}: {where} serves the tensorwise, delayed and blockwise "
                f"recipes only ({_NOT_SERVED.get(recipe, 'not a recipe megatron-adapt knows')}). "
                f"Use --fp8-recipe tensorwise, delayed or blockwise.")
    if recipe == "blockwise":
        why = backend.op("fp8_unavailable")(recipe)
        if why is not None:
            return (f"{flag} --fp8-recipe blockwise: {where} cannot run it: {why}. "
                    f"Use --fp8-recipe tensorwise or delayed.")
    if settings.get("fp8_param_gather"):
        return (f"{flag} --fp8-param-gather: {where} keeps parameters in bf16 and casts them to fp8 "
                f"per GEMM; fp8 parameters and their all-gather are Transformer Engine's. "
                f"Drop --fp8-param-gather.")
    for key, name in (("fp8_dot_product_attention", "--fp8-dot-product-attention"),
                      ("fp8_multi_head_attention", "--fp8-multi-head-attention")):
        if settings.get(key):
            return f"{flag} {name}: {where} runs attention in bf16/fp16 (fp8 attention is TE's). Drop {name}."
    if settings.get("num_experts"):
        why = _experts_refusal(backend, settings)
        if why is not None:
            return f"{flag} --num-experts {settings['num_experts']}: {why}"
    graphs = settings.get("cuda_graph_impl") == "local" or settings.get("enable_cuda_graph")
    if graphs and recipe == "delayed" and int(settings.get("fp8_interval") or 1) > 1:
        return (f"{flag} --fp8-recipe delayed --fp8-interval {settings['fp8_interval']} "
                f"--cuda-graph-impl local: a captured layer replays the same scale update every step; "
                f"recomputing the scale only every N-th step is a host-side count a CUDA graph cannot "
                f"keep. Drop --fp8-interval (deprecated in Megatron) or the graphs.")
    if settings.get("transformer_impl") == "local":
        return (f"{flag} --transformer-impl local: megatron-adapt serves fp8 in the linears of the "
                f"transformer_engine layer spec (Megatron's default); the local spec's linears would "
                f"run in bf16. Use --transformer-impl transformer_engine.")
    return None


def _experts_refusal(backend, settings: dict) -> str | None:
    """The MoE experts in fp8 run as TEGroupedMLP on megatron-adapt's grouped linears (the backend's
    fp8_grouped_gemm); every other experts set-up would run them in bf16."""
    where = f"the {backend.name} backend"
    if "fp8_grouped_gemm" not in backend.ops:
        return f"{where} has no fp8 grouped GEMM for the experts. Train the MoE model without --fp8-format."
    if not settings.get("moe_grouped_gemm"):
        return (f"{where} runs fp8 experts as one grouped GEMM per linear; without --moe-grouped-gemm "
                f"Megatron builds SequentialMLP, whose experts are not served in fp8. Add --moe-grouped-gemm.")
    if settings.get("moe_use_legacy_grouped_gemm"):
        return ("--moe-use-legacy-grouped-gemm builds Megatron's legacy GroupedMLP, which has no fp8 "
                "path (it would run bf16). Drop --moe-use-legacy-grouped-gemm.")
    if settings.get("delay_wgrad_compute"):
        return (f"--delay-wgrad-compute: {where}'s fp8 expert GEMMs compute their weight gradients "
                f"in the backward pass. Drop --delay-wgrad-compute.")
    if settings.get("use_transformer_engine_op_fuser"):
        return "--use-transformer-engine-op-fuser is Transformer Engine's fused grouped MLP. Drop it."
    return None


# ---------------------------------------------------------------- refusal at start
def _args_check(backend, settings: dict) -> str | None:
    why = fp8_refusal(backend, settings)
    if why is None and settings.get("fp8"):
        report.ran("fp8.flags", f"{backend.name}: --fp8-format {settings['fp8']} --fp8-recipe "
                                f"{_value(settings.get('fp8_recipe'))} served by fp8_linear")
    return why


def _config_check(backend, c) -> str | None:
    settings = {"fp8": getattr(c, "fp8", None), "fp8_recipe": getattr(c, "fp8_recipe", None),
                "fp8_param_gather": getattr(c, "fp8_param", False), "fp4": getattr(c, "fp4", None),
                "fp8_dot_product_attention": getattr(c, "fp8_dot_product_attention", False),
                "fp8_multi_head_attention": getattr(c, "fp8_multi_head_attention", False),
                "num_experts": getattr(c, "num_moe_experts", None),
                "moe_grouped_gemm": getattr(c, "moe_grouped_gemm", False),
                "moe_use_legacy_grouped_gemm": getattr(c, "moe_use_legacy_grouped_gemm", False),
                "delay_wgrad_compute": getattr(c, "delay_wgrad_compute", False),
                "use_transformer_engine_op_fuser": getattr(c, "use_transformer_engine_op_fuser", False),
                "cuda_graph_impl": getattr(c, "cuda_graph_impl", None),
                "fp8_interval": getattr(c, "fp8_interval", 1),
                "enable_cuda_graph": getattr(c, "enable_cuda_graph", False)}
    return fp8_refusal(backend, settings)


start_checks.register("fp8", "fp8", from_args=_args_check, from_config=_config_check)


# ---------------------------------------------------------------- the fp8 context
_active: list = [(None, None)]   # (recipe, amax reduction group) of the innermost fp8 context;
                                 # recipe None outside / in bf16 layers


def active_recipe():
    return _active[-1][0]


def active_amax_group():
    """The innermost fp8 context's amax reduction group (TE's fp8_group), None where it has none."""
    return _active[-1][1]


@contextlib.contextmanager
def fp8_autocast(recipe, amax_group=None):
    """fp8 on for megatron-adapt's linears inside (what TE's fp8_autocast is to TE's modules);
    delayed scaling all-reduces its amaxes over `amax_group` (TE's fp8_group)."""
    _active.append((recipe, amax_group))
    try:
        yield
    finally:
        _active.pop()


def amax_reduction_group(config):
    """The group Megatron's get_fp8_context hands TE's fp8_autocast as fp8_group: tensor, data and
    context parallel ranks (`--tp-only-amax-red`: tensor and context parallel). None before
    Megatron's model parallel state exists, and for a group of one rank (one GPU), which has
    nothing to reduce: the linears' updates then ask nothing of torch.distributed."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_amax_reduction_group(
        with_context_parallel=True, tp_only_amax_red=bool(getattr(config, "tp_only_amax_red", False)))
    return group if group is not None and torch.distributed.get_world_size(group) > 1 else None


def recipe_from_config(config):
    from megatron_adapt.backends.fp8_scaling import Fp8Recipe

    return Fp8Recipe(format=config.fp8, recipe=_value(config.fp8_recipe),
                     margin=int(config.fp8_margin), interval=int(config.fp8_interval),
                     amax_history_len=int(config.fp8_amax_history_len),
                     amax_compute_algo=_value(config.fp8_amax_compute_algo),
                     wgrad=bool(config.fp8_wgrad))


def build_get_fp8_context(backend, original):
    if start_checks.te_installed():
        raise SkipPatch("Transformer Engine is installed: its fp8_autocast serves")

    def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
        """Megatron's get_fp8_context, served by megatron-adapt's fp8 linears (module doc)."""
        from megatron.core import fp8_utils

        need = config.fp8 if not is_init else getattr(config, "fp8_param", False)
        if not need or fp8_utils.is_first_last_bf16_layer(config, layer_no):
            return contextlib.nullcontext()
        if is_init:
            raise UnsupportedFeatureError("fp8 parameters (--fp8-param-gather, fp8_param=True) are "
                                          f"Transformer Engine's; the {backend.name} backend keeps bf16 parameters")
        recipe = recipe_from_config(config)
        if config.first_last_layers_bf16 and recipe.recipe == "delayed":
            raise ValueError("Delayed scaling does not support first / last layer in BF16.")  # Megatron's rule
        return fp8_autocast(recipe, amax_reduction_group(config) if recipe.recipe == "delayed" else None)
    return get_fp8_context


# ---------------------------------------------------------------- the linears
def _wgrad_sink(weight, fusion: bool):
    """Megatron's gradient-accumulation fusion for an fp8 wgrad (fp32 dW): add into main_grad and
    return what Megatron's LinearWithGradAccumulationAndAsyncCommunication returns as the weight's
    gradient (a dummy where `grad_added_to_main_grad` is tracked, so the DDP hooks fire)."""
    if not (fusion and hasattr(weight, "main_grad")):
        return None
    main_grad = weight.main_grad

    def sink(dw):
        weight.main_grad = main_grad
        if dw is not None:   # None: the backend's GEMM already added into sink.main_grad
            main_grad.add_(dw)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return make(main_grad.shape, dtype=weight.dtype, device=main_grad.device)
    sink.main_grad = main_grad
    return sink


log = logging.getLogger("megatron_adapt")
_said: set = set()


def say_once(key: str, message: str) -> None:
    """A checkpoint-load note, logged once per process (not once per linear)."""
    if key not in _said:
        _said.add(key)
        log.warning(message)


def _nonempty(state) -> bool:
    if isinstance(state, torch.Tensor):
        return state.numel() > 0
    if isinstance(state, io.BytesIO):
        return state.getbuffer().nbytes > 0
    return state is not None


def _ignore_fp8_state_hook(state_dict, prefix, *args, **kwargs):
    """A linear built without fp8 loading a checkpoint whose `_extra_state` holds fp8 scaling state
    (ours or TE's): Megatron's set_extra_state drops it; the weights load as they are."""
    if _nonempty(state_dict.get(f"{prefix}_extra_state")):
        say_once("fp8_ignored", "fp8: the checkpoint holds fp8 scaling state (the linears' "
                 "_extra_state); this model runs without fp8, so it is ignored (weights load as saved)")


_variants: dict = {}


def fp8_variant(base, backend):
    """`base` (a Megatron column- or row-parallel linear class) with fp8 GEMMs inside fp8 contexts.
    Built with config.fp8 unset it is `base` itself (constructor returns a plain `base`)."""
    key = (base, backend.name)
    if key in _variants:
        return _variants[key]

    class Fp8Linear(base, metaclass=ServesPlainInstances):
        plain_class = base

        @property
        def save_original_input(self):
            """TE's flag for keeping the bf16 input instead of its fp8 copy (Megatron sets it for
            some fine-grained offloading and output-discarding recompute set-ups in fp8)."""
            return False

        @save_original_input.setter
        def save_original_input(self, value):
            if value:
                raise UnsupportedFeatureError(
                    f"save_original_input on an fp8 linear ({type(self).__name__}): the "
                    f"{backend.name} backend's fp8 linears keep the fp8 copies of their inputs for "
                    f"the backward; TE's option to keep the original input instead (asked for by "
                    f"Megatron's fine-grained offloading or output-discarding recompute under fp8) "
                    f"is not served. Drop fp8, or those offload / recompute modules.")

        def __new__(cls, *args, **kwargs):
            if not args and not kwargs:        # copy / unpickle: an object of this class
                return super().__new__(cls)
            config = kwargs.get("config")
            if config is None or not getattr(config, "fp8", None):
                plain = base.__new__(base)
                plain.__init__(*args, **kwargs)
                # Megatron's set_extra_state ignores an fp8 checkpoint's scaling state: say so once
                plain._register_load_state_dict_pre_hook(_ignore_fp8_state_hook)
                return plain
            return super().__new__(cls)

        def __init__(self, *args, config, **kwargs):
            if "fp8_linear" not in backend.ops:
                raise UnsupportedFeatureError(
                    f"fp8={config.fp8!r}: the {backend.name} backend serves no fp8 GEMM: "
                    f"{backend.op('fp8_unavailable')()}")
            super().__init__(*args, config=config, **kwargs)
            from megatron_adapt.backends.fp8_scaling import Fp8Scaling, Fp8WeightCache

            weight = getattr(self, "weight", None)   # None with skip_weight_param_allocation
            self.fp8_scaling = Fp8Scaling(recipe_from_config(config),
                                          device=weight.device if weight is not None else None)
            self._fp8_op = backend.op("fp8_linear")
            # TE's fp8 weight cache: Megatron's set_is_first_microbatch sets True at each step's
            # first micro-batch; None (never set: a loop other than Megatron's) casts every call
            self.is_first_microbatch = None
            self.fp8_weight_cache = Fp8WeightCache()

        def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (Megatron's names)
            recipe = active_recipe()
            if recipe is None:
                return super()._forward_impl(input, weight, *args, **kwargs)
            why = None
            if args:
                why = "positional arguments to _forward_impl"
            elif kwargs.get("grad_output_buffer") is not None:
                why = "deferred embedding wgrad (grad_output_buffer)"
            elif kwargs.get("gtp_remat_size", 1) != 1:
                why = f"gtp_remat_size={kwargs['gtp_remat_size']}"
            elif hasattr(weight, "__fsdp_param__"):
                why = "Megatron-FSDP parameters"
            if why is not None:
                report.fell_back("fp8_linear", "Megatron's bf16 linear", why)
                return super()._forward_impl(input, weight, *args, **kwargs)
            from megatron.core.tensor_parallel.mappings import (
                copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)

            self.fp8_scaling.amax_group = active_amax_group()
            scaling = _recompute_view(self, self.fp8_scaling)
            if scaling.recipe != recipe:
                raise ValueError(f"fp8 context recipe {recipe} differs from the one this linear was "
                                 f"built with ({scaling.recipe})")
            if scaling.scale["fwd"].device != weight.device:
                scaling.to(weight.device)
            group = kwargs.get("tp_group")
            x = input
            if kwargs.get("sequence_parallel"):
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
            elif kwargs.get("allreduce_dgrad"):
                x = copy_to_tensor_model_parallel_region(x, group=group)
            sink = _wgrad_sink(weight, bool(kwargs.get("gradient_accumulation_fusion")))
            return self._fp8_op(x, weight, kwargs.get("bias"), scaling, sink,
                                weight_cache=self._weight_cache_for_this_call())

        def _weight_cache_for_this_call(self):
            return weight_cache_for_this_call(self)

        # TE's checkpoint layout: the scaling state in the module's _extra_state
        def get_extra_state(self):
            return self.fp8_scaling.to_bytes()

        def set_extra_state(self, state):
            from megatron_adapt.backends.fp8_scaling import Fp8Scaling

            loaded = Fp8Scaling.from_bytes(state)
            if loaded is None:   # a checkpoint saved without fp8 (Megatron's linears save None)
                say_once("fp8_fresh", "fp8: the checkpoint holds no fp8 scaling state (saved without "
                         "fp8): the fp8 linears start with fresh scaling state (amax history 0, scale 1)")
                loaded = Fp8Scaling(self.fp8_scaling.recipe).state_dict()
            r = self.fp8_scaling.recipe
            if (loaded.get("format"), loaded.get("recipe")) != (r.format, r.recipe):
                # scales made for other fp8 maxima / another recipe would clip: start fresh
                say_once("fp8_other", f"fp8: the checkpoint's fp8 scaling state is for --fp8-format "
                         f"{loaded.get('format')} --fp8-recipe {loaded.get('recipe')}; this model runs "
                         f"{r.format} {r.recipe}: its fp8 linears start with fresh scaling state")
                loaded = Fp8Scaling(r).state_dict()
            self.fp8_scaling.load_state_dict(loaded)

    Fp8Linear.__name__ = Fp8Linear.__qualname__ = f"Fp8{base.__name__}"
    _variants[key] = Fp8Linear
    return Fp8Linear


# ---------------------------------------------------------------- recompute: TE's te_checkpoint
_saving: list = []      # per te_checkpoint forward running: {linear: [forward scales, in call order]}
_replaying: list = []   # per recompute running: the same dict, consumed


def _recompute_view(linear, scaling):
    """The scaling state a delayed-scaling linear casts with: its own, except inside te_checkpoint.
    There the forward saves the scales it casts with (the update after it changes them), and the
    recompute casts with those saved scales into a scratch amax row, with no forward update (TE's
    checkpoint does the same), so recompute leaves the forward state as a run without it would."""
    if scaling.recipe.recipe != "delayed":
        return scaling
    if _saving:
        _saving[-1].setdefault(linear, []).append(scaling.scale["fwd"].clone())
    elif _replaying:
        saved = _replaying[-1].get(linear)
        if not saved:
            raise RuntimeError(f"te_checkpoint: the recompute calls an fp8 linear ({type(linear).__name__}) "
                               f"more often than its forward did: no forward scale saved for it")
        return scaling.recomputed(saved.pop(0))
    return scaling


@contextlib.contextmanager
def _entered(stack, item):
    stack.append(item)
    try:
        yield
    finally:
        stack.pop()


def te_checkpoint(forward_func, distribute_saved_activations, get_rng_state_tracker, tp_group,
                  *args, **kwargs):
    """TE's te_checkpoint for megatron-adapt's fp8 linears: Megatron's own activation checkpoint
    (tensor_parallel.checkpoint: its RNG-state save and restore through Megatron's CUDA RNG tracker,
    which every caller passes as get_rng_state_tracker; distributed saved activations over the
    global tensor-parallel group), with the recompute inside the fp8 context the forward ran in
    (backward runs outside the layer's context) and the delayed-scaling rule of _recompute_view.
    kwargs go to forward_func on both runs, as with TE."""
    from megatron.core import tensor_parallel

    context, scales, forward_done = _active[-1], {}, [False]
    report.ran("te_checkpoint", "Megatron's checkpoint, recompute in the forward's fp8 context")

    def run(*inputs):
        phase = _replaying if forward_done[0] else _saving   # Megatron's checkpoint: forward, then recompute
        forward_done[0] = True
        with fp8_autocast(*context), _entered(phase, scales):
            return forward_func(*inputs, **kwargs)
    return tensor_parallel.checkpoint(run, distribute_saved_activations, *args)


# ---------------------------------------------------------------- fp8 in Megatron's local CUDA graphs
def weight_cache_for_this_call(module):
    """The module's fp8 weight cache, told whether this call casts (TE's is_first_microbatch logic,
    which Megatron drives through set_is_first_microbatch): a step's first micro-batch casts, later
    ones reuse; a CUDA-graph capture records a cast that Megatron's replays switch by the skip flag
    it sets (Fp8GraphState). None where Megatron never marks the module (cast at every call)."""
    first = module.is_first_microbatch
    if first is None:
        return None
    module.is_first_microbatch = False
    cache = module.fp8_weight_cache
    flag = Fp8GraphState.skip_flag
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    cache.skip = flag if (capturing and flag is not None) else not first
    return cache


class Fp8GraphState:
    """The part of TE's FP8GlobalStateManager that Megatron's cuda_graphs.py calls, answered for
    megatron-adapt's fp8 linears. The recipe is never TE's DelayedScaling (`te` below), so Megatron's
    per-TE-module amax bookkeeping and its reduce-and-update after a backward replay never run: each
    fp8 linear's delayed update is inside the captured forward and backward."""

    skip_flag = None   # the device flag captured weight casts read (nonzero: keep the cached weight)

    @staticmethod
    def get_fp8_recipe():
        return active_recipe()

    @staticmethod
    def is_fp8_enabled() -> bool:
        return active_recipe() is not None

    @staticmethod
    def set_skip_fp8_weight_update_tensor(skip) -> None:
        """Megatron sets this before replaying a step's first layer: False for the step's first
        micro-batch (the captured weight casts run), True for later ones (they keep the cache). Set
        once before any capture, so captures record the flagged cast (Fp8Linear's weight cache)."""
        if Fp8GraphState.skip_flag is None:
            Fp8GraphState.skip_flag = torch.zeros(1, dtype=torch.float32, device="cuda")
        Fp8GraphState.skip_flag.fill_(float(bool(skip)))

    @staticmethod
    def is_first_fp8_module() -> bool:   # megatron-core 0.15 asks before that skip
        return False


class _NotTransformerEngine:
    """Stands for TE's classes in Megatron's isinstance checks: nothing here is one."""


te = type("te", (), {"common": type("common", (), {"recipe": type("recipe", (), {
    "DelayedScaling": _NotTransformerEngine})})})


def _scalings(modules):
    return [m.fp8_scaling for module in modules for m in module.modules() if hasattr(m, "fp8_scaling")]


def save_fp8_tensors(modules, recipe=None):
    """TE's save_fp8_tensors for megatron-adapt's fp8 linears: a copy of each linear's delayed-scaling
    state, taken before Megatron's warm-up runs of a layer it is about to capture."""
    return [({d: s.amax_history[d].clone() for d in s.amax_history}, {d: s.scale[d].clone() for d in s.scale},
             dict(s.updates)) for s in _scalings(modules)]


def restore_fp8_tensors(modules, saved) -> None:
    """Put the state back in place (the captured graph holds these tensors' addresses)."""
    for s, (history, scale, updates) in zip(_scalings(modules), saved, strict=True):
        for d in history:
            s.amax_history[d].copy_(history[d])
            s.scale[d].copy_(scale[d])
        s.updates.update(updates)


def build_quantization_context(backend, original):
    if start_checks.te_installed():
        raise SkipPatch("Transformer Engine is installed: Megatron asks its FP8GlobalStateManager")

    def get_quantization_context(wrapped, instance, args, kwargs):
        """Megatron marks a runner's fp8 as on only where TE says so (at recording); without TE the
        capture would run outside fp8. A runner of an fp8 layer captures inside Megatron's fp8
        context for that layer (bf16 for --first-last-layers-bf16 layers, as get_fp8_context says)."""
        if instance.fp8_enabled and not getattr(instance, "fp4_enabled", False):
            instance.fp8_runtime_enabled = True
        return wrapped(*args, **kwargs)
    return get_quantization_context


# ---------------------------------------------------------------- MoE experts
def _padded(m_splits, align):
    return [-(-int(m) // align) * align for m in m_splits]


def _row_index(m_splits, padded, device):
    """Where each of the unpadded rows goes in the padded layout (int64 on `device`)."""
    shifts, shift = [], 0
    for m, p in zip(m_splits, padded):
        shifts.append(shift)
        shift += p - m
    index = torch.arange(sum(m_splits)) + torch.repeat_interleave(torch.tensor(shifts), torch.tensor(m_splits))
    return index.to(device, non_blocking=True)


class Fp8Padding(torch.nn.Module):
    """TE's Fp8Padding, which Megatron's TEGroupedMLP calls under fp8: each expert's rows padded
    with zero rows to a multiple of `align_size` (16: the fp8 grouped GEMM's alignment), returning
    the padded rows and row counts; the input as it is where every count already is a multiple."""

    def __init__(self, num_gemms: int, align_size: int | None = None):
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size or 16

    def forward(self, inp, m_splits):
        padded = _padded(m_splits, self.align_size)
        if padded == [int(m) for m in m_splits]:
            return inp, m_splits
        index = _row_index(m_splits, padded, inp.device)
        return inp.new_zeros(sum(padded), *inp.shape[1:]).index_copy(0, index, inp), padded


class Fp8Unpadding(Fp8Padding):
    """TE's Fp8Unpadding: the rows Fp8Padding added taken out again (m_splits: the unpadded counts)."""

    def forward(self, inp, m_splits):
        padded = _padded(m_splits, self.align_size)
        if padded == [int(m) for m in m_splits]:
            return inp
        return inp.index_select(0, _row_index(m_splits, padded, inp.device))


def _experts_name(name, obj):
    return start_checks.served_without_te(name, obj, "Megatron's fp8 experts")


# TransformerConfig asks for TE 1.7 (experts with zero tokens) and 1.11 (grouped GEMM) before it
# takes MoE in fp8; in transformer_config.py those two versions gate nothing else. Without TE the
# experts run on megatron-adapt's fp8 grouped GEMM, which handles both, and the fp8 start check (run
# right after __post_init__) refuses the MoE set-ups it does not serve.
serve_te_version("fp8", "megatron.core.transformer.transformer_config", "1.7.0.dev0", "1.11.0")


_recompute = start_checks.served_without_te("te_checkpoint", te_checkpoint, "Megatron's recompute of fp8 code")
GRAPHS = "megatron.core.transformer.cuda_graphs"
EXPERTS = "megatron.core.transformer.moe.experts"
SPECS = [
    PatchSpec("megatron.core.fp8_utils:get_fp8_context", area="fp8", build=build_get_fp8_context),
    PatchSpec(f"{GRAPHS}:_CudaGraphRunner.get_quantization_context", area="fp8", mode=WRAP,
              build=build_quantization_context),
] + [PatchSpec(f"{GRAPHS}:{name}", area="fp8", create=True,
               build=start_checks.served_without_te(name, obj, "Megatron's CUDA graphs"))
     for name, obj in (("FP8GlobalStateManager", Fp8GraphState), ("save_fp8_tensors", save_fp8_tensors),
                       ("restore_fp8_tensors", restore_fp8_tensors), ("te", te),
                       ("TransformerEngineBaseModule", _NotTransformerEngine))] + [
    # core_v0.18+ sets the skip flag through a helper that returns at once without TE
    PatchSpec(f"{GRAPHS}:_set_skip_fp8_weight_update_tensor", area="fp8", versions=">=0.18.0,<0.20.0",
              build=start_checks.served_without_te("_set_skip_fp8_weight_update_tensor",
                                                   Fp8GraphState.set_skip_fp8_weight_update_tensor,
                                                   "Megatron's CUDA graphs"))] + [
    # TEGroupedMLP under fp8 asserts HAVE_TE and pads each expert's rows with TE's Fp8Padding /
    # Fp8Unpadding; its linears are megatron-adapt's grouped linears (patches/moe), which run the
    # backend's fp8_grouped_gemm. experts.py reads HAVE_TE nowhere else that TE's absence changes:
    # its fused-ops probe imports transformer_engine itself.
    PatchSpec(f"{EXPERTS}:HAVE_TE", area="fp8", build=_experts_name("HAVE_TE", True), check_signature=False),
    PatchSpec(f"{EXPERTS}:Fp8Padding", area="fp8", build=_experts_name("Fp8Padding", Fp8Padding),
              create=True, check_signature=False),
    PatchSpec(f"{EXPERTS}:Fp8Unpadding", area="fp8", build=_experts_name("Fp8Unpadding", Fp8Unpadding),
              create=True, check_signature=False),
    # recompute of fp8 code: Megatron calls TE's te_checkpoint, imported from the extension module
    # at the call (transformer layer's MLP, MTP) or bound at import where TE imports (None without)
    PatchSpec("megatron.core.extensions.transformer_engine:te_checkpoint", area="fp8", build=_recompute),
    PatchSpec("megatron.core.transformer.moe.moe_layer:te_checkpoint", area="fp8", build=_recompute,
              create=True, check_signature=False),
    PatchSpec("megatron.core.transformer.transformer_block:te_checkpoint", area="fp8", build=_recompute,
              versions=">=0.15.0,<0.18.0", check_signature=False),   # full recompute: block's, then recompute.py's
    PatchSpec("megatron.core.recompute:te_checkpoint", area="fp8", build=_recompute,
              versions=">=0.18.0,<0.20.0", check_signature=False)]

"""Mixture-of-experts without Transformer Engine or the `grouped_gemm` package.

- `--moe-grouped-gemm` on core_v0.15-0.16: without TE, Megatron's spec providers (its local one,
  and patches/layer_specs' provider behind the default TE spec, which inherits it) build the legacy
  `GroupedMLP`, which takes no bias and needs the `grouped_gemm` package (bf16 only).
  `LocalSpecProvider.grouped_mlp_modules` gives `AdaptGroupedExperts`, which builds, per config:
  with `--add-bias-linear` (Megatron's default; GroupedMLP failed at model build) `TEGroupedMLP` on
  the backend's grouped linears (below), what TE's provider builds with TE; without biases
  Megatron's `GroupedMLP`, as before (its weights stay one stacked parameter per linear: no stacked
  copy per forward). Dist checkpoints of either load into the other and into SequentialMLP's
  (Megatron keeps their sharded keys the same). `--moe-use-legacy-grouped-gemm`: GroupedMLP.
- `GroupedMLP` (0.15-0.16): `grouped_gemm_util.grouped_gemm` / `.ops` are bound to a namespace whose
  `ops.gmm(a, b, batch_sizes, trans_b)` (the package's API) runs the backend's `grouped_gemm` op;
  `GroupedMLP.forward` is replaced with the same computation minus the bf16-only assertion (the
  backend op takes every float dtype). With the package installed, the package stays (specs skipped).
- `--moe-permute-fusion`: `permute`, `unpermute` and `sort_chunks_by_idxs` with fused=True run the
  backend's `moe_permute` / `moe_unpermute` / `moe_sort_chunks`; the five TE names the
  TransformerConfig check imports from moe_utils (`fused_permute`, ...) are created with TE's
  signatures on the same ops. fused=False calls Megatron's own code.
- `--moe-router-fusion`: `topk_routing_with_score_function` and
  `compute_routing_scores_for_aux_loss` with fused=True run `moe_topk_router` /
  `moe_router_scores`; `switch_load_balancing_loss_func` with fused=True runs Megatron's own
  formula (two reductions; reported as op `moe_aux_loss`, `megatron.formula`).
- every router: `te_general_gemm`, which 0.16 names in RouterGatingLinearFunction but binds only
  with TE (a NameError otherwise), is created on torch.mm.
- the alltoall dispatcher on cpu / npu: `maybe_move_tensor_to_cpu` copies any non-host tensor and
  gives numpy (all_to_all_single refuses tensor split sizes); on cpu, the uneven TP all-gather /
  reduce-scatter (TP + EP + sequence parallelism) run over gloo.
- `--moe-latent-size` (core 0.16+): MoELayer's latent projections are TE's duplicated TELinear; the
  layer spec provider's duplicated linear serves them (moe_layer's TELinear, and its HAVE_TE, which
  there only guards them).
- `validate_args`' compute-capability check for --moe-grouped-gemm reads (8, 0) while it runs
  on a device reporting less (the check guards the grouped_gemm package's CUTLASS kernels).

The grouped linears, `AdaptColumnParallelGroupedLinear` / `AdaptRowParallelGroupedLinear`, take TE's
TEColumnParallelGroupedLinear / TERowParallelGroupedLinear constructor (0.15's TEGroupedMLP passes
`tp_group=`, 0.16+ `pg_collection=`): per-expert parameters named as TE's (`weight0`, ... `bias0`,
...), one call of the backend's `grouped_gemm` op per linear, checkpoints sharded per expert as TE's
(and SequentialMLP's). core_v0.17+ removed the legacy GroupedMLP and grouped_gemm_util; its
`LocalSpecProvider.grouped_mlp_modules(True)` gives TEGroupedMLP on them (GroupedMLPSubmodules).
`permute` returns 5 values and `unpermute` takes `pad_offsets` from 0.17; `te_general_gemm` is bound
(None without TE) and Megatron's torch path serves the router, so that spec ends at 0.17.
The `transformer_engine` package is not faked: moe_utils.HAVE_TE stays False. See docs/moe.md.
"""
import inspect
import sys
import types

import torch

from megatron_adapt import report, start_checks
from megatron_adapt.patches.layer_specs import build_mla_te_linear
from megatron_adapt.spec import WRAP, PatchSpec, SkipPatch

GG = "megatron.core.transformer.moe.grouped_gemm_util"
UTILS = "megatron.core.transformer.moe.moe_utils"
EXPERTS = "megatron.core.transformer.moe.experts"
PACKAGE_PRESENT = "the grouped_gemm package is installed; Megatron uses it"

_namespaces: dict = {}


def _gmm_namespace(backend):
    ns = _namespaces.get(backend.name)
    if ns is None:
        grouped_gemm = backend.op("grouped_gemm")

        def gmm(a, b, batch_sizes, trans_b=False):
            # the package's own check and message (its batch_sizes live on the host)
            if batch_sizes.device.type == "cpu" and batch_sizes.numel() and not bool(batch_sizes.any()):
                raise ValueError("Input batch_sizes should not be all zeros!")
            return grouped_gemm(a, b, batch_sizes, trans_b)

        ops = types.SimpleNamespace(gmm=gmm, __megatron_adapt_impl__=f"{backend.name}.grouped_gemm")
        ns = types.SimpleNamespace(ops=ops, __name__="megatron_adapt.grouped_gemm",
                                   __megatron_adapt_impl__=f"{backend.name}.grouped_gemm")
        _namespaces[backend.name] = ns
    return ns


def build_package(backend, original):
    if original is not None:
        raise SkipPatch(PACKAGE_PRESENT)
    return _gmm_namespace(backend)


def build_ops(backend, original):
    if original is not None:
        raise SkipPatch(PACKAGE_PRESENT)
    return _gmm_namespace(backend).ops


def build_grouped_mlp_forward(backend, original):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is not None and not hasattr(grouped_gemm_util.grouped_gemm,
                                                                  "__megatron_adapt_impl__"):
        raise SkipPatch(PACKAGE_PRESENT)
    grouped_gemm = backend.op("grouped_gemm")

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """GroupedMLP.forward on the backend's grouped_gemm, in any float dtype."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.activation_recompute:
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, \
                "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        hidden = self.config.hidden_size
        if x.nelement() != 0:
            w1 = self.weight1.view(self.num_local_experts, hidden, -1)
            w2 = self.weight2.view(self.num_local_experts, -1, hidden)
            fc1 = grouped_gemm(x, w1, tokens_per_expert, False)
            fc2 = lambda h: grouped_gemm(h, w2, tokens_per_expert, False)  # noqa: E731
        else:  # no token for the local experts: keep the weights in the graph (zero grads)
            fc1 = torch.matmul(x, self.weight1.view(hidden, -1))
            fc2 = lambda h: torch.matmul(h, self.weight2.view(-1, hidden))  # noqa: E731
        if self.activation_recompute:
            h = self.activation_checkpoint.checkpoint(self.activation_func_with_probs, fc1,
                                                      probs.unsqueeze(-1))
            out = fc2(h)
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        else:
            out = fc2(self.activation_func_with_probs(fc1, probs.unsqueeze(-1)))
        return out, None

    forward.__megatron_adapt_impl__ = f"{backend.name}.grouped_gemm (GroupedMLP.forward, any dtype)"
    return forward


# --------------------------------------------------------------------- core_v0.17+: grouped linears
_linears: dict = {}


class _StackExpertWeights(torch.autograd.Function):
    """torch.stack of the per-expert weights [out, in] -> [E, out, in] for one grouped GEMM.

    Backward, with `fuse` (config.gradient_accumulation_fusion and Megatron's DDP main_grad
    buffers): the stacked weight gradient is added to every expert's `main_grad` in one
    `_foreach_add_` and each weight gets a dummy grad flagged `grad_added_to_main_grad`, the protocol
    of Megatron's own fused linears (and TE's fuse_wgrad_accumulation). Without it, each expert's
    gradient is a contiguous slice (autograd keeps it as .grad without a copy). Per-expert
    AccumulateGrad copies and DDP adds otherwise cost ~4 launches per expert per linear per micro-batch."""

    ADDED = "added"   # fuse's third value: the consumer (fp8_grouped_gemm's main_grads) added dW itself

    @staticmethod
    def forward(ctx, fuse, *weights):
        ctx.fuse, ctx.weights = fuse, weights if fuse else None
        return torch.stack(weights)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fuse:
            return (None, *grad.contiguous().unbind(0))
        weights, ctx.weights = ctx.weights, None
        if ctx.fuse != _StackExpertWeights.ADDED:   # else grad is an unwritten placeholder
            torch._foreach_add_([w.main_grad for w in weights], list(grad.unbind(0)))
        return (None, *_main_grad_dummies(weights, grad))


def _main_grad_dummies(weights, stacked_like):
    """The grads autograd gets for weights whose gradient went into `main_grad`: dummies, each
    weight flagged `grad_added_to_main_grad` (Megatron's protocol; zeros where Megatron asks
    for them with `zero_out_wgrad`, its cuda-graph path)."""
    grads = []
    for w, d in zip(weights, torch.empty_like(stacked_like).unbind(0)):
        w.grad_added_to_main_grad = True
        grads.append(torch.zeros_like(d) if getattr(w, "zero_out_wgrad", False) else d)
    return grads


def _wgrads_into_main_grads(wgrad, x, dy, weights, splits):
    """Each expert's dy_e^T x_e added into its weight's fp32 main_grad by the backend's
    wgrad_accumulate, over the rows the host split sizes give it (empty experts: nothing)."""
    r0 = 0
    for w, n in zip(weights, splits):
        if n:
            wgrad(x[r0:r0 + n], dy[r0:r0 + n], w.main_grad)
        r0 += n


class _GroupedWgradIntoMainGrad(torch.autograd.Function):
    """A bf16 grouped linear whose weight gradients go straight into the experts' `main_grad`:
    one backend `wgrad_accumulate` per expert (on cuda a GEMM that adds into the fp32 main_grad,
    beta = 1, as TE's grouped linear does with fuse_wgrad_accumulation), from the host sizes.
    The stacked path (`_StackExpertWeights`) writes a bf16 dW, rounding it, and adds it in a
    second pass over every main_grad: 41 ms of the MoE bench's 336 ms of bf16 kernels on an H100
    (docs/moe.md). Forward and dgrad stay one grouped GEMM each."""

    @staticmethod
    def forward(ctx, x, splits, ops, *weights):
        grouped, _ = ops
        stacked = torch.stack(weights)
        ctx.save_for_backward(x, stacked)
        ctx.splits, ctx.ops, ctx.weights = splits, ops, weights
        return grouped(x, stacked, splits, True)

    @staticmethod
    def backward(ctx, dy):
        x, stacked = ctx.saved_tensors
        grouped, wgrad = ctx.ops
        weights, ctx.weights = ctx.weights, None
        dy = dy.contiguous()
        dx = grouped(dy, stacked, ctx.splits, False) if ctx.needs_input_grad[0] else None
        _wgrads_into_main_grads(wgrad, x, dy, weights, ctx.splits)
        return (dx, None, None, *_main_grad_dummies(weights, stacked))


class _ExpertWgradIntoMainGrad(torch.autograd.Function):
    """Identity on an fp8 grouped GEMM's output y, for `--no-fp8-wgrad`: its backward adds each
    expert's bf16 weight gradient dy_e^T x_e into that expert's fp32 `main_grad` with the backend's
    `wgrad_accumulate` (cuBLAS beta = 1, as _GroupedWgradIntoMainGrad), and passes dy on to the fp8
    GEMM's own backward (dgrad only: it got the weights detached). The stacked alternative writes a
    bf16 dW and adds it to every main_grad in a second pass: 36 ms of the MoE bench's fp8 step on
    an H200 (docs/fp8.md)."""

    @staticmethod
    def forward(ctx, y, x, splits, wgrad, *weights):
        ctx.save_for_backward(x)
        ctx.splits, ctx.wgrad, ctx.weights = splits, wgrad, weights
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        weights, ctx.weights = ctx.weights, None
        _wgrads_into_main_grads(ctx.wgrad, x, dy.contiguous(), weights, ctx.splits)
        return (dy, None, None, None, *_main_grad_dummies(weights, weights[0].new_empty((len(weights),
                                                                                          *weights[0].shape))))


def _host_splits(m_splits):
    """The experts' row counts as Python ints when the host has them (a list, or a CPU tensor as
    Megatron's dispatchers give them), else None (sizes on the device: reading them would sync)."""
    if torch.is_tensor(m_splits):
        return [int(n) for n in m_splits.tolist()] if m_splits.device.type == "cpu" else None
    return [int(n) for n in m_splits]


def grouped_linear_classes(backend):
    """(column, row) grouped-linear builders for core_v0.17+'s TEGroupedMLP on the backend's
    grouped_gemm op, with the constructor, forward and checkpoint layout of TE's
    TEColumnParallelGroupedLinear / TERowParallelGroupedLinear (fp8 through the backend's
    fp8_grouped_gemm inside an fp8 context; delay_wgrad_compute's backward_dw: patches/delayed_wgrad)."""
    if backend.name not in _linears:
        _linears[backend.name] = _grouped_linear_classes(backend)
    return _linears[backend.name]


def _grouped_linear_classes(backend):
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu
    from megatron.core.tensor_parallel.utils import divide
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from megatron_adapt.patches.delayed_wgrad import DelayedWgradGroupedGemm, DelayedWgradGroupedMixin, delayed
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache
    from megatron_adapt.patches.fp8 import active_recipe, weight_cache_for_this_call

    grouped_gemm, grouped_wgrad = backend.op("grouped_gemm"), backend.op("grouped_gemm_wgrad")
    wgrad_accumulate = backend.op("wgrad_accumulate")

    class AdaptGroupedLinear(DelayedWgradGroupedMixin, torch.nn.Module):
        """`num_gemms` linears (one per local expert), weights `weight{i}` [out, in] as TE's
        GroupedLinear; forward(x, m_splits) runs all of them as one backend grouped GEMM."""

        parallel_mode = None  # "column" / "row" in the subclasses
        # TE's flag (Megatron's set_save_original_input, e.g. for --offload-modules expert_fc1):
        # keep the bf16 input, not an fp8 copy, for the backward. These linears always keep the
        # original input (their fp8 path too); the attribute is what Megatron checks for.
        save_original_input = False

        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                     skip_bias_add, is_expert=True, tp_comm_buffer_name=None, pg_collection=None,
                     name=None, tp_group=None):
            super().__init__()
            if not is_expert:
                raise ValueError("grouped linears serve MoE experts only (is_expert=True), as TE's")
            if getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):
                raise NotImplementedError(
                    "overlap_dispatch_backward_with_experts_wgrad=True needs TE's grouped linear "
                    "(its dispatch-overlapped wgrad pass); megatron-adapt's grouped linear serves "
                    "delay_wgrad_compute's backward_dw only")
            if getattr(config, "fp4", None):
                raise NotImplementedError("FP4 expert GEMMs are Transformer Engine's")
            # fp8: the backend's fp8_grouped_gemm inside Megatron's fp8 context (patches/fp8)
            self._fp8_gemm = None
            if config.fp8:
                if "fp8_grouped_gemm" not in backend.ops:
                    raise NotImplementedError(f"fp8 expert GEMMs: the {backend.name} backend serves no "
                                              f"fp8 grouped GEMM")
                if delayed(config):
                    raise NotImplementedError("fp8 expert GEMMs with --delay-wgrad-compute are not served "
                                              "(the delayed weight gradients run in bf16)")
                self._fp8_gemm = backend.op("fp8_grouped_gemm")
                # TE's fp8 weight cache across a step's micro-batches: Megatron's set_is_first_microbatch
                # sets True at each step's first one (None: never marked, cast at every call)
                self.is_first_microbatch = None
                self.fp8_weight_cache = Fp8WeightCache()
            self.config, self.num_gemms = config, num_gemms
            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                    required_pgs=["ep", "expt_tp", "expt_dp"])
            # core_v0.15's TEGroupedMLP passes the expert-TP group alone (tp_group=), 0.16+ the collection
            self._pg_collection = pg_collection
            self._tp_group = tp_group if tp_group is not None else pg_collection.expt_tp
            tp = self._tp_group.size() if self._tp_group is not None else 1
            if self.parallel_mode == "column":
                output_size = divide(output_size, tp)
            else:
                input_size = divide(input_size, tp)
            self.in_features, self.out_features = input_size, output_size
            self.use_bias, self.skip_bias_add = bias, skip_bias_add
            use_expert_pgs = (config.expert_model_parallel_size > 1
                              or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            axis = 0 if self.parallel_mode == "column" else 1
            for i in range(num_gemms):
                w = torch.nn.Parameter(torch.empty(output_size, input_size, device=device,
                                                   dtype=config.params_dtype))
                if config.perform_initialization and not config.use_cpu_initialization:
                    _initialize_affine_weight_gpu(w, init_method, partition_dim=axis, is_expert=True)
                else:  # on the host: the CPU generator (Megatron's own CPU init forks no device RNG)
                    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, axis, 1
                    if config.perform_initialization:
                        init_method(w.data)
                w.allreduce = not use_expert_pgs
                self.register_parameter(f"weight{i}", w)
                if bias:
                    b = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=config.params_dtype))
                    b.tensor_model_parallel = self.parallel_mode == "column"
                    b.partition_dim, b.partition_stride = 0, 1
                    b.allreduce = not use_expert_pgs
                    self.register_parameter(f"bias{i}", b)
            if delayed(config):  # the weight gradients in backward_dw() (patches/delayed_wgrad)
                self._init_delayed_wgrad()

        def forward(self, x, m_splits):
            weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            fuse = self.config.gradient_accumulation_fusion and all(hasattr(w, "main_grad") for w in weights)
            if self.delay_wgrad_compute and any(w.requires_grad for w in weights):
                out = DelayedWgradGroupedGemm.apply(x, m_splits, (grouped_gemm, grouped_wgrad), self, fuse,
                                                    *weights)
            else:
                recipe = active_recipe() if self._fp8_gemm is not None else None
                splits = (_host_splits(m_splits) if fuse and (recipe is None or not recipe.wgrad)
                          and any(w.requires_grad for w in weights) else None)
                if splits is not None and recipe is None:
                    out = _GroupedWgradIntoMainGrad.apply(x, splits, (grouped_gemm, wgrad_accumulate),
                                                          *weights)
                elif splits is not None:   # fp8, --no-fp8-wgrad: fp8 forward / dgrad, bf16 wgrad
                    stacked = torch.stack([w.detach() for w in weights])
                    out = _ExpertWgradIntoMainGrad.apply(
                        self._fp8_gemm(x, stacked, m_splits, recipe, self._weight_cache(weights)),
                        x.detach(), splits, wgrad_accumulate, *weights)
                elif recipe is None:
                    out = grouped_gemm(x, _StackExpertWeights.apply(fuse, *weights), m_splits, True)
                else:   # with fuse the fp8 wgrad is added into the experts' main_grad by the backend
                    into = dict(main_grads=[w.main_grad for w in weights], static_sizes=bool(
                        getattr(self.config, "moe_pad_expert_input_to_capacity", False))) if fuse else {}
                    stacked = _StackExpertWeights.apply(_StackExpertWeights.ADDED if fuse else False, *weights)
                    out = self._fp8_gemm(x, stacked, m_splits, recipe, self._weight_cache(weights), **into)
            if not self.use_bias:
                return out, None
            biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
            if self.skip_bias_add:  # TEGroupedMLP._apply_bias adds them, times the probs
                return out, biases
            # each expert's bias over its rows, from the host sizes: no host-to-device copy and no
            # size read back (both would break a CUDA graph capture of the layer)
            splits = m_splits.tolist() if torch.is_tensor(m_splits) else m_splits
            return out + torch.cat([b.expand(int(n), b.shape[0]) for b, n in zip(biases, splits)]), None

        def _weight_cache(self, weights):
            """The fp8 weight cache for this call (weight_cache_for_this_call); a later micro-batch
            casts again where an expert's weight changed in place since the cache was made."""
            cache = weight_cache_for_this_call(self)
            if cache is not None:
                key = tuple((w.data_ptr(), w._version) for w in weights)
                if cache.skip is True and cache.key != key:
                    cache.skip = False
                cache.key = key
            return cache

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """Per expert, as TE's grouped linears (and SequentialMLP): `weight{i}` is the global
            expert's `weight` with an expert axis; column: TP axis 0 (bias too), row: axis 1."""
            metadata = metadata or {}
            ep = self._pg_collection.ep
            num_global, offset = ep.size() * self.num_gemms, ep.rank() * self.num_gemms
            tp_axes = {"weight": 0 if self.parallel_mode == "column" else 1}
            if self.parallel_mode == "column":
                tp_axes["bias"] = 0
            out = {}
            for i in range(self.num_gemms):
                state = {f"{i}.{k}": getattr(self, f"{k}{i}") for k in ("weight", "bias")
                         if k == "weight" or self.use_bias}
                if metadata.get("singleton_local_shards", False):
                    expert_prefix, offsets = f"{offset + i}.{prefix}", sharded_offsets
                else:
                    expert_prefix = prefix
                    offsets = (*sharded_offsets, (len(sharded_offsets), offset + i, num_global))
                sub = make_sharded_tensors_for_checkpoint(
                    state, "", {f"{i}.{k}": ax for k, ax in tp_axes.items()}, offsets,
                    **_sharding_groups(self._tp_group, metadata))
                replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
                for k in state:
                    out[f"{prefix}{k.split('.')[1]}{i}"] = sub[k]
            edp_rank = self._pg_collection.expt_dp.rank()
            for sh in out.values():  # replicas over expert data parallelism, not DP
                sh.replica_id = (*sh.replica_id[:2], edp_rank)
            return out

    class AdaptColumnParallelGroupedLinear(AdaptGroupedLinear):
        parallel_mode = "column"

    class AdaptRowParallelGroupedLinear(AdaptGroupedLinear):
        parallel_mode = "row"

    def _sharding_groups(tp_group, metadata):
        """make_sharded_tensors_for_checkpoint takes the groups from core_v0.16; 0.15's reads
        parallel_state's TP group, which its TEGroupedMLP.sharded_state_dict swaps for expert TP
        (expert_dist_ckpt_decorator)."""
        if not groups_accepted:
            return {}
        return {"tp_group": tp_group, "dp_cp_group": metadata.get("dp_cp_group")}

    groups_accepted = "tp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters

    for cls in (AdaptColumnParallelGroupedLinear, AdaptRowParallelGroupedLinear):
        cls.__megatron_adapt_impl__ = f"{backend.name}.grouped_gemm ({cls.__name__})"
    return AdaptColumnParallelGroupedLinear, AdaptRowParallelGroupedLinear


def build_grouped_mlp_modules(backend, original):
    """core_v0.17+: LocalSpecProvider.grouped_mlp_modules(True) -> TEGroupedMLP on the backend's
    grouped linears (Megatron gives SequentialMLP there: its grouped experts need TE); False ->
    Megatron's own (SequentialMLP). patches/layer_specs' provider inherits it."""
    from functools import partial

    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    column, row = grouped_linear_classes(backend)

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        if not moe_use_grouped_gemm:
            return original(self, moe_use_grouped_gemm)
        return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=column, linear_fc2=row, activation_func=self.activation_func()))

    grouped_mlp_modules.__megatron_adapt_impl__ = f"{backend.name}.grouped_gemm (TEGroupedMLP on grouped linears)"
    return grouped_mlp_modules


def _upcycling_run() -> bool:
    """megatron.training's `--moe-use-upcycling` is set: upcycling_utils converts a dense MLP into
    SequentialMLP or TEGroupedMLP experts only (TypeError on the legacy GroupedMLP)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return bool(getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "moe_use_upcycling", False))


def grouped_experts_class(backend):
    """core_v0.15-0.16: the experts class `--moe-grouped-gemm` builds (see build_grouped_mlp_modules_legacy)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import GroupedMLP, TEGroupedMLP

    column, row = grouped_linear_classes(backend)

    class AdaptGroupedExperts:
        """With config.add_bias_linear, config.fp8 or config.moe_latent_size, or under
        `--moe-use-upcycling`: TEGroupedMLP on the backend's grouped linears (TE's module tree,
        parameter names and checkpoint layout; biases, fp8, latent-sized experts and upcycling served;
        the legacy GroupedMLP has none); otherwise Megatron's GroupedMLP (one [E*in, out] weight per
        linear, its forward on the backend's grouped_gemm). The spec is built before the config
        exists, so the choice is made here, at construction."""

        def __new__(cls, num_local_experts, config, submodules=None, pg_collection=None):
            if (config.add_bias_linear or config.fp8 or getattr(config, "moe_latent_size", None)
                    or _upcycling_run()):
                act = getattr(submodules, "activation_func", None)
                return TEGroupedMLP(num_local_experts, config,
                                    MLPSubmodules(linear_fc1=column, linear_fc2=row, activation_func=act),
                                    pg_collection=pg_collection)
            return GroupedMLP(num_local_experts, config, pg_collection=pg_collection)

    AdaptGroupedExperts.__megatron_adapt_impl__ = (
        f"{backend.name}.grouped_gemm (bias, fp8, latent, upcycling: TEGroupedMLP on grouped linears; else GroupedMLP)")
    return AdaptGroupedExperts


def build_grouped_mlp_modules_legacy(backend, original):
    """core_v0.15-0.16: LocalSpecProvider.grouped_mlp_modules(True, legacy=False) -> experts that are
    TEGroupedMLP on the backend's grouped linears when the model has biases (Megatron's default
    `--add-bias-linear`, which the legacy GroupedMLP refuses at build; TE's provider gives
    TEGroupedMLP there), Megatron's GroupedMLP otherwise (as before: no change for configurations
    that ran). `--moe-use-legacy-grouped-gemm` (legacy=True) and False: Megatron's own (GroupedMLP,
    SequentialMLP). patches/layer_specs' provider inherits it."""
    from megatron.core.transformer.mlp import MLPSubmodules

    experts = grouped_experts_class(backend)
    column, row = grouped_linear_classes(backend)

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        if not moe_use_grouped_gemm or moe_use_legacy_grouped_gemm:
            return original(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        return experts, MLPSubmodules(linear_fc1=column, linear_fc2=row)

    grouped_mlp_modules.__megatron_adapt_impl__ = experts.__megatron_adapt_impl__
    return grouped_mlp_modules


# --------------------------------------------------------------------- permute fusion
def _fused(args, kwargs, position):
    return kwargs["fused"] if "fused" in kwargs else (len(args) > position and bool(args[position]))


_signatures: dict = {}


def _bind(wrapped, args, kwargs):
    sig = _signatures.get(wrapped)
    if sig is None:
        sig = _signatures[wrapped] = inspect.signature(wrapped)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _fused_wrapper(op_name, fused_at, run):
    """A build for one of moe_utils' functions: fused=True (positional argument `fused_at`, or the
    keyword) runs run(op, bound arguments) on the backend's op `op_name`; fused=False runs Megatron's."""
    def build(backend, original):
        op = backend.op(op_name)

        def wrapper(wrapped, instance, args, kwargs):
            if not _fused(args, kwargs, fused_at):
                return wrapped(*args, **kwargs)
            return run(op, _bind(wrapped, args, kwargs))
        return wrapper
    return build


def _permute(moe_permute, a):
    return moe_permute(a["tokens"], a["routing_map"], a["probs"], a["num_out_tokens"])


def _permute_017(moe_permute, a):
    """core_v0.17+: permute(..., tokens_per_expert=None, align_size=0) returns (permuted, probs,
    row_map, pad_offsets, tokens_per_expert). align_size > 0 (the quantization padding of
    FP8/FP4 runs, TE's fused_permute_and_pad_with_probs) is refused with the reason."""
    if a["align_size"] and a["probs"] is not None and a["tokens_per_expert"] is not None:
        raise NotImplementedError(
            f"permute(align_size={a['align_size']}) pads each expert for FP8/FP4 GEMMs (TE's "
            "fused_permute_and_pad_with_probs); megatron-adapt's moe_permute does not pad")
    out, probs, row_map = _permute(moe_permute, a)
    return out, probs, row_map, None, a["tokens_per_expert"]


def _unpermute(moe_unpermute, a):
    return moe_unpermute(a["permuted_tokens"], a["sorted_indices"], a["restore_shape"], a["probs"])


def _unpermute_017(moe_unpermute, a):
    """core_v0.17+: unpermute(..., pad_offsets=None); pad_offsets come only from the padding
    permute that _permute_017 refuses."""
    if a["pad_offsets"] is not None:
        raise NotImplementedError("unpermute(pad_offsets=...) undoes FP8/FP4 expert padding, "
                                  "which megatron-adapt's moe_permute does not add")
    return _unpermute(moe_unpermute, a)


def _sort_chunks(sort_chunks, a):
    return sort_chunks(a["input"], a["split_sizes"], a["sorted_idxs"], a["probs"])


build_permute = _fused_wrapper("moe_permute", 4, _permute)
build_permute_017 = _fused_wrapper("moe_permute", 4, _permute_017)
build_unpermute = _fused_wrapper("moe_unpermute", 5, _unpermute)
build_unpermute_017 = _fused_wrapper("moe_unpermute", 5, _unpermute_017)
build_sort_chunks = _fused_wrapper("moe_sort_chunks", 4, _sort_chunks)


def _te_names(backend):
    """TE's fused permutation functions (moe_utils' names for them) on the backend's ops."""
    permute, unpermute = backend.op("moe_permute"), backend.op("moe_unpermute")
    sort_chunks = backend.op("moe_sort_chunks")

    def fused_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask"):
        _mask_only(map_type)
        out, _, row_map = permute(inp, routing_map, None, None if num_out_tokens < 0 else num_out_tokens)
        return out, row_map

    def fused_permute_with_probs(inp, merging_probs, routing_map, num_out_tokens=-1):
        return permute(inp, routing_map, merging_probs, None if num_out_tokens < 0 else num_out_tokens)

    def fused_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
                        probs=None):
        _mask_only(map_type)
        probs = merging_probs if merging_probs is not None else probs
        return unpermute(inp, row_id_map, restore_shape, probs)

    def fused_sort_chunks_by_index(inp, split_sizes, sorted_index):
        return sort_chunks(inp, split_sizes, sorted_index, None)[0]

    def fused_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index):
        return sort_chunks(inp, split_sizes, sorted_index, probs)

    return {f.__name__: f for f in (fused_permute, fused_permute_with_probs, fused_unpermute,
                                     fused_sort_chunks_by_index, fused_sort_chunks_by_index_with_probs)}


def _mask_only(map_type):
    if map_type != "mask":
        raise ValueError(f"map_type={map_type!r}: megatron-adapt's permutation takes a routing mask")


def _te_name_builder(name):
    def build(backend, original):
        _require_no_te(original)
        fn = _te_names(backend)[name]
        fn.__megatron_adapt_impl__ = f"{backend.name}.moe ops ({name} signature)"
        return fn
    return build


def _require_no_te(original=None):
    from megatron.core.transformer.moe import moe_utils
    if original is not None or getattr(moe_utils, "HAVE_TE", False):
        raise SkipPatch("Transformer Engine is installed: its fused MoE kernels serve")


# --------------------------------------------------------------------- router gating GEMM
def build_general_gemm(backend, original):
    """moe_utils' RouterGatingLinearFunction calls TE's `general_gemm` under the name
    te_general_gemm, which megatron-core 0.16 leaves unbound without TE (every MoE router then
    fails with a NameError). Created here with TE's layout convention, as the torch.mm its own
    fp64 branch uses: 'TN' -> B @ A^T, 'NN' -> B @ A, 'NT' -> B^T @ A, in out_dtype; returns a
    tuple whose first item is the product, as TE's does."""
    _require_no_te(original)

    def te_general_gemm(A, B, out_dtype, layout="TN", bias=None, grad=False):  # noqa: N803 (TE's names)
        a, b = A.to(out_dtype), B.to(out_dtype)
        if layout == "TN":
            out = b @ a.t() if bias is None else torch.addmm(bias.to(out_dtype), b, a.t())
        elif layout == "NN":
            out = b @ a
        elif layout == "NT":
            out = b.t() @ a
        else:
            raise ValueError(f"layout {layout!r}: the router gating GEMM uses TN, NN and NT")
        if bias is not None and layout != "TN":
            raise ValueError("bias is only added in the forward (TN) product")
        return (out, None, None, None)

    te_general_gemm.__megatron_adapt_impl__ = "torch.mm (router gating GEMM in the router dtype)"
    return te_general_gemm


# --------------------------------------------------------------------- router fusion
def build_topk(backend, original):
    router = backend.op("moe_topk_router")

    def wrapper(wrapped, instance, args, kwargs):
        if not _fused(args, kwargs, 8):
            return wrapped(*args, **kwargs)
        a = _bind(wrapped, args, kwargs)
        if a.get("router_replay") is not None:
            # TE's fused kernel ignores the replay too; Megatron's own path honours it
            report.fell_back("moe_topk_router", "megatron.topk_routing_with_score_function",
                             "router replay needs Megatron's unfused path")
            kwargs = dict(a, fused=False)
            return wrapped(**kwargs)
        why = _unfused_reason(a)
        if why:  # Megatron's own path serves these (reported; MEGATRON_ADAPT_STRICT=1 raises)
            report.fell_back("moe_topk_router", "megatron.topk_routing_with_score_function", why)
            return wrapped(**dict(a, fused=False))
        return router(a["logits"], a["topk"], a["use_pre_softmax"], a["num_groups"], a["group_topk"],
                      a["scaling_factor"], a["score_function"], a["expert_bias"])
    return wrapper


def _unfused_reason(a):
    """What the backend's top-k router does not do (core_v0.17+ arguments, 0.19's score function)."""
    if a.get("dense_output"):
        return "dense_output=True ([tokens, topk] outputs) is Megatron's unfused path's"
    if a.get("precomputed_indices") is not None:
        return "precomputed_indices are Megatron's unfused path's"
    if a["score_function"] not in ("softmax", "sigmoid"):
        return f"score_function={a['score_function']!r}: the backend op has softmax and sigmoid"
    return None


def build_router_scores(backend, original):
    scores = backend.op("moe_router_scores")

    def wrapper(wrapped, instance, args, kwargs):
        if not _fused(args, kwargs, 3):
            return wrapped(*args, **kwargs)
        a = _bind(wrapped, args, kwargs)
        why = _unfused_reason(a)
        if why:
            report.fell_back("moe_router_scores", "megatron.compute_routing_scores_for_aux_loss", why)
            return wrapped(**dict(a, fused=False))
        routing_map, s = scores(a["logits"], a["topk"], a["score_function"])
        mask = a.get("padding_mask")
        if mask is not None:  # as Megatron does after its own (and TE's) computation
            valid = (~mask).unsqueeze(-1)
            routing_map, s = routing_map * valid, s * valid
        return routing_map, s
    return wrapper


def build_aux_loss(backend, original):
    def wrapper(wrapped, instance, args, kwargs):
        if not _fused(args, kwargs, 6):
            return wrapped(*args, **kwargs)
        report.ran("moe_aux_loss", "megatron.formula")
        a = _bind(wrapped, args, kwargs)
        a["fused"] = False
        return wrapped(**a)
    return wrapper


# --------------------------------------------------------------------- split sizes on the host
def build_move_to_cpu(backend, original):
    """The alltoall dispatcher's split sizes go through maybe_move_tensor_to_cpu(as_numpy=True),
    which converts only CUDA tensors; on the cpu and npu backends they stayed tensors, which
    torch's all_to_all_single refuses as split sizes. Any non-host tensor is copied to the host,
    and as_numpy gives numpy wherever the tensor was."""
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if not torch.is_tensor(tensor):
            return tensor
        out = tensor
        if tensor.device.type != "cpu":
            out = tensor.to(torch.device("cpu"), non_blocking=True)
            if record_stream:
                tensor.record_stream(torch.cuda.current_stream())
        return out.numpy() if as_numpy else out
    return maybe_move_tensor_to_cpu


# --------------------------------------------------------------------- uneven TP collectives (gloo)
MAPPINGS = "megatron.core.tensor_parallel.mappings"


def build_gather_uneven(backend, original):
    """With TP + sequence parallelism the alltoall dispatcher all-gathers a different number of
    tokens from each TP rank (output_split_sizes), as a list all_gather that gloo refuses
    ("invalid tensor size"). On the cpu backend the uneven case pads each rank's rows to the
    largest, gathers into one tensor, and drops the padding; the even case is Megatron's."""
    def wrapper(wrapped, instance, args, kwargs):
        a = _bind(wrapped, args, kwargs)
        sizes, group, x = a["output_split_sizes"], a["group"], a["input_"]
        if sizes is None or group is None or group.size() == 1:
            return wrapped(*args, **kwargs)
        sizes = [int(n) for n in sizes]
        most = max(sizes)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        buf = x.new_empty((most * len(sizes), *x.shape[1:]))
        torch.distributed.all_gather_into_tensor(buf, padded.contiguous(), group=group)
        return torch.cat([buf[i * most:i * most + n] for i, n in enumerate(sizes)])
    return wrapper


def build_reduce_scatter_uneven(backend, original):
    """The matching uneven reduce-scatter (input_split_sizes): an all-reduce of the whole input,
    then this rank's rows (gloo has no list reduce_scatter)."""
    def wrapper(wrapped, instance, args, kwargs):
        a = _bind(wrapped, args, kwargs)
        sizes, group, x = a["input_split_sizes"], a["group"], a["input_"]
        if sizes is None or group is None or group.size() == 1:
            return wrapped(*args, **kwargs)
        total = x.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, [int(n) for n in sizes], dim=0)[group.rank()].contiguous()
    return wrapper


# --------------------------------------------------------------------- argument check
def build_validate_args(backend, original):
    """`validate_args` asserts compute capability >= 8 for --moe-grouped-gemm: the grouped_gemm
    package's CUTLASS kernels need it. The backend's grouped_gemm op does not (cpu: a loop; cuda
    below 9.0: a loop reported as a fallback; npu: npu_grouped_matmul), so while validate_args
    runs with --moe-grouped-gemm on a device reporting less, the capability reads (8, 0)."""
    def wrapper(wrapped, instance, args, kwargs):
        ns = args[0] if args else kwargs.get("args")
        if not getattr(ns, "moe_grouped_gemm", False):
            return wrapped(*args, **kwargs)
        capability = torch.cuda.get_device_capability
        try:
            real = tuple(capability())
        except Exception:  # no CUDA device and no device layer answering for one
            real = (0, 0)
        if real >= (8, 0):
            return wrapped(*args, **kwargs)
        torch.cuda.get_device_capability = lambda device=None: (8, 0)
        try:
            return wrapped(*args, **kwargs)
        finally:
            torch.cuda.get_device_capability = capability
    return wrapper


# The legacy GroupedMLP / grouped_gemm_util path and the te_general_gemm name: 0.15-0.16. From 0.17
# (GroupedMLP removed, permute/unpermute/top-k signatures extended) the 0.17+ specs serve.
LEGACY = ">=0.15.0,<0.17.0"
CORE017 = ">=0.17.0,<0.20.0"
VERSIONS = ">=0.15.0,<0.20.0"  # the area as a whole


def _wrap(name, build, versions=VERSIONS):
    return PatchSpec(f"{UTILS}:{name}", area="moe", build=build, mode=WRAP, versions=versions)


LATENT = ">=0.16.0,<0.20.0"   # --moe-latent-size exists from core 0.16
MOE_LAYER = "megatron.core.transformer.moe.moe_layer"


SPECS = [
    # MoELayer asserts HAVE_TE before building the latent projections; in moe_layer.py HAVE_TE
    # guards nothing else (the TE imports at its top have run by then)
    PatchSpec(f"{MOE_LAYER}:HAVE_TE", area="moe", versions=LATENT, check_signature=False,
              build=start_checks.served_without_te("HAVE_TE", True, "MoELayer's latent projections")),
    # the latent projections (hidden -> latent before the dispatcher, back after the combine) are TE's
    # duplicated TELinear, as MLA's down projections: the provider's duplicated linear serves both
    PatchSpec(f"{MOE_LAYER}:TELinear", area="moe", versions=LATENT, build=build_mla_te_linear, create=True,
              check_signature=False),
    PatchSpec(f"{GG}:grouped_gemm", area="moe", versions=LEGACY, build=build_package),
    PatchSpec(f"{GG}:ops", area="moe", versions=LEGACY, build=build_ops),
    PatchSpec(f"{EXPERTS}:GroupedMLP.forward", area="moe", versions=LEGACY, build=build_grouped_mlp_forward),
    PatchSpec("megatron.core.models.backends:LocalSpecProvider.grouped_mlp_modules", area="moe",
              versions=LEGACY, build=build_grouped_mlp_modules_legacy),
    PatchSpec("megatron.core.models.backends:LocalSpecProvider.grouped_mlp_modules", area="moe",
              versions=CORE017, build=build_grouped_mlp_modules),
    _wrap("permute", build_permute, LEGACY),
    _wrap("permute", build_permute_017, CORE017),
    _wrap("unpermute", build_unpermute, LEGACY),
    _wrap("unpermute", build_unpermute_017, CORE017),
    _wrap("sort_chunks_by_idxs", build_sort_chunks),
    _wrap("topk_routing_with_score_function", build_topk),
    _wrap("compute_routing_scores_for_aux_loss", build_router_scores),
    _wrap("switch_load_balancing_loss_func", build_aux_loss),
    PatchSpec(f"{UTILS}:te_general_gemm", area="moe", versions=LEGACY, build=build_general_gemm, create=True),
    PatchSpec(f"{UTILS}:maybe_move_tensor_to_cpu", area="moe", versions=VERSIONS, build=build_move_to_cpu,
              backends=("cpu", "npu")),
    PatchSpec(f"{MAPPINGS}:_gather_along_first_dim", area="moe", versions=VERSIONS, build=build_gather_uneven,
              mode=WRAP, backends=("cpu",)),
    PatchSpec(f"{MAPPINGS}:_reduce_scatter_along_first_dim", area="moe", versions=VERSIONS,
              build=build_reduce_scatter_uneven, mode=WRAP, backends=("cpu",)),
    PatchSpec("megatron.training.arguments:validate_args", area="moe", versions=VERSIONS, build=build_validate_args,
              mode=WRAP, optional=True),
] + [PatchSpec(f"{UTILS}:{name}", area="moe", versions=VERSIONS, build=_te_name_builder(name), create=True)
     for name in ("fused_permute", "fused_permute_with_probs", "fused_unpermute",
                  "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs")]

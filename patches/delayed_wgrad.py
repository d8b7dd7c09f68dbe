"""`--delay-wgrad-compute` on megatron-adapt's linears: TE's split weight-gradient pass, without TE.

Megatron's EP-overlap schedule (`--overlap-moe-expert-parallel-comm`, models/common/
model_chunk_schedule_plan.py) runs each layer's backward for the input gradients only, and calls
`backward_dw()` on the layer's linears later to compute the weight gradients (overlapping them with
the MoE all-to-all). TE's modules built with `delay_wgrad_compute=True` keep what the weight-gradient
GEMM needs in their backward and run it in `backward_dw()`. The linears here do the same:

* `backward` computes the input gradient (and the bias gradient, which needs no GEMM) and stashes
  (input, output gradient); the grouped expert GEMM's weight gradient is the backend's
  `grouped_gemm_wgrad` op;
* `backward_dw()` pops every stashed entry, runs the weight-gradient GEMM and accumulates it as the
  eager backward would: with gradient-accumulation fusion into `weight.main_grad` (Megatron's
  `fused_weight_gradient_mlp_cuda` entry point, i.e. the backend's `wgrad_accumulate` op, as Megatron's
  linear does), flagging `grad_added_to_main_grad` and leaving a dummy `.grad` (DDP's hook asserts a
  grad under --overlap-grad-reduce); otherwise into `weight.grad`;
* then it fires the hooks DDP registered through `register_wgrad_accumulation_and_reduce_hooks`:
  DDP (`ddp_config.delay_wgrad_compute`) registers its grad-ready hook there, not on the weight's
  AccumulateGrad, for every parameter flagged `skip_backward_post_hook` -- here the weights (biases
  get their gradients in the backward and keep the ordinary hook).

Weights keep their names (`weight`; `weight{i}` per expert), so checkpoints are TE's layout.
"""
from __future__ import annotations

from collections import deque

import torch

from megatron_adapt import report
from megatron_adapt.spec import ServesPlainInstances


def delayed(config) -> bool:
    return bool(getattr(config, "delay_wgrad_compute", False))


def refuse_with_fp8(config, what: str) -> None:
    """delay_wgrad_compute together with fp8 / fp4 on a linear: refused where it is built."""
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        from megatron_adapt.errors import UnsupportedFeatureError
        raise UnsupportedFeatureError(
            f"delay_wgrad_compute with fp8/fp4 ({what}): megatron-adapt's fp8 linears compute weight "
            "gradients in the backward. Drop --delay-wgrad-compute or fp8.")


class DelayedWgradMixin:
    """What a module needs for Megatron's delayed-wgrad protocol; `_wgrad_weights()` names its
    weights, `_wgrad_of(entry)` turns a stashed entry into one gradient per weight."""

    delay_wgrad_compute = False
    _wgrad_impl = "megatron-adapt wgrad GEMM"

    def _init_delayed_wgrad(self):
        self.delay_wgrad_compute = True
        self._wgrad_stash: deque = deque()
        self._wgrad_hooks: list = []
        for w in self._wgrad_weights():
            w.skip_backward_post_hook = True

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        """DDP's per-parameter grad-ready hook, fired after the weight gradients are in."""
        self._wgrad_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.delay_wgrad_compute

    def backward_dw(self):
        """The deferred weight-gradient GEMMs of every backward since the last call, then DDP's hooks."""
        if not self.delay_wgrad_compute:
            return
        weights = self._wgrad_weights()
        if self._wgrad_stash:
            report.ran("delayed_wgrad", f"{self._wgrad_impl} (backward_dw)")
        with torch.no_grad():  # Megatron calls it outside autograd; the stash holds graph inputs
            while self._wgrad_stash:
                entry = self._wgrad_stash.popleft()
                fuse = entry[0]
                for w, g in zip(weights, self._wgrad_of(entry)):
                    _accumulate(w, g, fuse)
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    def _trigger_wgrad_accumulation_and_reduce_hooks(self):
        for hook in self._wgrad_hooks:
            hook()


def _accumulate(weight, grad, fuse):
    if fuse and hasattr(weight, "main_grad"):
        _wgrad_accumulate(grad, weight.main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            if weight.grad is None:  # what the eager fused backward leaves (DDP's hook clears it)
                zero = getattr(weight, "zero_out_wgrad", False)
                weight.grad = (torch.zeros_like if zero else torch.empty_like)(weight)
        return
    if isinstance(grad, tuple):  # stashed for the fused entry point, but no main_grad now
        total_input, grad_output = grad
        grad = grad_output.t().matmul(total_input)
    grad = (grad() if callable(grad) else grad).to(weight.dtype)
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


def _wgrad_accumulate(grad, main_grad):
    """`grad` is a tensor, or (input, grad_output) for Megatron's fused wgrad GEMM entry point."""
    if isinstance(grad, tuple):
        from megatron.core.tensor_parallel import layers
        total_input, grad_output = grad
        ext = layers.fused_weight_gradient_mlp_cuda
        fn = ext.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32 else ext.wgrad_gemm_accum_fp16
        fn(total_input, grad_output, main_grad)
    else:
        main_grad.add_(grad)


# ------------------------------------------------------------------ Megatron's parallel linears
class DelayedWgradLinear(torch.autograd.Function):
    """Megatron's LinearWithGradAccumulationAndAsyncCommunication (sequence-parallel all-gather,
    dgrad all-reduce / reduce-scatter) with the weight-gradient GEMM left to `module.backward_dw()`."""

    @staticmethod
    def forward(ctx, input, weight, bias, module, fuse, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.module, ctx.fuse, ctx.use_bias = module, fuse, bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = _all_gather(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

        input, weight = ctx.saved_tensors
        total_input = _all_gather(input, ctx.tp_group) if ctx.sequence_parallel else input
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter(grad_input, ctx.tp_group)
        grad_output_2d, total_input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        ctx.module._wgrad_stash.append((ctx.fuse, total_input_2d.detach(), grad_output_2d.detach()))
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_bias, None, None, None, None, None


def _all_gather(t, group):
    from megatron.core.tensor_parallel import layers
    out = torch.empty((t.shape[0] * group.size(), *t.shape[1:]), dtype=t.dtype, device=t.device)
    layers.dist_all_gather_func(out, t.contiguous(), group=group)
    return out


def _reduce_scatter(t, group):
    from megatron.core.tensor_parallel import layers
    out = torch.empty((t.shape[0] // group.size(), *t.shape[1:]), dtype=t.dtype, device=t.device)
    layers.dist_reduce_scatter_func(out, t.contiguous(), group=group)
    return out


def _linear_wgrad_of(entry):
    """One weight: (input, grad_output) for the fused entry point, else grad_output^T @ input."""
    fuse, total_input, grad_output = entry
    return [(total_input, grad_output) if fuse else (lambda: grad_output.t().matmul(total_input))]


class DelayedWgradLinearMixin(DelayedWgradMixin):
    """For Megatron's ColumnParallelLinear / RowParallelLinear (and subclasses): their forward calls
    `self._forward_impl(input=..., weight=..., bias=..., gradient_accumulation_fusion=...,
    allreduce_dgrad=..., sequence_parallel=..., tp_group=..., ...)`."""

    _wgrad_impl = "backend wgrad_accumulate / torch.matmul (deferred linear)"

    def _wgrad_weights(self):
        return [self.weight]

    _wgrad_of = staticmethod(_linear_wgrad_of)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if args or not weight.requires_grad:  # frozen weight: Megatron's own path, nothing deferred
            return super()._forward_impl(input, weight, *args, **kwargs)
        bias, tp_group = kwargs.get("bias"), kwargs.get("tp_group")
        grad_output_buffer, gtp_remat_size = kwargs.get("grad_output_buffer"), kwargs.get("gtp_remat_size")
        gradient_accumulation_fusion = kwargs.get("gradient_accumulation_fusion", False)
        allreduce_dgrad, sequence_parallel = kwargs.get("allreduce_dgrad"), kwargs.get("sequence_parallel")
        if weight is not self.weight:
            raise NotImplementedError(f"{type(self).__name__}: a weight passed to forward with "
                                      "delay_wgrad_compute (the deferred gradient is the module's own)")
        if grad_output_buffer is not None or (gtp_remat_size or 1) > 1:
            raise NotImplementedError("delay_wgrad_compute with --defer-embedding-wgrad-compute or "
                                      "GTP weight rematerialisation on the same linear")
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        tp_group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
        return DelayedWgradLinear.apply(input, weight, bias, self,
                                        bool(gradient_accumulation_fusion and hasattr(weight, "main_grad")),
                                        allreduce_dgrad, sequence_parallel, tp_group)


_variants: dict = {}


def delayed_wgrad_variant(base, outer=None):
    """`base` (a Megatron column- / row-parallel linear class) deferring its weight gradient when
    built with config.delay_wgrad_compute; built without it, `outer(*args, **kwargs)` (default
    `base`), so other models keep exactly the classes they had."""
    outer = outer or base
    key = (base, outer)
    if key in _variants:
        return _variants[key]

    class DelayedWgrad(DelayedWgradLinearMixin, base, metaclass=ServesPlainInstances):
        plain_class = outer

        def __new__(cls, *args, **kwargs):
            if not args and not kwargs:  # copy / unpickle
                return super().__new__(cls)
            config = kwargs.get("config")
            if not delayed(config):
                return outer(*args, **kwargs)
            refuse_with_fp8(config, base.__name__)
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._init_delayed_wgrad()

    DelayedWgrad.__name__ = DelayedWgrad.__qualname__ = f"DelayedWgrad{base.__name__}"
    _variants[key] = DelayedWgrad
    return DelayedWgrad


# ------------------------------------------------------------------ the grouped expert GEMM
class DelayedWgradGroupedGemm(torch.autograd.Function):
    """`grouped_gemm(x, stack(weights), m_splits, trans_b=True)` (y_e = x_e @ W_e^T) whose backward
    runs the input-gradient grouped GEMM only (dx_e = dy_e @ W_e: the backend's grouped_gemm) and
    stashes (x, dy); `module.backward_dw()` runs the backend's grouped_gemm_wgrad
    (dW_e = dy_e^T @ x_e, [E, out, in]) -- each GEMM once, where Megatron's schedule wants it."""

    @staticmethod
    def forward(ctx, x, m_splits, ops, module, fuse, *weights):
        grouped_gemm = ops[0]
        stacked = torch.stack([w.detach() for w in weights])
        ctx.save_for_backward(x, stacked)
        ctx.m_splits, ctx.ops, ctx.module, ctx.fuse = m_splits, ops, module, fuse
        return grouped_gemm(x.detach(), stacked, m_splits, True)

    @staticmethod
    def backward(ctx, grad_out):
        x, stacked = ctx.saved_tensors
        grouped_gemm, grouped_wgrad = ctx.ops
        grad_out = grad_out.contiguous()
        dx = grouped_gemm(grad_out, stacked, ctx.m_splits, False) if ctx.needs_input_grad[0] else None
        ctx.module._wgrad_stash.append((ctx.fuse, grouped_wgrad, grad_out.detach(), x.detach(), ctx.m_splits))
        return (dx, None, None, None, None, *([None] * stacked.shape[0]))


def _grouped_wgrad_of(entry):
    _, grouped_wgrad, grad_out, x, m_splits = entry
    return list(grouped_wgrad(grad_out, x, m_splits).unbind(0))


class DelayedWgradGroupedMixin(DelayedWgradMixin):
    """For the grouped expert linears (weights `weight0..weight{n-1}`)."""

    _wgrad_impl = "backend grouped_gemm_wgrad (deferred grouped linear)"

    def _wgrad_weights(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    _wgrad_of = staticmethod(_grouped_wgrad_of)

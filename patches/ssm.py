"""Megatron's Mamba and hybrid models (megatron/core/ssm, models/mamba, models/hybrid) without
mamba-ssm, causal-conv1d or Transformer Engine.

Megatron's Mamba mixer imports its kernels by name at module import, each in a try/except that
leaves a placeholder when the package is missing: `mamba_chunk_scan_combined` and
`mamba_split_conv1d_scan_combined` (None), `causal_conv1d_fn` (None), `RMSNormGated` and the
`ExtendedRMSNorm` built on it (MagicMocks), `HAVE_MAMBA_SSM = False` (the mixer refuses to build).
Those module globals are the seam: this area binds them to adapters over the backend's Mamba-2
ops (megatron_adapt.ops: `ssd_scan`, `causal_conv1d`, `rms_norm_gated`) and sets
HAVE_MAMBA_SSM. No `mamba_ssm` or `causal_conv1d` package is faked: nothing is put in
sys.modules, and Megatron's version checks of those packages still see them absent (the
sequence-packing check is replaced: training with packed sequences is served; dynamic-batching
inference, which needs causal-conv1d's varlen kernels, is refused naming the reason).

The layer specs: Megatron's Mamba / hybrid stack specs (`mamba_stack_spec`, from core_v0.18
`hybrid_stack_spec`) are built at import from TE's classes, which without TE are MagicMocks. Each
spec object is replaced by a copy whose TE leaves are the modules of megatron-adapt's TE spec
provider (patches/layer_specs): TELayerNormColumnParallelLinear -> the norm-fused column-parallel
linear with TE's parameter names (`in_proj.layer_norm_weight`), TERowParallelLinear /
TEColumnParallelLinear -> Megatron's parallel linears, TEDotProductAttention -> the backend's
attention, TENorm -> the backend norm. So a model built from it has the state-dict keys of a
TE-built one. A TE leaf with no equivalent refuses at construction, naming it. The block's final
norm calls `TENorm` directly: it is bound to the backend norm.

Decoding (core_v0.17+): the mixer calls Megatron's own Triton kernels `causal_conv1d_update` and
`selective_state_update`; on the cpu and npu backends they are bound to the backend's
`ssm_conv_update` / `ssm_state_update` ops (on cuda Megatron's kernels serve).

With mamba-ssm (or causal-conv1d, or TE) installed, Megatron's own imports serve and the
corresponding specs here step aside.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from megatron_adapt.spec import PatchSpec, SkipPatch

from .layer_specs import BackendNorm, build_provider, build_provider_with_residual_norms

MIXER = "megatron.core.ssm.mamba_mixer"
MAMBA_PRESENT = "mamba-ssm is installed: its own kernels serve"
CONV_PRESENT = "causal-conv1d is installed: its own kernel serves"
TE_PRESENT = "Transformer Engine is installed: its own modules serve"


def _mixer():
    import sys

    return sys.modules[MIXER]


def _require_no_mamba_ssm():
    if getattr(_mixer(), "HAVE_MAMBA_SSM", False) is True and not _ours(_mixer(), "HAVE_MAMBA_SSM"):
        raise SkipPatch(MAMBA_PRESENT)


def _ours(module, name):
    from megatron_adapt import applier

    inst = applier.installed().get(f"{module.__name__}:{name}")
    return inst is not None and getattr(module, name) is inst.new


def _require_no_te():
    from megatron.core.extensions import transformer_engine as te_ext

    if getattr(te_ext, "HAVE_TE", False):
        raise SkipPatch(TE_PRESENT)


# ----------------------------------------------------------------------------- the mixer's kernels
def build_have_mamba_ssm(backend, original):
    if original is True:
        raise SkipPatch(MAMBA_PRESENT)
    return True


def build_has_state_dtype(backend, original):
    """core_v0.19: the mixer passes `state_dtype` (--mamba-training-ssm-states-dtype) only when
    the kernels take it; ours do."""
    _require_no_mamba_ssm()
    return True


def _refuse(what: str, why: str):
    raise NotImplementedError(f"{what}: {why} (megatron-adapt serves Megatron's Mamba training "
                              "path; install mamba-ssm for this)")


def build_chunk_scan(backend, original):
    _require_no_mamba_ssm()
    scan = backend.op("ssd_scan")

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None,
                                  dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False,
                                  state_dtype=None):
        """mamba-ssm's mamba_chunk_scan_combined on the backend's ssd_scan op."""
        if cu_seqlens is not None or return_varlen_states:
            _refuse("mamba_chunk_scan_combined(cu_seqlens=..., return_varlen_states=True)",
                    "per-sequence final states of a packed batch are an inference feature")
        out = scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                   dt_limit=dt_limit, initial_states=initial_states, seq_idx=seq_idx,
                   return_final_states=return_final_states)
        if return_final_states and state_dtype is not None:
            return out[0], out[1].to(state_dtype)
        return out

    return mamba_chunk_scan_combined


def build_split_conv1d_scan(backend, original):
    _require_no_mamba_ssm()
    scan, conv, norm = backend.op("ssd_scan"), backend.op("causal_conv1d"), backend.op("rms_norm_gated")

    def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                         chunk_size, initial_states=None, seq_idx=None,
                                         dt_limit=(0.0, float("inf")), return_final_states=False,
                                         activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                         outproj_weight=None, outproj_bias=None, headdim=None,
                                         ngroups=1, norm_before_gate=True, state_dtype=None):
        """mamba-ssm's fused in_proj-output path: split [z, xBC, dt], causal conv1d + activation
        over xBC, split [x, B, C], the SSD scan (dt softplus, D, z-gated unless an RMSNorm weight
        is given, which then normalises with the z gate), optionally the out projection."""
        if D.dim() == 1:
            if headdim is None:
                raise ValueError("mamba_split_conv1d_scan_combined: D of shape [nheads] needs headdim")
            nheads = D.size(0)
        else:
            nheads, headdim = D.shape
        dim = nheads * headdim
        dstate = (conv1d_weight.size(0) - dim) // ngroups // 2
        b, l, width = zxbcdt.shape
        if width != 2 * dim + 2 * ngroups * dstate + nheads:
            _refuse("mamba_split_conv1d_scan_combined", f"an input projection of width {width} "
                    f"carries extra (non-SSM) channels beyond z, x, B, C, dt ({2 * dim + 2 * ngroups * dstate + nheads})")
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        xbc = conv(xbc, conv1d_weight, conv1d_bias, activation, seq_idx)
        x, B, C = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        out = scan(x.reshape(b, l, nheads, headdim), dt, A, B.reshape(b, l, ngroups, dstate),
                   C.reshape(b, l, ngroups, dstate), chunk_size, D=D,
                   z=z.reshape(b, l, nheads, headdim) if rmsnorm_weight is None else None,
                   dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit,
                   initial_states=initial_states, seq_idx=seq_idx,
                   return_final_states=return_final_states)
        y, final = out if return_final_states else (out, None)
        y = y.reshape(b, l, dim)
        if rmsnorm_weight is not None:
            y = norm(y, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups, norm_before_gate)
        if outproj_weight is not None:
            y = torch.nn.functional.linear(y, outproj_weight, outproj_bias)
        if final is None:
            return y
        return y, (final if state_dtype is None else final.to(state_dtype))

    return mamba_split_conv1d_scan_combined


def build_causal_conv1d_fn(backend, original):
    if original is not None:
        raise SkipPatch(CONV_PRESENT)
    conv = backend.op("causal_conv1d")

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, activation=None):
        """causal-conv1d's causal_conv1d_fn (x [b, d, l]) on the backend's causal_conv1d op."""
        if initial_states is not None or return_final_states or final_states_out is not None:
            _refuse("causal_conv1d_fn(initial_states / final states)", "conv states are an "
                    "inference-cache feature")
        return conv(x.transpose(1, 2), weight, bias, activation, seq_idx).transpose(1, 2)

    return causal_conv1d_fn


def build_conv_update(backend, original):
    """core_v0.17+: the mixer's decode step calls Megatron's own Triton `causal_conv1d_update`
    (imported unconditionally); on a backend without a CUDA device it is the backend's
    ssm_conv_update op, with the same arguments and in-place state update (cpu and npu: on cuda
    Megatron's kernel runs)."""
    update = backend.op("ssm_conv_update")

    def causal_conv1d_update(x, conv_state, weight, bias, silu_activation, conv_state_indices,
                             intermediate_conv_states=None):
        return update(x, conv_state, weight, bias, bool(silu_activation), conv_state_indices,
                      intermediate_conv_states)

    return causal_conv1d_update


def build_state_update(backend, original):
    """core_v0.17+: Megatron's own Triton `selective_state_update` (decode), as build_conv_update."""
    update = backend.op("ssm_state_update")

    def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=False, state_batch_indices=None,
                               intermediate_ssm_states=None):
        return update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                      intermediate_ssm_states)

    return selective_state_update


def build_sequence_packing_check(backend, original):
    _require_no_mamba_ssm()

    def _check_mamba_sequence_packing_support(for_inference_not_training: bool = True):
        """Packed sequences: training is served (seq_idx through the backend's scan and conv);
        dynamic-batching inference needs causal-conv1d's varlen-state kernel."""
        if for_inference_not_training:
            return False, ("megatron-adapt serves Mamba training with packed sequences, not "
                           "dynamic-batching inference (causal-conv1d's causal_conv1d_varlen_states "
                           "and conv-state cache): install mamba-ssm and causal-conv1d for it")
        return True, None

    return _check_mamba_sequence_packing_support


# ----------------------------------------------------------------------------- gated RMSNorm
def build_rms_norm_gated(backend, original):
    _require_no_mamba_ssm()
    op = backend.op("rms_norm_gated")

    class GatedRMSNorm(torch.nn.Module):
        """mamba-ssm's gated RMSNorm module (layernorm_gated.RMSNorm): the same constructor,
        parameter (`weight`; `bias` None) and forward(x, z=None), on the backend's
        rms_norm_gated op."""

        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                     device=None, dtype=None):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)
            self.reset_parameters()

        def reset_parameters(self):
            torch.nn.init.ones_(self.weight)

        def forward(self, x, z=None):
            return op(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate)

    return GatedRMSNorm


def build_extended_rms_norm(backend, original):
    """Megatron's ExtendedRMSNorm: the gated RMSNorm whose weight is sharded along dim 0 over TP
    in distributed checkpoints (class built once per backend, shared with RMSNormGated's)."""
    _require_no_mamba_ssm()
    base = _built_norm(backend)

    class ExtendedGatedRMSNorm(base):
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            from megatron.core import parallel_state
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
                tp_group=tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return ExtendedGatedRMSNorm


_norms: dict[str, type] = {}


def _built_norm(backend):
    if backend.name not in _norms:
        _norms[backend.name] = build_rms_norm_gated(backend, None)
    return _norms[backend.name]


def build_rms_norm_gated_shared(backend, original):
    _require_no_mamba_ssm()
    return _built_norm(backend)


# ----------------------------------------------------------------------------- layer specs
class BackendTENorm(BackendNorm):
    """TENorm's constructor for the code that calls TENorm itself (the Mamba / hybrid block's
    final norm): the backend norm."""


def build_te_norm(backend, original):
    _require_no_te()
    return BackendTENorm


class _Unserved:
    name = "?"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"this layer spec names Transformer Engine's {self.name}, which megatron-adapt has no "
            "equivalent for (TE is not installed); choose a layer pattern or spec without it")


def _te_leaf_table(provider):
    """{id(TE placeholder): module}: what each TE name of Megatron's spec modules becomes."""
    from megatron.core.extensions import transformer_engine as te_ext

    wanted = {
        "TELayerNormColumnParallelLinear": provider.column_parallel_layer_norm_linear,
        "TEColumnParallelLinear": provider.column_parallel_linear,
        "TERowParallelLinear": provider.row_parallel_linear,
        "TEDotProductAttention": provider.core_attention,
        "TELinear": provider.linear,
        "TENorm": provider.layer_norm,
    }
    table, names = {}, {}
    for name, value in vars(te_ext).items():
        if name.startswith("TE") and value is not None:
            names[id(value)] = name
            if name in wanted:
                table[id(value)] = wanted[name]()
    return table, names


def _is_te_placeholder(obj):
    """A TE class as Megatron defines it without TE: a MagicMock (or the TENorm class)."""
    from unittest import mock

    return isinstance(obj, mock.NonCallableMock) or (
        getattr(obj, "__qualname__", None) == "TENorm"
        and getattr(obj, "__module__", "") == "megatron.core.extensions.transformer_engine")


def rewrite_spec(spec, table, names, provider):
    """A copy of a ModuleSpec tree with each TE placeholder leaf replaced (shared sub-specs stay
    shared; Megatron's own spec objects are never modified)."""
    done: dict[int, object] = {}

    def walk(obj):
        key = id(obj)
        if key in done:
            return done[key]
        if key in table:
            new = table[key]
        elif _is_te_placeholder(obj):
            if getattr(obj, "__qualname__", None) == "TENorm":
                new = provider.layer_norm()
            else:
                new = type(f"Unserved{names.get(key, 'TE')}", (_Unserved,),
                           {"name": names.get(key, "a TE module")})
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            if all(fields[k] is getattr(obj, k) for k in fields):
                new = obj
            else:
                new = copy.copy(obj)
                for k, v in fields.items():
                    object.__setattr__(new, k, v)
        elif isinstance(obj, functools.partial):
            func, args = walk(obj.func), [walk(a) for a in obj.args]
            kw = {k: walk(v) for k, v in obj.keywords.items()}
            same = func is obj.func and all(a is b for a, b in zip(args, obj.args)) and all(
                kw[k] is obj.keywords[k] for k in kw)
            new = obj if same else functools.partial(func, *args, **kw)
        elif isinstance(obj, dict):
            items = {k: walk(v) for k, v in obj.items()}
            new = obj if all(items[k] is obj[k] for k in items) else type(obj)(items)
        elif isinstance(obj, (list, tuple)):
            items = [walk(o) for o in obj]
            new = obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
        else:
            new = obj
        done[key] = new
        return new

    return walk(spec)


_specs: dict[tuple, object] = {}


def _spec_builder(provider_builder):
    def build(backend, original):
        _require_no_te()
        key = (backend.name, id(original))
        if key not in _specs:
            provider = provider_builder(backend, None)()
            table, names = _te_leaf_table(provider)
            _specs[key] = (rewrite_spec(original, table, names, provider), original)
        return _specs[key][0]
    return build


build_spec_015 = _spec_builder(build_provider)                       # core_v0.15 - v0.16
build_spec_017 = _spec_builder(build_provider_with_residual_norms)  # core_v0.17 on


def _stack_specs():
    old, new = ">=0.15.0,<0.18.0", ">=0.18.0,<0.20.0"
    mamba, hybrid = "megatron.core.models.mamba.mamba_layer_specs", "megatron.core.models.hybrid.hybrid_layer_specs"
    return [
        PatchSpec(f"{mamba}:mamba_stack_spec", area="ssm", build=build_spec_015, versions=">=0.15.0,<0.17.0"),
        PatchSpec(f"{mamba}:mamba_stack_spec", area="ssm", build=build_spec_017, versions=">=0.17.0,<0.18.0"),
        *(PatchSpec(f"{module}:{name}", area="ssm", build=build_spec_017, versions=new)
          for module in (hybrid, mamba) for name in ("hybrid_stack_spec", "mamba_stack_spec")),
        PatchSpec("megatron.core.ssm.mamba_block:TENorm", area="ssm", build=build_te_norm, versions=old),
        PatchSpec("megatron.core.models.hybrid.hybrid_block:TENorm", area="ssm", build=build_te_norm,
                  versions=new),
    ]


SPECS = [
    PatchSpec(f"{MIXER}:mamba_chunk_scan_combined", area="ssm", build=build_chunk_scan, create=True),
    PatchSpec(f"{MIXER}:mamba_split_conv1d_scan_combined", area="ssm", build=build_split_conv1d_scan,
              create=True),
    PatchSpec(f"{MIXER}:causal_conv1d_fn", area="ssm", build=build_causal_conv1d_fn),
    PatchSpec(f"{MIXER}:RMSNormGated", area="ssm", build=build_rms_norm_gated_shared, check_signature=False),
    PatchSpec(f"{MIXER}:ExtendedRMSNorm", area="ssm", build=build_extended_rms_norm, check_signature=False),
    PatchSpec(f"{MIXER}:causal_conv1d_update", area="ssm", build=build_conv_update, versions=">=0.17.0",
              backends=("cpu", "npu")),
    PatchSpec(f"{MIXER}:selective_state_update", area="ssm", build=build_state_update, versions=">=0.17.0",
              backends=("cpu", "npu")),
    PatchSpec(f"{MIXER}:_check_mamba_sequence_packing_support", area="ssm",
              build=build_sequence_packing_check, versions=">=0.16.0,<0.20.0"),
    PatchSpec(f"{MIXER}:MAMBA_HAS_STATE_DTYPE", area="ssm", build=build_has_state_dtype,
              versions=">=0.19.0,<0.20.0"),
    # last: the checks above read HAVE_MAMBA_SSM as Megatron set it
    PatchSpec(f"{MIXER}:HAVE_MAMBA_SSM", area="ssm", build=build_have_mamba_ssm),
    *_stack_specs(),
]

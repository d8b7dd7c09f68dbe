"""Grouped MoE experts with bias (Megatron's default --add-bias-linear) on megatron-core 0.15 - 0.16:
Megatron's MoELayer built from its real specs under megatron-adapt (cpu backend, one process),
against the same layer with Megatron's own SequentialMLP (local experts on ColumnParallelLinear /
RowParallelLinear), same weights. Prints PROBE-JSON: the experts' classes, forward and backward
differences (output, input, router, every expert weight and bias), three SGD steps of both, the
dist-checkpoint keys of both, a SequentialMLP checkpoint loaded into the grouped experts, and
what builds without biases (GroupedMLP, against SequentialMLP too), with
--moe-use-legacy-grouped-gemm, and a TE-built model's expert checkpoint into and out of GroupedMLP."""
import dataclasses
import json
import os
import sys
import tempfile
import types
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import one_rank_env  # noqa: E402

one_rank_env()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

E, H = 4, 32


def config(**kw):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=48, num_moe_experts=E,
                moe_ffn_hidden_size=24, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, add_bias_linear=True,
                moe_grouped_gemm=True,
                bias_dropout_fusion=False,  # TEGroupedMLP asserts it off with bias (as with TE)
                gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def moe_layer(cfg, spec):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return build_module(spec.submodules.mlp, config=cfg, pg_collection=_pgs())


def _pgs():
    from megatron.core.process_groups_config import ProcessGroupCollection
    return ProcessGroupCollection.use_mpu_process_groups()


def te_spec(**kw):
    return get_gpt_layer_with_transformer_engine_spec(num_experts=E, moe_grouped_gemm=True, **kw)


def sequential_spec():
    return get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)


def grouped_to_sequential(grouped):
    """The grouped experts' parameters under SequentialMLP's names (same tensors)."""
    out = {}
    for name, p in grouped.named_parameters():
        if ".linear_fc" in name:
            head, linear, leaf = name.rsplit(".", 2)   # experts.linear_fc1.weight3
            kind, i = leaf.rstrip("0123456789"), leaf[len(leaf.rstrip("0123456789")):]
            out[f"{head}.local_experts.{i}.{linear}.{kind}"] = p
        else:
            out[name] = p
    return out


def run(layer, hidden):
    h = hidden.clone().requires_grad_()
    y, bias = layer(h)
    assert bias is None
    loss = (y * torch.linspace(-1, 1, H)).sum()   # the aux loss reaches the router too
    loss.backward()
    return y.detach(), h.grad


def _copied_output(forward):
    def fc2(*args, **kwargs):
        out, bias = forward(*args, **kwargs)
        return out.clone(), bias
    return fc2


def max_diff(a, b):
    """Largest |a - b|; inf where either has a NaN (max() over NaNs would hide them)."""
    d = (a.float() - b.float()).abs()
    return float("inf") if bool(d.isnan().any()) else float(d.max())


def compare(cfg, spec):
    # Megatron's MLP refuses its fused weighted SwiGLU with a bias (the grouped experts add fc1's
    # bias inside the linear, so the fusion takes none): the reference runs it unfused
    grouped = moe_layer(cfg, spec)
    # (and SequentialMLP recomputes no moe_act: Megatron allows it with grouped GEMM only)
    sequential = moe_layer(dataclasses.replace(cfg, bias_activation_fusion=False, moe_grouped_gemm=False,
                                               recompute_granularity=None), sequential_spec())
    for expert in sequential.experts.local_experts:
        # with one TP rank RowParallelLinear returns its reduce's input as-is, which MLP's
        # `output += bias * probs` then modifies in place: autograd refuses (Megatron's MLP, any
        # backend). The reference takes a copy of fc2's output; the numbers are unchanged.
        expert.linear_fc2.forward = _copied_output(expert.linear_fc2.forward)
    mapped = grouped_to_sequential(grouped)
    seq_params = dict(sequential.named_parameters())
    assert set(mapped) == set(seq_params), (sorted(set(mapped) ^ set(seq_params)))
    with torch.no_grad():
        for name, p in mapped.items():
            if name == "router.weight" or name.startswith("experts.") and name.endswith("bias"):
                p.normal_()    # biases start at zero: make them count; spread the routing
            elif name == "router.bias":
                p.zero_()      # core_v0.15's TopKRouter leaves it torch.empty (0.16 initialises it)
            seq_params[name].copy_(p)
    hidden = torch.randn(16, 2, H)
    before = sum(report.op_counts().get("grouped_gemm", {}).values())
    yg, dg = run(grouped, hidden)
    calls = sum(report.op_counts().get("grouped_gemm", {}).values()) - before
    ys, ds = run(sequential, hidden)
    grads = {n: max_diff(p.grad, seq_params[n].grad) for n, p in mapped.items()}
    res = {"experts": type(grouped.experts).__name__, "reference": type(sequential.experts).__name__,
           "linears": [type(grouped.experts.linear_fc1).__name__, type(grouped.experts.linear_fc2).__name__],
           "grouped_gemm_calls": calls, "recomputes_act": bool(grouped.experts.activation_recompute),
           "out_diff": max_diff(yg, ys), "input_grad_diff": max_diff(dg, ds),
           "param_grad_diff": max(grads.values()), "params": len(grads),
           "bias_grads_zero": sorted(n for n, p in mapped.items()
                                     if ".linear_fc" in n and n.endswith("bias") and not bool(p.grad.abs().sum() > 0)),
           "out_norm": float(yg.norm())}
    # three SGD steps of each: the same trajectory
    losses = {}
    for tag, layer, params in (("grouped", grouped, list(mapped.values())),
                               ("sequential", sequential, [seq_params[n] for n in mapped])):
        opt = torch.optim.SGD(params, lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses[tag] = []
        for _ in range(3):
            opt.zero_grad()
            y, _ = layer(torch.randn(8, 2, H, generator=g))
            loss = y.square().mean()
            loss.backward()
            opt.step()
            losses[tag].append(loss.item())
    res["losses"] = losses
    res["weights_after_diff"] = max(max_diff(p, seq_params[n]) for n, p in mapped.items())
    res["grouped_keys"] = sorted(grouped.state_dict())
    return res, grouped, sequential


def legacy_matches_sequential(legacy, cfg):
    """GroupedMLP (its forward on the backend's grouped_gemm, fp32: stock takes bf16 only) against
    SequentialMLP, same weights:
    expert i's fc1 is weight1.view(E, in, out)[i]^T."""
    sequential = moe_layer(cfg, sequential_spec())
    w1 = legacy.experts.weight1.view(E, H, -1)
    w2 = legacy.experts.weight2.view(E, -1, H)
    with torch.no_grad():
        for p in (legacy.router.weight, legacy.experts.weight1, legacy.experts.weight2):
            p.normal_()
        sequential.router.weight.copy_(legacy.router.weight)
        for i, expert in enumerate(sequential.experts.local_experts):
            expert.linear_fc1.weight.copy_(w1[i].t())
            expert.linear_fc2.weight.copy_(w2[i].t())
    hidden = torch.randn(16, 2, H)
    before = sum(report.op_counts().get("grouped_gemm", {}).values())
    yl, dl = run(legacy, hidden)
    calls = sum(report.op_counts().get("grouped_gemm", {}).values()) - before
    ys, ds = run(sequential, hidden)
    g1 = torch.stack([e.linear_fc1.weight.grad.t() for e in sequential.experts.local_experts])
    g2 = torch.stack([e.linear_fc2.weight.grad.t() for e in sequential.experts.local_experts])
    def rel(a, b):
        return max_diff(a, b) / float(b.abs().max())
    return {"grouped_gemm_calls": calls, "out_norm": float(yl.norm()), "out_rel_diff": rel(yl, ys),
            "input_grad_rel_diff": rel(dl, ds),
            "weight_grad_rel_diff": max(rel(legacy.experts.weight1.grad.view(E, H, -1), g1),
                                        rel(legacy.experts.weight2.grad.view(E, -1, H), g2))}


def te_grouped_spec(spec):
    """The layer spec with TEGroupedMLP experts on the backend's grouped linears whatever the bias:
    the module tree and sharded layout a TE-built model has."""
    import copy

    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    import megatron_adapt
    from megatron_adapt.patches.moe import grouped_linear_classes

    column, row = grouped_linear_classes(megatron_adapt.active_backend())
    spec = copy.deepcopy(spec)
    spec.submodules.mlp.submodules.experts = ModuleSpec(
        module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))
    return spec


def _expert_weights(layer):
    """[E, out, in] fc1 and fc2 weights of TEGroupedMLP's grouped linears or GroupedMLP's stacked ones."""
    x = layer.experts
    if hasattr(x, "weight1"):
        return (x.weight1.detach().view(E, H, -1).transpose(1, 2), x.weight2.detach().view(E, -1, H).transpose(1, 2))
    return tuple(torch.stack([getattr(lin, f"weight{i}").detach() for i in range(E)])
                 for lin in (x.linear_fc1, x.linear_fc2))


def checkpoint_roundtrip(a, b):
    """a's dist checkpoint loaded into b, then b's (changed) into a: expert weights equal each time."""
    out = {}
    for tag, src, dst in (("forward", a, b), ("back", b, a)):
        with torch.no_grad():
            for p in src.experts.parameters():
                p.add_(torch.randn_like(p))
        before = max(max_diff(s, d) for s, d in zip(_expert_weights(src), _expert_weights(dst)))
        with tempfile.TemporaryDirectory() as d:
            dist_checkpointing.save(src.sharded_state_dict(prefix="mlp."), d)
            # the grouped linears keep no _extra_state (TE's hold fp8 metadata there; GroupedMLP
            # asks for it): the load logs those keys as missing instead of refusing
            loaded = dist_checkpointing.load(dst.sharded_state_dict(prefix="mlp."), d,
                                             strict=dist_checkpointing.validation.StrictHandling.LOG_ALL)
        dst.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=False)
        after = max(max_diff(s, d) for s, d in zip(_expert_weights(src), _expert_weights(dst)))
        out[tag] = {"diff_before_load": before, "loaded_diff": after}
    return out


def checkpoint(grouped, sequential):
    """SequentialMLP's dist checkpoint loaded into the grouped experts: Megatron keeps the sharded
    keys of both the same (experts.linear_fc1.weight with a global expert axis, ...)."""
    sg, ss = grouped.sharded_state_dict(prefix="mlp."), sequential.sharded_state_dict(prefix="mlp.")

    def keys(sd):   # ShardedTensors, and the SwiGLU fc1's ShardedTensorFactory (both have a key)
        return sorted({(v.key, tuple(getattr(v, "global_shape", v.data.shape))) for v in sd.values()
                       if "_extra_state" not in v.key})
    out = {"same_sharded_keys": keys(sg) == keys(ss), "sharded_keys": [k for k, _ in keys(sg)]}
    with torch.no_grad():      # distinct values on the reference, then through a checkpoint
        for p in sequential.experts.parameters():
            p.add_(torch.randn_like(p))
    seq_params = dict(sequential.named_parameters())
    out["diff_before_load"] = min(max_diff(p, seq_params[n]) for n, p in grouped_to_sequential(grouped).items()
                                  if n.startswith("experts."))
    with tempfile.TemporaryDirectory() as d:
        dist_checkpointing.save(sequential.sharded_state_dict(prefix="mlp."), d)
        loaded = dist_checkpointing.load(grouped.sharded_state_dict(prefix="mlp."), d,
                                         strict=dist_checkpointing.validation.StrictHandling.LOG_ALL)
    grouped.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=False)
    out["loaded_diff"] = max(max_diff(p, seq_params[n]) for n, p in grouped_to_sequential(grouped).items())
    return out


def upcycled(cfg):
    """A dense MLP (no bias) upcycled by Megatron's upcycling_utils into the experts
    the TE spec builds for `cfg` (granularity 1: every expert a copy of the dense MLP, and the top-2
    probabilities sum to 1, so the layer's output is the dense MLP's)."""
    from megatron.core.transformer.moe import upcycling_utils
    from megatron.core.transformer.mlp import MLP

    assert cfg.moe_router_topk == 2 and not cfg.moe_router_pre_softmax
    moe = moe_layer(cfg, te_spec())
    dense_spec = get_gpt_layer_local_spec().submodules.mlp   # no norm fused into fc1: the MoE layer has none
    dense = build_module(dense_spec, config=dataclasses.replace(cfg, num_moe_experts=None, moe_ffn_hidden_size=None,
                                                                ffn_hidden_size=cfg.moe_ffn_hidden_size))
    assert isinstance(dense, MLP), type(dense)
    class Holder(torch.nn.Module):   # what upcycling_utils looks for: a submodule named "mlp"
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

    state = upcycling_utils.upcycle_state_dict([Holder(moe)], [Holder(dense)])["model"]
    Holder(moe).load_state_dict(state, strict=True)
    hidden = torch.randn(8, 2, cfg.hidden_size)
    with torch.no_grad():
        want, got = dense(hidden)[0], moe(hidden)[0]
    return {"experts": type(moe.experts).__name__, "out_norm": float(want.norm()),
            "rel_diff": float((want - got).abs().max() / want.abs().max())}


def main():
    """Under __main__ only: dist_checkpointing.save starts a process that imports this file."""
    import megatron_adapt
    from megatron_adapt import report

    megatron_adapt.apply("cpu", quiet=True)

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    globals().update(report=report, dist_checkpointing=dist_checkpointing,
                     get_gpt_layer_local_spec=get_gpt_layer_local_spec,
                     get_gpt_layer_with_transformer_engine_spec=get_gpt_layer_with_transformer_engine_spec,
                     model_parallel_cuda_manual_seed=model_parallel_cuda_manual_seed,
                     TransformerConfig=TransformerConfig, build_module=build_module)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    cfg = config()
    results["te_spec_swiglu"], grouped, sequential = compare(cfg, te_spec())
    results["checkpoint"] = checkpoint(grouped, sequential)
    # GeLU without a gated unit and without the fused bias-activation (TEGroupedMLP's plain branch),
    # through the local spec (--transformer-impl local)
    results["local_spec_gelu"] = compare(config(gated_linear_unit=False, activation_func=F.gelu,
                                                bias_activation_fusion=False),
                                         get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True))[0]
    # --recompute-modules moe_act (what Megatron's fine-grained offloading test sets for MoE): the
    # biased fc1 output's activation recomputed in the backward
    results["recompute_moe_act"] = compare(config(recompute_granularity="selective", recompute_modules=["moe_act"]),
                                           te_spec())[0]
    # without biases the default spec keeps Megatron's GroupedMLP (its forward on the backend op)
    plain_cfg = config(add_bias_linear=False)
    plain = moe_layer(plain_cfg, te_spec())
    results["no_bias"] = {"experts": type(plain.experts).__name__, **legacy_matches_sequential(plain, plain_cfg)}
    # --moe-use-upcycling (Megatron's global args): TEGroupedMLP, which upcycling_utils converts into
    # (it refuses the legacy GroupedMLP); the dense MLP's weights upcycled, the layer matches it
    try:
        from megatron.training import global_vars
    except ImportError:   # Megatron-LM's training package is not on PyPI: its module, as set_args leaves it
        global_vars = sys.modules.setdefault("megatron.training.global_vars",
                                             types.ModuleType("megatron.training.global_vars"))
    global_vars._GLOBAL_ARGS = types.SimpleNamespace(moe_use_upcycling=True)
    try:
        results["upcycling"] = upcycled(plain_cfg)
    finally:
        global_vars._GLOBAL_ARGS = None
    # --moe-use-legacy-grouped-gemm: GroupedMLP, which refuses a bias (its own assertion, with TE too)
    legacy_cfg = config(add_bias_linear=False, moe_use_legacy_grouped_gemm=True)
    legacy = moe_layer(legacy_cfg, te_spec(moe_use_legacy_grouped_gemm=True))
    results["legacy_flag"] = {"experts": type(legacy.experts).__name__}
    try:
        moe_layer(dataclasses.replace(legacy_cfg, add_bias_linear=True), te_spec(moe_use_legacy_grouped_gemm=True))
        results["legacy_flag"]["with_bias"] = "built"
    except AssertionError as exc:
        results["legacy_flag"]["with_bias"] = str(exc)
    # a TE-built model's experts without biases (TEGroupedMLP: grouped linears with TE's names and
    # sharding) checkpointed, loaded into the GroupedMLP built here for the same flags, and back
    te_built = moe_layer(plain_cfg, te_grouped_spec(te_spec()))
    results["te_checkpoint"] = {"source": type(te_built.experts).__name__, "target": type(plain.experts).__name__}
    results["te_checkpoint"].update(checkpoint_roundtrip(te_built, plain))
    print("PROBE-JSON:" + json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Reach every patch through Megatron's real consumer, in a fresh interpreter; print JSON findings.

Each check calls the Megatron object that uses the patched symbol (GPTModel's loss, the local
layer spec's norms and attention, MLP, the optimizer factory, grad clipping, the RNG tracker),
compares with Megatron's original implementation where one runs on CPU, and records which op
implementation counted the call.
"""
import dataclasses
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import probe_port  # noqa: E402  (a free port: two test runs may share the machine)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=probe_port(),
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import applier, report  # noqa: E402

megatron_adapt.apply("cpu", quiet=True)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

dist.init_process_group("nccl")  # the device layer maps it to gloo
parallel_state.initialize_model_parallel(1, 1)
torch.manual_seed(0)
model_parallel_cuda_manual_seed(0)
results = {}


def original(target):
    return applier.installed()[target].original


def counted(op):
    return sum(report.op_counts().get(op, {}).values())


def close(a, b, tol=1e-5):
    return bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))


def make_model(**overrides):
    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
              persist_layer_norm=True, masked_softmax_fusion=True)
    pos = overrides.pop("position_embedding_type", "learned_absolute")
    kw.update(overrides)
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(config, spec, vocab_size=64, max_sequence_length=16, position_embedding_type=pos), config


def check(name):
    def deco(fn):
        try:
            results[name] = fn()
        except Exception as exc:  # the test reports the failure with its message
            import traceback
            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        return fn
    return deco


@check("package_versions")
def _():
    """Megatron's unit-test conftest asks is_te_min_version("1.3") in an autouse fixture, its test
    modules is_fa_min_version(...) at import; the bert module holds its own alias of get_te_version.
    Without the packages: 0.0.0, never a TypeError / ModuleNotFoundError."""
    import importlib.util

    from megatron.core import utils
    from megatron.core.models.bert import bert_model
    from megatron_adapt.versions import in_range, megatron_core_version

    version = megatron_core_version()
    out = {"absent": {p: importlib.util.find_spec(p) is None
                      for p in ("transformer_engine", "flash_attn", "mamba_ssm", "causal_conv1d")},
           # the bert module's own alias (0.15-0.16; gone from later releases): None where absent
           "bert_alias_ours": (bert_model._get_te_version is utils.get_te_version
                               if hasattr(bert_model, "_get_te_version") else None)}
    helpers = ["te", "fa"] + (["mamba", "causal_conv1d"] if in_range(">=0.16.0", version) else [])
    for name in helpers:
        out[name] = {"version": str(getattr(utils, f"get_{name}_version")()),
                     "min": getattr(utils, f"is_{name}_min_version")("1.0"),
                     "min_0_strict": getattr(utils, f"is_{name}_min_version")("0.0.0", check_equality=False)}
    if in_range(">=0.15.0,<0.17.0", version):
        out["te_original_answers_none"] = original("megatron.core.utils:get_te_version")() is None
    try:
        original("megatron.core.utils:get_fa_version")()
        out["fa_original_raises"] = False
    except ModuleNotFoundError:
        out["fa_original_raises"] = True
    return out


@check("cross_entropy")
def _():
    model, config = make_model()
    logits = torch.randn(8, 2, 64)
    labels = torch.randint(0, 64, (2, 8))
    before = counted("vocab_parallel_cross_entropy")
    unfused = model.compute_language_model_loss(labels, logits.clone().requires_grad_())
    config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl = True, "native"
    fused = model.compute_language_model_loss(labels, logits.clone())
    ref = original("megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy")(
        logits.clone(), labels.transpose(0, 1).contiguous()).transpose(0, 1)
    return {"calls": counted("vocab_parallel_cross_entropy") - before,
            "matches_megatron": close(unfused, ref) and close(fused, ref)}


@check("norms")
def _():
    out = {}
    for norm in ("LayerNorm", "RMSNorm"):
        model, _ = make_model(normalization=norm)
        layer = model.decoder.layers[0]
        op = "layer_norm" if norm == "LayerNorm" else "rms_norm"
        before = counted(op)
        x = torch.randn(4, 2, 32)
        y = layer.input_layernorm(x)
        ref = (torch.nn.LayerNorm(32, eps=1e-5) if norm == "LayerNorm" else torch.nn.RMSNorm(32, eps=1e-5))(x)
        out[norm] = {"class": type(layer.input_layernorm).__name__, "calls": counted(op) - before,
                     "final_class": type(model.decoder.final_layernorm).__name__, "matches": close(y, ref)}
    model, _ = make_model(layernorm_zero_centered_gamma=True, sequence_parallel=False)
    ln = model.decoder.layers[0].input_layernorm
    out["zero_centered_gamma"] = bool((ln.weight == 0).all()) and close(ln(torch.ones(2, 32) * 3), torch.zeros(2, 32), 1e-3)
    return out


@check("softmax")
def _():
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    out = {}
    for mask_type in (AttnMaskType.causal, AttnMaskType.padding):
        sm = FusedScaleMaskSoftmax(False, True, mask_type, True, attention_mask_func, True, 2.0)
        x = torch.randn(2, 4, 32, 32).bfloat16()
        mask = None if mask_type == AttnMaskType.causal else torch.rand(2, 1, 32, 32) > 0.7
        before = counted("scaled_masked_softmax")
        y = sm(x, mask)
        ref = original("megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward")
        # Megatron's own unfused path (its fused path needs the CUDA extension)
        sm.scaled_masked_softmax_fusion = False
        y_ref = ref(sm, x, mask)
        out[mask_type.name] = {"calls": counted("scaled_masked_softmax") - before, "matches": close(y, y_ref, 1e-2)}
    return out


@check("attention_dropout_rng")
def _():
    """Attention dropout's RNG: the TE-named core attention (TE's layer spec) forks Megatron's
    model-parallel RNG tracker only if the tracker was initialized when the module was built, as
    TEDotProductAttention decides (it hands TE the tracker or None); Megatron's local
    DotProductAttention forks it always (its own forward: an uninitialized tracker raises)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnMaskType

    te_cls = get_gpt_layer_with_transformer_engine_spec().submodules.self_attention.submodules.core_attention
    local_cls = get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.5,
                               use_cpu_initialization=True)
    q, k, v = (torch.randn(16, 2, 4, 8) for _ in range(3))
    tracker = get_cuda_rng_tracker()

    def run(cls):
        core = cls(config, 1, AttnMaskType.causal, "self").train()
        before = {n: s.clone() for n, s in tracker.get_states().items()}
        try:
            core(q, k, v, None)
        except Exception as exc:  # noqa: BLE001 (the message is the result)
            return {"fork": core.__dict__.get("adapt_dropout_fork"), "error": str(exc)[:120]}
        after = tracker.get_states()
        return {"fork": core.__dict__.get("adapt_dropout_fork"), "cls": cls.__name__,
                "tracker_advanced": any(not torch.equal(before[n], after[n]) for n in before)}

    out = {"te_seeded": run(te_cls), "local_seeded": run(local_cls)}
    tracker.reset()
    try:
        out["te_unseeded"], out["local_unseeded"] = run(te_cls), run(local_cls)
    finally:
        model_parallel_cuda_manual_seed(0)
    return out


@check("linear_init_rng")
def _():
    """Weight initialization on the device (use_cpu_initialization=False): the TE spec's linears
    fork the model-parallel RNG tracker only if it is initialized when they are built (TE hands its
    linears the tracker or None); Megatron's local ColumnParallelLinear forks it always (an
    uninitialized tracker raises)."""
    from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    te_fc1 = TESpecProvider().column_parallel_layer_norm_linear()   # the TE spec's linear_fc1
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=False)
    tracker = get_cuda_rng_tracker()
    kwargs = dict(config=config, init_method=config.init_method, bias=False, skip_bias_add=True,
                  gather_output=False, is_expert=False)

    def build(cls, seeded):
        if seeded:
            model_parallel_cuda_manual_seed(0)   # the same tracker states for each build
        else:
            tracker.reset()
        torch.manual_seed(7)
        try:
            linear = cls(32, 64, **kwargs)
        except Exception as exc:  # noqa: BLE001 (the message is the result)
            return {"error": str(exc)[:120]}
        return {"cls": type(linear).__name__, "weight": linear.weight.detach().clone(),
                "fork": "fork" in tracker.__dict__}

    out = {"te_seeded": build(te_fc1, True), "local_seeded": build(ColumnParallelLinear, True)}
    out["seeded_same"] = torch.equal(out["te_seeded"].pop("weight", None), out["local_seeded"].pop("weight", None))
    try:
        out["te_unseeded"] = build(te_fc1, False)
        out["local_unseeded"] = build(ColumnParallelLinear, False)
        torch.manual_seed(7)
        default = torch.empty(64, 32)
        config.init_method(default)
        unseeded = out["te_unseeded"].pop("weight", None)
        out["unseeded_from_default_generator"] = unseeded is not None and torch.equal(unseeded.cpu().float(), default)
    finally:
        model_parallel_cuda_manual_seed(0)
    return out


@check("linear_sharded_metadata")
def _():
    """Sharded state dicts with metadata that names no dp_cp_group (dist_checkpointing's
    test_mlp_glu on core_v0.16.1): TE's linears fill it (ensure_metadata_has_dp_cp_group), so the TE
    spec's linears here do; Megatron's local ColumnParallelLinear reads it and raises KeyError."""
    from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import utils as transformer_utils

    if not hasattr(transformer_utils, "ensure_metadata_has_dp_cp_group"):
        return {"no_dp_cp_group": True}   # core_v0.15: no dp_cp_group in sharded state dicts
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    kwargs = dict(config=config, init_method=config.init_method, bias=False, skip_bias_add=True,
                  gather_output=False, is_expert=False)
    out = {}
    for name, cls in (("te", TESpecProvider().column_parallel_layer_norm_linear()),
                      ("local", ColumnParallelLinear)):
        linear = cls(32, 64, **kwargs)
        metadata = {"singleton_local_shards": False}
        try:
            keys = sorted(linear.sharded_state_dict("fc1.", (), metadata))
            out[name] = {"keys": keys, "filled": "dp_cp_group" in metadata}
        except KeyError as exc:
            out[name] = {"error": f"KeyError {exc}"}
    return out


@check("provider_classes_isinstance")
def _():
    """The provider's linears are variants (fp8, delayed wgrad) whose constructor returns a plain
    Megatron linear when the feature is off; that object is an instance of the class the spec
    named, as Megatron's tests ask (isinstance(attn.linear_kv_up_proj, TELayerNormColumnParallelLinear))."""
    from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    provider = TESpecProvider()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    init = torch.nn.init.zeros_
    out = {}
    for name, cls, plain_base, kw in (
            ("column", provider.column_parallel_linear(), ColumnParallelLinear, dict(gather_output=False)),
            ("row", provider.row_parallel_linear(), RowParallelLinear, dict(input_is_parallel=True, skip_bias_add=True)),
            ("norm_column", provider.column_parallel_layer_norm_linear(), ColumnParallelLinear, dict(gather_output=False))):
        m = cls(32, 16, config=config, init_method=init, bias=False, **kw)
        out[name] = {"variant": cls.__name__, "built": type(m).__name__, "isinstance": isinstance(m, cls),
                     "plain_base": isinstance(m, plain_base),
                     "other_module_not_instance": not isinstance(torch.nn.Linear(2, 2), cls)}
    return out


@check("attention")
def _():
    out = {}
    for groups in (4, 2):
        model, config = make_model(num_query_groups=groups)
        core = model.decoder.layers[0].self_attention.core_attention
        q = torch.randn(16, 2, 4, 8)
        k = torch.randn(16, 2, groups, 8)
        v = torch.randn(16, 2, groups, 8)
        before = counted("attention")
        y = core(q, k, v, None)
        y_ref = original("megatron.core.transformer.dot_product_attention:DotProductAttention.forward")(core, q, k, v, None)
        mask = torch.rand(2, 1, 16, 16) > 0.8
        mask[..., 0] = False
        y2 = core(q, k, v, mask, attn_mask_type=__import__("megatron.core.transformer.enums", fromlist=["x"]).AttnMaskType.padding)
        y2_ref = original("megatron.core.transformer.dot_product_attention:DotProductAttention.forward")(
            core, q, k, v, mask, __import__("megatron.core.transformer.enums", fromlist=["x"]).AttnMaskType.padding)
        # GPT's dataloader passes its [b, 1, s, s] causal mask with attn_mask_type causal: served by
        # the causal kernel (the mask is implied), equal to Megatron's masked result.
        causal_mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).triu(1)
        y3 = core(q, k, v, causal_mask)
        y3_ref = original("megatron.core.transformer.dot_product_attention:DotProductAttention.forward")(
            core, q, k, v, causal_mask)
        out[f"groups{groups}"] = {"calls": counted("attention") - before,
                                  "matches": close(y, y_ref, 1e-4) and close(y2, y2_ref, 1e-4),
                                  "causal_mask_matches": close(y3, y3_ref, 1e-4)}
    return out


@check("attention_unfused")
def _():
    """--attention-backend unfused: Megatron's own unfused math (TE's UnfusedDotProductAttention
    with TE), not the backend's fused op; the report names it."""
    from megatron.core.transformer.enums import AttnBackend

    nvte = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    for name in nvte:     # the models built before (backend auto) set them; Megatron asserts on a change
        os.environ.pop(name, None)
    model, config = make_model(attention_backend=AttnBackend.unfused)
    for name in nvte:
        os.environ.pop(name, None)
    core = model.decoder.layers[0].self_attention.core_attention
    q, k, v = (torch.randn(16, 2, 4, 8, requires_grad=True) for _ in range(3))
    impls_before = dict(report.op_counts().get("attention", {}))
    y = core(q, k, v, None)
    y.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    y_ref = original("megatron.core.transformer.dot_product_attention:DotProductAttention.forward")(core, q, k, v, None)
    y_ref.square().sum().backward()
    after = report.op_counts().get("attention", {})
    return {"new_calls": {impl: n - impls_before.get(impl, 0) for impl, n in after.items()
                          if n != impls_before.get(impl, 0)},
            "equal": bool(torch.equal(y, y_ref)) and all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))}


@check("rope")
def _():
    from megatron.core.models.common.embeddings import rope_utils

    model, config = make_model(position_embedding_type="rope", apply_rope_fusion=True)
    before = counted("rope")
    tokens = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    loss = model(tokens, pos, None, labels=tokens)
    t = torch.randn(16, 2, 4, 8)
    freqs = torch.randn(16, 1, 1, 8)
    ref = original("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd")(t, freqs)
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, config)
    config.apply_rope_fusion = False
    unfused = rope_utils.apply_rotary_pos_emb(t, freqs, config)
    return {"calls": counted("rope") - before, "model_ran": bool(torch.isfinite(loss).all()),
            "matches": close(fused, ref) and close(unfused, ref)}


@check("activations")
def _():
    out = {}
    for glu in (True, False):
        model, _ = make_model(gated_linear_unit=glu, bias_activation_fusion=True,
                              activation_func=torch.nn.functional.silu if glu else torch.nn.functional.gelu)
        op = "bias_swiglu" if glu else "bias_gelu"
        before = counted(op)
        mlp = model.decoder.layers[0].mlp
        x = torch.randn(4, 2, 32)
        y, _ = mlp(x)
        target = ("megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl" if glu
                  else "megatron.core.fusions.fused_bias_gelu:bias_gelu_impl")
        inter = torch.randn(8, 128 if glu else 64)
        bias = torch.randn(128 if glu else 64)
        from megatron.core.transformer import mlp as mlp_module
        mine = mlp_module.bias_swiglu_impl(inter, bias) if glu else mlp_module.bias_gelu_impl(inter, bias)
        out[op] = {"calls": counted(op) - before, "matches": close(mine, original(target)(inter, bias), 1e-5)}
    return out


@check("bias_dropout_add")
def _():
    from megatron.core.fusions import fused_bias_dropout
    model, _ = make_model(hidden_dropout=0.3, bias_dropout_fusion=True)
    layer = model.decoder.layers[0]
    layer.train()
    before = counted("bias_dropout_add")
    y, _ = layer(torch.randn(16, 2, 32), attention_mask=None)
    calls = counted("bias_dropout_add") - before
    x, b, r = torch.randn(16, 2, 32), torch.randn(32), torch.randn(16, 2, 32)
    torch.manual_seed(3)
    mine = fused_bias_dropout.get_bias_dropout_add(True, True)((x, b), r, 0.3)
    torch.manual_seed(3)
    ref = original("megatron.core.fusions.fused_bias_dropout:bias_dropout_add_fused_train")((x, b), r, 0.3)
    bq = b.clone().requires_grad_()
    expanded = fused_bias_dropout.get_bias_dropout_add(True, True)((x, bq.expand_as(r)), r, 0.0)
    expanded.sum().backward()
    mixed = fused_bias_dropout.get_bias_dropout_add(True, True)((x.bfloat16(), b.bfloat16()), r, 0.0)
    return {"calls": calls, "layer_ran": bool(torch.isfinite(y).all()), "matches": torch.equal(mine, ref),
            "dropped": round((mine == r).float().mean().item(), 2),
            "expanded_bias": close(expanded, x + b + r) and bool((bq.grad == 32).all()),
            "mixed_dtypes_kept_megatrons": sorted(report.op_counts()["bias_dropout_add"])}


@check("optimizer")
def _():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, config = make_model()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    before = counted("adam")
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1), [ddp])
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt.chained_optimizers[0].optimizer
    return {"calls": counted("adam") - before, "class": type(inner).__name__,
            "foreach": bool(inner.defaults.get("foreach"))}


@check("checkpointing")
def _():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, config = make_model()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
    dist_opt = opt if hasattr(opt, "optimizer") else opt.chained_optimizers[0]
    try:
        original("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict")(dist_opt)
        original_fails = False
    except AssertionError:
        original_fails = True
    template = dist_opt.state_dict()  # what Megatron builds on --load before reading the checkpoint
    out = {"original_fails_on_fresh_optimizer": original_fails, "ours_returns_template": isinstance(template, dict),
           "inner_state_untouched": len(dist_opt.optimizer.state) == 0}
    # a data-parallel rank that owns no parameter (a small model over many ranks, e.g. Megatron's
    # test_optimizer_resharding at DP 2 of 8 ranks): its inner groups are empty, and so is its state
    inner = dist_opt.optimizer
    kept = [group["params"] for group in inner.param_groups]
    for group in inner.param_groups:
        group["params"] = []
    try:
        original("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict")(dist_opt)
        out["original_fails_owning_nothing"] = False
    except AssertionError:
        out["original_fails_owning_nothing"] = True
    steps = [g["step"] for g in dist_opt.state_dict()["optimizer"]["param_groups"]]
    out["owning_nothing_steps"] = sorted(set(float(s) for s in steps))
    out["owning_nothing_untouched"] = len(inner.state) == 0
    for group, params in zip(inner.param_groups, kept):
        group["params"] = params
    # FusedAdam-style states (Megatron's init_state_fn before a sharded load: no per-parameter step)
    for group in inner.param_groups:
        for p in group["params"]:
            inner.state[p]["exp_avg"], inner.state[p]["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
    try:
        original("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict")(dist_opt)
        out["original_fails_without_steps"] = False
    except KeyError:
        out["original_fails_without_steps"] = True
    steps = [g.get("step") for g in dist_opt.state_dict()["optimizer"]["param_groups"]]
    out["fused_style_steps"] = sorted(set(float(s) for s in steps))
    out["fused_style_untouched"] = all("step" not in s for s in inner.state.values())
    # a loader of the reshardable formats hands over exp_avg / exp_avg_sq without "step" (Megatron
    # sets the step from the param groups): the live torch step is kept, the moments copied
    dist = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else dist_opt
    inner = dist.optimizer
    model_param = next(iter(dist.model_param_group_index_map))
    group_index, group_order = dist.model_param_group_index_map[model_param]
    main_param = inner.param_groups[group_index]["params"][group_order]
    inner.state[main_param]["step"] = torch.tensor(5.0)
    loaded = {"param": main_param.detach() + 1, "exp_avg": torch.full_like(main_param, 2.0),
              "exp_avg_sq": torch.full_like(main_param, 3.0)}
    target = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states"
    with torch.no_grad():     # as Megatron's loaders call it
        try:
            original(target)(dist, model_param, loaded)
            out["original_set_fails_without_step"] = False
        except KeyError:
            out["original_set_fails_without_step"] = True
        dist._set_main_param_and_optimizer_states(model_param, loaded)
    live = inner.state[main_param]
    out["set_keeps_step"] = float(live["step"]) == 5.0
    out["set_copies_moments"] = bool((live["exp_avg"] == 2).all() and (live["exp_avg_sq"] == 3).all())
    return out


@check("multi_tensor")
def _():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    grads = [torch.randn(7, 5), torch.randn(33)]
    before = counted("multi_tensor_l2norm"), counted("multi_tensor_scale")
    norm = get_grad_norm_fp32(grads)
    expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    clipped = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])))
    return {"l2norm_calls": counted("multi_tensor_l2norm") - before[0],
            "scale_calls": counted("multi_tensor_scale") - before[1],
            "norm_matches": abs(norm - expected) < 1e-4 * expected, "clipped_to_one": abs(clipped - 1.0) < 1e-3}


@check("rng")
def _():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    state = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    outside = torch.rand(4)
    torch.set_rng_state(state)
    plain = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    x = torch.randn(4, 4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()  # stock without TE: fp8 is True -> NameError in forward
    y = ckpt.checkpoint(torch.nn.functional.gelu, x)
    z = y * x
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()
    xr = x.detach().requires_grad_()
    (torch.nn.functional.gelu(xr) * xr).sum().backward()
    try:
        CheckpointWithoutOutput(fp8=True)
        fp8_refused = False
    except RuntimeError as e:
        fp8_refused = "Transformer Engine" in str(e)
    return {"fork_switches_state": not torch.equal(a, plain), "restores_default": torch.equal(outside, plain),
            "fork_advances": not torch.equal(a, b), "checkpoint_without_output_grad_matches": close(x.grad, xr.grad),
            "checkpoint_fp8_without_te_refused": fp8_refused}


@check("jit")
def _():
    from megatron.core.fusions import fused_bias_gelu

    return {"eager": type(fused_bias_gelu.bias_gelu).__name__ == "function"}


@check("training")
def _():
    from megatron.core.datasets.utils import compile_helpers

    compile_helpers()
    from megatron.core.datasets import helpers_cpp  # noqa: F401
    return {"helpers_import": True, "ops": report.op_counts().get("compile_helpers", {})}


@check("collectives")
def _():
    """Megatron-FSDP's gradient reduce with --gradient-reduce-div-fusion: NCCL's premultiplied sum, which
    gloo refuses at the reduce ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): scale, then SUM."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffer

    fused = DistributedDataParallelConfig(gradient_reduce_div_fusion=True, average_in_collective=False)
    out = {}
    for dtype, scale in ((torch.float32, 0.5), (torch.bfloat16, 0.5), (torch.float32, None)):
        grad = torch.full((8,), 3.0, dtype=dtype)   # fp32: the fused branch; bf16 / None: Megatron's own
        op = fsdp_buffer.gradient_reduce_preprocessing(grad, scale, fused)
        reduced = torch.empty(8, dtype=dtype)
        dist.reduce_scatter_tensor(reduced, grad, op=op)
        out[f"{dtype}-{scale}"] = {"sum": op == dist.ReduceOp.SUM, "reduced": reduced.tolist()}
    # inference's broadcast from the last pipeline stage asserts the tensor is on the accelerator
    from megatron.core.inference import communication_utils

    try:
        sent = communication_utils.broadcast_from_last_pipeline_stage([2, 3], torch.float32, torch.ones(2, 3))
        out["inference_broadcast"] = sent.tolist()
    except AssertionError as e:
        out["inference_broadcast"] = f"AssertionError {e}"
    return out


@check("grad_accum_fusion")
def _():
    """ColumnParallelLinear with Megatron's default gradient_accumulation_fusion: the weight
    gradient lands in the fp32 main_grad (no .grad), equal to the unfused layer's .grad."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    out = {}
    for fusion in (True, False):
        torch.manual_seed(3)
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                                   use_cpu_initialization=True, gradient_accumulation_fusion=fusion)
        layer = ColumnParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_,
                                     bias=False).bfloat16()
        layer.weight.main_grad = torch.full((24, 16), 0.5)  # accumulates onto what is there
        x = torch.randn(5, 2, 16, dtype=torch.bfloat16, requires_grad=True)
        before = counted("wgrad_accumulate")
        y, _ = layer(x)
        g = torch.randn_like(y)
        y.backward(g)
        expect = 0.5 + g.reshape(-1, 24).float().t() @ x.detach().reshape(-1, 16).float()
        out[str(fusion)] = {
            "calls": counted("wgrad_accumulate") - before,
            "grad_is_none": layer.weight.grad is None,
            "main_grad_matches": close(layer.weight.main_grad, expect, 1e-3),
            "grad_matches": layer.weight.grad is not None and close(layer.weight.grad.float() + 0.5, expect, 3e-2),
        }
    return out


@check("layer_specs")
def _():
    """Megatron's TE layer / block specs with TE absent: built from megatron-adapt's provider, with
    TE's parameter names, and numerically the local spec's model (same init, same seed)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    out = {}
    for norm in ("LayerNorm", "RMSNorm"):
        kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                  normalization=norm, gated_linear_unit=norm == "RMSNorm")
        models = {}
        for name in ("te", "te_block", "local"):
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            config = TransformerConfig(**kw)
            spec = (get_gpt_layer_with_transformer_engine_spec() if name == "te" else
                    get_gpt_decoder_block_spec(config, use_transformer_engine=True) if name == "te_block" else
                    get_gpt_layer_local_spec(normalization=norm))
            models[name] = GPTModel(config, spec, vocab_size=64, max_sequence_length=16)
        tokens = torch.randint(0, 64, (2, 16))
        pos = torch.arange(16).unsqueeze(0).expand(2, -1)
        mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
        before = counted("rms_norm" if norm == "RMSNorm" else "layer_norm")
        logits = {n: m(tokens, pos, mask) for n, m in models.items()}
        layer = models["te"].decoder.layers[0]
        out[norm] = {
            "qkv": type(layer.self_attention.linear_qkv).__name__,
            "fc1": type(layer.mlp.linear_fc1).__name__,
            "input_layernorm": type(layer.input_layernorm).__name__,
            "final": type(models["te_block"].decoder.final_layernorm).__name__,
            "keys": sorted(k for k in models["te"].state_dict() if "layers.0." in k and "norm" in k),
            "norm_calls": counted("rms_norm" if norm == "RMSNorm" else "layer_norm") - before,
            "matches_local": close(logits["te"], logits["local"], 1e-5),
            "block_matches_local": close(logits["te_block"], logits["local"], 1e-5),
        }
    # core_v0.17+: the provider's layer_norm takes has_residual (0.19's MoE / MLA specs pass it).
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs
    provider = gpt_layer_specs.TESpecProvider()
    if "has_residual" in inspect.signature(provider.layer_norm).parameters:
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                   normalization="RMSNorm", use_cpu_initialization=True)
        norm = provider.layer_norm(has_residual=True)(config=config, hidden_size=32, eps=1e-5)
        x = torch.randn(3, 32)
        out["residual_norm"] = {"type": type(norm).__name__,
                                "matches": close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), 1e-5)}
        try:
            config.fused_residual_rmsnorm = True
            provider.layer_norm(has_residual=True)(config=config, hidden_size=32, eps=1e-5)
            out["residual_norm"]["fused_residual"] = "built"
        except NotImplementedError as exc:
            out["residual_norm"]["fused_residual"] = str(exc)
    return out


def _mla_reference(attn, x, config, causal):
    """Multi-latent attention in fp32 from the module's weights, written out: RMSNorm'd low-rank
    q / kv projections, MLA's interleaved YaRN RoPE on the positional channels (shared by all
    heads for k), causal softmax attention with head dims q/k != v, the output projection."""
    p = dict(attn.named_parameters())
    s, b, _ = x.shape
    n, dq, dp, dv = (config.num_attention_heads, config.qk_head_dim, config.qk_pos_emb_head_dim,
                     config.v_head_dim)
    eps = config.layernorm_epsilon

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    q = rms(x @ p["linear_q_down_proj.weight"].t(), p["linear_q_up_proj.layer_norm_weight"])
    q = (q @ p["linear_q_up_proj.weight"].t()).view(s, b, n, dq + dp)
    kv_c, k_pe = (x @ p["linear_kv_down_proj.weight"].t()).split([config.kv_lora_rank, dp], -1)
    kv = rms(kv_c, p["linear_kv_up_proj.layer_norm_weight"]) @ p["linear_kv_up_proj.weight"].t()
    kv = kv.view(s, b, n, dq + dv)
    emb, mscale = attn.rotary_pos_emb(s)
    cos, sin = emb.cos() * mscale, emb.sin() * mscale            # [s, 1, 1, dp]

    def rope(t):
        t = torch.cat((t[..., 0::2], t[..., 1::2]), -1)
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    q_nope, q_pe = q.split([dq, dp], -1)
    k_nope, v = kv.split([dq, dv], -1)
    query = torch.cat((q_nope, rope(q_pe)), -1)
    key = torch.cat((k_nope, rope(k_pe.unsqueeze(2)).expand(s, b, n, dp)), -1)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * attn.softmax_scale
    scores = scores.masked_fill(causal, float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * dv)
    return ctx @ p["linear_proj.weight"].t() + p["linear_proj.bias"]


@check("mla")
def _():
    """Multi-latent attention from Megatron's TE layer spec: the provider's duplicated linear
    (q / kv down projections), fused norm + linear (q / kv layernorms), core attention with
    k_channels != v_channels, and MLA's RoPE (unfused: the backend rope op; fused: rope_cos_sin),
    forward and backward against _mla_reference."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    out = {}
    for fusion in (False, True):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = MLATransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6,
            qk_layernorm=True, apply_rope_fusion=fusion, rope_type="yarn", rotary_scaling_factor=4.0,
            original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.7)
        spec = get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True)
        model = GPTModel(config, spec, vocab_size=64, max_sequence_length=16)
        attn = model.decoder.layers[0].self_attention
        s, b = 12, 2
        x = torch.randn(s, b, 32, requires_grad=True)
        causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
        before = {op: counted(op) for op in ("attention", "rope", "rope_cos_sin")}
        y, bias = attn(x, causal)
        y = y + bias
        g = torch.randn_like(y)
        params = [p for _, p in attn.named_parameters()]
        grads = torch.autograd.grad(y, [x, *params], g)
        y_ref = _mla_reference(attn, x, config, causal)
        grads_ref = torch.autograd.grad(y_ref, [x, *params], g)
        core = attn.core_attention
        out[f"fusion={fusion}"] = {
            "types": {n: type(getattr(attn, n)).__name__ for n in (
                "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                "core_attention", "q_layernorm", "kv_layernorm")},
            "core_head_dims": [core.hidden_size_per_attention_head_k, core.hidden_size_per_attention_head_v,
                               core.hidden_size_per_partition],
            "keys": sorted(k.split("self_attention.")[1] for k in model.state_dict()
                           if "self_attention." in k),
            "down_proj_attrs": [(p.allreduce, p.tensor_model_parallel, p.sequence_parallel)
                                for p in attn.linear_kv_down_proj.parameters()],
            "calls": {op: counted(op) - n for op, n in before.items()},
            "max_err": float((y - y_ref).abs().max()),
            "grad_max_err": max(float((a - r).abs().max()) for a, r in zip(grads, grads_ref)),
            "mscale_not_one": abs(attn.rotary_pos_emb(s)[1] - 1.0) > 1e-3,
        }
    return out


def _expert_weights(experts):
    """Functions giving the experts' fc1 / fc2 weights (or grads) as [E, in, out]: the legacy
    GroupedMLP's weight1 / weight2 (0.15-0.16), or the grouped linears' weight{i} [out, in] (0.17+)."""
    e = experts.num_local_experts
    if hasattr(experts, "weight1"):
        return (lambda attr="data": getattr(experts.weight1, attr).view(e, experts.config.hidden_size, -1),
                lambda attr="data": getattr(experts.weight2, attr).view(e, -1, experts.config.hidden_size))

    def stacked(linear):
        return lambda attr="data": torch.stack([getattr(getattr(linear, f"weight{i}"), attr).t()
                                                for i in range(e)])
    return stacked(experts.linear_fc1), stacked(experts.linear_fc2)


def _grouped_experts_fused_wgrad(experts, x, sizes, probs, g, w1_ref, w2_ref):
    """With gradient_accumulation_fusion and DDP's main_grad buffers: the weight gradients
    land in main_grad (added to what is there), each weight flagged grad_added_to_main_grad."""
    weights = [p for n, p in experts.named_parameters() if ".weight" in n]
    for w in weights:
        w.grad, w.grad_added_to_main_grad = None, False
        w.main_grad = torch.ones(w.shape, dtype=torch.float32)
    fusion, experts.config.gradient_accumulation_fusion = experts.config.gradient_accumulation_fusion, True
    before = counted("wgrad_accumulate")
    try:
        y, _ = experts(x.detach(), sizes, probs.detach())
        y.backward(g)
    finally:
        experts.config.gradient_accumulation_fusion = fusion
    calls = counted("wgrad_accumulate") - before
    e = experts.num_local_experts
    main1 = torch.stack([getattr(experts.linear_fc1, f"weight{i}").main_grad.t() for i in range(e)])
    main2 = torch.stack([getattr(experts.linear_fc2, f"weight{i}").main_grad.t() for i in range(e)])
    res = {"main_grad": close(main1 - 1, w1_ref.grad, 1e-5) and close(main2 - 1, w2_ref.grad, 1e-5),
           "flagged": all(w.grad_added_to_main_grad for w in weights),
           # one GEMM into main_grad per expert with rows, per linear (host sizes)
           "wgrad_accumulate_per_expert": calls == 2 * int((torch.as_tensor(sizes) > 0).sum())}
    for w in weights:
        del w.main_grad, w.grad_added_to_main_grad
        w.grad = None
    return res


def _grouped_experts_with_bias(config, sizes):
    """TEGroupedMLP with add_bias_linear against a per-expert fp64 loop: fc1's bias
    is added per expert inside the grouped linear, fc2's returned and scaled by the probs."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    cfg = dataclasses.replace(config, add_bias_linear=True, bias_dropout_fusion=False,
                              moe_permute_fusion=False, moe_router_fusion=False)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=5, moe_grouped_gemm=True)
    experts = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=16).decoder.layers[0].mlp.experts
    if type(experts).__name__ != "TEGroupedMLP":
        return {"experts_class": type(experts).__name__}
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    with torch.no_grad():
        for i in range(5):
            getattr(fc1, f"bias{i}").normal_()
            getattr(fc2, f"bias{i}").normal_()
    x = torch.randn(int(sizes.sum()), 32, requires_grad=True)
    probs = torch.rand(x.shape[0], requires_grad=True)
    y, _ = experts(x, sizes, probs)
    g = torch.randn_like(y)
    y.backward(g)
    p64 = {n: p.detach().double().requires_grad_() for n, p in experts.named_parameters()}
    xr, pr = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    rows, r0 = [], 0
    for e, n in enumerate(sizes.tolist()):
        h = xr[r0:r0 + n] @ p64[f"linear_fc1.weight{e}"].t() + p64[f"linear_fc1.bias{e}"]
        a, b = h.chunk(2, dim=-1)
        p = pr[r0:r0 + n, None]
        rows.append((F.silu(a) * b * p) @ p64[f"linear_fc2.weight{e}"].t() + p64[f"linear_fc2.bias{e}"] * p)
        r0 += n
    ref = torch.cat(rows)
    ref.backward(g.double())
    named = dict(experts.named_parameters())
    res = {"matches": close(y, ref, 1e-5),
           "grads_match": close(x.grad, xr.grad, 1e-5) and close(probs.grad, pr.grad, 1e-5)
           and all(close(named[n].grad, p64[n].grad, 1e-5) for n in named),
           "bias_grads_nonzero": bool(named["linear_fc2.bias0"].grad.abs().sum() > 0)}
    # with gradient_accumulation_fusion and main_grad buffers (every release: 0.15-0.16 build these
    # grouped linears for biased experts): the weight gradients added into main_grad in the GEMM,
    # one wgrad_accumulate per expert with rows; biases keep their autograd grads
    weights = [p for n, p in named.items() if ".weight" in n]
    for w in weights:
        w.main_grad, w.grad_added_to_main_grad = torch.ones(w.shape, dtype=torch.float32), False
    fusion, before = experts.config.gradient_accumulation_fusion, counted("wgrad_accumulate")
    experts.config.gradient_accumulation_fusion = True
    try:
        y2, _ = experts(x.detach(), sizes, probs.detach())
        y2.backward(g)
    finally:
        experts.config.gradient_accumulation_fusion = fusion
    res["fused_wgrad"] = (all(close(named[n].main_grad - 1, p64[n].grad, 1e-5) for n in named if ".weight" in n)
                          and all(w.grad_added_to_main_grad for w in weights)
                          and counted("wgrad_accumulate") - before == 2 * int((sizes > 0).sum()))
    return res


@check("moe")
def _():
    """Megatron's MoELayer from the default TE layer spec (TE absent): 5 experts, top-2, grouped
    GEMM, alltoall dispatcher, aux loss, in fp32 (stock GroupedMLP accepts bf16 only).
    The experts against a per-expert fp64 loop with uneven and empty experts; the whole layer with
    --moe-permute-fusion / --moe-router-fusion against the same layer on Megatron's unfused code."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    out = {}
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=5,
        moe_ffn_hidden_size=24, moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, moe_permute_fusion=True, moe_router_fusion=True)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=5, moe_grouped_gemm=True)
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=16)
    moe = model.decoder.layers[0].mlp
    experts = moe.experts
    out["experts_class"] = type(experts).__name__

    # the experts alone: uneven rows, experts 1 and 4 empty
    sizes = torch.tensor([3, 0, 6, 2, 0])
    x = torch.randn(int(sizes.sum()), 32, requires_grad=True)
    probs = torch.rand(x.shape[0], requires_grad=True)
    before = counted("grouped_gemm")
    y, _ = experts(x, sizes, probs)
    g = torch.randn_like(y)
    y.backward(g)
    out["grouped_gemm_calls"] = counted("grouped_gemm") - before
    out["grouped_linears"] = [type(getattr(experts, n, None)).__name__ for n in ("linear_fc1", "linear_fc2")]
    expert_w1, expert_w2 = _expert_weights(experts)
    w1 = expert_w1().detach().double().requires_grad_()
    w2 = expert_w2().detach().double().requires_grad_()
    xr, pr = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    rows, r0 = [], 0
    for e, n in enumerate(sizes.tolist()):
        a, b = (xr[r0:r0 + n] @ w1[e]).chunk(2, dim=-1)
        rows.append((F.silu(a) * b * pr[r0:r0 + n, None]) @ w2[e])
        r0 += n
    ref = torch.cat(rows)
    ref.backward(g.double())
    out["experts_match"] = close(y, ref, 1e-5)
    out["experts_grads_match"] = (close(x.grad, xr.grad, 1e-5) and close(probs.grad, pr.grad, 1e-5)
                                  and close(expert_w1("grad"), w1.grad, 1e-5)
                                  and close(expert_w2("grad"), w2.grad, 1e-5))
    out["empty_expert_grad_zero"] = bool((expert_w1("grad")[[1, 4]] == 0).all()
                                         and (expert_w2("grad")[[1, 4]] == 0).all())

    # with biases TEGroupedMLP on the grouped linears on every release (fc1's bias added, fc2's returned)
    out["experts_with_bias"] = _grouped_experts_with_bias(config, sizes)
    if not hasattr(experts, "weight1"):  # 0.17+ (0.15-0.16 without biases: GroupedMLP, one weight per linear)
        out["experts_fused_wgrad"] = _grouped_experts_fused_wgrad(experts, x, sizes, probs, g, w1, w2)

    # the whole layer: fused flags (backend ops) against Megatron's unfused code, same weights
    hidden = torch.randn(8, 2, 32)
    runs = {}
    for fused in (True, False):
        config.moe_permute_fusion = config.moe_router_fusion = fused
        model.zero_grad()
        ops = ("moe_permute", "moe_unpermute", "moe_sort_chunks", "moe_topk_router",
               "moe_router_scores", "moe_aux_loss")
        before = {op: counted(op) for op in ops}
        h = hidden.clone().requires_grad_()
        y, _ = moe(h)
        (y * torch.linspace(-1, 1, 32)).sum().backward()  # the aux loss reaches the router too
        runs[fused] = (y.detach(), h.grad, moe.router.weight.grad.clone(), expert_w1("grad").clone())
        out[f"calls_fused_{fused}"] = {op: counted(op) - before[op] for op in ops}
    out["layer_matches_unfused"] = all(close(a, b, 1e-5) for a, b in zip(runs[True], runs[False]))

    # capacity-padded dispatch (--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity,
    # what the CUDA-graph switch needs for MoE): Megatron hands the fused permute the padded routing
    # map (exactly `capacity` rows per expert, 7 here: 16 tokens x top-2 / 5 experts, rounded up) and
    # drops its own drop_and_pad branch; the backend ops must give what that branch gives
    padded = dataclasses.replace(config, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    torch.manual_seed(1)
    pmodel = GPTModel(padded, spec, vocab_size=64, max_sequence_length=16)
    pmoe = pmodel.decoder.layers[0].mlp
    pexpert_w1, _ = _expert_weights(pmoe.experts)
    pruns = {}
    for fused in (True, False):
        padded.moe_permute_fusion = padded.moe_router_fusion = fused
        pmodel.zero_grad()
        before = {op: counted(op) for op in ("moe_permute", "moe_unpermute", "grouped_gemm")}
        h = hidden.clone().requires_grad_()
        y, _ = pmoe(h)
        (y * torch.linspace(-1, 1, 32)).sum().backward()
        pruns[fused] = (y.detach(), h.grad, pmoe.router.weight.grad.clone(), pexpert_w1("grad").clone())
        out[f"padded_calls_fused_{fused}"] = {op: counted(op) - before[op] for op in before}
    out["padded_capacity"] = pmoe.token_dispatcher.capacity
    out["padded_matches_unfused"] = all(close(a, b, 1e-5) for a, b in zip(pruns[True], pruns[False]))

    # --moe-router-dtype fp32: the router GEMM (0.16 names te_general_gemm, left unbound without TE)
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    inp = torch.randn(6, 2, 32).bfloat16().requires_grad_()
    w = torch.randn(5, 32).bfloat16().requires_grad_()
    logits = router_gating_linear(inp, w, None, torch.float32)
    g = torch.randn_like(logits)
    logits.backward(g)
    ir, wr = inp.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = ir @ wr.t()
    ref.backward(g)
    out["router_fp32"] = {"dtype": str(logits.dtype), "matches": close(logits, ref, 1e-4),
                          "grads_match": close(inp.grad, ir.grad, 2e-2) and close(w.grad, wr.grad, 2e-2)}
    return out


def _mixer_decode(mixer):
    """core_v0.17+: the mixer's decode step (`_ssm_decode`, one token) on the backend's decode ops
    against Megatron's own PyTorch fallback (its path when the Triton kernels are None), from the
    same conv and SSM states."""
    import sys

    module = sys.modules["megatron.core.ssm.mamba_mixer"]
    if getattr(module, "causal_conv1d_update", None) is None:
        return None   # core_v0.15 - v0.16: Megatron's fallback is the only path
    torch.manual_seed(6)
    width = 2 * mixer.d_inner_local_tp + 2 * mixer.ngroups_local_tp * mixer.d_state + mixer.nheads_local_tp
    conv_shape, ssm_shape = mixer.mamba_state_shapes_per_request()
    zx = torch.randn(2, 1, width)
    conv, ssm = torch.randn(2, *conv_shape), torch.randn(2, *ssm_shape)
    ops = ("ssm_conv_update", "ssm_state_update")
    before = {op: counted(op) for op in ops}
    # the z gate in the state update, not the gated norm: Megatron's fallback squeezes z's sequence
    # dim before its norm (a shape error there with rmsnorm on)
    rmsnorm, mixer.rmsnorm = mixer.rmsnorm, False
    with torch.no_grad():
        ours = mixer._ssm_decode(zx, conv_ours := conv.clone(), ssm_ours := ssm.clone())
        calls = {op: counted(op) - before[op] for op in ops}
        saved = module.causal_conv1d_update, module.selective_state_update
        module.causal_conv1d_update = module.selective_state_update = None
        try:
            megatrons = mixer._ssm_decode(zx, conv_ref := conv.clone(), ssm_ref := ssm.clone())
        finally:
            module.causal_conv1d_update, module.selective_state_update = saved
            mixer.rmsnorm = rmsnorm
    return {"calls": calls, "out": close(ours, megatrons, 1e-4), "conv_state": close(conv_ours, conv_ref, 1e-5),
            "ssm_state": close(ssm_ours, ssm_ref, 1e-4), "state_changed": not torch.equal(ssm_ours, ssm)}


@check("ssm")
def _():
    """A Mamba + attention + MLP model built from Megatron's own Mamba / hybrid stack spec (TE's
    classes served by the backend): TE parameter names, the mixer's forward and backward on the
    backend's Mamba ops, and the mixer's fused path against its unfused one (causal_conv1d_fn,
    mamba_chunk_scan_combined, the gated norm with z) on the same weights."""
    try:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec
        from megatron.core.models.hybrid.hybrid_model import HybridModel as Model
        pattern = dict(hybrid_layer_pattern="M*-")
    except ImportError:
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as spec
        from megatron.core.models.mamba import MambaModel as Model
        pattern = dict(hybrid_override_pattern="M*-")
    torch.manual_seed(5)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               normalization="RMSNorm", mamba_state_dim=8, mamba_head_dim=8,
                               mamba_num_groups=2)
    model = Model(config, spec, vocab_size=64, max_sequence_length=24, **pattern)
    keys = list(model.state_dict())
    ops = ("ssd_scan", "causal_conv1d", "rms_norm_gated")
    before = {op: counted(op) for op in ops}
    ids = torch.randint(0, 64, (2, 24))
    loss = model(ids, torch.arange(24)[None].expand(2, -1), None, labels=ids).mean()
    loss.backward()
    mixer = model.decoder.layers[0].mixer
    grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixer.parameters())
    calls = {op: counted(op) - before[op] for op in ops}
    h = torch.randn(24, 2, 32)
    fused, _ = mixer(h)
    mixer.use_mem_eff_path = False
    unfused, _ = mixer(h)
    return {"keys": keys, "calls": calls, "grads_ok": bool(grads_ok), "loss": float(loss),
            "fused_matches_unfused": close(fused, unfused, 1e-4),
            "norm": type(mixer.norm).__name__, "in_proj": type(mixer.in_proj).__name__,
            "decode": _mixer_decode(mixer)}


@check("hybrid_mla_down_proj_fusion")
def _():
    """core 0.19's --mla-down-proj-fusion: HybridStack swaps its MLA layers to FusedMLASelfAttention
    with the module's TELayerNormColumnParallelLinear as the fused input norm + q/kv down projection.
    Without TE that name was Megatron's stand-in ("Unsupported linear_qkv_down_proj" at model build)."""
    try:
        from megatron.core.models.hybrid import hybrid_block
    except ImportError:
        return None   # core < 0.18: no hybrid package
    if not hasattr(hybrid_block.HybridStack, "_fuse_mla_down_proj"):
        return None   # core < 0.19
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    torch.manual_seed(7)
    config = MLATransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                                  hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                                  q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                  v_head_dim=16, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                                  mla_down_proj_fusion=True)
    model = HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=64,
                        max_sequence_length=16, hybrid_layer_pattern="M+-")
    attn = next(layer.self_attention for layer in model.decoder.layers
                if isinstance(getattr(layer, "self_attention", None), FusedMLASelfAttention))
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, torch.arange(16)[None].expand(2, -1), None, labels=ids).mean()
    loss.backward()
    down = attn.linear_qkv_down_proj
    return {"down_proj": type(down).__name__, "loss_finite": bool(torch.isfinite(loss)),
            "down_grads": all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
                              for p in down.parameters()),
            "keys": [k for k in model.state_dict() if "linear_qkv_down_proj" in k]}


@check("context_parallel")
def _():
    """get_thd_batch_on_this_cp_rank's CP split (TE's thd_get_partitioned_indices) without TE."""
    from megatron.core import utils as core_utils

    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    cu_p = torch.tensor([0, 8, 12, 24, 28], dtype=torch.int32)
    tokens = torch.arange(28)[None]
    batch = {"tokens": tokens.clone(), "labels": tokens.clone() + 100, "cu_seqlens": cu, "cu_seqlens_padded": cu_p,
             "max_seqlen": torch.tensor([12])}
    # --sft's form: SFTDataset pads each conversation to a multiple of 2·CP and gives no
    # cu_seqlens_padded; core 0.16 hands cu_seqlens as (1, n) on TP rank 0
    sft = {"tokens": tokens.clone(), "labels": tokens.clone() + 100, "cu_seqlens": cu_p[None],
           "cu_seqlens_padded": None, "max_seqlen": torch.tensor([12])}
    if hasattr(core_utils, "get_thd_batch_on_this_cp_rank"):      # core 0.16-0.17
        out, params = core_utils.get_thd_batch_on_this_cp_rank(batch, cu, cu_p, torch.tensor([12]), cp_size=2,
                                                               cp_rank=1)
        sft_out, sft_params = core_utils.get_thd_batch_on_this_cp_rank(sft, cu_p[None], None, torch.tensor([12]),
                                                                       cp_size=2, cp_rank=1)
        return {"tokens": out["tokens"][0].tolist(), "labels": out["labels"][0].tolist(),
                "qkv_format": params.qkv_format, "max_seqlen": params.max_seqlen_q,
                "padded_kept": bool(params.cu_seqlens_q_padded is cu_p),
                "sft_tokens": sft_out["tokens"][0].tolist(), "sft_cu_seqlens": sft_params.cu_seqlens_q.tolist()}

    class Rank1Of2:   # the split reads only the group's size and rank
        def size(self):
            return 2

        def rank(self):
            return 1
    batch["cu_seqlens"], batch["cu_seqlens_padded"] = cu[None], cu_p[None]   # core 0.18-0.19 keep (1, n)
    split = getattr(core_utils, "get_sft_batch_on_this_cp_rank", None)           # core 0.18's name
    split = split or core_utils._get_batch_on_this_cp_rank_per_document_balancing
    out = split(batch, Rank1Of2())
    sft_out = split(sft, Rank1Of2())
    return {"tokens": out["tokens"][0].tolist(), "labels": out["labels"][0].tolist(), "qkv_format": "thd",
            "max_seqlen": 12, "padded_kept": True, "sft_tokens": sft_out["tokens"][0].tolist(),
            "sft_cu_seqlens": sft_out["cu_seqlens"].view(-1).tolist()}   # 0.19 builds PackedSeqParams later

print("PROBE-JSON:" + json.dumps(results))

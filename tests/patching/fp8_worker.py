"""fp8 through Megatron's real path, in a fresh interpreter; prints PROBE-JSON findings.

    python fp8_worker.py refusal      the cpu backend refuses TransformerConfig(fp8=...)
    python fp8_worker.py train        GPTModel from Megatron's TE layer spec with fp8 set
    python fp8_worker.py moe          the same with MoE experts (--moe-grouped-gemm) in fp8
    python fp8_worker.py weight_cache the fp8 weight cache across micro-batches, marked as Megatron's schedule does
    python fp8_worker.py swiglu       SwiGLU computed inside the fp8 casts (fp8_swiglu) against the unfused path
    python fp8_worker.py recompute    Megatron's recompute of fp8 code (te_checkpoint) against no recompute
    python fp8_worker.py duplicated   MLA's down projections and MoE's latent projections (TE's duplicated TELinear) in fp8

`train` and `moe` need fp8 GEMMs, which the cpu backend does not serve. It lends the cpu backend the
cuda backend's own `fp8_linear` and `fp8_grouped_gemm` (torch's CPU build has `torch._scaled_mm` for float8, so the
cuda op runs on CPU tensors) and an `fp8_unavailable` answering None: everything Megatron-facing
(the config check, get_fp8_context, the provider's linears, gradient-accumulation fusion, the
extra state) runs as on a GPU; only the GEMMs run on the CPU.
"""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"


from single_rank import one_rank_env  # noqa: E402

one_rank_env()

import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import report  # noqa: E402

scenario = sys.argv[1]
if scenario in ("train", "moe", "moe_weight_cache", "weight_cache", "swiglu", "recompute", "duplicated"):
    from megatron_adapt.backends import cpu as cpu_backend
    from megatron_adapt.backends.cuda import fp8 as cuda_fp8

    cpu_backend.BACKEND.ops["fp8_linear"] = "megatron_adapt.backends.cuda.fp8:fp8_linear"
    cpu_backend.BACKEND.ops["fp8_grouped_gemm"] = "megatron_adapt.backends.cuda.fp8:fp8_grouped_gemm"
    cpu_backend.BACKEND._loaded["fp8_unavailable"] = lambda recipe=None: None
    assert cpu_backend.BACKEND.op("fp8_linear") is cuda_fp8.fp8_linear

megatron_adapt.apply("cpu", quiet=True)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

out = {}
BASE = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False)


def refusal():
    for kw in ({"fp8": "hybrid"}, {"fp8": "e4m3", "fp8_recipe": "delayed"}, {"fp4": "e2m1"}):
        try:
            TransformerConfig(**BASE, **kw)
            out[str(kw)] = "built"
        except Exception as exc:  # noqa: BLE001 (the test reads the type and message)
            out[str(kw)] = f"{type(exc).__name__}: {exc}"
    TransformerConfig(**BASE)   # no fp8: builds
    out["plain"] = "built"


def calls():
    return sum(report.op_counts().get("fp8_linear", {}).values())


def model(**kw):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(**BASE, **kw)
    return GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=128,
                    max_sequence_length=32), config


def reset_grads(m, main_grad):
    """No grads; with main_grad, a zero fp32 main_grad on every parameter (Megatron's DDP buffers)."""
    for p in m.parameters():
        p.grad = None
        if main_grad:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False


def grads_of(m, main_grad):
    return {n: (p.main_grad if main_grad and getattr(p, "grad_added_to_main_grad", False) else p.grad)
            for n, p in m.named_parameters()}


def step(m, tokens, pos, labels, main_grad):
    reset_grads(m, main_grad)
    loss = m(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.item(), grads_of(m, main_grad)


def micro_batch_step(m, batches, pos, mark, main_grad=False):
    """One step over the micro-batches (tokens, labels); with mark, the first is marked by
    GPTModel.set_is_first_microbatch as Megatron's forward_step does. -> (losses, cloned grads)."""
    reset_grads(m, main_grad)
    losses = []
    for i, (tokens, labels) in enumerate(batches):
        if mark and i == 0:
            m.set_is_first_microbatch()
        loss = m(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {n: g.clone() for n, g in grads_of(m, main_grad).items() if g is not None}


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, add_bias_linear=False,
           moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=128, gated_linear_unit=True,
           activation_func=torch.nn.functional.silu, moe_router_load_balancing_type="none")


def moe_model(**kw):
    """GPTModel with TEGroupedMLP experts (MOE, then kw) from the TE decoder-block spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(**{**BASE, **MOE, **kw})
    return GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=True),
                    vocab_size=128, max_sequence_length=32)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def start():
    """One rank (the device layer maps nccl to gloo) and the data every scenario trains on."""
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    tokens, labels = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    return tokens, torch.arange(32).unsqueeze(0).expand(2, -1), labels


def train():
    tokens, pos, labels = start()
    ref, _ = model()
    ref_loss, ref_grads = step(ref, tokens, pos, labels, False)
    out["plain_class"] = type(ref.decoder.layers[0].self_attention.linear_qkv).__name__
    for recipe, main_grad in (("tensorwise", False), ("delayed", False), ("tensorwise", True)):
        m, config = model(fp8="hybrid", fp8_recipe=recipe, gradient_accumulation_fusion=main_grad,
                          fp8_amax_history_len=4, fp8_amax_compute_algo="max")
        m.load_state_dict(ref.state_dict(), strict=False)
        layer = m.decoder.layers[0]
        before = calls()
        losses, grads = [], None
        for _ in range(2):  # delayed: the 2nd step's scales come from the 1st step's amaxes
            loss, grads = step(m, tokens, pos, labels, main_grad)
            losses.append(loss)
        key = f"{recipe}{'+main_grad' if main_grad else ''}"
        out[key] = {
            "classes": sorted({type(mod).__name__ for mod in (
                layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
                layer.mlp.linear_fc1, layer.mlp.linear_fc2)}),
            "fp8_calls": calls() - before,
            "loss_rel": abs(losses[-1] - ref_loss) / abs(ref_loss),
            "grad_rel_max": max(rel(grads[n], ref_grads[n]) for n in ref_grads if "layers" in n and "weight" in n
                                and "norm" not in n),
            "scale_fwd": layer.self_attention.linear_qkv.fp8_scaling.scale["fwd"].tolist(),
            "amax_rows": layer.self_attention.linear_qkv.fp8_scaling.amax_history["fwd"].tolist(),
        }
    # --first-last-layers-bf16: Megatron's is_first_last_bf16_layer decides; only layer 1 is fp8
    m, _ = model(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                 num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    before = calls()
    step(m, tokens, pos, labels, False)
    out["first_last_bf16_calls"] = calls() - before
    graphs(m, tokens, pos, labels)
    # the delayed state travels in _extra_state
    m, _ = model(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4)
    step(m, tokens, pos, labels, False)
    sd = m.state_dict()
    qkv_key = "decoder.layers.0.self_attention.linear_qkv._extra_state"
    out["extra_state_type"] = type(sd.get(qkv_key)).__name__
    fresh, _ = model(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4)
    fresh.load_state_dict(sd)
    a = m.decoder.layers[0].self_attention.linear_qkv.fp8_scaling
    b = fresh.decoder.layers[0].self_attention.linear_qkv.fp8_scaling
    out["extra_state_roundtrip"] = all(torch.equal(a.scale[d], b.scale[d]) and
                                       torch.equal(a.amax_history[d], b.amax_history[d]) for d in ("fwd", "bwd"))
    out["extra_state_nontrivial"] = bool((a.scale["fwd"] != 1).all())
    plain, _ = model()
    out["plain_loads_fp8_checkpoint"] = str(plain.load_state_dict(sd, strict=True))
    out["report_impls"] = sorted(report.op_counts().get("fp8_linear", {}))


def moe():
    """MoE experts in fp8: TEGroupedMLP on megatron-adapt's grouped linears, Megatron's fp8 padding
    (Fp8Padding / Fp8Unpadding served without TE) and the backend's fp8_grouped_gemm."""
    tokens, pos, labels = start()
    # the reference: the same module tree (TEGroupedMLP, whose parameter names differ from the
    # GroupedMLP a bf16 build without biases gets on 0.15-0.16) with fp8 off at run time
    ref = moe_model(fp8="hybrid", fp8_recipe="tensorwise")
    ref.config.fp8 = None
    ref_loss, ref_grads = step(ref, tokens, pos, labels, False)
    out["moe_ref_calls"] = sum(report.op_counts().get("fp8_grouped_gemm", {}).values())
    # --no-fp8-wgrad with main_grad fusion: the experts' bf16 wgrad added into main_grad by the
    # backend's wgrad_accumulate, one per expert and linear
    for name, recipe, main_grad, fp8_wgrad in (("tensorwise", "tensorwise", False, True),
                                               ("delayed", "delayed", True, True),
                                               ("no_fp8_wgrad", "delayed", True, False)):
        m = moe_model(fp8="hybrid", fp8_recipe=recipe, gradient_accumulation_fusion=main_grad, fp8_wgrad=fp8_wgrad)
        m.load_state_dict(ref.state_dict(), strict=False)
        before = dict(report.op_counts().get("fp8_grouped_gemm", {}))
        accumulates = sum(report.op_counts().get("wgrad_accumulate", {}).values())
        wgrad_paths = dict(report.op_counts().get("fp8_wgrad", {}))
        loss, grads = step(m, tokens, pos, labels, main_grad)
        after = report.op_counts().get("fp8_grouped_gemm", {})
        experts = m.decoder.layers[0].mlp.experts
        expert_w = [n for n in ref_grads if "experts" in n and "weight" in n]
        out[f"moe_{name}"] = {
            "experts": type(experts).__name__,
            "wgrad_accumulate_calls": sum(report.op_counts().get("wgrad_accumulate", {}).values()) - accumulates,
            "linears": sorted({type(experts.linear_fc1).__name__, type(experts.linear_fc2).__name__}),
            "padding": type(experts.quantization_padding).__module__ if hasattr(experts, "quantization_padding")
                       else type(getattr(experts, "fp8_padding", None)).__module__,
            "calls": {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)},
            "fp8_wgrad_paths": {k: v - wgrad_paths.get(k, 0) for k, v in report.op_counts().get("fp8_wgrad", {}).items()
                                if v > wgrad_paths.get(k, 0) and k.startswith("experts")},
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
            "expert_grad_rel_max": max(rel(grads[n], ref_grads[n]) for n in expert_w),
            "expert_grads": len(expert_w),
        }
    out["moe_fallbacks"] = {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"]
                            if "grouped" in o["op"] and o["fallback_reason"]}


def moe_weight_cache():
    """The experts' grouped linears keep their fp8 weights across a step's micro-batches, as TE's do:
    two micro-batches a step, the first marked by GPTModel.set_is_first_microbatch (Megatron's
    forward_step), against the same model never marked (casts at every call); weights updated
    through .data between steps, as Megatron's optimizers write them. Also with --no-fp8-wgrad."""
    start()
    torch.manual_seed(4321)
    batches = [(torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))) for _ in range(2)]
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)

    for name, kw in (("fp8_wgrad", {}), ("no_fp8_wgrad", dict(fp8_wgrad=False, gradient_accumulation_fusion=True))):
        main_grad = bool(kw.get("gradient_accumulation_fusion"))
        every, cached = (moe_model(fp8="hybrid", fp8_recipe="tensorwise", **kw) for _ in range(2))
        cached.load_state_dict(every.state_dict(), strict=False)
        report.reset_op_counts()
        steps = []
        for _ in range(3):
            l_every, g_every = micro_batch_step(every, batches, pos, False, main_grad)
            l_cached, g_cached = micro_batch_step(cached, batches, pos, True, main_grad)
            experts = [n for n in g_every if "experts" in n]
            steps.append({"losses": [l_every, l_cached], "expert_grads": len(experts),
                          "grad_rel_max": max(rel(g_cached[n], g_every[n]) for n in g_every)})
            with torch.no_grad():   # the same update for both, through .data
                for (n, p), q in zip(every.named_parameters(), cached.parameters()):
                    delta = 0.01 * torch.sign(g_every[n]) if n in g_every else 0.0
                    p.data.add_(delta)
                    q.data.add_(delta)
        fc1 = every.decoder.layers[0].mlp.experts.linear_fc1
        out[f"moe_cache_{name}"] = {
            "steps": steps,
            "casts": {k: v for k, v in report.op_counts().get("fp8_weight_cast", {}).items() if k.startswith("experts")},
            "never_marked_has_no_cache": fc1.fp8_weight_cache.tensors is None,
            "marked": cached.decoder.layers[0].mlp.experts.linear_fc1.fp8_weight_cache.tensors is not None}


def graphs(first_last_bf16, tokens, pos, labels):
    """What Megatron's local CUDA graphs ask TE's FP8GlobalStateManager, save_fp8_tensors and
    restore_fp8_tensors, and the context a runner captures in, as its code calls them."""
    import types

    from megatron.core.transformer import cuda_graphs as cg

    from megatron_adapt.patches.fp8 import active_recipe

    m, config = model(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4)
    step(m, tokens, pos, labels, False)
    layer = m.decoder.layers[1]
    s = layer.mlp.linear_fc1.fp8_scaling
    before = {d: (s.amax_history[d].clone(), s.scale[d].clone()) for d in ("fwd", "bwd")}
    saved = cg.save_fp8_tensors([layer], config.fp8_amax_history_len)
    step(m, tokens, pos, labels, False)          # Megatron's warm-up runs move the state on
    moved = any(not torch.equal(s.amax_history[d], before[d][0]) for d in before)
    addresses = [s.amax_history["fwd"].data_ptr(), s.scale["fwd"].data_ptr()]
    cg.restore_fp8_tensors([layer], saved)
    seen = {}

    def runner(module):
        r = types.SimpleNamespace(fp8_enabled=True, fp4_enabled=False, fp8_runtime_enabled=None,
                                  base_module=module)
        if hasattr(cg._CudaGraphRunner, "get_fp8_context"):   # megatron-core 0.15 asks this method
            r.get_fp8_context = types.MethodType(cg._CudaGraphRunner.get_fp8_context, r)
        return r

    for name, module in (("fp8_layer", layer), ("bf16_first_layer", first_last_bf16.decoder.layers[0]),
                         ("fp8_middle_layer", first_last_bf16.decoder.layers[1])):
        r = runner(module)
        with cg._CudaGraphRunner.get_quantization_context.__get__(r, cg._CudaGraphRunner)():
            recipe = active_recipe()
            seen[name] = {"recipe": None if recipe is None else recipe.recipe,
                          "manager": cg.FP8GlobalStateManager.get_fp8_recipe() is recipe,
                          "enabled": cg.FP8GlobalStateManager.is_fp8_enabled(),
                          "te_delayed": isinstance(recipe, cg.te.common.recipe.DelayedScaling),
                          "runtime_enabled": r.fp8_runtime_enabled}
    out["graphs"] = {
        "moved_then_restored": moved and all(torch.equal(s.amax_history[d], before[d][0]) and
                                             torch.equal(s.scale[d], before[d][1]) for d in before),
        "same_addresses": addresses == [s.amax_history["fwd"].data_ptr(), s.scale["fwd"].data_ptr()],
        "contexts": seen, "outside": active_recipe() is None and not cg.FP8GlobalStateManager.is_fp8_enabled(),
    }


def weight_cache():
    """Two micro-batches a step, the first marked by GPTModel.set_is_first_microbatch as Megatron's
    forward_step does: the cached run against one that casts every call (never marked)."""
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    batches = [(torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))) for _ in range(2)]
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)

    def casts():
        return dict(report.op_counts().get("fp8_weight_cast", {}))

    for recipe in ("tensorwise", "delayed"):
        kw = dict(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=4, fp8_amax_compute_algo="max")
        every, _ = model(**kw)
        cached, _ = model(**kw)
        cached.load_state_dict(every.state_dict())
        micro_batch_step(every, batches, pos, False)              # warm-up: the delayed state has a history in both
        micro_batch_step(cached, batches, pos, False)
        report.reset_op_counts()
        steps = []
        for _ in range(3):
            l_every, g_every = micro_batch_step(every, batches, pos, False)
            l_cached, g_cached = micro_batch_step(cached, batches, pos, True)
            steps.append({"losses": [l_every, l_cached],
                          "grad_rel_max": max(rel(g_cached[n], g_every[n]) for n in g_every)})
            with torch.no_grad():   # the same optimizer step for both, through .data as Megatron's write
                for (name, p), q in zip(every.named_parameters(), cached.parameters()):
                    delta = 0.01 * torch.sign(g_every[name]) if name in g_every else 0.0
                    p.data.add_(delta)
                    q.data.add_(delta)
        out[recipe] = {"steps": steps, "casts": casts(), "never_marked_has_no_cache":
                       every.decoder.layers[0].mlp.linear_fc1.fp8_weight_cache.tensors is None}


def swiglu():
    """Megatron's MLP with bias_swiglu_impl (delayed scaling, 3 layers, 2 steps): without the
    backend's fp8_swiglu op (SwiGLU, then fc2's own cast), then with it lent as the cuda backend
    has it (SwiGLU computed inside fc2's cast and its backward inside fc1's)."""
    tokens, pos, labels = start()
    kw = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
              activation_func=torch.nn.functional.silu, bias_activation_fusion=True)
    runs = {}
    for name in ("unfused", "fused"):
        if name == "fused":
            cpu_backend.BACKEND.ops["fp8_swiglu"] = "megatron_adapt.backends.cuda.fp8_swiglu:fp8_swiglu"
        m, _ = model(**kw)
        report.reset_op_counts()
        losses, grads = [], None
        for _ in range(2):   # the second step's scales come from the first step's amaxes
            loss, grads = step(m, tokens, pos, labels, False)
            losses.append(loss)
        mlp = m.decoder.layers[1].mlp
        runs[name] = {"losses": losses, "grads": grads, "calls": dict(report.op_counts().get("fp8_swiglu", {})),
                      "history": [mlp.linear_fc2.fp8_scaling.amax_history["fwd"][:, 0].tolist(),
                                  mlp.linear_fc1.fp8_scaling.amax_history["bwd"][:, 0].tolist()]}
    u, f = runs["unfused"], runs["fused"]
    out["swiglu"] = {
        "calls": f["calls"], "unfused_calls": u["calls"],
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(f["losses"], u["losses"])),
        "grad_rel_max": max(rel(f["grads"][n], u["grads"][n]) for n in u["grads"] if u["grads"][n] is not None),
        "history_rel": max(abs(a - b) / max(abs(b), 1e-12) for hf, hu in zip(f["history"], u["history"])
                           for a, b in zip(hf, hu)),
        "history_fused": f["history"],
        "fallbacks": {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"]
                      if o["op"] == "fp8_swiglu" and o["fallback_reason"]},
    }


def recompute():
    """Three steps on the same weights and data, with and without recompute, for each recipe:
    selective recompute of the MLP (transformer_layer calls te_checkpoint), full recompute of every
    layer (the block's / recompute.py's te_checkpoint) and, with MoE experts, of the MoE layer
    (moe_layer's te_checkpoint). The recompute repeats the forward's fp8 GEMMs on the same inputs
    with the same scales, so the losses and the forward scaling state match a run without it
    exactly; gradients too, but for the order in which autograd sums a residual's two gradients,
    which Megatron's MLP recompute changes in fp32 rounding with fp8 off as well."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    tokens, pos, labels = start()
    moe_kw = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_ffn_hidden_size=128,
                  moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                  activation_func=torch.nn.functional.silu)
    modes = {"none": {}, "mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "moe_none": moe_kw, "moe": dict(moe_kw, recompute_granularity="selective", recompute_modules=["moe"])}

    def build(kw):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(**{**BASE, **kw})
        spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=True) if "num_moe_experts" in kw
                else get_gpt_layer_with_transformer_engine_spec())
        return GPTModel(config, spec, vocab_size=128, max_sequence_length=32)

    def state(m, d):
        return {n: (mod.fp8_scaling.scale[d].clone(), mod.fp8_scaling.amax_history[d].clone(), mod.fp8_scaling.updates[d])
                for n, mod in m.named_modules() if hasattr(mod, "fp8_scaling")}

    def close(a, b):   # relative difference of two states' tensors; inf where the counts differ
        return max((max(rel(x[0], y[0]), rel(x[1], y[1])) if x[2] == y[2] else float("inf"))
                   for x, y in zip(a.values(), b.values()))

    for recipe in ("tensorwise", "delayed"):
        runs = {}
        for mode, kw in modes.items():
            m = build(dict(kw, fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=4, fp8_amax_compute_algo="max"))
            before = sum(report.op_counts().get("te_checkpoint", {}).values())
            losses, grads = [], []
            for _ in range(3):   # delayed: steps 2 and 3 cast with scales from the earlier steps
                loss, g = step(m, tokens, pos, labels, False)
                losses.append(loss)
                grads.append({n: t.clone() for n, t in g.items() if t is not None})
            runs[mode] = {"losses": losses, "grads": grads, "fwd": state(m, "fwd"), "bwd": state(m, "bwd"),
                          "checkpoints": sum(report.op_counts().get("te_checkpoint", {}).values()) - before}
        res = {}
        for mode, ref in (("mlp", "none"), ("full", "none"), ("moe", "moe_none")):
            a, b = runs[mode], runs[ref]
            res[mode] = {
                "checkpoints": a["checkpoints"], "ref_checkpoints": b["checkpoints"],
                "losses_equal": a["losses"] == b["losses"],
                "grad_rel_max": max(rel(ga[n], gb[n]) for ga, gb in zip(a["grads"], b["grads"]) for n in gb),
                "grads_compared": sum(len(g) for g in b["grads"]),
                "fwd_state_equal": all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
                                       for x, y in zip(a["fwd"].values(), b["fwd"].values())),
                "bwd_state_rel": close(a["bwd"], b["bwd"]),
                "linears_with_state": len(b["fwd"]),
                "fwd_updates": sorted({v[2] for v in a["fwd"].values()}),
            }
        out[recipe] = res
    out["report"] = sorted(report.op_counts().get("te_checkpoint", {}))


def duplicated():
    """MLA (q / kv down projections) with latent MoE (fc1 / fc2 latent projections): the linears
    TE's spec builds as TELinear(parallel_mode="duplicated") run the backend's fp8 GEMM, as TE's
    would, against the same model with fp8 off at run time (Megatron's get_fp8_context: nullcontext)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    tokens, pos, labels = start()
    kw = dict(BASE, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
              qk_pos_emb_head_dim=16, v_head_dim=16, qk_layernorm=True, rope_type="rope",
              num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_ffn_hidden_size=64,
              moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
              activation_func=torch.nn.functional.silu)
    latent = "moe_latent_size" in TransformerConfig.__dataclass_fields__   # core 0.16+
    if latent:
        kw["moe_latent_size"] = 32

    def build(**extra):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = MLATransformerConfig(**kw, **extra)
        return GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=True),
                        vocab_size=128, max_sequence_length=32)

    names = ["self_attention.linear_q_down_proj", "self_attention.linear_kv_down_proj"]
    if latent:
        names += ["mlp.fc1_latent_proj", "mlp.fc2_latent_proj"]
    ref = build(fp8="hybrid", fp8_recipe="tensorwise")
    ref.config.fp8 = None
    before = calls()
    ref_loss, ref_grads = step(ref, tokens, pos, labels, False)
    out["ref_calls"] = calls() - before
    out["latent"] = latent
    out["plain_types"] = sorted({type(build().get_submodule(f"decoder.layers.0.{n}")).__name__ for n in names})
    for recipe, main_grad in (("tensorwise", False), ("delayed", True)):
        m = build(fp8="hybrid", fp8_recipe=recipe, gradient_accumulation_fusion=main_grad,
                  fp8_amax_history_len=4, fp8_amax_compute_algo="max")
        m.load_state_dict(ref.state_dict(), strict=False)
        dup = {f"{i}.{n}": m.get_submodule(f"decoder.layers.{i}.{n}") for i in range(3) for n in names}
        fp8_linears = sum(1 for mod in m.modules() if hasattr(mod, "fp8_scaling"))
        before = calls()
        for _ in range(2):   # delayed: the 2nd step casts with scales from the 1st step's amaxes
            loss, grads = step(m, tokens, pos, labels, main_grad)
        sd = m.state_dict()
        out[recipe] = {
            "types": sorted({type(mod).__name__ for mod in dup.values()}),
            "fp8_calls": calls() - before, "fp8_linears": fp8_linears,
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
            "dup_grad_rel": {k: rel(grads[f"decoder.layers.{k}.weight"], ref_grads[f"decoder.layers.{k}.weight"])
                             for k in dup},
            "dup_amax_seen": all(bool(mod.fp8_scaling.amax_history["fwd"].abs().sum() > 0) for mod in dup.values()),
            "dup_extra_state_bytes": min(sd[f"decoder.layers.{k}._extra_state"].numel() for k in dup),
        }
    out["fallbacks"] = {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"]
                        if o["op"] == "fp8_linear" and o["fallback_reason"]}


{"refusal": refusal, "train": train, "moe": moe, "moe_weight_cache": moe_weight_cache, "weight_cache": weight_cache, "swiglu": swiglu,
 "recompute": recompute, "duplicated": duplicated}[scenario]()
print("PROBE-JSON:" + json.dumps(out))

"""Tier 1, area fp8 (its PatchContract: TestFp8 in test_patches.py): the refusal on cpu, and fp8 reached
through Megatron's real path (GPTModel from the TE layer spec, Megatron's get_fp8_context callers,
--first-last-layers-bf16, gradient-accumulation fusion, _extra_state). Each in a fresh interpreter
(tests/patching/fp8_worker.py says how the cpu backend borrows the cuda fp8 op for `train`)."""
import json
import os
import types
from functools import lru_cache

import pytest

from adapt_testutil import run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_worker.py")


@lru_cache(maxsize=None)
def worker(scenario):
    out = run_python([WORKER, scenario], timeout=600).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


class TestFp8ThroughMegatron:
    """(The area's PatchContract subclass is TestFp8 in test_patches.py.)"""

    def test_cpu_refuses_fp8_and_fp4_configs_naming_flag_backend_reason(self):
        res = worker("refusal")
        assert res["plain"] == "built"
        for key, flag in (("{'fp8': 'hybrid'}", "--fp8-format hybrid"),
                          ("{'fp8': 'e4m3', 'fp8_recipe': 'delayed'}", "--fp8-format e4m3")):
            assert res[key].startswith(f"UnsupportedFeatureError: TransformerConfig: {flag}: the cpu "
                                       "backend cannot run it: CPUs have no fp8 matrix units"), res[key]
        assert "--fp4-format e2m1: the cpu backend cannot run it: megatron-adapt serves no fp4" in res["{'fp4': 'e2m1'}"]

    def test_fp8_linears_through_gpt_model(self):
        res = worker("train")
        assert res["plain_class"] == "AdaptLayerNormColumnParallelLinear"   # fp8 unset: Megatron's / ours, unchanged
        for key in ("tensorwise", "delayed", "tensorwise+main_grad"):
            r = res[key]
            assert r["classes"] == ["Fp8AdaptLayerNormColumnParallelLinear", "Fp8RowParallelLinear"], r
            assert r["fp8_calls"] == 2 * 3 * 4, r          # 2 steps x 3 layers x (qkv, proj, fc1, fc2)
            assert r["loss_rel"] < 2e-3, r                 # fp8 against the same model in fp32
            # quantized (not fp32), within fp8's error: e5m2 gradients through 3 layers of a tiny
            # model (the op's exactness against an emulation is tests/cuda/test_cuda_fp8.py's)
            assert 1e-3 < r["grad_rel_max"] < 0.25, r
        assert res["tensorwise+main_grad"]["grad_rel_max"] == pytest.approx(res["tensorwise"]["grad_rel_max"], rel=1e-3)
        d = res["delayed"]
        assert d["scale_fwd"] != [1.0, 1.0] and d["amax_rows"][0] == [0.0, 0.0], d   # updated, row 0 fresh
        assert [row != [0.0, 0.0] for row in d["amax_rows"]] == [False, False, True, True], d
        assert res["first_last_bf16_calls"] == 4             # only the middle layer of three in fp8
        assert res["extra_state_type"] == "Tensor" and res["extra_state_roundtrip"] and res["extra_state_nontrivial"]
        assert res["plain_loads_fp8_checkpoint"] == "<All keys matched successfully>"
        assert res["report_impls"] == ["cpu.scaled_mm(hybrid, delayed)", "cpu.scaled_mm(hybrid, tensorwise)"]

    def test_fp8_weight_cache_across_a_steps_micro_batches(self):
        """GPTModel.set_is_first_microbatch (Megatron's forward_step at each step's first micro-batch)
        makes each fp8 linear cast its weight there and reuse it for the step's later micro-batches,
        also after the weights change through .data as Megatron's optimizers write them. Against a
        model never marked (casts every call): tensorwise equal to the bit; delayed equal at the
        first step and within fp8's error after (the later micro-batches keep the first one's scale)."""
        res = worker("weight_cache")
        for recipe in ("tensorwise", "delayed"):
            r = res[recipe]
            # 3 steps x 12 linears: each step's first micro-batch casts, the second reuses
            assert r["casts"] == {"cast (cache made)": 12, "cast into the cache": 24,
                                  "cached (later micro-batch)": 36}, r
            assert r["never_marked_has_no_cache"], r
            first = r["steps"][0]
            assert first["losses"][0] == first["losses"][1] and first["grad_rel_max"] == 0.0, r
            for step in r["steps"]:
                if recipe == "tensorwise":
                    assert step["losses"][0] == step["losses"][1] and step["grad_rel_max"] == 0.0, r
                else:
                    assert step["losses"][1] == pytest.approx(step["losses"][0], rel=2e-3), r
                    assert step["grad_rel_max"] < 0.1, r

    def test_swiglu_inside_the_fp8_casts_through_megatrons_mlp(self):
        """Delayed scaling, Megatron's MLP calling bias_swiglu_impl: with the backend's fp8_swiglu
        (lent from cuda; its torch path on CPU) the activation runs inside fc2's cast and its
        backward inside fc1's, 3 layers x 2 steps each way, with no fallback; losses, gradients
        and the amax histories those casts record equal the unfused path's."""
        r = worker("swiglu")["swiglu"]
        assert r["calls"] == {"torch (swiglu, then cast)": 6, "torch (swiglu backward, then cast)": 6}, r
        assert r["unfused_calls"] == {} and r["fallbacks"] == {}, r
        assert r["loss_rel"] < 1e-6 and r["grad_rel_max"] < 1e-5, r
        assert r["history_rel"] < 1e-5 and all(h[2] > 0 and h[3] > 0 for h in r["history_fused"]), r

    def test_the_names_megatrons_cuda_graphs_ask_te_for(self):
        """--cuda-graph-impl local with fp8: a runner captures inside its layer's fp8 context (bf16 for
        a --first-last-layers-bf16 layer), and the delayed state Megatron's warm-up moves on is put
        back in place (the graph keeps the tensors' addresses). The capture itself needs a GPU:
        tests/cuda/test_cuda_graphs.py."""
        g = worker("train")["graphs"]
        assert g["moved_then_restored"] and g["same_addresses"] and g["outside"], g
        on = {"recipe": "delayed", "manager": True, "enabled": True, "te_delayed": False, "runtime_enabled": True}
        assert g["contexts"]["fp8_layer"] == on, g
        assert g["contexts"]["fp8_middle_layer"] == {**on, "recipe": "tensorwise"}, g
        assert g["contexts"]["bf16_first_layer"] == {"recipe": None, "manager": True, "enabled": False,
                                                     "te_delayed": False, "runtime_enabled": True}, g


    def test_recompute_of_fp8_code_through_te_checkpoint(self):
        """Megatron recomputes fp8 code through TE's te_checkpoint (selective MLP recompute, full
        recompute, MoE-layer recompute). Served: the recompute runs inside the forward's fp8
        context and, for delayed scaling, casts with the scales the forward used and makes no
        forward update (TE's rule). Against the same model without recompute (3 steps): equal
        losses and forward scaling state, gradients and backward state equal (full, MoE) or within
        the fp32 rounding by which Megatron's MLP recompute changes the order of a residual's
        gradient sum, with fp8 off too (mlp). Casting the recompute with the updated scales, or
        outside fp8, moves gradients by 7-20 % here."""
        res = worker("recompute")
        assert res["report"] == ["Megatron's checkpoint, recompute in the forward's fp8 context"]
        for recipe in ("tensorwise", "delayed"):
            for mode in ("mlp", "full", "moe"):
                r = res[recipe][mode]
                assert r["checkpoints"] == 9 and r["ref_checkpoints"] == 0, (recipe, mode, r)   # 3 steps x 3 layers
                assert r["losses_equal"] and r["fwd_state_equal"], (recipe, mode, r)
                assert r["fwd_updates"] == ([3] if recipe == "delayed" else [0]), (recipe, mode, r)
                if mode == "mlp":
                    assert r["grad_rel_max"] < 1e-4 and r["bwd_state_rel"] < 1e-5, (recipe, mode, r)
                else:
                    assert r["grad_rel_max"] == 0.0 and r["bwd_state_rel"] == 0.0, (recipe, mode, r)

    def test_moe_experts_in_fp8_through_megatron(self):
        """--num-experts with --moe-grouped-gemm in fp8: Megatron's TEGroupedMLP (its fp8 padding
        served without TE) on megatron-adapt's grouped linears, one fp8 grouped GEMM per linear."""
        res = worker("moe")
        assert res["moe_ref_calls"] == 0                     # fp8 off at run time: bf16 grouped GEMM
        assert res["moe_fallbacks"] == {}, res["moe_fallbacks"]  # every expert's rows padded to 16
        for recipe in ("tensorwise", "delayed"):
            r = res[f"moe_{recipe}"]
            assert r["experts"] == "TEGroupedMLP" and r["padding"] == "megatron_adapt.patches.fp8", r
            assert r["linears"] == ["AdaptColumnParallelGroupedLinear", "AdaptRowParallelGroupedLinear"], r
            assert r["calls"] == {f"cpu.scaled_grouped_mm(e4m3, rowwise; recipe {recipe} read as rowwise)": 6}, r
            assert r["loss_rel"] < 2e-3, r
            assert r["expert_grads"] == 24 and 1e-3 < r["expert_grad_rel_max"] < 0.35, r
        # with main_grad fusion (delayed here) the fp8 wgrad goes into main_grad in the backend: on
        # CPU by the grouped GEMM's dW and one _foreach_add_ per linear (a GPU: cuBLASLt per expert)
        assert res["moe_tensorwise"]["fp8_wgrad_paths"] == {}, res["moe_tensorwise"]
        assert res["moe_delayed"]["fp8_wgrad_paths"] == {
            "experts: cpu.scaled_grouped_mm+main_grad._foreach_add_ (tensors on cpu)": 6}, res["moe_delayed"]
        # --no-fp8-wgrad with main_grad fusion: fp8 forward and dgrad, the experts' bf16 weight
        # gradients added straight into main_grad (3 layers x 2 linears x 4 experts that got rows)
        r = res["moe_no_fp8_wgrad"]
        assert r["calls"] == {"cpu.scaled_grouped_mm(e4m3, rowwise; recipe delayed read as rowwise)": 6}, r
        assert 0 < r["wgrad_accumulate_calls"] - res["moe_delayed"]["wgrad_accumulate_calls"] <= 24, r
        assert r["loss_rel"] < 2e-3, r
        # in main_grad once (a second add would put them ~100 % off); within the fp8 error of the
        # forward and dgrad, which dominates it here as it does with the fp8 wgrad (0.22 against 0.23)
        assert r["expert_grads"] == 24 and 1e-3 < r["expert_grad_rel_max"] < 0.35, r

    def test_moe_experts_keep_their_fp8_weights_across_a_steps_micro_batches(self):
        """TEGroupedMLP's grouped linears cast the experts' weights (the forward's per-(expert, output)
        operand and the dgrad's per-(expert, input) one) at a step's first micro-batch, marked by
        GPTModel.set_is_first_microbatch, and reuse them for the later ones; equal to the bit to a
        model never marked (which casts at every call), over 3 steps whose updates go through .data;
        with the fp8 wgrad and with --no-fp8-wgrad into main_grad. Fails if the cache is stale
        (a later step reusing the first step's weights) or never reused."""
        res = worker("moe_weight_cache")
        for name in ("fp8_wgrad", "no_fp8_wgrad"):
            r = res[f"moe_cache_{name}"]
            # 3 layers x 2 grouped linears, 3 steps: each step's first micro-batch casts, the second reuses
            assert r["casts"] == {"experts: cast (cache made)": 6, "experts: cast into the cache": 12,
                                  "experts: cached (later micro-batch)": 18}, r
            assert r["never_marked_has_no_cache"] and r["marked"], r
            for step in r["steps"]:
                assert step["losses"][0] == step["losses"][1], r
                assert step["grad_rel_max"] == 0.0 and step["expert_grads"] == 24, r

    def test_duplicated_linears_of_mla_and_latent_moe_in_fp8(self):
        """The linears TE's spec builds as TELinear(parallel_mode="duplicated") -- MLA's q / kv down
        projections and MoE's latent projections -- run the backend's fp8 GEMM inside Megatron's fp8
        context, as TE's would, with their scaling state in _extra_state; built without fp8 they stay
        the plain duplicated linear. Against the same model with fp8 off at run time."""
        res = worker("duplicated")
        assert res["ref_calls"] == 0 and res["plain_types"] == ["AdaptDuplicatedLinear"], res
        assert res["fallbacks"] == {}, res["fallbacks"]        # no linear left in bf16 under fp8
        for recipe in ("tensorwise", "delayed"):
            r = res[recipe]
            assert r["types"] == ["Fp8AdaptDuplicatedLinear"], r
            # every fp8 linear once per step: 3 layers x (q_down, q_up, kv_down, kv_up, proj, and the
            # two latent projections where the release has them), 2 steps
            assert r["fp8_linears"] == 3 * (7 if res["latent"] else 5) and r["fp8_calls"] == 2 * r["fp8_linears"], r
            assert r["loss_rel"] < 2e-3, r
            assert len(r["dup_grad_rel"]) == 3 * (4 if res["latent"] else 2), r
            assert all(1e-3 < v < 0.25 for v in r["dup_grad_rel"].values()), r   # quantized, within fp8 error
            assert r["dup_extra_state_bytes"] > 0, r
        assert res["delayed"]["dup_amax_seen"] and not res["tensorwise"]["dup_amax_seen"]


@pytest.mark.parametrize("settings,expected", [
    ({"fp8": "hybrid", "fp8_recipe": "blockwise"}, None),
    ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, "--fp8-format hybrid --fp8-recipe mxfp8: the cuda backend serves the tensorwise, delayed and blockwise recipes only (mxfp8 needs the MX block-scaled GEMMs of sm100"),
    ({"fp8": "hybrid", "fp8_recipe": "custom"}, "--fp8-recipe custom"),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True}, "--fp8-param-gather: the cuda backend keeps parameters in bf16"),
    ({"fp8": "e4m3", "fp8_recipe": "delayed", "num_experts": 8, "moe_grouped_gemm": True}, None),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "num_experts": 8}, "--num-experts 8: the cuda backend runs fp8 experts as one grouped GEMM per linear; without --moe-grouped-gemm Megatron builds SequentialMLP"),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "num_experts": 8, "moe_grouped_gemm": True,
      "moe_use_legacy_grouped_gemm": True}, "--moe-use-legacy-grouped-gemm builds Megatron's legacy GroupedMLP, which has no fp8 path"),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "num_experts": 8, "moe_grouped_gemm": True,
      "delay_wgrad_compute": True}, "--delay-wgrad-compute: the cuda backend's fp8 expert GEMMs"),
    ({"fp8": "hybrid", "fp8_recipe": "delayed", "transformer_impl": "local"}, "--transformer-impl local"),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_dot_product_attention": True}, "--fp8-dot-product-attention"),
    ({"fp4": "e2m1"}, "--fp4-format e2m1: the cuda backend cannot run it"),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "cuda_graph_impl": "local"}, None),
    ({"fp8": "hybrid", "fp8_recipe": "delayed", "cuda_graph_impl": "local", "fp8_interval": 1}, None),
    ({"fp8": "hybrid", "fp8_recipe": "delayed", "cuda_graph_impl": "local", "fp8_interval": 2}, "--fp8-interval 2 --cuda-graph-impl local: a captured layer replays the same scale update every step"),
    ({"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_interval": 2}, None),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "cuda_graph_impl": "none"}, None),
    ({"fp8": "hybrid", "fp8_recipe": "delayed", "recompute_granularity": "full"}, None),   # te_checkpoint served
    ({"fp8": "hybrid", "fp8_recipe": "delayed", "recompute_granularity": "selective"}, None),
    ({"fp8": "hybrid", "fp8_recipe": "tensorwise", "transformer_impl": "transformer_engine"}, None),
    ({"fp8": "hybrid", "fp8_recipe": "delayed"}, None),
    ({}, None),
])
def test_refusal_on_a_backend_that_runs_fp8(settings, expected):
    """On an fp8-capable cuda device (fp8_unavailable answers None) the features no linear here
    serves are still refused, each naming its flag; the served ones pass."""
    from megatron_adapt.patches.fp8 import fp8_refusal

    backend = types.SimpleNamespace(name="cuda", ops={"fp8_linear": "", "fp8_grouped_gemm": ""},
                                    op=lambda name: {"fp8_unavailable": lambda recipe=None: None}[name])
    why = fp8_refusal(backend, settings)
    assert (why is None) if expected is None else (expected in why), why


@pytest.mark.parametrize("reason", ["NVIDIA A100-SXM4-80GB is sm80; fp8 GEMMs (cuBLASLt through torch._scaled_mm) need sm89"])
def test_refusal_on_a_gpu_before_sm89(reason):
    from megatron_adapt.patches.fp8 import fp8_refusal

    backend = types.SimpleNamespace(name="cuda", op=lambda name: {"fp8_unavailable": lambda recipe=None: reason}[name])
    why = fp8_refusal(backend, {"fp8": "hybrid", "fp8_recipe": "tensorwise"})
    assert why.startswith(f"--fp8-format hybrid: the cuda backend cannot run it: {reason}"), why


def test_blockwise_refused_where_the_gpu_has_no_block_scaled_gemm():
    """An fp8 GPU without cuBLASLt's block-scaled GEMM (here: an Ada card) runs tensorwise and delayed,
    and refuses blockwise naming the recipe and the reason."""
    from megatron_adapt.patches.fp8 import fp8_refusal

    reason = "NVIDIA L40S (sm89), CUDA 13.0: the 1x128 / 128x128 block-scaled fp8 GEMMs ..."
    backend = types.SimpleNamespace(name="cuda", op=lambda name: {
        "fp8_unavailable": lambda recipe=None: reason if recipe == "blockwise" else None}[name])
    assert fp8_refusal(backend, {"fp8": "hybrid", "fp8_recipe": "tensorwise"}) is None
    why = fp8_refusal(backend, {"fp8": "hybrid", "fp8_recipe": "blockwise"})
    assert why.startswith(f"--fp8-format hybrid --fp8-recipe blockwise: the cuda backend cannot run it: {reason}"), why


def test_npu_refuses_fp8():
    from megatron_adapt.backends.npu.fp8 import fp8_unavailable
    from megatron_adapt.patches.fp8 import fp8_refusal

    backend = types.SimpleNamespace(name="npu", op=lambda name: {"fp8_unavailable": fp8_unavailable}[name])
    why = fp8_refusal(backend, {"fp8": "hybrid"})
    assert why.startswith("--fp8-format hybrid: the npu backend cannot run it: megatron-adapt wires no torch_npu fp8 matmul"), why


def test_wgrad_sink_exposes_main_grad_and_takes_none_when_the_gemm_added():
    """patches/fp8.py's gradient-accumulation sink: `sink.main_grad` is where the backend's in-place
    GEMM adds (backends/cuda/fp8_wgrad.py); `sink(None)` then adds nothing more but keeps Megatron's
    protocol (grad_added_to_main_grad, a dummy grad); `sink(dw)` adds dw."""
    import torch
    from megatron_adapt.patches.fp8 import _wgrad_sink
    w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    w.main_grad = torch.full((2, 3), 0.5)
    w.grad_added_to_main_grad = False
    sink = _wgrad_sink(w, fusion=True)
    assert sink.main_grad is w.main_grad
    dummy = sink(None)
    assert torch.equal(w.main_grad, torch.full((2, 3), 0.5)) and w.grad_added_to_main_grad
    assert dummy.shape == (2, 3) and dummy.dtype == torch.bfloat16
    sink(torch.ones(2, 3))
    assert torch.equal(w.main_grad, torch.full((2, 3), 1.5))
    assert _wgrad_sink(w, fusion=False) is None

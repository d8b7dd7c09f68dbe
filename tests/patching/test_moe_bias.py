"""Grouped MoE experts with bias on megatron-core 0.15 - 0.16 (patches/moe.py,
build_grouped_mlp_modules_legacy): `--moe-grouped-gemm` with Megatron's default `--add-bias-linear`
builds TEGroupedMLP on the backend's grouped linears, as Megatron's TE provider does with TE; without
biases Megatron's legacy GroupedMLP stays (it refuses a bias), as under `--moe-use-legacy-grouped-gemm`.

Through Megatron's real specs (the default TE spec served without TE, and the local spec), in a fresh
interpreter (moe_bias_worker.py): the MoE layer against the same layer on Megatron's SequentialMLP
with the same weights, forward, backward and three SGD steps; a SequentialMLP dist checkpoint loads
into the grouped experts; without biases GroupedMLP against SequentialMLP, and a TE-built
(TEGroupedMLP) expert checkpoint into GroupedMLP and back. 0.17+ serve TEGroupedMLP through their own spec
(test_patches.py::TestMoE covers its bias)."""
import json
import os
from functools import lru_cache

import pytest
from packaging.version import Version

from adapt_testutil import run_python
from megatron_adapt.versions import megatron_core_version

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_bias_worker.py")

pytestmark = pytest.mark.skipif(megatron_core_version() >= Version("0.17.0"),
                                reason="0.15-0.16 spec (0.17+: TestMoE's experts_with_bias)")


@lru_cache(maxsize=None)
def result() -> dict:
    out = run_python([WORKER], timeout=600).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


@pytest.mark.parametrize("case", ["te_spec_swiglu", "local_spec_gelu", "recompute_moe_act"])
def test_grouped_experts_with_bias_match_sequential_mlp(case):
    r = result()[case]
    assert r["experts"] == "TEGroupedMLP" and r["reference"] == "SequentialMLP", r
    assert r["linears"] == ["AdaptColumnParallelGroupedLinear", "AdaptRowParallelGroupedLinear"], r
    assert r["grouped_gemm_calls"] == 2, r             # fc1 and fc2 on the backend op
    assert r["recomputes_act"] == (case == "recompute_moe_act"), r
    assert r["params"] == 18, r                        # router weight + bias, 4 experts x 2 linears x (w, b)
    assert r["out_norm"] > 1.0 and r["out_diff"] < 1e-5, r
    assert r["input_grad_diff"] < 1e-5 and r["param_grad_diff"] < 1e-5, r
    assert r["bias_grads_zero"] == [], r               # every expert got tokens: its biases learn
    assert r["losses"]["grouped"] == pytest.approx(r["losses"]["sequential"], abs=1e-6), r
    assert r["weights_after_diff"] < 1e-5, r
    # TE's names (a TE-built TEGroupedMLP's state-dict keys)
    assert {"experts.linear_fc1.weight0", "experts.linear_fc1.bias3", "experts.linear_fc2.weight3",
            "experts.linear_fc2.bias0"} <= set(r["grouped_keys"]), r["grouped_keys"]


def test_sequential_mlp_checkpoint_loads_into_grouped_experts():
    r = result()["checkpoint"]
    assert r["same_sharded_keys"], r
    assert {"mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc1.bias",
            "mlp.experts.experts.linear_fc2.weight", "mlp.experts.experts.linear_fc2.bias"} <= set(r["sharded_keys"])
    assert r["diff_before_load"] > 0.1 and r["loaded_diff"] == 0.0, r


def test_without_bias_grouped_mlp_stays_and_matches_sequential_mlp():
    """No bias: Megatron's GroupedMLP as before this change (one stacked weight per linear)."""
    r = result()["no_bias"]
    assert r["experts"] == "GroupedMLP", r
    # its forward on the backend's grouped_gemm (fp32: stock GroupedMLP takes bf16 only) against
    # SequentialMLP with the same weights
    assert r["grouped_gemm_calls"] == 2 and r["out_norm"] > 1.0, r
    assert max(r["out_rel_diff"], r["input_grad_rel_diff"], r["weight_grad_rel_diff"]) < 1e-5, r


def test_upcycling_builds_te_grouped_mlp_and_matches_the_dense_mlp():
    """--moe-use-upcycling without biases: upcycling_utils converts into SequentialMLP or TEGroupedMLP
    only (TypeError on the legacy GroupedMLP, which Megatron's unit test test_upcycling_TE hit on
    core_v0.16.1), so the experts are TEGroupedMLP; the upcycled layer gives the dense MLP's output."""
    r = result()["upcycling"]
    assert r["experts"] == "TEGroupedMLP", r
    assert r["out_norm"] > 0.0 and r["rel_diff"] < 1e-5, r


def test_legacy_flag_builds_grouped_mlp_which_refuses_bias():
    r = result()["legacy_flag"]
    assert r["experts"] == "GroupedMLP", r   # --moe-use-legacy-grouped-gemm, as with TE
    assert "bias not supported in Grouped GEMM" in r["with_bias"], r   # Megatron's own, with TE too


def test_te_built_expert_checkpoint_loads_into_grouped_mlp_and_back():
    r = result()["te_checkpoint"]
    assert r["source"] == "TEGroupedMLP" and r["target"] == "GroupedMLP", r
    for way in ("forward", "back"):
        assert r[way]["diff_before_load"] > 0.1 and r[way]["loaded_diff"] == 0.0, r

"""Tier 1: every patch area inherits PatchContract (before/after import, idempotent, revert,
disabled) and adds a check that Megatron's real consumer reaches it."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python
from contract import PatchContract, specs_of

CONSUMERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "consumers.py")


@lru_cache(maxsize=None)
def consumers():
    out = run_python([CONSUMERS]).stdout
    line = next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))
    return json.loads(line[len("PROBE-JSON:"):])


def consumer(area):
    res = consumers()[area]
    assert "error" not in res, res["error"]
    return res


def _te_version_in_range():
    from megatron_adapt.patches import te_version
    from megatron_adapt.versions import in_range, megatron_core_version

    return in_range(te_version.SPECS[0].versions, megatron_core_version())


@pytest.mark.skipif(not _te_version_in_range(), reason="megatron-core 0.17+ answers Version('0.0.0') "
                    "without TE itself (patches/te_version.py); the area has no spec there")
class TestTeVersion(PatchContract):
    area = "te_version"

    def test_no_te_answers_zero_through_is_te_min_version_and_aliases(self):
        res = consumer("te_version")
        assert not res["have_te"], "this test checks the answer without Transformer Engine"
        assert res["original_answers_none"], res  # what Megatron's own helper says (then TypeError)
        assert res["version"] == "0.0.0" and res["min_1_3"] is False and res["min_0_0_strict"] is False, res
        assert res["bert_alias_ours"], res


def test_te_version_stock_answer_on_0_17_plus_matches_ours():
    """On 0.17+ Megatron answers itself; what it answers is what the patch gives 0.15-0.16."""
    if _te_version_in_range():
        pytest.skip("megatron-core 0.15-0.16: covered by TestTeVersion")
    proc = run_python("import megatron_adapt; megatron_adapt.apply('cpu')\n"
                      "from megatron.core.utils import get_te_version, is_te_min_version\n"
                      "assert str(get_te_version()) == '0.0.0' and not is_te_min_version('1.3')\n")
    assert proc.returncode == 0, proc.stderr[-2000:]


class TestCrossEntropy(PatchContract):
    area = "cross_entropy"

    def test_reached_through_gpt_model_loss_fused_and_unfused(self):
        res = consumer("cross_entropy")
        assert res["calls"] == 2 and res["matches_megatron"], res


class TestNorms(PatchContract):
    area = "norms"

    def test_reached_through_local_layer_spec(self):
        res = consumer("norms")
        for norm in ("LayerNorm", "RMSNorm"):
            assert res[norm]["class"].startswith("Adapt") and res[norm]["final_class"].startswith("Adapt"), res
            assert res[norm]["calls"] == 1 and res[norm]["matches"], res
        assert res["zero_centered_gamma"]


class TestSoftmax(PatchContract):
    area = "softmax"

    def test_reached_through_fused_scale_mask_softmax(self):
        res = consumer("softmax")
        for kind in ("causal", "padding"):
            assert res[kind] == {"calls": 1, "matches": True}, res


class TestAttention(PatchContract):
    area = "attention"

    def test_reached_through_local_core_attention_incl_gqa(self):
        res = consumer("attention")
        for groups in ("groups4", "groups2"):
            assert res[groups] == {"calls": 3, "matches": True, "causal_mask_matches": True}, res


class TestRope(PatchContract):
    area = "rope"

    def test_rope_fusion_default_works_and_matches(self):
        res = consumer("rope")
        assert res["calls"] >= 2 and res["model_ran"] and res["matches"], res


class TestActivations(PatchContract):
    area = "activations"

    def test_reached_through_mlp(self):
        res = consumer("activations")
        for op in ("bias_swiglu", "bias_gelu"):
            assert res[op]["calls"] >= 1 and res[op]["matches"], res


class TestOptimizer(PatchContract):
    area = "optimizer"

    def test_reached_through_get_megatron_optimizer(self):
        res = consumer("optimizer")
        assert res == {"calls": 1, "class": "AdamW", "foreach": True}, res


class TestCheckpointing(PatchContract):
    area = "checkpointing"

    def test_fresh_distributed_optimizer_yields_a_load_template(self):
        res = consumer("checkpointing")
        assert res == {"original_fails_on_fresh_optimizer": True, "ours_returns_template": True,
                       "inner_state_untouched": True}, res


class TestMultiTensor(PatchContract):
    area = "multi_tensor"

    def test_reached_through_grad_norm_and_clipping(self):
        res = consumer("multi_tensor")
        assert res["l2norm_calls"] >= 1 and res["scale_calls"] >= 1, res
        assert res["norm_matches"] and res["clipped_to_one"], res


class TestRng(PatchContract):
    area = "rng"

    def test_tracker_fork_switches_and_restores(self):
        assert all(consumer("rng").values()), consumer("rng")


class TestJit(PatchContract):
    area = "jit"

    def test_fusions_are_eager_on_cpu(self):
        assert consumer("jit") == {"eager": True}


class TestTraining(PatchContract):
    area = "training"

    def test_dataset_helpers_importable_from_the_wheel(self):
        res = consumer("training")
        assert res["helpers_import"] and res["ops"], res


class TestGradAccumFusion(PatchContract):
    area = "grad_accum_fusion"

    def test_weight_gradient_accumulates_into_main_grad(self):
        res = consumer("grad_accum_fusion")
        fused, unfused = res["True"], res["False"]
        assert fused == {"calls": 1, "grad_is_none": True, "main_grad_matches": True,
                         "grad_matches": False}, res
        assert unfused["calls"] == 0 and unfused["grad_matches"], res


class TestLayerSpecs(PatchContract):
    area = "layer_specs"

    def test_te_specs_built_from_the_backend_provider(self):
        res = consumer("layer_specs")
        for norm in ("LayerNorm", "RMSNorm"):
            r = res[norm]
            assert r["qkv"] == r["fc1"] == "AdaptLayerNormColumnParallelLinear", r
            assert r["input_layernorm"] == "IdentityOp" and r["final"].startswith("Adapt"), r
            names = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                     "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"}
            if norm == "LayerNorm":
                names |= {n.replace("weight", "bias") for n in names}
            assert names <= set(r["keys"]), r["keys"]  # TE's parameter names
            assert r["norm_calls"] >= 3 * 2 * 2 + 3, r   # 2 norms/layer x 2 layers + final, 3 models
            assert r["matches_local"] and r["block_matches_local"], r
        from packaging.version import Version

        from megatron_adapt.versions import megatron_core_version
        if megatron_core_version() >= Version("0.17.0"):  # the provider's layer_norm(has_residual=...)
            r = res["residual_norm"]
            assert r["type"].startswith("Adapt") and r["matches"], r
            assert "TEFusedResidualRMSNorm" in r["fused_residual"], r
        else:
            assert "residual_norm" not in res, res


def _moe_in_range():
    from megatron_adapt.patches import moe
    from megatron_adapt.versions import in_range, megatron_core_version

    return in_range(moe.VERSIONS, megatron_core_version())


@pytest.mark.skipif(not _moe_in_range(), reason="the moe area's specs cover megatron-core 0.15-0.16 "
                    "(patches/moe.py VERSIONS); on 0.17+ they are reported as skipped by range")
class TestMoE(PatchContract):
    area = "moe"

    def test_grouped_gemm_permute_and_router_fusion_through_moe_layer(self):
        res = consumer("moe")
        assert res["experts_class"] == "GroupedMLP", res
        assert res["grouped_gemm_calls"] == 2, res  # fc1 and fc2, fp32 (stock: bf16 only)
        assert res["experts_match"] and res["experts_grads_match"] and res["empty_expert_grad_zero"], res
        fused, unfused = res["calls_fused_True"], res["calls_fused_False"]
        assert all(n >= 1 for n in fused.values()), fused   # every fused MoE op served by the backend
        assert not any(unfused.values()), unfused            # flags off: Megatron's own code
        assert res["layer_matches_unfused"], res
        # --moe-router-dtype fp32 (every router, without TE, NameErrors on te_general_gemm unpatched)
        assert res["router_fp32"] == {"dtype": "torch.float32", "matches": True, "grads_match": True}, res


class TestCudaGraphs(PatchContract):
    area = "cuda_graphs"

    def test_reached_from_the_schedules_and_a_no_op_without_recorded_graphs(self):
        """The schedules call create_cudagraphs by the name they imported: that name is ours,
        and with no graph recorded (no --cuda-graph-impl local) it does nothing and reports none."""
        proc = run_python(
            "import megatron_adapt; megatron_adapt.apply('cpu')\n"
            "from megatron.core.pipeline_parallel import schedules\n"
            "from megatron.core.transformer import cuda_graphs as cg\n"
            "assert schedules.create_cudagraphs is cg.create_cudagraphs\n"
            "assert 'megatron_adapt' in repr(type(cg.create_cudagraphs)) or hasattr(cg.create_cudagraphs, '__wrapped__'), repr(cg.create_cudagraphs)\n"
            "assert schedules.create_cudagraphs() is None\n"
            "from megatron_adapt import report; assert report(as_json=True)['cuda_graphs'] == []\n")
        assert proc.returncode == 0, proc.stderr[-2000:]


class TestStartupReport(PatchContract):
    area = "startup_report"

    def test_table_printed_on_rank0_once_parallel_state_is_set_up(self):
        """...and the tensor-parallel group is named to the backends (ops.replica_group) while
        it exists: kernels chosen at run time must agree across its ranks."""
        proc = run_python(
            "import os; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533', RANK='0', WORLD_SIZE='1')\n"
            "import megatron_adapt; megatron_adapt.apply('cpu')\n"
            "import torch.distributed as d; d.init_process_group('nccl')\n"
            "from megatron.core import parallel_state as ps; ps.initialize_model_parallel(1, 1)\n"
            "from megatron_adapt.ops import replica_group\n"
            "assert replica_group() is ps.get_tensor_model_parallel_group(), 'TP group not named'\n"
            "ps.destroy_model_parallel(); assert replica_group() is None\n")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "megatron-adapt: backend=cpu" in proc.stderr and "applied" in proc.stderr, proc.stderr[-2000:]


def test_every_patch_area_has_a_contract_subclass():
    from megatron_adapt.patches import AREAS

    covered = {cls.area for cls in PatchContract.__subclasses__()}
    missing = [a for a in AREAS if a not in covered]
    assert not missing, f"patch areas without tests: {missing}"
    from megatron_adapt.core import all_specs
    from megatron_adapt.versions import in_range, megatron_core_version

    version = megatron_core_version()
    for area in AREAS:
        declared = [s for s in all_specs() if s.area == area]
        assert declared, f"area {area} declares no specs"
        # An area may be limited to some releases (every spec's range excludes this one: moe on
        # 0.17+); otherwise it must have specs to probe here.
        if any(in_range(s.versions, version) for s in declared):
            assert specs_of(area), f"area {area} has no megatron-core specs to test"

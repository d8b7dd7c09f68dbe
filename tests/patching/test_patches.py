"""Tier 1: every patch area inherits PatchContract (before/after import, idempotent, revert,
disabled) and adds a check that Megatron's real consumer reaches it."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python
from contract import PatchContract, probe, specs_of

CONSUMERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "consumers.py")


def _free_port():
    from megatron_adapt.apps.ports import free_port  # below the ephemeral range: see its docstring

    return str(free_port())


@lru_cache(maxsize=None)
def consumers():
    for _ in range(3):   # a free port can be taken by another process before the worker binds it
        proc = run_python([CONSUMERS], env={"PROBE_PORT": _free_port()}, check=False)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    out = proc.stdout
    line = next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))
    return json.loads(line[len("PROBE-JSON:"):])


def consumer(area):
    res = consumers()[area]
    assert "error" not in res, res["error"]
    return res


class TestPackageVersions(PatchContract):
    area = "package_versions"

    def test_absent_packages_answer_zero_through_is_min_version_and_aliases(self):
        res = consumer("package_versions")
        assert all(res["absent"].values()), f"this test checks the answers without the packages: {res}"
        assert res["fa_original_raises"], res  # Megatron's own helper, every supported release
        if "te_original_answers_none" in res:  # 0.15-0.16 (then is_te_min_version raises TypeError)
            assert res["te_original_answers_none"], res
        for name in ("te", "fa", "mamba", "causal_conv1d"):
            if name in res:
                assert res[name] == {"version": "0.0.0", "min": False, "min_0_strict": False}, (name, res)
        assert res["bert_alias_ours"] is not False, res   # None: this release has no bert alias

    def test_installed_package_keeps_megatrons_answer_and_broken_one_raises(self, tmp_path):
        """A package that is present keeps the original's answer (here: a fake flash_attn with a
        __version__); one whose import fails is not reported "absent"."""
        (tmp_path / "flash_attn").mkdir()
        (tmp_path / "flash_attn" / "__init__.py").write_text("__version__ = '2.7.4'\n")
        proc = run_python(
            f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "import megatron_adapt; megatron_adapt.apply('cpu')\n"
            "from megatron.core.utils import get_fa_version, is_fa_min_version\n"
            "assert str(get_fa_version()) == '2.7.4' and is_fa_min_version('2.7.3'), get_fa_version()\n")
        assert proc.returncode == 0, proc.stderr[-2000:]
        (tmp_path / "flash_attn" / "__init__.py").write_text("raise ImportError('broken build')\n")
        proc = run_python(
            f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "import megatron_adapt; megatron_adapt.apply('cpu')\n"
            "from megatron.core.utils import get_fa_version\n"
            "try:\n    get_fa_version()\nexcept ImportError as e:\n    assert 'broken build' in str(e), e\n"
            "else:\n    raise SystemExit('a broken flash_attn was answered')\n")
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

    def test_attention_backend_unfused_keeps_megatrons_unfused_math(self):
        res = consumer("attention_unfused")
        assert res == {"new_calls": {"megatron.unfused": 1}, "equal": True}, res

    def test_provider_linears_built_plain_are_instances_of_the_spec_class(self):
        res = consumer("provider_classes_isinstance")
        for name, r in res.items():
            assert r["variant"] != r["built"], (name, r)        # the constructor returned a plain linear
            assert r["isinstance"] and r["plain_base"] and r["other_module_not_instance"], (name, r)

    def test_dropout_rng_follows_te_for_te_named_attention_and_megatron_for_local(self):
        res = consumer("attention_dropout_rng")
        assert res["te_seeded"] == {"fork": True, "cls": "AdaptDotProductAttention", "tracker_advanced": True}, res
        assert res["local_seeded"] == {"fork": None, "cls": "DotProductAttention", "tracker_advanced": True}, res
        # built with no tracker states: TE-named dropout draws from the default generator (as
        # TEDotProductAttention hands TE no tracker); Megatron's local attention raises, as stock
        assert res["te_unseeded"] == {"fork": False, "cls": "AdaptDotProductAttention", "tracker_advanced": False}, res
        assert res["local_unseeded"]["error"] == "cuda rng state model-parallel-rng is not added", res

    def test_linear_sharded_state_fills_dp_cp_group_as_te_does(self):
        res = consumer("linear_sharded_metadata")
        if res.get("no_dp_cp_group"):
            pytest.skip("core_v0.15 has no dp_cp_group in sharded state dicts")
        assert res["te"]["filled"] and "fc1.weight" in res["te"]["keys"], res
        assert res["local"] == {"error": "KeyError 'dp_cp_group'"}, res

    def test_linear_weight_init_follows_te_for_te_named_linears_and_megatron_for_local(self):
        res = consumer("linear_init_rng")
        assert res["te_seeded"] == {"cls": "AdaptLayerNormColumnParallelLinear", "fork": False}, res
        assert res["local_seeded"] == {"cls": "ColumnParallelLinear", "fork": False}, res
        assert res["seeded_same"], res      # an initialized tracker: both fork it, the same weights
        # no tracker states: the TE-named linear draws from the default generator; the override
        # of the tracker's fork is gone after the build
        assert res["te_unseeded"] == {"cls": "AdaptLayerNormColumnParallelLinear", "fork": False}, res
        assert res["unseeded_from_default_generator"], res
        assert res["local_unseeded"]["error"] == "cuda rng state model-parallel-rng is not added", res


class TestContextParallel(PatchContract):
    """The CP core attention itself: tests/ops/test_cp_attention.py (op) and
    tests/megatron_lm/test_pretrain_gpt_cp.py (stock pretrain_gpt.py, CP=2 against CP=1)."""
    area = "context_parallel"

    def test_thd_batch_split_without_te(self):
        self._targets()   # skips where this release has no THD split under CP (0.15)
        res = consumer("context_parallel")
        assert res["tokens"] == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20, 25, 26], res
        assert res["labels"] == [t + 100 for t in res["tokens"]]
        assert res["qkv_format"] == "thd" and res["max_seqlen"] == 12 and res["padded_kept"], res
        # --sft's batches: cu_seqlens are the padded slots, no cu_seqlens_padded, (1, n) on core 0.16
        assert res["sft_tokens"] == res["tokens"], res
        assert res["sft_cu_seqlens"] == [0, 8, 12, 24, 28], res


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


class TestBiasDropoutAdd(PatchContract):
    area = "bias_dropout_add"

    def test_reached_through_transformer_layer(self):
        res = consumer("bias_dropout_add")
        assert res["calls"] == 2 and res["layer_ran"] and res["matches"], res  # attention and MLP
        assert 0.2 <= res["dropped"] <= 0.4 and res["expanded_bias"], res
        assert res["mixed_dtypes_kept_megatrons"] == ["cpu.torch", "megatron.bias_dropout_add_fused_train"], res


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
                       "inner_state_untouched": True,
                       # a rank that owns no parameter: step 0, and no state left behind
                       "original_fails_owning_nothing": True, "owning_nothing_steps": [0.0],
                       "owning_nothing_untouched": True,
                       # states without a per-parameter step (Megatron's init_state_fn): step 0,
                       # the states left as they were
                       "original_fails_without_steps": True, "fused_style_steps": [0.0],
                       "fused_style_untouched": True,
                       # loaded tensors without "step" (Megatron drops it): the live step is kept
                       "original_set_fails_without_step": True, "set_keeps_step": True,
                       "set_copies_moments": True}, res


HARDEN_CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_hardening_check.py")


@lru_cache(maxsize=None)
def hardening_check(harden: bool):
    """(directory, findings) of one run of checkpoint_hardening_check.py (cached per switch)."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="adapt-harden-")
    env = {"MEGATRON_ADAPT_CHECKPOINT_HARDEN": "1" if harden else "0", "PROBE_PORT": _free_port()}
    out = run_python([HARDEN_CHECK, tmp], env=env).stdout
    line = next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))
    return tmp, json.loads(line[len("PROBE-JSON:"):])


def _hardening_checks_verified():
    """The save/load behaviour checks (checkpoint_hardening_check.py) are written against
    megatron-core 0.15-0.16's dist_checkpointing: common state in common.pt, async saves by
    megatron-core's own writer. From 0.19 the common state lives inside the torch_dist files and
    async saves default to nvidia-resiliency-ext; the checks have not been adapted and run there."""
    from megatron_adapt.versions import in_range, megatron_core_version
    return in_range(">=0.15.0,<0.17.0", megatron_core_version())


needs_verified_hardening = pytest.mark.skipif(
    not _hardening_checks_verified(),
    reason="checkpoint hardening's save/load checks are verified on megatron-core 0.15-0.16 only "
           "(0.19 moved the common state into the torch_dist files; not yet adapted: docs/checkpoints.md)")


class TestCheckpointHardening(PatchContract):
    """Off by default (skipped, reason given); probed with MEGATRON_ADAPT_CHECKPOINT_HARDEN=1."""
    area = "checkpoint_hardening"
    env = (("MEGATRON_ADAPT_CHECKPOINT_HARDEN", "1"),)

    def test_skipped_with_reason_when_switch_is_off(self):
        res = probe("before")
        for t in self._targets():
            assert res[t]["status"] == "skipped" and "MEGATRON_ADAPT_CHECKPOINT_HARDEN" in res[t]["reason"], res[t]

    @needs_verified_hardening
    def test_save_modes_under_umask_0000_sync_and_async(self):
        _, res = hardening_check(True)
        assert res["hardened"] and res["loaded_identical"], res
        for kind in ("sync_modes", "async_modes"):
            modes = res[kind]
            assert {".", "common.pt", "metadata.json", ".metadata", "__0_0.distcp"} <= modes.keys(), modes
            assert modes.pop(".") == 0o750, (kind, modes)
            assert set(modes.values()) == {0o640}, (kind, {k: oct(v) for k, v in modes.items()})

    @needs_verified_hardening
    def test_load_refuses_world_writable_file_naming_it(self):
        tmp, res = hardening_check(True)
        for key in ("world_writable", "world_writable_common"):
            assert res[key].startswith("refusing to load checkpoint file ") and \
                os.path.join(tmp, "sync", "common.pt") in res[key] and "0o666" in res[key], res[key]

    @needs_verified_hardening
    def test_common_state_is_loaded_weights_only(self):
        """With torch's default simulated as weights_only=False (torch < 2.6), a common.pt holding
        an arbitrary class loads unhardened and is refused hardened."""
        assert hardening_check(True)[1]["weights_only"].startswith(
            "UnpicklingError: Weights only load failed")

    @needs_verified_hardening
    def test_without_the_switch_umask_0000_leaves_world_writable_files(self):
        """The baseline the checks above are measured against: stock behaviour under umask 0000."""
        _, res = hardening_check(False)
        assert not res["hardened"]
        assert res["sync_modes"]["."] == 0o777 and res["sync_modes"]["common.pt"] == 0o666, res
        assert res["world_writable"] == "loaded" and res["weights_only"] == "loaded NotAllowListed", res

    def test_conflicting_torch_switch_is_refused(self):
        proc = run_python("import megatron_adapt; megatron_adapt.apply('cpu')",
                          env={"MEGATRON_ADAPT_CHECKPOINT_HARDEN": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
                               "MEGATRON_ADAPT_AUTO": "0"}, check=False)
        assert proc.returncode != 0 and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in proc.stderr, proc.stderr[-2000:]


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


class TestCollectives(PatchContract):
    area = "collectives"

    def test_premultiplied_sum_becomes_scale_then_sum_on_gloo(self):
        res = consumer("collectives")
        for case in ("torch.float32-0.5", "torch.bfloat16-0.5"):
            assert res[case] == {"sum": True, "reduced": [1.5] * 8}, res
        assert res["torch.float32-None"] == {"sum": True, "reduced": [3.0] * 8}, res

    def test_inference_broadcast_takes_the_backends_tensors(self):
        res = consumer("collectives")
        assert res["inference_broadcast"] == [[1.0] * 3] * 2, res


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


def test_hybrid_mla_down_proj_fusion_builds_on_the_providers_norm_linear():
    """core 0.19's --mla-down-proj-fusion in a hybrid (Mamba + MLA) model: the fused input norm +
    q/kv down projection is the provider's norm + column-parallel linear with TE's parameter names,
    and it trains (forward, backward, finite non-zero gradients)."""
    from packaging.version import Version

    from megatron_adapt.versions import megatron_core_version

    if megatron_core_version() < Version("0.19.0"):
        assert consumers()["hybrid_mla_down_proj_fusion"] is None   # no fusion flag before core 0.19
        return
    res = consumer("hybrid_mla_down_proj_fusion")
    assert res["down_proj"] == "AdaptLayerNormColumnParallelLinear", res
    assert res["loss_finite"] and res["down_grads"], res
    assert {"decoder.layers.1.self_attention.linear_qkv_down_proj.weight",
            "decoder.layers.1.self_attention.linear_qkv_down_proj.layer_norm_weight"} <= set(res["keys"]), res


def test_multi_latent_attention_from_the_te_spec_matches_an_fp32_reference():
    """MLA (DeepSeek-V3 style) from Megatron's TE layer spec without TE: modules with TE's names
    and arguments, forward and backward against MLA written out in fp32, with and without
    --rope-fusion (Megatron's Triton kernel there; the backend's rope_cos_sin op here)."""
    res = consumer("mla")
    for fusion in ("False", "True"):
        r = res[f"fusion={fusion}"]
        assert r["types"] == {"linear_q_down_proj": "AdaptDuplicatedLinear",
                              "linear_kv_down_proj": "AdaptDuplicatedLinear",
                              "linear_q_up_proj": "AdaptLayerNormColumnParallelLinear",
                              "linear_kv_up_proj": "AdaptLayerNormColumnParallelLinear",
                              "core_attention": "AdaptDotProductAttention",
                              "q_layernorm": "IdentityOp", "kv_layernorm": "IdentityOp"}, r["types"]
        assert r["core_head_dims"] == [16, 6, 4 * 6], r   # q/k: qk + rope dims; v: v_head_dim
        assert {"linear_q_down_proj.weight", "linear_q_down_proj._extra_state",
                "linear_kv_down_proj.weight", "linear_q_up_proj.layer_norm_weight",
                "linear_kv_up_proj.layer_norm_weight", "linear_proj.weight"} <= set(r["keys"]), r["keys"]
        assert r["down_proj_attrs"] == [[True, False, False]], r   # replicated on TP ranks, as TE
        assert r["mscale_not_one"], r   # YaRN's mscale is exercised
        assert r["max_err"] < 1e-5 and r["grad_max_err"] < 1e-5, r
        assert r["calls"]["attention"] == 1, r
        rope_op = "rope_cos_sin" if fusion == "True" else "rope"
        assert r["calls"][rope_op] == 2 and sum(r["calls"].values()) == 3, r   # q and k


def test_fused_mla_rope_matches_megatrons_triton_kernels_under_the_interpreter():
    """--rope-fusion with MLA on cpu / npu: the backend's rope_cos_sin op in place of Megatron's
    Triton kernels, which TRITON_INTERPRET=1 runs on the CPU as the reference (forward and
    backward; sbhd, packed thd, thd under context parallelism on either rank)."""
    pytest.importorskip("triton")
    proc = run_python([os.path.join(os.path.dirname(CONSUMERS), "mla_rope_check.py")], timeout=900)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("MLA-ROPE-JSON:"))
    res = json.loads(line[len("MLA-ROPE-JSON:"):])
    assert set(res) == {"sbhd", "thd cp_rank=0/1", "thd cp_rank=0/2", "thd cp_rank=1/2"}, res
    for case, r in res.items():
        assert r["max_err"] < 1e-5, (case, r)
        if "other_rank_err" in r:
            assert r["other_rank_err"] > 0.1, (case, r)   # positions matter: the check can fail


class TestSsm(PatchContract):
    area = "ssm"

    def test_mamba_model_from_megatrons_spec_on_backend_ops(self):
        res = consumer("ssm")
        mixer = "decoder.layers.0.mixer."
        # TE's parameter names (a TE-built Mamba layer's keys)
        assert {mixer + "in_proj.layer_norm_weight", mixer + "in_proj.weight", mixer + "norm.weight",
                mixer + "out_proj.weight", mixer + "A_log", mixer + "D", mixer + "dt_bias",
                "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"} <= set(res["keys"]), res["keys"]
        assert res["in_proj"] == "AdaptLayerNormColumnParallelLinear" and res["norm"] == "ExtendedGatedRMSNorm", res
        assert res["calls"] == {"ssd_scan": 1, "causal_conv1d": 1, "rms_norm_gated": 1}, res["calls"]
        assert res["grads_ok"] and res["fused_matches_unfused"], res
        from packaging.version import Version

        from megatron_adapt.versions import megatron_core_version

        if megatron_core_version() >= Version("0.17.0"):   # Megatron's own Triton decode kernels
            assert res["decode"] == {"calls": {"ssm_conv_update": 1, "ssm_state_update": 1}, "out": True,
                                     "conv_state": True, "ssm_state": True, "state_changed": True}, res
        else:
            assert res["decode"] is None, res


class TestMoE(PatchContract):
    area = "moe"

    def test_grouped_gemm_permute_and_router_fusion_through_moe_layer(self):
        from packaging.version import Version

        from megatron_adapt.versions import megatron_core_version

        res = consumer("moe")
        if megatron_core_version() >= Version("0.17.0"):  # legacy GroupedMLP removed
            assert res["experts_class"] == "TEGroupedMLP", res
            assert res["grouped_linears"] == ["AdaptColumnParallelGroupedLinear",
                                              "AdaptRowParallelGroupedLinear"], res
            assert res["experts_fused_wgrad"] == {"main_grad": True, "flagged": True,
                                                  "wgrad_accumulate_per_expert": True}, res
        else:  # no biases: GroupedMLP (with biases TEGroupedMLP: below, and test_moe_bias.py)
            assert res["experts_class"] == "GroupedMLP", res
        # with add_bias_linear: TEGroupedMLP on the grouped linears on every release
        assert res["experts_with_bias"] == {"matches": True, "grads_match": True,
                                            "bias_grads_nonzero": True, "fused_wgrad": True}, res
        assert res["grouped_gemm_calls"] == 2, res  # fc1 and fc2, fp32 (stock 0.16: bf16 only)
        assert res["experts_match"] and res["experts_grads_match"] and res["empty_expert_grad_zero"], res
        fused, unfused = res["calls_fused_True"], res["calls_fused_False"]
        assert all(n >= 1 for n in fused.values()), fused   # every fused MoE op served by the backend
        assert not any(unfused.values()), unfused            # flags off: Megatron's own code
        assert res["layer_matches_unfused"], res
        # capacity-padded dispatch: the fused permute / unpermute give Megatron's drop_and_pad branch
        assert res["padded_capacity"] == 7 and res["padded_matches_unfused"], res
        assert all(n >= 1 for n in res["padded_calls_fused_True"].values()), res
        assert res["padded_calls_fused_False"]["moe_permute"] == 0, res
        # --moe-router-dtype fp32 (on 0.16 every router, without TE, NameErrors on te_general_gemm)
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


    def test_mla_rope_inside_a_capture_survives_the_runners_buffer_restore(self):
        """core 0.18+'s CudaGraphRunner copies a layer's buffers back in place after its forward
        capture; MLA's fused RoPE (Megatron's Triton kernels, run here by TRITON_INTERPRET=1) saved
        YaRN's cos / sin cache, so the backward capture raised (seen on an H200 with core_v0.19.0,
        bf16 and fp8). Megatron's functions as they are reproduce the error; the cuda backend's
        wrapper (copies of cos / sin inside a capture) gives the same values as an eager run."""
        pytest.importorskip("triton")
        proc = run_python([os.path.join(os.path.dirname(CONSUMERS), "mla_graph_buffers_check.py")], timeout=900)
        line = next(l for l in proc.stdout.splitlines() if l.startswith("MLA-GRAPH-JSON:"))
        res = json.loads(line[len("MLA-GRAPH-JSON:"):])
        assert "modified by an inplace operation" in (res["megatron_error"] or ""), res
        assert res["ours_error"] is None and res["buffers"] == 2 and res["max_err"] == 0.0, res

    def test_mla_rope_capture_wrapper_is_chosen_on_cuda_from_core_0_18_only(self):
        """The real specs of MLA's two fused-RoPE functions: on cuda from core 0.18 (the runner's
        buffer restore came then) area cuda_graphs wraps them; on cuda before 0.18 and on cpu / npu at
        every release, area rope's replacement is the spec chosen (and on cuda it is recorded as not
        needed for that backend)."""
        from packaging.version import Version

        from megatron_adapt.applier import select
        from megatron_adapt.core import all_specs
        from megatron_adapt.patches.cuda_graphs import build_mla_rope_cache_copies

        specs = all_specs()
        for part in ("q", "kv"):
            target = f"megatron.core.transformer.multi_latent_attention:fused_apply_mla_rope_for_{part}"
            for version in ("0.15.0", "0.16.1", "0.17.1", "0.18.2", "0.19.2"):
                for backend in ("cpu", "cuda", "npu"):
                    (spec,) = [s for s in select(specs, Version(version), backend) if s.target == target]
                    wraps = backend == "cuda" and Version(version) >= Version("0.18.0")
                    assert (spec.area, spec.build is build_mla_rope_cache_copies) == (
                        ("cuda_graphs", True) if wraps else ("rope", False)), (part, version, backend, spec)

    def test_mla_rope_capture_reports_in_the_backend_impl_form(self):
        """Inside a capture the wrapper clones cos / sin and reports as `cuda.<impl>`; outside a
        capture it is the original call and reports nothing."""
        proc = run_python(
            "from unittest import mock\n"
            "import torch\n"
            "from megatron_adapt import report\n"
            "from megatron_adapt.patches.cuda_graphs import build_mla_rope_cache_copies\n"
            "seen = []\n"
            "def f(t, cos, sin, qk_head_dim, emb_dim):\n"
            "    seen.append((cos.data_ptr(), sin.data_ptr()))\n"
            "    return t\n"
            "call = build_mla_rope_cache_copies(None, f)\n"
            "cos, sin = torch.ones(4, 2), torch.zeros(4, 2)\n"
            "with mock.patch.object(torch.cuda, 'is_current_stream_capturing', lambda: False):\n"
            "    call(f, None, (torch.ones(1), cos, sin, 8, 8), {})\n"
            "assert report.op_counts().get('mla_rope_capture') is None, report.op_counts()\n"
            "with mock.patch.object(torch.cuda, 'is_current_stream_capturing', lambda: True):\n"
            "    call(f, None, (torch.ones(1),), dict(cos=cos, sin=sin, qk_head_dim=8, emb_dim=8))\n"
            "assert seen[0] == (cos.data_ptr(), sin.data_ptr()), seen\n"
            "assert cos.data_ptr() not in seen[1] and sin.data_ptr() not in seen[1], seen\n"
            "(impl,) = report.op_counts()['mla_rope_capture']\n"
            "assert impl.startswith('cuda.'), impl\n")
        assert proc.returncode == 0, proc.stderr[-2000:]

    def test_full_iteration_wrapper_is_wrapped_and_passes_through(self):
        """--cuda-graph-scope full_iteration: training.py builds FullCudaGraphWrapper by the name it
        imported; the class's __call__ is ours, and an iteration that does not capture passes
        straight through to Megatron's (here: iteration 0, warm-up, eager)."""
        proc = run_python(
            "import megatron_adapt; megatron_adapt.apply('cpu')\n"
            "from megatron.core import full_cuda_graph as fcg\n"
            "call = fcg.FullCudaGraphWrapper.__dict__['__call__']\n"
            "assert hasattr(call, '__wrapped__'), repr(call)\n"
            "w = fcg.FullCudaGraphWrapper.__new__(fcg.FullCudaGraphWrapper)\n"
            "w.cuda_graph_warmup_steps = 1; seen = []\n"
            "w.forward_backward_func = lambda **kw: seen.append(kw['num_microbatches']) or 'ran'\n"
            "w.data_read = lambda it, model, training, n: [iter([])]\n"
            "out = w(model=[None], data_iterator=None, num_microbatches=2, seq_length=8, forward_only=False)\n"
            "assert out == 'ran' and seen == [2], (out, seen)\n"
            "from megatron_adapt import report; assert report(as_json=True)['cuda_graphs'] == []\n")
        assert proc.returncode == 0, proc.stderr[-2000:]


class TestStartupReport(PatchContract):
    area = "startup_report"

    def test_table_printed_on_rank0_once_parallel_state_is_set_up(self):
        """...and the tensor-parallel group is named to the backends (ops.replica_group) while
        it exists: kernels chosen at run time must agree across its ranks."""
        proc = run_python(
            f"import os; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{_free_port()}', RANK='0', WORLD_SIZE='1')\n"
            "import megatron_adapt; megatron_adapt.apply('cpu')\n"
            "import torch.distributed as d; d.init_process_group('nccl')\n"
            "from megatron.core import parallel_state as ps; ps.initialize_model_parallel(1, 1)\n"
            "from megatron_adapt.ops import replica_group\n"
            "assert replica_group() is ps.get_tensor_model_parallel_group(), 'TP group not named'\n"
            "ps.destroy_model_parallel(); assert replica_group() is None\n")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "megatron-adapt: backend=cpu" in proc.stderr and "applied" in proc.stderr, proc.stderr[-2000:]


class TestFp8(PatchContract):
    """Refusals and fp8 through GPTModel: tests/patching/test_fp8.py."""
    area = "fp8"


class TestStartChecks(PatchContract):
    """Refusals through Megatron's argument parsing, configs and layer specs:
    tests/patching/test_start_checks.py."""
    area = "start_checks"


class TestOffloading(PatchContract):
    """Activation offloading through GPTModel: tests/patching/test_offloading.py; stock scripts:
    tests/megatron_lm/test_pretrain_gpt_offloading.py."""
    area = "offloading"


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
        # An area may be limited to some releases (every spec's range excluding this one);
        # otherwise it must have specs to probe here.
        if any(in_range(s.versions, version) for s in declared):
            assert specs_of(area), f"area {area} has no megatron-core specs to test"


def test_te_rng_tracker_request_becomes_megatrons_graph_safe_tracker():
    """cuda backend, no TE: initialize_rng_tracker(use_te_rng_tracker=True) asks for a tracker CUDA
    graphs can capture; Megatron's own graph-safe one is passed on (without it, Megatron builds the
    plain tracker and a capture asserts "RNG tracker does not support cudagraphs!")."""
    import types

    import wrapt

    from megatron.core.tensor_parallel import random as mrandom
    from megatron_adapt.patches import rng

    seen = []

    def initialize_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                               use_cudagraphable_rng=False, force_reset=False):
        seen.append((use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset))

    if getattr(mrandom, "HAVE_TE", True):
        pytest.skip("Transformer Engine installed: the patch steps aside")
    wrapped = wrapt.FunctionWrapper(initialize_rng_tracker, rng.build_initialize_rng_tracker(
        types.SimpleNamespace(name="cuda"), initialize_rng_tracker))
    wrapped(use_te_rng_tracker=True, force_reset=True)
    wrapped(True, True)
    wrapped()
    wrapped(use_cudagraphable_rng=True)
    assert seen == [(True, False, True, True), (True, True, True, False), (False, False, False, False),
                    (False, False, True, False)]

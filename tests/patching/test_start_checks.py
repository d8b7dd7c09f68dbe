"""Tier 1, area start_checks (its PatchContract: TestStartChecks in test_patches.py): features and
families no backend here serves are refused before any model is built, naming the flag, the backend
and the reason; what is served is not refused. Through Megatron's real paths, each scenario in a
fresh interpreter (start_checks_worker.py): TransformerConfig's __post_init__, the T5 / BERT /
heterogeneous layer-spec functions, and (with MEGATRON_LM_PATH) Megatron-LM's parse_args ->
validate_args -> set_global_variables, the start-up every training script goes through."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python
from megatron_checkout import mismatch_reason

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "start_checks_worker.py")
LM = os.environ.get("MEGATRON_LM_PATH")
REFUSED = "UnsupportedFeatureError: "


@lru_cache(maxsize=None)
def worker(scenario, flag_lists=None, env=()):
    argv = [WORKER, scenario] + ([json.dumps(json.loads(flag_lists))] if flag_lists else [])
    out = run_python(argv, env=dict(env), timeout=300).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


class TestConfig:
    """megatron-core users: the refusal is raised by the config, before any module exists."""

    @pytest.mark.parametrize("key,expected", [
        ("cpu_offloading_weights", "TransformerConfig: cpu_offloading_weights: the cpu backend cannot run it: "
                                   "weight offloading is Transformer Engine's"),
        ("mla_local", "MLATransformerConfig: --multi-latent-attention --transformer-impl local: the cpu backend "
                      "cannot run it: Megatron's local spec builds MLA's core attention from DotProductAttention"),
        ("cp_a2a_heads", "TransformerConfig: --cp-comm-type a2a with --context-parallel-size 2: the cpu backend "
                         "cannot serve it: cp_comm_type a2a: 4 query and 1 key/value heads per tensor-parallel rank "
                         "must both divide by the all-to-all group size 2"),
        ("cp_comm_unknown", "TransformerConfig: --cp-comm-type ring with --context-parallel-size 2: the cpu backend "
                            "cannot serve it: cp_comm_type 'ring' is none of p2p, allgather, a2a, a2a+p2p"),
    ])
    def test_refused(self, key, expected):
        got = worker("config")[key]
        if got == "absent":
            pytest.skip(f"this megatron-core's TransformerConfig has no {key}")
        assert got.startswith(REFUSED + expected), got

    @pytest.mark.parametrize("key", ["plain", "mla_te", "cp_a2a_served", "cpu_offloading", "delay_wgrad_compute",
                                     "fine_grained_activation_offloading", "moe_grouped_bias", "moe_latent"])
    def test_served_configs_build(self, key):
        got = worker("config")[key]
        if got == "absent":
            pytest.skip(f"this megatron-core's TransformerConfig has no {key}")
        assert got == "built", got


class TestLayerSpecs:
    """Families whose specs name TE's classes: served (T5, BERT) or refused where the spec is asked for."""

    @pytest.mark.parametrize("name", [f"get_t5_{p}_with_{i}_block_spec" for p in ("encoder", "decoder")
                                      for i in ("transformer_engine", "local")])
    def test_t5_specs_served(self, name):
        """patches/layer_specs binds t5_spec's TE names (tests/patching/test_te_spec_families.py runs them)."""
        assert worker("specs")[name] == "built"

    @pytest.mark.parametrize("key", ["bert_te", "bert_te_attribute"])
    def test_bert_te_spec_served(self, key):
        """pretrain_bert.py imports `bert_layer_with_transformer_engine_spec` (the module's __getattr__
        calls the function): it builds, where Megatron raised ImportError without TE."""
        assert worker("specs")[key] == "built"

    def test_t5_builds_with_either_position_embedding(self):
        """relative (an attention bias: the backend's attention_bias op serves it) and learned_absolute."""
        res = worker("specs")
        assert res["t5_model_relative"] == res["t5_model_learned_absolute"] == "built", res

    def test_hybrid_device_optimizer_refused_on_cpu(self):
        """megatron-core users who build Megatron's CPU-offloading optimizer themselves: refused at
        construction on cpu, not a KeyError in the first step."""
        got = worker("specs")["hybrid_device_optimizer"]
        assert got.startswith(REFUSED + "HybridDeviceOptimizer (--optimizer-cpu-offload): the cpu backend "
                              "cannot run it: Megatron's HybridDeviceOptimizer offloads"), got

    @pytest.mark.parametrize("key", ["mla_local_spec", "mla_local_block_spec"])
    def test_mla_local_spec_refused(self, key):
        """megatron-core users asking the local spec for MLA (directly, or through the decoder block
        spec with use_transformer_engine=False), whatever their config's transformer_impl says."""
        got = worker("specs")[key]
        assert got.startswith(f"{REFUSED}get_gpt_layer_local_spec(multi_latent_attention=True): the cpu "
                              "backend cannot build it: Megatron's local spec builds MLA's core attention"), got

    @pytest.mark.parametrize("key", ["local_spec", "mla_te_spec"])
    def test_served_gpt_specs_build(self, key):
        assert worker("specs")[key] == "built"

    def test_bert_local_spec_untouched(self):
        assert worker("specs")["bert_local"] == "built"

    def test_heterogeneous_specs_served(self):
        """TE spec (keyword and positional use_te) and local: patches/layer_specs binds the TE names
        (tests/patching/test_te_spec_families.py runs the model against the local spec)."""
        res = worker("specs")
        for key in ("hetero_te", "hetero_te_positional", "hetero_local", "hetero_default"):
            assert res[key] == "built", (key, res[key])

    def test_heterogeneous_local_model_trains_a_step(self):
        """What the refusal points to works: per-layer ffn sizes and a no-op attention, forward and backward."""
        res = worker("hetero_local")
        assert res["ffn_sizes"] == [96, 160]
        assert res["attention_types"] == ["SelfAttention", "IdentityOp"]
        assert res["grads_finite"] and 3.0 < res["loss"] < 7.0, res


# ------------------------------------------------------------------ Megatron-LM's argument path
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--lr", "1e-3",
        "--train-iters", "3"]
DELAY_WGRAD = ["--delay-wgrad-compute", "--num-experts", "4", "--expert-model-parallel-size", "2",
               "--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm", "--bf16",
               "--moe-grouped-gemm"]
CASES = [
    # refused by megatron-adapt at start (Megatron itself would fail later, at model build or in the first forward)
    (DELAY_WGRAD + ["--fp8-format", "hybrid"],
     REFUSED + "--delay-wgrad-compute with --fp8-format: the cpu backend cannot run it"),
    (DELAY_WGRAD + ["--cuda-graph-impl", "local", "--moe-pad-experts-for-cuda-graph-inference"],
     REFUSED + "--delay-wgrad-compute with --cuda-graph-impl local: the cpu backend cannot run it"),
    (["--multi-latent-attention", "--transformer-impl", "local"],
     REFUSED + "--multi-latent-attention --transformer-impl local: the cpu backend cannot run it"),
    (["--fp8-format", "hybrid", "--bf16"], REFUSED + "--fp8-format hybrid: the cpu backend cannot run it"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "1"],
     REFUSED + "--cp-comm-type a2a with --context-parallel-size 2: the cpu backend cannot serve it: cp_comm_type "
               "a2a: 4 query and 1 key/value heads per tensor-parallel rank must both divide by the all-to-all "
               "group size 2"),
    (["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
     REFUSED + "--cp-comm-type all_gather with --context-parallel-size 2: the cpu backend cannot serve it: "
               "cp_comm_type 'all_gather' is none of p2p, allgather, a2a, a2a+p2p"),
    # refused by Megatron's own validate_args, at start, with a message that names the flag
    (["--delay-wgrad-compute", "--transformer-impl", "local"],
     "AssertionError: Delaying wgrad compute is only supported with transformer_engine implementation"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--transformer-impl", "local"],
     "AssertionError: Fine-grained activation offloading is only supported with transformer_engine implementation"),
    (["--position-embedding-type", "relative", "--transformer-impl", "local"],
     "AssertionError: Local transformer implementation currently does not support attention bias-based "
     "position embeddings."),
    (["--optimizer-cpu-offload", "--use-distributed-optimizer", "--use-precision-aware-optimizer"],
     REFUSED + "--optimizer-cpu-offload: the cpu backend cannot run it: Megatron's HybridDeviceOptimizer "
               "offloads the parameters for which param.is_cuda holds"),
    # served: not refused
    (["--multi-latent-attention"], "passed"),
    (["--num-experts", "4", "--moe-grouped-gemm"], "passed"),    # with Megatron's default --add-bias-linear
    (["--num-experts", "4", "--moe-latent-size", "16"], "passed"),   # patches/moe
    (DELAY_WGRAD, "passed"),                                    # patches/delayed_wgrad
    (["--cpu-offloading-num-layers", "1"], "passed"),
    (["--cpu-offloading-num-layers", "1", "--cuda-graph-impl", "local"],
     REFUSED + "--cpu-offloading-num-layers with --cuda-graph-impl local: the cpu backend cannot run it"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn"], "passed"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], "passed"),
    ([], "passed"),
]
NO_LM = ("MEGATRON_LM_PATH is not set: Megatron-LM's argument parsing (megatron.training) lives in a checkout"
         if not LM else mismatch_reason(LM))
needs_lm = pytest.mark.skipif(bool(NO_LM), reason=NO_LM or "")


def _args_results(env=()):
    return worker("args", json.dumps([TINY + flags for flags, _ in CASES]), (("WORLD_SIZE", "2"), *env))


@needs_lm
@pytest.mark.parametrize("flags,expected", CASES, ids=[" ".join(f) or "plain" for f, _ in CASES])
def test_megatron_argument_path(flags, expected):
    got = _args_results()[" ".join(TINY + flags)]
    assert got.startswith(expected), got


@needs_lm
def test_disabling_an_area_drops_only_its_checks():
    res = _args_results((("MEGATRON_ADAPT_DISABLE", "fp8"),))
    assert res[" ".join(TINY + ["--fp8-format", "hybrid", "--bf16"])] == "passed"
    assert res[" ".join(TINY + DELAY_WGRAD + ["--fp8-format", "hybrid"])].startswith(
        REFUSED + "--delay-wgrad-compute with --fp8-format")


@pytest.mark.parametrize("backend", ["cuda", "npu"])
@pytest.mark.parametrize("settings,expected", [
    ({"cpu_offloading": True, "cpu_offloading_num_layers": 2}, None),      # served (patches/offloading)
    ({"cpu_offloading": True, "cpu_offloading_weights": True}, "cpu_offloading_weights"),
    ({"cpu_offloading": True, "cuda_graph_impl": "full_iteration"},
     "--cpu-offloading-num-layers with --cuda-graph-impl full_iteration"),
    ({"cpu_offloading": True, "cuda_graph_impl": "none"}, None),
    ({"delay_wgrad_compute": True}, None),                                # served (patches/delayed_wgrad)
    ({"delay_wgrad_compute": True, "fp8": "hybrid"}, "--delay-wgrad-compute with --fp8-format"),
    ({"delay_wgrad_compute": True, "cuda_graph_impl": "local"}, "--delay-wgrad-compute with --cuda-graph-impl local"),
    ({"delay_wgrad_compute": True, "cuda_graph_impl": "none"}, None),
    ({"multi_latent_attention": True, "transformer_impl": "local"}, "--multi-latent-attention --transformer-impl local"),
    ({"multi_latent_attention": True, "transformer_impl": "transformer_engine"}, None),
    ({"cpu_offloading": False, "delay_wgrad_compute": False}, None),
])
def test_refusals_name_every_backend(backend, settings, expected):
    """The accelerator backends refuse the same features (none of them serves TE's weight
    offloading or split wgrad pass), naming themselves."""
    import types

    from megatron_adapt.patches import offloading
    from megatron_adapt.patches import start_checks as area

    b = types.SimpleNamespace(name=backend)
    got = [why for check in (offloading.offload_refusal, area.wgrad_refusal, area.mla_local_refusal)
           if (why := check(b, settings))]
    if expected is None:
        assert not got, got
        return
    assert len(got) == 1 and got[0].startswith(f"{expected}: the {backend} backend cannot run it: "), got


@pytest.mark.parametrize("backend", ["cpu", "cuda", "npu"])
@pytest.mark.parametrize("settings,expected", [
    ({"context_parallel_size": 2, "cp_comm_type": ["a2a"], "num_attention_heads": 4, "group_query_attention": True,
      "num_query_groups": 1}, "--cp-comm-type a2a with --context-parallel-size 2: the {b} backend cannot serve it: "
                              "cp_comm_type a2a: 4 query and 1 key/value heads"),
    # per tensor-parallel rank: 8 heads over TP=2 are 4, over an all-to-all group of 8
    ({"context_parallel_size": 8, "cp_comm_type": ["p2p", "a2a"], "num_attention_heads": 8,
      "tensor_model_parallel_size": 2}, "--cp-comm-type a2a with --context-parallel-size 8: the {b} backend cannot "
                                        "serve it: cp_comm_type a2a: 4 query and 4 key/value heads per "
                                        "tensor-parallel rank must both divide by the all-to-all group size 8"),
    # a2a+p2p: the all-to-all group is the first of the hierarchical sizes
    ({"context_parallel_size": 4, "cp_comm_type": ["a2a+p2p"], "hierarchical_context_parallel_sizes": [4, 1],
      "num_attention_heads": 6}, "--cp-comm-type a2a+p2p with --context-parallel-size 4: the {b} backend cannot "
                                 "serve it: cp_comm_type a2a+p2p: 6 query and 6 key/value heads"),
    ({"context_parallel_size": 4, "cp_comm_type": ["a2a+p2p"], "hierarchical_context_parallel_sizes": [2, 2],
      "num_attention_heads": 6}, None),
    ({"context_parallel_size": 2, "cp_comm_type": "ulysses", "num_attention_heads": 4},
     "--cp-comm-type ulysses with --context-parallel-size 2: the {b} backend cannot serve it: cp_comm_type "
     "'ulysses' is none of p2p, allgather, a2a, a2a+p2p"),
    ({"context_parallel_size": 1, "cp_comm_type": ["ulysses"], "num_attention_heads": 4}, None),   # no CP: unused
    ({"context_parallel_size": 2, "cp_comm_type": ["allgather"], "num_attention_heads": 3}, None),
    ({"context_parallel_size": 2, "cp_comm_type": ["a2a"], "num_attention_heads": 3,
      "multi_latent_attention": True}, None),     # MLA's heads: checked at construction
])
def test_cp_comm_type_refusal_from_settings(backend, settings, expected):
    """--cp-comm-type refused at start from the arguments alone, naming the flag and the backend."""
    import types

    from megatron_adapt.patches import context_parallel as area

    got = area.comm_type_refusal(types.SimpleNamespace(name=backend), settings)
    if expected is None:
        assert got is None, got
    else:
        assert got is not None and got.startswith(expected.format(b=backend)), got


@pytest.mark.parametrize("backend,settings,env,expected", [
    ("cuda", {"cpu_offloading": True}, "1", "unset CUDA_DEVICE_MAX_CONNECTIONS"),
    ("cuda", {"fine_grained_activation_offloading": True}, "1", "unset CUDA_DEVICE_MAX_CONNECTIONS"),
    ("cuda", {"cpu_offloading": True, "tensor_model_parallel_size": 2}, "1", "expect the copies to add to the step"),
    ("cuda", {"cpu_offloading": True}, None, None),       # several queues: the copies overlap
    ("cuda", {"cpu_offloading": True}, "8", None),
    ("cuda", {"cpu_offloading": False}, "1", None),
    ("cpu", {"cpu_offloading": True}, "1", None),         # host copies: no queue to share
    ("npu", {"cpu_offloading": True}, "1", None),
])
def test_offloading_under_one_hardware_queue_gets_a_notice(backend, settings, env, expected, monkeypatch, capsys):
    """Offloading on cuda with CUDA_DEVICE_MAX_CONNECTIONS=1 does not refuse: it says, once, that the
    copies will not be hidden, and whether this run could unset the variable."""
    import types

    from megatron_adapt.patches import offloading

    from megatron_adapt import report

    monkeypatch.setattr(report, "_said", set())
    if env is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", env)
    b = types.SimpleNamespace(name=backend)
    assert offloading.offload_start(b, settings) is None          # never a refusal
    err = capsys.readouterr().err
    if expected is None:
        assert err == ""
        return
    assert err.count("megatron-adapt: notice: activation offloading") == 1 and expected in err, err
    offloading.offload_start(b, settings)                          # once per process
    assert capsys.readouterr().err == ""

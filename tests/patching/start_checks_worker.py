"""Start-up refusals through Megatron's real paths, in a fresh interpreter; prints PROBE-JSON findings.

    python start_checks_worker.py config         TransformerConfig / MLATransformerConfig with refused settings
    python start_checks_worker.py specs          T5, BERT and heterogeneous layer-spec functions, T5Model
    python start_checks_worker.py hetero_local   a heterogeneous GPT from the local spec: forward, backward
    python start_checks_worker.py args JSON      Megatron-LM's parse_args -> validate_args ->
                                                 set_global_variables for each flag list in JSON
                                                 (needs MEGATRON_LM_PATH)

Each case records "built" / "passed" or "<exception type>: <message>".
"""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import probe_port  # noqa: E402  (a free port: two test runs may share the machine)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=probe_port(),
                  RANK="0", LOCAL_RANK="0")
os.environ.setdefault("WORLD_SIZE", "1")

import torch  # noqa: E402

import megatron_adapt  # noqa: E402

scenario = sys.argv[1]
if scenario == "args":
    sys.path.insert(0, os.environ["MEGATRON_LM_PATH"])
megatron_adapt.apply("cpu", quiet=True)

out = {}
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)


def outcome(key, fn):
    try:
        fn()
        out[key] = "built"
    except Exception as exc:  # noqa: BLE001 (the test reads the type and message)
        out[key] = f"{type(exc).__name__}: {exc}"


def config():
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    cases = {
        "cpu_offloading": dict(cpu_offloading=True, cpu_offloading_num_layers=1),
        "cpu_offloading_weights": dict(cpu_offloading=True, cpu_offloading_num_layers=1, cpu_offloading_weights=True),
        "fine_grained_activation_offloading": dict(fine_grained_activation_offloading=True,
                                                   offload_modules=["core_attn"]),
        "delay_wgrad_compute": dict(delay_wgrad_compute=True, num_moe_experts=4, expert_model_parallel_size=2,
                                    moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True,
                                    bf16=True, params_dtype=torch.bfloat16),
        "plain": {},
        "moe_latent": dict(num_moe_experts=4, moe_latent_size=16),
        "moe_grouped_bias": dict(num_moe_experts=4, moe_grouped_gemm=True, add_bias_linear=True),
        "cp_a2a_heads": dict(context_parallel_size=2, cp_comm_type="a2a", num_query_groups=1),
        "cp_comm_unknown": dict(context_parallel_size=2, cp_comm_type=["p2p", "ring"]),
        "cp_a2a_served": dict(context_parallel_size=2, cp_comm_type="a2a", num_query_groups=2),
    }
    fields = TransformerConfig.__dataclass_fields__
    for key, kw in cases.items():
        if not set(kw) <= set(fields):
            out[key] = "absent"       # a field this megatron-core does not have (0.15: fine-grained offloading)
            continue
        outcome(key, lambda kw=kw: TransformerConfig(**BASE, **kw))
    mla = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
               qk_pos_emb_head_dim=8, v_head_dim=16)
    outcome("mla_local", lambda: MLATransformerConfig(**BASE, **mla, transformer_impl="local"))
    outcome("mla_te", lambda: MLATransformerConfig(**BASE, **mla))


def hetero_config(tmp):
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    layer = {"attention": {"no_op": False, "replace_with_linear": False, "num_query_groups": 2},
             "mlp": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 96}}
    second = {"attention": {"no_op": True, "replace_with_linear": False, "num_query_groups": None},
              "mlp": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 160}}
    path = os.path.join(tmp, "hetero.json")
    with open(path, "w") as f:
        json.dump({"block_configs": [layer, second]}, f)
    return HeterogeneousTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, add_bias_linear=False, normalization="RMSNorm",
        gated_linear_unit=True, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        heterogeneous_layers_config_path=path)


def specs():
    import tempfile

    from megatron.core.models.bert import bert_layer_specs
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from megatron.core.models.T5 import t5_spec

    for part in ("encoder", "decoder"):
        for impl in ("transformer_engine", "local"):
            name = f"get_t5_{part}_with_{impl}_block_spec"
            outcome(name, lambda name=name: getattr(t5_spec, name)(2))
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import MLATransformerConfig

    outcome("mla_local_spec", lambda: gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True))
    outcome("local_spec", gpt_layer_specs.get_gpt_layer_local_spec)
    mla = MLATransformerConfig(**BASE, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
                               qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
    outcome("mla_local_block_spec", lambda: gpt_layer_specs.get_gpt_decoder_block_spec(
        mla, use_transformer_engine=False))
    outcome("mla_te_spec", lambda: gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        multi_latent_attention=True))
    outcome("bert_te", bert_layer_specs.get_bert_layer_with_transformer_engine_spec)
    outcome("bert_te_attribute", lambda: bert_layer_specs.bert_layer_with_transformer_engine_spec)
    outcome("bert_local", lambda: bert_layer_specs.bert_layer_local_spec)
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    outcome("hybrid_device_optimizer", lambda: HybridDeviceOptimizer(
        [torch.nn.Parameter(torch.ones(4))], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.Adam,
        gpu_optimizer_cls=torch.optim.Adam))
    with tempfile.TemporaryDirectory() as tmp:
        _init()
        config = hetero_config(tmp)
        outcome("hetero_te", lambda: get_gpt_heterogeneous_layer_spec(config, use_te=True))
        outcome("hetero_te_positional", lambda: get_gpt_heterogeneous_layer_spec(config, True))
        outcome("hetero_local", lambda: get_gpt_heterogeneous_layer_spec(config, use_te=False))
        outcome("hetero_default", lambda: get_gpt_heterogeneous_layer_spec(config))   # use_te=False
        from megatron.core.models.T5.t5_model import T5Model
        from megatron.core.transformer import TransformerConfig

        t5_config = TransformerConfig(**BASE)
        for pos in ("relative", "learned_absolute"):
            outcome(f"t5_model_{pos}", lambda pos=pos: T5Model(
                t5_config, t5_config, t5_spec.get_t5_encoder_with_transformer_engine_block_spec(2),
                t5_spec.get_t5_decoder_with_transformer_engine_block_spec(2), vocab_size=64,
                max_sequence_length=16, position_embedding_type=pos))


def _init():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)


def hetero_local():
    """The heterogeneous GPT that --transformer-impl local builds: Megatron's own modules."""
    import tempfile

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

    _init()
    with tempfile.TemporaryDirectory() as tmp:
        config = hetero_config(tmp)
        model = GPTModel(config, get_gpt_heterogeneous_layer_spec(config, use_te=False), vocab_size=128,
                         max_sequence_length=16, position_embedding_type="rope")
    tokens = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).triu(1)
    loss = model(tokens, pos, mask, labels=tokens).float().mean()
    loss.backward()
    layers = model.decoder.layers
    out["loss"] = loss.item()
    out["ffn_sizes"] = [layer.mlp.linear_fc2.weight.shape[1] for layer in layers]
    out["attention_types"] = [type(layer.self_attention).__name__ for layer in layers]
    out["grads_finite"] = all(p.grad is not None and torch.isfinite(p.grad).all().item()
                              for p in model.parameters() if p.requires_grad)


def args(flag_lists):
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    for flags in flag_lists:
        key = " ".join(flags) or "(none)"
        sys.argv = ["pretrain_gpt.py", *flags]

        def run():
            a = parse_args()
            validate_args(a, {})
            global_vars.set_global_variables(a, build_tokenizer=False)
            global_vars.unset_global_variables()
        outcome(key, run)
        out[key] = out[key].replace("built", "passed")


{"config": config, "specs": specs, "hetero_local": hetero_local}.get(scenario, lambda: None)()
if scenario == "args":
    args(json.loads(sys.argv[2]))
print("PROBE-JSON:" + json.dumps(out))

"""Stock Megatron-LM pretrain_gpt.py, unmodified, as a DeepSeek-V3-style model on the cpu backend:
multi-latent attention (q / kv LoRA ranks, q/k head dim != v head dim, q/kv layernorms, YaRN RoPE
with --rope-fusion, Megatron's default) and mixture-of-experts (sigmoid router with expert bias,
seq_aux_loss, a shared expert, a dense first layer), Megatron's default
--transformer-impl transformer_engine served without TE, under `megatron-adapt-run torchrun`:
expert parallelism 2 with save and resume, and TP=2 with sequence parallelism. Each run checks the
loss falls and, from the JSON report, which backend ops served MLA.

Megatron's own --transformer-impl local cannot build MLA without TE (its DotProductAttention
takes no k_channels / v_channels), so there is no local run to compare with; the model is checked
against an fp32 MLA written out in tests/patching (test_patches.py). Needs MEGATRON_LM_PATH.
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_pretrain_gpt as base  # noqa: E402
import test_pretrain_gpt_moe as moe  # noqa: E402

NEEDS_CHECKOUT = True
pytestmark = base.pytestmark

MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm",
       "--position-embedding-type", "rope", "--rotary-scaling-factor", "40", "--mscale", "1.0",
       "--mscale-all-dim", "1.0", "--normalization", "RMSNorm", "--swiglu",
       "--untie-embeddings-and-output-weights"]
DEEPSEEK_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm",
                "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type",
                "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "64",
                "--moe-ffn-hidden-size", "64", "--disable-bias-linear", "--moe-layer-freq", "[0]+[1]"]
MLA_PATCHES = ("megatron.core.transformer.multi_latent_attention:TELinear",
               "megatron.core.transformer.multi_latent_attention:fused_apply_mla_rope_for_q",
               "megatron.core.transformer.multi_latent_attention:fused_apply_mla_rope_for_kv")


def pretrain(args, tmp, name, iters=10):
    """moe.pretrain with this file's MoE configuration in place of its MoE flags."""
    return moe.pretrain([*MLA, *args], tmp, name, iters=iters, moe=DEEPSEEK_MOE)


def assert_mla_ran(run):
    # the DeepSeek-style MoE configuration reached Megatron (Megatron prints its arguments)
    for name, value in (("num_experts", "4"), ("moe_router_score_function", "sigmoid"),
                        ("moe_router_enable_expert_bias", "True"), ("moe_layer_freq", "[0, 1]"),
                        ("multi_latent_attention", "True")):
        assert re.search(rf"^\s*{name} \.+ {re.escape(value)}$", run.out, re.M), (name, value)
    base.assert_patched(run, base.REQUIRED_PATCHES + MLA_PATCHES)
    for op in ("attention", "rope_cos_sin", "grouped_gemm"):
        assert op in run.ops and run.ops[op]["calls"] > 0, (op, run.ops)
        assert not run.ops[op]["fallback_reason"], run.ops[op]


def test_mla_moe_ep2_save_and_resume(tmp_path):
    first, _ = moe.save_and_resume(["--expert-model-parallel-size", "2"], tmp_path, "mla_ep2", run=pretrain)
    base.assert_loss_falls(first)
    assert_mla_ran(first)


def test_mla_moe_tp2_sequence_parallel(tmp_path):
    run = pretrain(["--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path, "mla_tp2_sp")
    base.assert_loss_falls(run)
    assert_mla_ran(run)

"""Stock pretrain_gpt.py with --heterogeneous-layers-config-path (Nemotron-NAS style blocks: per-layer
GQA, a no-op attention, attention and MLP replaced by a linear, per-layer FFN sizes), Megatron's
default --transformer-impl transformer_engine served without TE (patches/layer_specs binds the
heterogeneous spec's TE names and TE's gathered norm + linear), on the cpu backend, TP=2 (the
replaced blocks' outputs are gathered over TP),
against Megatron's own path (`--transformer-impl local`, megatron-adapt's attention off), dropout 0,
same seed: the losses agree. Needs MEGATRON_LM_PATH.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_pretrain_gpt as base  # noqa: E402

NEEDS_CHECKOUT = True
pytestmark = base.pytestmark


def block(attention, mlp):
    """One entry of the Hugging Face-style (DeciLM / Nemotron-NAS) config Megatron-LM reads."""
    return {"attention": {"no_op": attention == "no_op", "replace_with_linear": attention == "linear",
                          "n_heads_in_group": 2 if attention == "gqa" else None},
            "mlp": {"no_op": False, "replace_with_linear": mlp == "linear",
                    "ffn_hidden_size": None if mlp == "linear" else mlp}}


BLOCKS = [block("gqa", 96), block("no_op", 160), block("linear", "linear"), block("gqa", 64)]
# What validate_args checks against the arguments (TINY_GPT's sizes, llama-style flags below).
HF_CONFIG = {"hidden_act": "silu", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "tie_word_embeddings": False, "rope_theta": 10000, "rope_scaling": {"factor": 8.0},
             "block_configs": BLOCKS}


def run(tmp, name, extra, env=None):
    path = tmp / "hetero.json"
    path.write_text(json.dumps(HF_CONFIG))
    flags = ["--num-layers", "4", "--heterogeneous-layers-config-path", str(path), "--normalization", "RMSNorm",
             "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope", "--use-rope-scaling",
             "--group-query-attention", "--num-query-groups", "2", "--use-rotary-position-embeddings",
             "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--tensor-model-parallel-size", "2", *extra]
    args = [a for a in base.TINY_GPT]
    i = args.index("--num-layers")
    del args[i:i + 2]
    return base.launch_reported("pretrain_gpt.py", [*args, "--train-iters", "8", *flags], tmp, name, env)


def test_heterogeneous_te_spec_matches_megatrons_local_path(tmp_path):
    """TP=2 (the replaced blocks' outputs gathered over TP). With --sequence-parallel Megatron's own
    local path fails on core_v0.16.1 as the TE spec does ("The size of tensor a (64) must match the
    size of tensor b (32)" in the replaced block's bias-dropout-add): not run."""
    te = run(tmp_path, "hetero_te", [])
    flags, env = base.LOCAL_PATH
    local = run(tmp_path, "hetero_local", flags, env=env)
    assert te.ops["attention"]["calls"] > 0 and not te.ops["attention"]["fallback_reason"], te.ops
    base.assert_matches_local(te, local, 8)
    base.assert_loss_falls(te, by=0.2)

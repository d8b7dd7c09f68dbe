"""Stock Megatron-LM pretrain_vlm.py (LLaVA: a CLIP ViT, a projection and a GPT decoder), unmodified,
on its mock data, on the cpu backend over gloo, with Megatron's default --transformer-impl
transformer_engine served without TE: llava_spec and vit_layer_specs name TE's classes as module
globals (core 0.16: its extension's MagicMock stand-ins), which patches/layer_specs binds to the
provider's modules, and CLIP-ViT's norms default to the backend norm.

TP=2: loss falls, save and resume (`--ckpt-format torch`, which the script requires), attention and
norms served with no fallback. Against Megatron's own path (`--transformer-impl local`, megatron-adapt's
attention off), dropout 0, same seed: the losses agree. Needs MEGATRON_LM_PATH (core_v0.16.1 or
core_v0.19.0).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_pretrain_gpt as base  # noqa: E402

NEEDS_CHECKOUT = True
pytestmark = base.pytestmark

VLM = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--split", "949,50,1",
       "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", "20",
       "--seed", "1234", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
       "--img-h", "32", "--img-w", "32", "--patch-dim", "8", "--ckpt-format", "torch",
       "--tensor-model-parallel-size", "2"]


def run(args, tmp, name, iters, env=None):
    return base.launch_reported("pretrain_vlm.py", [*VLM, "--train-iters", str(iters), *args], tmp, name, env)


def test_stock_vlm_tp2_trains_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "10"]
    first = run(save, tmp_path, "vlm_save", iters=10)
    base.assert_loss_falls(first, by=0.3)
    for op, impl in (("attention", "cpu.torch.sdpa"), ("layer_norm", "cpu.torch.F.layer_norm")):
        assert first.ops[op]["implementation"] == impl and not first.ops[op]["fallback_reason"], first.ops[op]
    second = run([*save, "--load", str(ckpt), "--override-opt_param-scheduler"], tmp_path, "vlm_resume", iters=15)
    assert min(second.losses) == 11 and max(second.losses) == 15, second.losses
    assert abs(second.losses[11] - first.losses[10]) < 0.25, (first.losses, second.losses)


def test_stock_vlm_te_spec_matches_megatrons_local_path(tmp_path):
    no_dropout = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    te = run(no_dropout, tmp_path, "vlm_te", iters=6)
    flags, env = base.LOCAL_PATH
    local = run([*no_dropout, *flags], tmp_path, "vlm_local", iters=6, env=env)
    base.assert_matches_local(te, local, 6)

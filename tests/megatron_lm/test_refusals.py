"""Stock Megatron-LM scripts asking for what no backend here serves: refused at start on the cpu backend.

The run must stop non-zero before any model is built (Megatron prints the parameter count once the
model exists: it must not appear), with megatron-adapt's message naming the flag (or the family),
the backend and the reason (patches/start_checks.py). Each launch takes ~10-20 s on two CPU cores.
"""
from __future__ import annotations

import os

import pytest

from test_pretrain_gpt import LM, NEEDS_CHECKOUT, TINY_GPT, launch, pretrain, pytestmark  # noqa: F401 (conftest reads them)

BUILT = "number of parameters on (tensor, pipeline) model parallel rank"


def assert_refused_at_start(run, expected: str):
    assert run.rc != 0, f"ran; log {run.log}"
    assert f"megatron-adapt: {expected}" in run.out, f"no refusal naming it; log {run.log}:\n{run.out[-4000:]}"
    assert "UnsupportedFeatureError" in run.out, run.out[-3000:]
    assert BUILT not in run.out and not run.losses, f"a model was built before the refusal; log {run.log}"


@pytest.mark.parametrize("flags,expected", [
    (["--cpu-offloading-num-layers", "1"],
     "--cpu-offloading-num-layers 1 (cpu_offloading): the cpu backend cannot run it: Megatron's CPU "
     "offloading is Transformer Engine's get_cpu_offload_context"),
    (["--bf16", "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
      "alltoall", "--moe-grouped-gemm", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
     "--delay-wgrad-compute: the cpu backend cannot run it: megatron-adapt's linears compute weight "
     "gradients inside the backward"),
], ids=["cpu_offloading", "delay_wgrad_compute"])
def test_pretrain_gpt_flag_refused_at_start(tmp_path, flags, expected):
    assert_refused_at_start(pretrain(flags, tmp_path, "refused", iters=3), expected)


def _script(*candidates):
    for c in candidates:
        if os.path.isfile(os.path.join(LM, c)):
            return c
    pytest.skip(f"none of {candidates} in {LM}")


def test_pretrain_t5_refused_before_model_build(tmp_path):
    """T5 is told from GPT by its script only: refused where it asks for its layer spec."""
    script = _script("pretrain_t5.py", "examples/t5/pretrain_t5.py")
    t5 = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--encoder-seq-length", "64",
          "--decoder-seq-length", "32", "--kv-channels", "16", "--ffn-hidden-size", "128",
          "--vocab-extra-ids", "10", "--train-iters", "3"]
    run = launch(script, [*_without(TINY_GPT, "--num-layers", "--seq-length"), *t5], tmp_path, "t5")
    assert_refused_at_start(run, "T5 (megatron.core.models.T5.t5_spec.get_t5_encoder_with_"
                                 "transformer_engine_block_spec, pretrain_t5.py): the cpu backend cannot build it")


def test_pretrain_bert_refused_at_import(tmp_path):
    script = _script("pretrain_bert.py", "examples/bert/pretrain_bert.py")
    run = launch(script, [*TINY_GPT, "--train-iters", "3"], tmp_path, "bert")
    assert_refused_at_start(run, "BERT with the transformer_engine layer spec (pretrain_bert.py): the cpu "
                                 "backend cannot build it")


def _without(args: list[str], *flags: str) -> list[str]:
    """`args` less each flag in `flags` and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out

"""Stock Megatron-LM scripts asking for what no backend here serves: refused at start on the cpu backend.

The run must stop non-zero before any model is built (Megatron prints the parameter count once the
model exists: it must not appear), with megatron-adapt's message naming the flag (or the family),
the backend and the reason (patches/start_checks.py). Each launch takes ~10-20 s on two CPU cores.
"""
from __future__ import annotations

import pytest

from test_pretrain_gpt import NEEDS_CHECKOUT, TINY_GPT, pretrain, pytestmark  # noqa: F401 (conftest reads them)

BUILT = "number of parameters on (tensor, pipeline) model parallel rank"


def assert_refused_at_start(run, expected: str):
    assert run.rc != 0, f"ran; log {run.log}"
    assert f"megatron-adapt: {expected}" in run.out, f"no refusal naming it; log {run.log}:\n{run.out[-4000:]}"
    assert "UnsupportedFeatureError" in run.out, run.out[-3000:]
    assert BUILT not in run.out and not run.losses, f"a model was built before the refusal; log {run.log}"


@pytest.mark.parametrize("flags,expected", [
    (["--bf16", "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
      "alltoall", "--moe-grouped-gemm", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
      "--fp8-format", "hybrid"],
     "--delay-wgrad-compute with --fp8-format: the cpu backend cannot run it: megatron-adapt's fp8 / fp4 "
     "linears compute their weight gradients inside the backward"),
], ids=["delay_wgrad_compute_fp8"])
def test_pretrain_gpt_flag_refused_at_start(tmp_path, flags, expected):
    assert_refused_at_start(pretrain(flags, tmp_path, "refused", iters=3), expected)

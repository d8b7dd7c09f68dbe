"""Stock pretrain_gpt.py with Megatron's fp8 / fp4 flags on the cpu backend: refused at start.

Without Transformer Engine, Megatron's get_fp8_context is a nullcontext, so `--fp8-format hybrid`
would train in bf16 and say nothing. Under megatron-adapt the run must stop before training,
non-zero, with a message naming the flag, the backend and the reason (patches/fp8.py).
"""
from __future__ import annotations

import pytest

from test_pretrain_gpt import LM, NEEDS_CHECKOUT, pretrain, pytestmark  # noqa: F401 (conftest reads them)


@pytest.mark.parametrize("flags,expected", [
    (["--fp8-format", "hybrid"],
     "--fp8-format hybrid: the cpu backend cannot run it: CPUs have no fp8 matrix units"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
     "--fp8-format e4m3: the cpu backend cannot run it"),
])
def test_fp8_flags_refused_at_start_on_cpu(tmp_path, flags, expected):
    run = pretrain(["--bf16", *flags], tmp_path, "fp8_refused", iters=3)
    assert run.rc != 0, f"{flags} trained on the cpu backend; log {run.log}"
    assert expected in run.out, f"no refusal naming the flag and backend; log {run.log}:\n{run.out[-4000:]}"
    assert "UnsupportedFeatureError" in run.out, run.out[-3000:]
    assert not run.losses, f"training started before the refusal: {run.losses}"


def test_fp4_flag_refused_at_start_on_cpu(tmp_path):
    """Megatron's own validate_args refuses --fp4-format without TE >= 2.7 before megatron-adapt's
    check runs (which would refuse it too: tests/patching/test_fp8.py); either way it never trains."""
    run = pretrain(["--bf16", "--fp4-format", "e2m1"], tmp_path, "fp4_refused", iters=3)
    assert run.rc != 0 and not run.losses, f"--fp4-format trained; log {run.log}"
    assert "--fp4-format" in run.out and "Error" in run.out, run.out[-3000:]

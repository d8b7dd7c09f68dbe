"""Stock Megatron-LM Mamba / hybrid pretraining, unmodified, on the cpu backend over gloo.

`megatron-adapt-run torchrun --nproc-per-node 2` runs Megatron-LM's own script (core_v0.18+:
pretrain_hybrid.py with --hybrid-layer-pattern and the hybrid_layer_specs spec; before:
pretrain_mamba.py with --hybrid-override-pattern and mamba_layer_specs) with Megatron's TE layer
spec served by megatron-adapt (no TE, no mamba-ssm, no causal-conv1d installed): a hybrid
Mamba + attention + MLP model at TP=2 in bf16 saved and resumed, and a pure Mamba model at DP=2
through pretrain_mamba.py. Each run: the loss falls, the report shows the Mamba ops served by the
backend and the ssm patches applied.

Needs MEGATRON_LM_PATH (skipped otherwise, like test_pretrain_gpt.py). ~3 minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_pretrain_gpt as base  # noqa: E402

NEEDS_CHECKOUT = True  # conftest.py: skipped when the checkout's version is not the installed one
pytestmark = base.pytestmark

MAMBA = ["--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
         "--normalization", "RMSNorm", "--position-embedding-type", "none", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
REQUIRED = (
    "megatron.core.ssm.mamba_mixer:HAVE_MAMBA_SSM",
    "megatron.core.ssm.mamba_mixer:mamba_split_conv1d_scan_combined",
    "megatron.core.ssm.mamba_mixer:ExtendedRMSNorm",
)

# Modules the Mamba scripts never import: their patches wait, pending.
NOT_IMPORTED = ("megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.mamba.mamba_layer_specs")


def _hybrid_script() -> bool:
    return os.path.isfile(os.path.join(base.LM or "", "pretrain_hybrid.py"))


def _model_args(pattern: str) -> list[str]:
    if _hybrid_script():   # core_v0.18+: the hybrid model; --num-layers comes from the pattern
        spec = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
                "--hybrid-layer-pattern", pattern]
    else:
        spec = ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec",
                "--hybrid-override-pattern", pattern]
    return [*MAMBA, *spec, "--num-layers", str(len(pattern))]


def train(script: str, pattern: str, args: list[str], tmp: Path, name: str, iters: int = 10):
    report = tmp / f"{name}.json"
    run = base.launch(script, [*base.TINY_GPT, *_model_args(pattern), "--train-iters", str(iters),
                               *args], tmp, name, env={"MEGATRON_ADAPT_REPORT": str(report)})
    return run, report


def ops_of(report: Path) -> dict:
    """{op: {implementation: calls}} from rank 0's JSON report."""
    out: dict = {}
    for row in json.loads(report.read_text())["ops"]:
        out.setdefault(row["op"], {})[row["implementation"]] = row["calls"]
    return out


def assert_mamba_ops(report: Path, calls_at_least: int):
    ops = ops_of(report)
    for op, impl in (("ssd_scan", "cpu.reference.ssd_scan"), ("causal_conv1d", "cpu.torch.conv1d"),
                     ("rms_norm_gated", "cpu.reference.rms_norm_gated")):
        assert ops.get(op, {}).get(impl, 0) >= calls_at_least, (op, ops.get(op))


def test_hybrid_tp2_bf16_save_and_resume(tmp_path):
    """Mamba, attention and MLP layers (the Nemotron-H pattern, shortened): TP=2, bf16, saved at 5
    and 10, resumed to 15 from the saved iteration."""
    script = "pretrain_hybrid.py" if _hybrid_script() else "pretrain_mamba.py"
    ckpt = tmp_path / "ckpt"
    save = ["--tensor-model-parallel-size", "2", "--bf16", "--save", str(ckpt), "--save-interval", "5"]
    first, report = train(script, "M*M-", save, tmp_path, "hybrid_save")
    first.check()
    base.assert_patched(first, required=base.REQUIRED_PATCHES[:5] + REQUIRED, may_wait=NOT_IMPORTED)
    base.assert_loss_falls(first)
    assert_mamba_ops(report, calls_at_least=2 * 10)   # 2 Mamba layers x 10 iterations, forward
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    second, _ = train(script, "M*M-", [*save, "--load", str(ckpt), "--override-opt_param-scheduler"],
                      tmp_path, "hybrid_resume", iters=15)
    second.check()
    assert f"loading distributed checkpoint from {ckpt} at iteration 10" in second.out
    assert min(second.losses) == 11 and max(second.losses) == 15, second.losses
    assert abs(second.losses[11] - first.losses[10]) < 0.25, (first.losses, second.losses)
    assert base.ranks_printed(second, t="1/2", p="1/1")


def test_pure_mamba_dp2_pretrain_mamba_script(tmp_path):
    """Megatron-LM's pretrain_mamba.py (from core_v0.18 a wrapper of pretrain_hybrid.py): Mamba
    layers only, data parallel over 2 processes, fp32."""
    run, report = train("pretrain_mamba.py", "MMM", [], tmp_path, "mamba_dp2")
    run.check()
    base.assert_patched(run, required=REQUIRED, may_wait=NOT_IMPORTED)
    base.assert_loss_falls(run)
    assert_mamba_ops(report, calls_at_least=3 * 10)

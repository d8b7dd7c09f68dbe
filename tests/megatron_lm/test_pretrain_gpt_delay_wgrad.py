"""Stock pretrain_gpt.py, MoE with expert parallelism 2 and Megatron's EP-overlap 1F1B schedule
(`--overlap-moe-expert-parallel-comm`, bf16, alltoall), with and without `--delay-wgrad-compute`,
on the cpu backend under `megatron-adapt-run torchrun --nproc-per-node 2`.

The delayed run must train exactly as the undelayed one (same loss and grad norm every iteration:
the deferred GEMMs are the same ops on the same operands), with the weight-gradient GEMMs of the
attention linears and the grouped expert linears run from Megatron's backward_dw calls (the report
counts them; the undelayed run has none). A control run drops those GEMMs (a sitecustomize chained
after megatron-adapt's replaces backward_dw with one that only fires DDP's hooks): its grad norm and
later losses must differ, so the comparison can fail.

On core_v0.17+ the grouped expert linears defer too; on 0.16 the legacy GroupedMLP does not (as in
Megatron). Also SequentialMLP experts with a shared expert, and MLA with a dense first layer. ~3.5 minutes
on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_pretrain_gpt as base  # noqa: E402
import test_pretrain_gpt_moe as moe  # noqa: E402

NEEDS_CHECKOUT = True  # conftest.py: skipped when the checkout's version is not the installed one
pytestmark = base.pytestmark
# core_v0.17+: TEGroupedMLP on megatron-adapt's grouped linears, deferred too; before, the legacy
# GroupedMLP computes its expert weight gradients in the backward (Megatron's own no-op backward_dw)
GROUPED_LINEARS = moe.REQUIRED_MOE_PATCHES[-1].endswith("grouped_mlp_modules")

OVERLAP = ["--bf16", "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"]
GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+)")

DROP_WGRAD = textwrap.dedent('''
    """Control: backward_dw fires DDP's hooks but computes no weight gradient."""
    from megatron_adapt.patches import delayed_wgrad

    def backward_dw(self):
        self._wgrad_stash.clear()
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    delayed_wgrad.DelayedWgradMixin.backward_dw = backward_dw
    ''')


def deferred_gemms(tmp, name) -> dict:
    ops = json.loads((tmp / f"{name}.report.json").read_text())["ops"]
    return {re.search(r"\(deferred (.*?)\)", o["implementation"]).group(1): o["calls"]
            for o in ops if o["op"] == "delayed_wgrad"}


def grad_norms(run):
    return {int(i): float(g) for i, g in GRAD_NORM_RE.findall(run.out)}


SEQUENTIAL = ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size",
              "64", "--swiglu", "--disable-bias-linear"]
MLA_DENSE_FIRST = ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
                   "--disable-bias-linear", "--moe-layer-freq", "[0,1]", "--multi-latent-attention",
                   "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
                   "--v-head-dim", "12", "--qk-layernorm", "--position-embedding-type", "rope",
                   "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0",
                   "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights"]
ITERS = 4


def pretrain(args, tmp, name, env=None):
    report = tmp / f"{name}.report.json"
    return base.launch("pretrain_gpt.py", [*base.TINY_GPT, "--train-iters", str(ITERS), *OVERLAP, *args], tmp, name,
                       env={"MEGATRON_ADAPT_REPORT": str(report), **(env or {})}).check()


@pytest.mark.parametrize("experts", ["grouped", "sequential_shared", "mla_dense_first"])
def test_delay_wgrad_compute_trains_as_without_it(tmp_path, experts):
    """grouped: --moe-grouped-gemm (TEGroupedMLP on the grouped linears from 0.17); sequential_shared:
    SequentialMLP experts and a shared expert, all on the deferred local linears; mla_dense_first:
    multi-latent attention (its duplicated down projections too), a dense first layer, then MoE."""
    args = {"grouped": moe.MOE, "sequential_shared": SEQUENTIAL, "mla_dense_first": MLA_DENSE_FIRST}[experts]
    plain = pretrain(args, tmp_path, "overlap")
    delayed = pretrain([*args, "--delay-wgrad-compute"], tmp_path, "overlap_delayed")
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    (control_dir / "sitecustomize.py").write_text(DROP_WGRAD)
    pythonpath = os.pathsep.join(p for p in (str(control_dir), os.environ.get("PYTHONPATH")) if p)
    control = pretrain([*args, "--delay-wgrad-compute"], tmp_path, "overlap_delayed_control",
                       env={"PYTHONPATH": pythonpath})

    assert sorted(plain.losses) == sorted(delayed.losses) == list(range(1, ITERS + 1))
    for i in plain.losses:
        assert delayed.losses[i] == pytest.approx(plain.losses[i], rel=1e-5), (plain.losses, delayed.losses)
    assert len(grad_norms(plain)) == ITERS
    assert grad_norms(delayed) == pytest.approx(grad_norms(plain), abs=2e-3), (grad_norms(plain), grad_norms(delayed))

    # the deferred GEMMs ran from backward_dw (rank 0's report), none without the flag
    deferred = deferred_gemms(tmp_path, "overlap_delayed")
    if experts == "grouped":
        kinds = {"linear", "grouped linear"} if GROUPED_LINEARS else {"linear"}
        assert set(deferred) == kinds and all(n > 0 for n in deferred.values()), deferred
    elif experts == "sequential_shared":  # per layer: qkv, proj, shared fc1 / fc2, 2 local experts x
        assert deferred == {"linear": 8 * 2 * 2 * ITERS}, deferred  # fc1 / fc2; 2 layers, 2 micro-batches
    else:  # MLA's 5 linears per layer, the dense MLP's 2; the MoE layer's grouped fc1 / fc2
        expected = {"linear": (5 + 5 + 2) * 2 * ITERS}
        if GROUPED_LINEARS:
            expected["grouped linear"] = 2 * 2 * ITERS
        assert deferred == expected, deferred
    assert not deferred_gemms(tmp_path, "overlap")

    # the control really lost the weight gradients: the comparison above can fail
    assert abs(grad_norms(control)[1] - grad_norms(plain)[1]) > 1e-2, (grad_norms(plain), grad_norms(control))
    assert abs(control.losses[ITERS] - plain.losses[ITERS]) > 1e-4, (plain.losses, control.losses)

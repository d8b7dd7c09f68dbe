"""Stock Megatron-LM pretrain_gpt.py, unmodified, as a mixture-of-experts GPT on the cpu backend.

8 experts, top-2, --moe-grouped-gemm, the alltoall dispatcher and the aux-loss load balancing,
Megatron's default arguments otherwise (fp32, --transformer-impl transformer_engine served without
TE), under `megatron-adapt-run torchrun`: expert parallelism 2 on 2 processes (with save and
resume), a shared expert with the permute and router fusions, TP=2 + EP=2 on 4 processes, and the
capacity-padded dispatch that MEGATRON_ADAPT_CUDA_GRAPHS captures on a GPU, eager here.
Each run checks the loss falls and, from the JSON report, which backend ops served the MoE layer.

Needs MEGATRON_LM_PATH (skipped otherwise, like test_pretrain_gpt.py). ~2 minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_pretrain_gpt as base  # noqa: E402

NEEDS_CHECKOUT = True  # conftest.py: skipped when the checkout's version is not the installed one


pytestmark = base.pytestmark
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--disable-bias-linear"]

def _required_moe_patches():
    from packaging.version import Version

    from megatron_adapt.versions import megatron_core_version

    common = ("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
              "megatron.training.arguments:validate_args")
    # 0.15-0.16: GroupedMLP without biases, TEGroupedMLP with; 0.17+: TEGroupedMLP
    common += ("megatron.core.models.backends:LocalSpecProvider.grouped_mlp_modules",)
    if megatron_core_version() >= Version("0.17.0"):
        return common
    return common + ("megatron.core.transformer.moe.grouped_gemm_util:grouped_gemm",  # --moe-use-legacy-grouped-gemm
                     "megatron.core.transformer.moe.grouped_gemm_util:ops",
                     "megatron.core.transformer.moe.experts:GroupedMLP.forward",
                     "megatron.core.transformer.moe.moe_utils:te_general_gemm")


REQUIRED_MOE_PATCHES = _required_moe_patches()


def pretrain(args, tmp: Path, name: str, nproc: int = 2, iters: int = 10, env: dict | None = None,
             moe=MOE):
    report = tmp / f"{name}.report.json"
    cmd = ["megatron-adapt-run", "torchrun", "--nproc-per-node", str(nproc), "--master-port",
           str(base._free_port()), os.path.join(base.LM, "pretrain_gpt.py"), *base.TINY_GPT,
           "--train-iters", str(iters), *moe, *args]
    proc = subprocess.run(cmd, env={**base._env(), "MEGATRON_ADAPT_REPORT": str(report), **(env or {})}, cwd=tmp,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    log = tmp / f"{name}.log"
    log.write_text(" ".join(cmd) + "\n" + proc.stdout)
    run = base.Run(proc, log).check()
    run.ops = {o["op"]: o for o in json.loads(report.read_text())["ops"]} if report.exists() else {}
    return run


def assert_moe_ran(run, *ops):
    base.assert_patched(run, base.REQUIRED_PATCHES + REQUIRED_MOE_PATCHES)
    assert "load_balancing_loss" in run.out, "no aux loss logged"
    for op in ("grouped_gemm", *ops):
        assert op in run.ops and run.ops[op]["calls"] > 0, (op, run.ops)
        assert not run.ops[op]["fallback_reason"], run.ops[op]


def save_and_resume(args, tmp, name, run=pretrain):
    """`run` for 10 iterations saving at 5 and 10, then for 15 loading iteration 10: the resumed run
    reports iterations 11-15 and continues the first run's curve. Returns both runs."""
    ckpt = tmp / f"ckpt_{name}"
    save = [*args, "--save", str(ckpt), "--save-interval", "5"]
    first = run(save, tmp, f"{name}_save")
    second = run([*save, "--load", str(ckpt), "--override-opt_param-scheduler"], tmp, f"{name}_resume", iters=15)
    assert "successfully loaded checkpoint" in second.out
    assert min(second.losses) == 11 and max(second.losses) == 15, second.losses
    assert abs(second.losses[11] - first.losses[10]) < 0.25, (first.losses, second.losses)
    return first, second


def test_ep2_grouped_gemm_alltoall_aux_loss_save_and_resume(tmp_path):
    first, _ = save_and_resume(["--expert-model-parallel-size", "2"], tmp_path, "ep2")
    base.assert_loss_falls(first)
    assert_moe_ran(first)
    assert first.ops["grouped_gemm"]["implementation"] == "cpu.loop(matmul per expert)"


def test_ep2_shared_expert_permute_and_router_fusion(tmp_path):
    run = pretrain(["--expert-model-parallel-size", "2", "--moe-shared-expert-intermediate-size", "128",
                    "--moe-permute-fusion", "--moe-router-fusion"], tmp_path, "ep2_shared_fused")
    base.assert_loss_falls(run)
    assert_moe_ran(run, "moe_permute", "moe_unpermute", "moe_sort_chunks", "moe_topk_router",
                   "moe_router_scores", "moe_aux_loss")


def test_tp2_ep2_four_processes(tmp_path):
    # Megatron's MoELayer refuses tensor parallelism without sequence parallelism in training
    run = pretrain(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                    "--moe-shared-expert-intermediate-size", "128"], tmp_path, "tp2_ep2", nproc=4)
    base.assert_loss_falls(run)
    assert_moe_ran(run)


def test_ep2_capacity_padded_dispatch_with_the_graph_switch(tmp_path):
    """The flags scripts/bench_moe.sh's graphed runs add (capacity factor 1.0, padded to capacity,
    permute and router fusions) with MEGATRON_ADAPT_CUDA_GRAPHS=auto: Megatron's real parse_args and
    validate_args take them, the switch says why this process stays eager (cpu backend), and the
    capacity-padded MoE trains through the backend ops."""
    run = pretrain(["--expert-model-parallel-size", "2", "--moe-permute-fusion", "--moe-router-fusion",
                    "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
                   tmp_path, "ep2_padded", env={"MEGATRON_ADAPT_CUDA_GRAPHS": "auto"})
    base.assert_loss_falls(run)
    assert_moe_ran(run, "moe_permute", "moe_unpermute", "moe_topk_router", "moe_router_scores")
    assert "MEGATRON_ADAPT_CUDA_GRAPHS=auto: running eager: CUDA graphs need the cuda backend" in run.out
    assert "moe_pad_expert_input_to_capacity ................ True" in run.out
    assert "cuda_graph_impl ................................. none" in run.out


def test_ep2_grouped_experts_with_bias(tmp_path):
    """Megatron's default --add-bias-linear with --moe-grouped-gemm: TEGroupedMLP on the backend's
    grouped linears on every release (0.15-0.16's legacy GroupedMLP, built without biases, refuses
    them). Megatron's
    TEGroupedMLP (with TE too) asserts --no-bias-dropout-fusion with a bias, and fuses bias and
    activation only for SwiGLU / quick-GeLU (GeLU needs --no-bias-gelu-fusion): --swiglu here, fused."""
    moe = [a for a in MOE if a != "--disable-bias-linear"]
    run = pretrain(["--expert-model-parallel-size", "2", "--no-bias-dropout-fusion", "--swiglu"], tmp_path,
                   "ep2_bias", moe=moe)
    base.assert_loss_falls(run)
    assert_moe_ran(run)
    assert "add_bias_linear ................................. True" in run.out


LATENT_PATCHES = ("megatron.core.transformer.moe.moe_layer:TELinear",
                  "megatron.core.transformer.moe.moe_layer:HAVE_TE")


def _needs_latent():
    from packaging.version import Version

    from megatron_adapt.versions import megatron_core_version

    if megatron_core_version() < Version("0.16.0"):
        pytest.skip("--moe-latent-size exists from megatron-core 0.16")


def test_latent_moe_ep2_save_and_resume(tmp_path):
    """--moe-latent-size (the experts, and the dispatcher, in a 32-wide latent space of the 64-wide
    model; Nemotron's latent MoE): MoELayer's two latent projections, TE's duplicated TELinear in
    Megatron, on the provider's duplicated linear. A shared expert runs on the full hidden states."""
    _needs_latent()
    first, _ = save_and_resume(["--expert-model-parallel-size", "2", "--moe-latent-size", "32",
                                "--moe-shared-expert-intermediate-size", "128"], tmp_path, "latent_ep2")
    base.assert_loss_falls(first)
    assert_moe_ran(first)
    base.assert_patched(first, base.REQUIRED_PATCHES + REQUIRED_MOE_PATCHES + LATENT_PATCHES)
    assert "moe_latent_size ................................. 32" in first.out


def test_latent_moe_tp2_sequence_parallel(tmp_path):
    """The latent projections duplicated on both tensor-parallel ranks under sequence parallelism:
    each rank projects its own tokens and Megatron all-reduces the projections' gradients over the TP
    group (sequence_parallel=True on them, as TE marks its duplicated linears)."""
    _needs_latent()
    run = pretrain(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-latent-size", "32"],
                   tmp_path, "latent_tp2_sp")
    base.assert_loss_falls(run)
    assert_moe_ran(run)
    base.assert_patched(run, base.REQUIRED_PATCHES + REQUIRED_MOE_PATCHES + LATENT_PATCHES)

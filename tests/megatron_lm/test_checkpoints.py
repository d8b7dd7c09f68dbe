"""Stock pretrain_gpt.py checkpoints under megatron-adapt (issue 12, parts 2 and 3).

* Hardening (MEGATRON_ADAPT_CHECKPOINT_HARDEN=1) on a real save and resume, process umask 0000,
  --ckpt-format torch_dist and torch: every file 0640, every directory 0750; a world-writable file
  is refused on load, naming it; the torch format resumes with torch.load(weights_only=True).
* Portability: a torch_dist checkpoint saved at TP=2 is loaded at TP=1 (DP=2) and at PP=2
  (Megatron's resharding): re-saved at once, every tensor (model and optimizer state) equals the
  original bit for bit; the next iteration's loss matches the TP=2 resume within 2e-3 (fp32; the
  tests/parity bound for a change of layout). The default (TE-named) spec's checkpoint also resumes
  with --transformer-impl local. What is NOT portable is checked too: the torch format does not
  reshard (Megatron refuses), and between the two specs it loads only partially (see below).

Cross-backend (cpu <-> npu) loads are in tests/parity/test_checkpoint_portability.py: the torch_npu
emulation cannot run stock pretrain_gpt.py (it keeps torch.cuda.is_available() False, and
Megatron's initialize asserts CUDA unless the cpu backend's patch allows it). cpu <-> cuda:
scripts/checkpoint_portability_gpu.py on a GPU.
Needs MEGATRON_LM_PATH; ~15 launches, ~6 minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from test_pretrain_gpt import LOCAL_UNFUSED, LM, NEEDS_CHECKOUT, pretrain, pytestmark  # noqa: F401

HARDEN = {"MEGATRON_ADAPT_CHECKPOINT_HARDEN": "1"}
LAYOUT_TOL = 2e-3
RESUME = ["--override-opt_param-scheduler"]  # --train-iters differs from the saving run's
# Dropout masks come from per-rank RNG streams that depend on the layout: without dropout, the
# next-iteration loss at another layout differs only by the order of fp32 reductions.
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        out[os.path.relpath(dirpath, root)] = stat.S_IMODE(os.stat(dirpath).st_mode)
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def assert_hardened(root: Path, must_have: tuple[str, ...]):
    found = modes(root)
    for name in must_have:
        assert name in found, (name, sorted(found))
    loose = {k: oct(v) for k, v in found.items()
             if v != (0o750 if os.path.isdir(root / k) else 0o640)}
    assert not loose, loose
    return found


def save_resume_hardened(tmp: Path, name: str, extra: list[str], shards: tuple[str, ...]):
    ckpt = tmp / f"ckpt_{name}"
    save = ["--save", str(ckpt), "--save-interval", "3", *extra]
    first = pretrain(save, tmp, f"{name}_save", iters=6, env=HARDEN, umask=0).check()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    must = (".", "latest_checkpointed_iteration.txt", "iter_0000003", "iter_0000006",
            *(f"iter_0000006/{s}" for s in shards))
    assert_hardened(ckpt, must)
    report = tmp / f"{name}_report.json"
    second = pretrain([*save, "--load", str(ckpt), "--override-opt_param-scheduler"], tmp,
                      f"{name}_resume", iters=8, umask=0,
                      env={**HARDEN, "MEGATRON_ADAPT_REPORT": str(report)}).check()
    assert "successfully loaded checkpoint" in second.out and min(second.losses) == 7, second.losses
    assert abs(second.losses[7] - first.losses[6]) < 0.25, (first.losses, second.losses)
    assert_hardened(ckpt, (*must, "iter_0000008"))
    ops = {o["op"]: o["implementation"] for o in json.loads(report.read_text())["ops"]}
    assert ops.get("checkpoint_load_check") == "refuse world-writable; weights_only=True", ops
    assert ops.get("checkpoint_harden") == "chmod", ops
    return ckpt, first, second


def test_hardened_torch_dist_save_resume_under_umask_0000(tmp_path):
    ckpt, _, _ = save_resume_hardened(
        tmp_path, "dist", ["--tensor-model-parallel-size", "2"],
        ("common.pt", "metadata.json", ".metadata", "__0_0.distcp", "__1_0.distcp"))
    victim = ckpt / "iter_0000008" / "__1_0.distcp"
    victim.chmod(0o646)
    refused = pretrain(["--tensor-model-parallel-size", "2", "--load", str(ckpt)], tmp_path,
                       "dist_refused", iters=9, env=HARDEN)
    assert refused.rc != 0
    assert f"refusing to load checkpoint file {victim}: it is world-writable (mode 0o646)" in refused.out, \
        refused.out[-3000:]
    assert "iteration        9/" not in refused.out


def test_hardened_torch_format_save_resume_under_umask_0000(tmp_path):
    """--ckpt-format torch: mp_rank_0X/model_optim_rng.pt, read back by torch.load with
    weights_only forced on (the argparse Namespace, numpy RNG state and Megatron's enums inside
    are on megatron.core's safe-globals list). Also what the torch format cannot do: load at
    another TP size (refused), or into the other layer spec (its keys are module names: a partial,
    non-strict load)."""
    tp2 = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch"]
    ckpt, _, _ = save_resume_hardened(tmp_path, "torch", tp2,
                                      ("mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"))
    tp1 = pretrain(["--ckpt-format", "torch", "--load", str(ckpt), "--no-load-optim", "--no-load-rng",
                    "--override-opt_param-scheduler"], tmp_path, "torch_tp1", iters=9, env=HARDEN)
    assert tp1.rc != 0 and "iteration        9/" not in tp1.out, tp1.out[-3000:]
    assert "tensor_model_parallel_size value from checkpoint (2) is not equal to the input argument " \
        "value (1)" in tp1.out, tp1.out[-3000:]  # Megatron's own check: this format does not reshard
    # Into the local spec: the strict load fails on the norms' names; Megatron's
    # load_model_state_dict then retries with strict=False and only prints "load_return: None", so
    # the run goes on with input_layernorm / pre_mlp_layernorm at their initial values.
    local = pretrain([*tp2, *LOCAL_UNFUSED, "--load", str(ckpt), "--no-load-optim",
                      "--override-opt_param-scheduler"], tmp_path, "torch_local", iters=9, env=HARDEN)
    assert local.rc == 0 and local.out.count("load_return: None") == 2, local.out[-3000:]


def full_tensors(checkpoint_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    import megatron.core  # noqa: F401  (registers Megatron's safe globals: the common state holds numpy RNG state)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / (checkpoint_dir.parent.name + "_" + checkpoint_dir.name + ".pt")
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    return {k: v for k, v in torch.load(out, weights_only=True).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """TP=2, default (TE-named) spec, fp32, no dropout: 5 iterations, saved at 5; and the TP=2
    resume to 6."""
    tmp = tmp_path_factory.mktemp("tp2")
    ckpt = tmp / "ckpt"
    pretrain(["--tensor-model-parallel-size", "2", *NO_DROPOUT, "--save", str(ckpt), "--save-interval", "5"],
             tmp, "tp2_save", iters=5).check()
    ref = pretrain(["--tensor-model-parallel-size", "2", *NO_DROPOUT, "--load", str(ckpt), *RESUME], tmp, "tp2_resume",
                   iters=6).check()
    assert sorted(ref.losses) == [6], ref.losses
    return tmp, ckpt, ref.losses[6]


@pytest.mark.parametrize("name,layout", [
    ("tp1", ["--tensor-model-parallel-size", "1"]),
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
])
def test_tp2_checkpoint_loads_at_another_layout(tp2_checkpoint, name, layout):
    tmp, ckpt, ref = tp2_checkpoint
    # Loaded and re-saved with no step in between (--train-iters 5 = the loaded iteration; Megatron
    # saves at the end when the last iteration is not a multiple of --save-interval).
    resaved = tmp / f"resaved_{name}"
    run = pretrain([*layout, "--load", str(ckpt), "--save", str(resaved), "--save-interval", "1000"],
                   tmp, f"{name}_resave", iters=5)
    assert run.rc == 0 and "successfully loaded checkpoint" in run.out, run.out[-3000:]
    a = full_tensors(ckpt / "iter_0000005", tmp)
    b = full_tensors(resaved / "iter_0000005", tmp)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert any(k.startswith("optimizer.") for k in a) and any(k.startswith("decoder.") for k in a), sorted(a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
    nxt = pretrain([*layout, *NO_DROPOUT, "--load", str(ckpt), *RESUME], tmp, f"{name}_next", iters=6).check()
    print(f"\nSTOCK tp2 -> {name}: {len(a)} tensors identical; iteration 6 loss {nxt.losses[6]:.6f} "
          f"vs tp2 {ref:.6f}, |diff| {abs(nxt.losses[6] - ref):.2e}")
    assert sorted(nxt.losses) == [6] and abs(nxt.losses[6] - ref) <= LAYOUT_TOL, (nxt.losses, ref)


def test_default_spec_torch_dist_checkpoint_resumes_with_local_spec(tp2_checkpoint):
    """torch_dist keys are not module names: the local spec saves/loads its norms under TE's names
    (sharded_state_dict_keys_map), so the default spec's checkpoint resumes with the local one."""
    tmp, ckpt, ref = tp2_checkpoint
    run = pretrain(["--tensor-model-parallel-size", "2", *NO_DROPOUT, *LOCAL_UNFUSED, "--load", str(ckpt), *RESUME], tmp,
                   "local_next", iters=6).check()
    print(f"\nSTOCK default spec -> local spec: iteration 6 |diff| {abs(run.losses[6] - ref):.2e}")
    assert abs(run.losses[6] - ref) <= LAYOUT_TOL, (run.losses, ref)

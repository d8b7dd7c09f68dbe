"""Tier 3: checkpoint portability across backends, parallel layouts and layer specs, through
megatron-core's public API only (runs in CI: no Megatron-LM checkout needed).

The tiny llama-like GPT of megatron_adapt.apps.demo (RMSNorm, SwiGLU, RoPE, fp32, so the npu backend's
npu_rms_norm / npu_swiglu / npu_rotary_mul / npu_fusion_attention all run) trains 2 steps on the
cpu backend at TP=2 and saves a torch_dist checkpoint X. Another backend / layout loads X,
re-saves what it loaded (before any step) as Y and takes one training step. Checked:

* every tensor of Y equals X's bit for bit (both read back as full, unsharded tensors with
  torch.distributed.checkpoint's dcp_to_torch_save, in this process);
* the loss of that next step matches the cpu TP=2 run's from X within the stated tolerance:
  npu (emulated) vs cpu 5e-4 (tests/npu/test_npu_parity.py's bound), cpu at another layout 2e-3
  (tests/parity's bound: TP/PP change only the order of reductions).

Directions: cpu TP=2 -> npu TP=1 (local and TE-named spec), cpu TP=2 -> npu PP=2 (TE-named),
npu TP=1 -> cpu TP=2 (the re-saved Y back again), and the local spec's checkpoint into the TE-named
spec's model (Megatron's local spec maps its norm names onto TE's in the sharded state dict).
"""
import dataclasses
import os
import sys

import pytest
import torch

from megatron_adapt.apps.demo import RunConfig, losses_of, run

EMULATION_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "npu", "emulation")
NPU_TOL, LAYOUT_TOL = 5e-4, 2e-3
BASE = RunConfig(tp=2, steps=2, backend="cpu", normalization="RMSNorm", swiglu=True, position_embedding="rope")


@pytest.fixture(scope="module", autouse=True)
def emulation_on_path():
    # demo.run spawns its ranks: they inherit sys.path (multiprocessing's spawn preparation data).
    sys.path.insert(0, EMULATION_DIR)
    try:
        yield
    finally:
        sys.path.remove(EMULATION_DIR)


def full_tensors(checkpoint_dir, tmp):
    """Every tensor of a torch_dist checkpoint, unsharded (no process group needed)."""
    import megatron.core  # noqa: F401  (registers Megatron's safe globals: the common state holds numpy RNG state)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tmp, os.path.basename(checkpoint_dir) + ".full.pt")
    dcp_to_torch_save(checkpoint_dir, out)
    state = torch.load(out, weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def assert_identical(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert len(a) == 9, sorted(a)  # embeddings, output layer, final norm, 2 norms + 4 linears (stacked layers)
    diff = {k: (a[k].shape, b[k].shape) if a[k].shape != b[k].shape else float((a[k] - b[k]).abs().max())
            for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Per spec: X saved by cpu TP=2 after 2 steps, and the cpu TP=2 next-step loss from X."""
    made = {}

    def get(spec):
        if spec not in made:
            tmp = tmp_path_factory.mktemp(f"src_{spec}")
            x = str(tmp / "x")
            run(dataclasses.replace(BASE, spec=spec, save_final_to=x))
            ref = losses_of(run(dataclasses.replace(BASE, spec=spec, steps=1, init_from=x)))[0]
            made[spec] = (x, ref, tmp)
        return made[spec]
    return get


def load_elsewhere(x, tmp, name, **overrides):
    """Load X under `overrides`, re-save it at once as Y, take one step: (Y, next loss, results)."""
    y = str(tmp / name)
    results = run(dataclasses.replace(BASE, steps=1, init_from=x, save_init_to=y, **overrides))
    return y, losses_of(results)[0], results


@pytest.mark.parametrize("spec", ["local", "te"])
def test_cpu_tp2_checkpoint_loads_on_npu_tp1_and_back(source, spec):
    x, ref, tmp = source(spec)
    y, loss, results = load_elsewhere(x, tmp, "y_npu_tp1", backend="npu", tp=1, spec=spec)
    assert_identical(full_tensors(x, tmp), full_tensors(y, tmp))
    print(f"\nPORTABILITY {spec} cpu tp2 -> npu tp1: tensors identical, next loss {loss:.6f} vs {ref:.6f}, "
          f"|diff| {abs(loss - ref):.2e}")
    assert abs(loss - ref) <= NPU_TOL, (loss, ref)
    assert set(results[0]["ops"]["rms_norm"]) == {"npu.torch_npu.npu_rms_norm"}, results[0]["ops"]
    # ... and what the npu run saved (TP=1) loads on the cpu backend at TP=2
    z, back, _ = load_elsewhere(y, tmp, "z_cpu_tp2", backend="cpu", tp=2, spec=spec)
    assert_identical(full_tensors(y, tmp), full_tensors(z, tmp))
    print(f"PORTABILITY {spec} npu tp1 -> cpu tp2: tensors identical, next loss |diff| {abs(back - ref):.2e}")
    assert abs(back - ref) <= NPU_TOL, (back, ref)


def test_cpu_tp2_checkpoint_loads_on_npu_pp2(source):
    x, ref, tmp = source("te")
    y, loss, results = load_elsewhere(x, tmp, "y_npu_pp2", backend="npu", tp=1, pp=2, spec="te")
    assert sorted(r["pp_rank"] for r in results) == [0, 1]
    assert_identical(full_tensors(x, tmp), full_tensors(y, tmp))
    print(f"\nPORTABILITY te cpu tp2 -> npu pp2: tensors identical, next loss |diff| {abs(loss - ref):.2e}")
    assert abs(loss - ref) <= NPU_TOL, (loss, ref)


def test_local_spec_checkpoint_loads_into_te_named_spec(source):
    """The module names differ (input_layernorm.weight vs linear_qkv.layer_norm_weight), but the
    local spec's sharded_state_dict_keys_map saves its norms under TE's names, so a torch_dist
    checkpoint crosses between the two specs."""
    x, _, tmp = source("local")
    y, _, results = load_elsewhere(x, tmp, "y_te", spec="te")
    assert_identical(full_tensors(x, tmp), full_tensors(y, tmp))
    te_keys = set(results[0]["state"])
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in te_keys), sorted(te_keys)
    assert not any("input_layernorm" in k for k in te_keys), sorted(te_keys)

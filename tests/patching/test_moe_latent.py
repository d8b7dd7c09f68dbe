"""Tier 1, area moe: `--moe-latent-size` (MoE latent projections, core 0.16+) through Megatron's
MoELayer on the cpu backend, in a fresh interpreter (moe_latent_worker.py). Megatron builds the two
projections from TE's TELinear only (`assert HAVE_TE`); patches/moe serves them on the provider's
duplicated linear."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_latent_worker.py")


@lru_cache(maxsize=None)
def worker():
    out = run_python([WORKER], timeout=600).stdout
    res = json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])
    if res.get("absent"):
        pytest.skip("this megatron-core's TransformerConfig has no moe_latent_size (added in core 0.16)")
    return res


@pytest.mark.parametrize("experts,cls", [("grouped", "TEGroupedMLP"), ("sequential", "SequentialMLP")])
def test_identity_projections_give_megatrons_path_without_them(experts, cls):
    """latent size = hidden size, both projections the identity: output, input gradient and every
    other parameter's gradient equal to Megatron's MoELayer path without the projections, same weights."""
    r = worker()[f"identity_{experts}"]
    assert r["experts"] == cls, r
    assert r["out_rel"] == 0.0 and r["dx_rel"] == 0.0 and r["grad_rel_max"] == 0.0, r
    assert r["grads_compared"] >= 10, r
    assert r["latent_grads"] == ["fc1_latent_proj.weight", "fc2_latent_proj.weight"], r


def test_latent_projections_shapes_checkpoint_keys_and_training():
    r = worker()["latent16"]
    assert r["classes"] == ["AdaptDuplicatedLinear"], r
    assert r["shapes"] == [[16, 32], [32, 16]], r              # hidden 32 -> latent 16 -> hidden 32
    assert r["expert_fc1_in"] == [16] and r["shared_fc1_in"] == 32 and r["router_in"] == 32, r
    assert r["out_shape"] == r["dx_shape"] == [16, 2, 32], r
    assert all(n > 1e-3 for n in r["latent_grad_norms"]), r
    # TE's TELinear keys (weight and an _extra_state), so checkpoints match TE-built ones
    assert r["latent_keys"] == ["mlp.fc1_latent_proj._extra_state", "mlp.fc1_latent_proj.weight",
                                "mlp.fc2_latent_proj._extra_state", "mlp.fc2_latent_proj.weight"], r
    losses = r["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

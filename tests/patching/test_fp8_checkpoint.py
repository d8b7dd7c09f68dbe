"""Tier 1, area fp8: checkpoints of fp8 training (issue 23, item 5), through Megatron's GPTModel
from the TE layer spec and dist_checkpointing (torch_dist). Each step in a fresh interpreter
(tests/patching/fp8_ckpt_worker.py): `save` trains 3 steps in fp8 delayed scaling and saves; `resume`
loads into a fresh fp8 model; `plain` loads on the cpu backend as it is (no fp8 GEMM) into a model
without fp8. Weights are compared as full tensors read back from the torch_dist checkpoints."""
import json
import os
import sys

import pytest

from adapt_testutil import run_python

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fp8_ckpt_worker.py")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parity"))
from test_checkpoint_portability import full_tensors  # noqa: E402

FRESH = "fp8: the checkpoint holds no fp8 scaling state (saved without fp8): the fp8 linears start with fresh scaling state"
IGNORED = "fp8: the checkpoint holds fp8 scaling state (the linears' _extra_state); this model runs without fp8, so it is ignored"


def worker(scenario, root):
    out = run_python([WORKER, scenario, str(root)], timeout=300).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    return root, {s: worker(s, root) for s in ("save", "resume", "plain")}


def test_fp8_checkpoint_resumes_in_fp8(runs):
    _, r = runs
    save, resume = r["save"], r["resume"]
    assert save["fp8_calls"] == 4 * 3 * 4, save        # 4 steps x 3 layers x (qkv, proj, fc1, fc2)
    assert resume["linears"] == 12, resume
    # the saved state is a trained one (scales from amaxes, history rows filled) and comes back equal
    assert resume["scale_nontrivial"] and resume["history_nonzero"], resume
    assert resume["scaling_equal"], resume
    assert resume["messages_after_fp8_load"] == [], resume
    assert resume["fp8_calls"] == 12, resume
    # the resumed step is the uninterrupted run's 4th step, bit for bit (same weights, same scales)
    assert resume["next_loss"] == save["next_loss"], (resume["next_loss"], save["next_loss"])
    # ... which fresh scaling state would not give: the scaling state is what makes it equal
    assert resume["fresh_scaling_loss"] != save["next_loss"], resume


def test_fp8_checkpoint_loads_without_fp8_on_the_cpu_backend(runs, tmp_path):
    root, r = runs
    plain = r["plain"]
    assert not plain["cpu_has_fp8_op"] and plain["fp8_calls"] == 0, plain
    assert plain["classes"] == ["AdaptLayerNormColumnParallelLinear", "RowParallelLinear"], plain
    assert len(plain["messages"]) == 1 and plain["messages"][0].startswith(IGNORED), plain["messages"]
    assert plain["plain_from_bf16_messages"] == [], plain["plain_from_bf16_messages"]
    # every weight as saved by the fp8 run (the re-save of what the plain model loaded)
    a = {k: v for k, v in full_tensors(str(root / "fp8"), str(tmp_path)).items() if not k.endswith("_extra_state")}
    b = {k: v for k, v in full_tensors(str(root / "plain"), str(tmp_path)).items() if not k.endswith("_extra_state")}
    # embeddings (word, position), output layer, final norm, 2 norms + 4 linears (stacked layers)
    assert a.keys() == b.keys() and len(a) == 10, sorted(set(a) ^ set(b))
    assert not [k for k in a if not (a[k].dtype == b[k].dtype and a[k].equal(b[k]))]
    # it trains on: the next loss in bf16 near the fp8 run's
    assert abs(plain["loss"] - r["save"]["next_loss"]) < 0.02, (plain["loss"], r["save"]["next_loss"])


def test_checkpoint_without_fp8_loads_into_fp8_with_fresh_scaling(runs):
    _, r = runs
    resume = r["resume"]
    assert resume["bf16_into_fp8_fresh"], resume
    assert len(resume["bf16_into_fp8_messages"]) == 1, resume["bf16_into_fp8_messages"]
    assert resume["bf16_into_fp8_messages"][0].startswith(FRESH), resume
    assert resume["bf16_into_fp8_loss"] == pytest.approx(4.74, abs=0.2), resume


def test_fp8_checkpoint_of_another_format_starts_fresh(runs):
    """hybrid's gradient scales are made for e5m2's maximum (57344): an e4m3 model (448) would clip."""
    _, r = runs
    resume = r["resume"]
    assert resume["into_e4m3_fresh"], resume
    assert resume["into_e4m3_messages"] == [
        "fp8: the checkpoint's fp8 scaling state is for --fp8-format hybrid --fp8-recipe delayed; this "
        "model runs e4m3 delayed: its fp8 linears start with fresh scaling state"], resume

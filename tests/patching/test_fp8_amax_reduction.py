"""Tier 1, area fp8: delayed scaling all-reduces its amaxes over Megatron's amax reduction group
(TE's `fp8_autocast(fp8_group=...)` with `DelayedScaling(reduce_amax=True)`), reached through
Megatron's own get_fp8_context callers in GPTModel, at 2 ranks over gloo (fp8_amax_worker.py).

Without the reduction each rank scales by its own amaxes: data-parallel ranks by their own
activations, tensor-parallel ranks by their own weight shards, so the ranks of one layer hold
different scales and a checkpoint keeps rank 0's. The `unreduced` model is that control."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_amax_worker.py")


def _free_port() -> str:
    from megatron_adapt.apps.ports import free_port

    return str(free_port())


@lru_cache(maxsize=None)
def result(layout: str, interpret: bool = False) -> dict:
    env = {"FP8_AMAX_LAYOUT": layout}
    if interpret:   # the cuda backend's own delayed update (one Triton launch) under the interpreter
        env["TRITON_INTERPRET"] = "1"
    out = run_python(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _free_port(),
                      WORKER], env=env, timeout=900).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


def _states(res, case):
    return [r[case]["state"] for r in res["ranks"]]


def _rows_max(a, b):
    return [[max(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


CASES = [("dp2", False), ("tp2", False)]
try:
    import triton  # noqa: F401
    CASES.append(("dp2", True))
except ImportError:  # pragma: no cover (the [test] extra installs Triton)
    pass


@pytest.mark.parametrize("layout,interpret", CASES, ids=[f"{l}{'-triton-interpreted' if i else ''}" for l, i in CASES])
class TestAmaxReduction:
    def test_ranks_agree_on_every_linears_scaling_state(self, layout, interpret):
        r0, r1 = _states(result(layout, interpret), "reduced")
        assert len(r0) == 8, sorted(r0)                      # 2 layers x (qkv, proj, fc1, fc2)
        for name in r0:
            assert r0[name]["group_size"] == 2, (name, r0[name])
            assert r0[name] == r1[name], name
        # the report: one reduction per linear and direction and step (8 linears x 2 x 2 steps)
        for rank in result(layout, interpret)["ranks"]:
            assert rank["reduced"]["reductions"] == {
                "all_reduce(MAX) over 2 ranks (Megatron's amax reduction group)": 32}, rank["reduced"]["reductions"]
            assert rank["unreduced"]["reductions"] == {}

    def test_without_the_group_the_ranks_differ(self, layout, interpret):
        """The control: the same run with no group gives each rank its own amaxes."""
        r0, r1 = _states(result(layout, interpret), "unreduced")
        assert all(s["group_size"] == 0 for s in r0.values())
        differ = [n for n in r0 if r0[n]["history_fwd"] != r1[n]["history_fwd"]]
        assert len(differ) >= (8 if layout == "tp2" else 4), differ   # tp2: every weight shard's amax

    def test_the_reduced_amax_is_the_max_over_ranks(self, layout, interpret):
        """The first step casts with scale 1 everywhere, so it computes the same amaxes with and without
        the reduction; the reduced history row is their elementwise max over the two ranks, exactly."""
        res = result(layout, interpret)
        (red, _), (u0, u1) = _states(res, "reduced"), _states(res, "unreduced")
        for name in red:
            for d in ("fwd", "bwd"):
                # history length 4 after two steps: rows [0, 0, step 1, step 2]
                want = _rows_max([u0[name][f"history_{d}"][2]], [u1[name][f"history_{d}"][2]])[0]
                assert red[name][f"history_{d}"][2] == want, (name, d)
                assert red[name][f"history_{d}"][0] == [0.0] * len(want), (name, d)
        assert [r["reduced"]["losses"][0] for r in res["ranks"]] == [r["unreduced"]["losses"][0] for r in res["ranks"]]

    def test_tp_only_amax_red_reduces_over_tensor_parallel_ranks_only(self, layout, interpret):
        """Megatron's `--tp-only-amax-red`: at data parallel 2 the group is one rank, which the
        linears are not given (nothing to reduce: the unreduced run, to the bit); at tensor parallel 2
        it is the whole reduced group."""
        res = result(layout, interpret)
        same_as = "unreduced" if layout == "dp2" else "reduced"
        for rank in res["ranks"]:
            for name, s in rank["tp_only"]["state"].items():
                assert s["group_size"] == (0 if layout == "dp2" else 2), (name, s)
                want = dict(rank[same_as]["state"][name], group_size=s["group_size"])
                assert s == want, name
            assert rank["tp_only"]["losses"] == rank[same_as]["losses"]


def test_one_rank_group_is_not_handed_to_the_linears():
    """On one GPU Megatron's amax reduction group has one rank: `amax_reduction_group` gives None,
    so the linears' updates ask nothing of torch.distributed; at 2 ranks (above) it is the group."""
    code = f"""
import os, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_free_port()}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import megatron_adapt
megatron_adapt.apply("cpu", quiet=True)
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_adapt.patches import fp8 as fp8_patch
class Config: tp_only_amax_red = False
print("BEFORE", fp8_patch.amax_reduction_group(Config()))
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
megatrons = parallel_state.get_amax_reduction_group(with_context_parallel=True)
print("MEGATRON", dist.get_world_size(megatrons))
print("OURS", fp8_patch.amax_reduction_group(Config()))
"""
    out = run_python(code, timeout=300).stdout
    assert "BEFORE None" in out and "MEGATRON 1" in out and "OURS None" in out, out

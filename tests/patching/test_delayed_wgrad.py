"""--delay-wgrad-compute at the module level (patches/delayed_wgrad.py), each linear the TE spec gets
under megatron-adapt, in a fresh interpreter (delayed_wgrad_worker.py): the backward gives input
and bias gradients only, backward_dw() the weight gradients (equal to the eager module's, in .grad
or through gradient-accumulation fusion into main_grad) and then DDP's registered hook. A control
that skips backward_dw must lose the weight gradients (so the comparison can fail).

The schedule-level parity (Megatron's EP-overlap 1F1B through stock pretrain_gpt.py) is in
tests/megatron_lm/test_pretrain_gpt_moe.py."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayed_wgrad_worker.py")
LINEARS = ["column", "row", "norm_column", "duplicated", "grouped_fc1", "grouped_fc2"]


def _free_port() -> str:
    from megatron_adapt.apps.ports import free_port

    return str(free_port())


@lru_cache(maxsize=None)
def result(tp: int = 1) -> dict:
    """tp=2: two ranks under torch.distributed.run, tensor parallelism 2 with sequence parallelism
    (the linears' all-gather / reduce-scatter around the deferred GEMM); rank 0's answers."""
    args = [WORKER, "cpu"] if tp == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                                            "--master-port", _free_port(), WORKER, "cpu"]
    out = run_python(args, env={"DELAYED_WGRAD_TP": str(tp)}, timeout=600).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2_sp"])
@pytest.mark.parametrize("mode", ["grad", "fused"])
@pytest.mark.parametrize("linear", LINEARS)
def test_backward_dw_gives_the_eager_weight_gradients(linear, mode, tp):
    res = result(tp)
    key = f"{linear}/{mode}"
    if key not in res:
        pytest.skip(f"{linear}: this megatron-core has no TE-style grouped linears (core_v0.17+)")
    r = res[key]
    assert r["dgrad_diff"] == 0.0 and r["grad_diff"] < 1e-6, r
    assert r["weight_grad_in_backward"] == [False, False], r        # the wgrad GEMM really waited
    assert r["eager_weight_grad_in_backward"] == [True, True], r
    assert r["hooks_fired"] == 2, r                                 # once per backward_dw
    assert r["control_weight_diff"] > 1e-2 and r["control_other_diff"] == 0.0, r
    assert all(v == k.startswith("weight") for k, v in r["skip"].items()), r["skip"]
    assert not any(r["eager_skip"].values()), r["eager_skip"]


def test_models_without_the_flag_keep_megatrons_classes():
    r = result()
    assert r["column/grad"]["eager_type"] == "ColumnParallelLinear"
    assert r["row/grad"]["eager_type"] == "RowParallelLinear"
    assert r["column/grad"]["type"] == "DelayedWgradColumnParallelLinear"


def test_report_names_the_deferred_gemms():
    assert any(k.startswith("delayed_wgrad|") and n > 0 for k, n in result()["report"].items()), result()["report"]

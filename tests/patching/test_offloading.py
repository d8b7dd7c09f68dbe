"""Activation offloading without TE (patches/offloading.py, backends/activation_offload.py), through
Megatron's real GPTModel from the TE layer spec, each backend in a fresh interpreter
(offload_worker.py): config.cpu_offloading with 2 of 4 layers offloaded against the same model
without it, two micro-batches accumulating gradients.

On the cpu backend the "offload" is a host-to-host copy (no device memory exists to save): the path
and its numerics are the same as on a GPU, where the copies run on side streams (the cuda case,
which needs a GPU). A control zeroes every host copy after it is taken: its gradients must differ,
so the backward really reads what was offloaded."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offload_worker.py")


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@lru_cache(maxsize=None)
def result(backend: str) -> dict:
    out = run_python([WORKER, backend], timeout=600).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_offloaded_layers_train_as_without_offloading(backend):
    res = result(backend)
    assert res["context"] == "ActivationOffload" and res["grads"] > 20
    assert res["loss_diff"] <= 1e-6, res
    assert res["grad_rel_diff"] <= 1e-5, res


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_first_layers_are_offloaded_and_reported(backend):
    res = result(backend)
    assert res["layers_offloaded"] == [0, 1], res          # cpu_offloading_num_layers=2 of 4
    assert res["tensors"] > 0 and res["bytes"] > 0
    assert res["impls"] == [f"{backend}.{'host_copy' if backend == 'cpu' else 'side_streams'}"]
    # a GPU copies asynchronously only into pinned host memory; the cpu backend has nothing to pin
    assert res["pinned"] == [backend != "cpu"], res


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_reads_the_offloaded_copies(backend):
    assert result(backend)["control_grad_rel_diff"] > 1e-2


def test_without_cpu_offloading_megatron_gets_tes_disabled_pair():
    assert result("cpu")["disabled_pair"] == ["nullcontext", None]

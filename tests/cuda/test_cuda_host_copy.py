"""host_copy (activation offloading's copies): the SM-kernel copy under one hardware queue moves
every byte both ways, whatever the dtype; what the kernel does not take goes to the copy engine and
the report says why; more hardware queues keep the copy engine; a kernel copy's host tensor is
held until its event has run. With a GPU the host side is pinned memory reached through its
unified address; without one the kernel runs under the interpreter on CPU tensors."""
import pytest
import torch

from _cuda_helpers import DEVICE, GPU, ran_impl, reset
from megatron_adapt import report
from megatron_adapt.backends.cuda import host_copy as hc

SIZES = [(4096 * 16 * 3 + 6, 7), (3, 1000), (2,)] if GPU else [(3, 1000), (4096 * 16 * 2 + 6,), (2,)]
KERNEL = "cuda.sm_kernel (one hardware queue)"


def _host(shape, dtype):
    return torch.empty(shape, dtype=dtype, pin_memory=GPU)


def _values(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape, device=DEVICE).to(dtype)
    return torch.randint(-2 ** 62, 2 ** 62, shape, device=DEVICE, dtype=dtype)


@pytest.fixture
def one_queue(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _sync():
    if GPU:
        torch.cuda.synchronize()


@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.float16])
def test_the_kernel_copies_every_byte_both_ways(one_queue, shape, dtype):
    torch.manual_seed(0)
    src = _values(shape, dtype)
    reset()
    host = hc.host_copy(_host(shape, dtype).zero_(), src)
    back = hc.host_copy(torch.empty_like(src), host)
    _sync()
    assert ran_impl("host_copy") == {KERNEL}
    assert host.device.type == "cpu" and back.device == src.device
    assert torch.equal(host.view(-1).view(torch.uint8), src.cpu().view(-1).view(torch.uint8))
    assert torch.equal(back.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8))


@pytest.mark.parametrize("case", ["strided", "odd_bytes"])
def test_what_the_kernel_does_not_take_goes_to_the_copy_engine_and_says_why(one_queue, case):
    if case == "strided":
        src = torch.randn(64, 96, device=DEVICE).t()
        host = _host((96, 64), torch.float32)
        why = "strided"
    else:
        src = torch.randn(1001, device=DEVICE).to(torch.bfloat16)
        host = _host((1001,), torch.bfloat16)
        why = "4-byte words"
    reset()
    hc.host_copy(host, src)
    _sync()
    assert torch.equal(host, src.cpu())
    assert ran_impl("host_copy") == {"cuda.copy_engine"}
    reasons = [o["fallback_reason"] for o in report.as_dict()["ops"] if o["op"] == "host_copy"]
    assert any(why in (r or "") for r in reasons), reasons


def test_more_hardware_queues_keep_the_copy_engine(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    src = torch.randn(4096, device=DEVICE)
    host = _host((4096,), torch.float32)
    reset()
    hc.host_copy(host, src)
    _sync()
    assert ran_impl("host_copy") == {"cuda.copy_engine"} and torch.equal(host, src.cpu())


@pytest.mark.skipif(not GPU, reason="needs a GPU (events and pinned memory)")
def test_a_kernel_copy_holds_its_host_tensor_until_its_event_has_run(one_queue):
    src = torch.randn(1 << 20, device="cuda")
    host = _host((1 << 20,), torch.float32)
    torch.cuda._sleep(50_000_000)          # the copy stays queued behind this
    hc.host_copy(host, src)
    assert hc._held and hc._held[-1][1] is host
    torch.cuda.synchronize()
    hc.host_copy(_host((1 << 20,), torch.float32), src)   # releases what has run
    torch.cuda.synchronize()
    assert all(t is not host for _, t in hc._held)
    assert torch.equal(host, src.cpu())


@pytest.mark.skipif(not GPU, reason="needs a GPU (pageable memory is a host-only notion without one)")
def test_pageable_host_memory_goes_to_the_copy_engine(one_queue):
    src = torch.randn(4096, device="cuda")
    host = torch.empty(4096)
    reset()
    hc.host_copy(host, src)
    torch.cuda.synchronize()
    assert ran_impl("host_copy") == {"cuda.copy_engine"} and torch.equal(host, src.cpu())

"""The shared direct launcher of compiled Triton kernels (backends/cuda/_common.launch)."""
import pytest
import torch
import triton
import triton.language as tl

from megatron_adapt.backends.cuda import _common

from _cuda_helpers import DEVICE, GPU


@triton.jit
def _axpy(X, Y, OUT, n, a, BLOCK: tl.constexpr, NEG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = a * tl.load(X + offs, mask=m, other=0.0) + tl.load(Y + offs, mask=m, other=0.0)
    if NEG:
        v = -v
    tl.store(OUT + offs, v, mask=m)


def _run(n, a, neg, dtype=torch.float32, offset=0):
    x = torch.randn(n + offset, device=DEVICE, dtype=dtype)[offset:]
    y = torch.randn(n, device=DEVICE, dtype=dtype)
    out = torch.full((n,), float("nan"), device=DEVICE, dtype=dtype)
    _common.launch(_axpy, (triton.cdiv(n, 128),), x, y, out, n, a, BLOCK=128, NEG=neg, num_warps=4)
    ref = a * x.double() + y.double()
    torch.testing.assert_close(out.double(), -ref if neg else ref, rtol=1e-2, atol=1e-2)


def test_interpreter_takes_the_ordinary_launcher():
    """Under TRITON_INTERPRET=1 there is no compiled kernel: launch() calls the interpreter
    (explicitly) and caches nothing."""
    if GPU:
        pytest.skip("GPU present: the compiled path is tested below")
    before = len(_common._compiled)
    _run(300, 2.0, False)
    assert len(_common._compiled) == before


@pytest.mark.skipif(not GPU, reason="needs a GPU (compiled Triton kernels)")
def test_direct_launch_matches_and_caches_per_specialisation():
    if not _common.direct_launch_enabled():
        pytest.skip("direct launch off (MEGATRON_ADAPT_TRITON_DIRECT=0 or Triton < 3.3)")
    _common._compiled.clear()
    _run(320, 2.0, False)            # compiles through JITFunction.run, caches
    assert len(_common._compiled) == 1
    for _ in range(3):
        _run(320, 2.0, False)        # direct launches of the cached binary
    _run(301, 0.5, False)            # 301: not divisible by 16 -> another specialisation
    _run(300, 0.5, False)            # 300: neither (Triton compiles the same binary): no new entry
    _run(320, 1.5, True)             # another constexpr
    _run(320, 1.5, True, torch.bfloat16)                # another dtype
    _run(320, 1.5, True, torch.float32, offset=1)       # a pointer not 16-byte aligned
    assert len(_common._compiled) == 5
    for key in _common._compiled:
        assert key[0] is _axpy


@pytest.mark.skipif(not GPU, reason="needs a GPU (CUDA graphs)")
def test_direct_launch_is_captured_by_cuda_graphs():
    n = 4096
    x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    out = torch.empty_like(x)
    args = (_axpy, (triton.cdiv(n, 128),), x, y, out, n, 3.0)
    _common.launch(*args, BLOCK=128, NEG=False)          # compile + cache outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _common.launch(*args, BLOCK=128, NEG=False)
    x.copy_(torch.randn(n, device=DEVICE))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 3.0 * x + y)

"""RMSNorm / LayerNorm Triton kernels, forward and backward, against fp32 torch."""
import pytest
import torch
import torch.nn.functional as F

from _cuda_helpers import DEVICE, DTYPES, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.cuda import norms

# (rows, hidden): odd sizes, a power of two, and rows wider than 65536 (chunked kernels).
# Narrow rows (a tile of several rows per program, a ragged last tile) too.
SHAPES = [(4096, 4096), (2048, 5123), (257, 12288), (1024, 9000), (64, 65536 + 17), (1001, 200)] if GPU else \
    [(6, 7), (5, 300), (9, 1024), (5, 9000), (2, 65536 + 3)]   # 5x9000: LayerNorm's split backward
# Under the CPU interpreter the wide rows (split backward, chunked kernels: 10-30 s a case) run in bf16
# only; their chunking does not depend on the dtype, which the narrow shapes cover in all three.
CASES = [(r, h, d) for r, h in SHAPES for d in DTYPES if GPU or h < 5000 or d is torch.bfloat16]


def _run(rms, rows, h, dtype, wdtype=None, offset=0.5):
    torch.manual_seed(rows + h)
    wdtype = wdtype or dtype
    x = (torch.randn(rows, h, device=DEVICE) * 2 + offset).to(dtype).requires_grad_()
    w = (torch.rand(h, device=DEVICE) + 0.5).to(wdtype).requires_grad_()
    b = None if rms else torch.randn(h, device=DEVICE).to(wdtype).requires_grad_()
    reset()
    y = norms.rms_norm(x, w, 1e-5) if rms else norms.layer_norm(x, w, b, 1e-5)
    assert y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    assert ran_impl("rms_norm" if rms else "layer_norm") == {"cuda.triton"}
    leaves = [x, w] + ([] if rms else [b])
    ref_in = [t.detach().float().requires_grad_() for t in leaves]
    if rms:
        yr = F.rms_norm(ref_in[0], (h,), ref_in[1], 1e-5)
    else:
        yr = F.layer_norm(ref_in[0], (h,), ref_in[1], ref_in[2], 1e-5)
    yr.backward(dy.float())
    assert_close(y, yr, dtype, "y")
    for name, t, r in zip(("dx", "dw", "db"), leaves, ref_in):
        assert t.grad.dtype == t.dtype
        # dw/db sum over rows: fp32 partials, bf16 inputs -> a bit more rounding.
        assert_close(t.grad, r.grad, dtype, name, scale=1.0 if name == "dx" else 2.0)


@pytest.mark.parametrize("rows,h,dtype", CASES, ids=[f"{r}x{h}-{str(d)[6:]}" for r, h, d in CASES])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_norm(rms, rows, h, dtype):
    _run(rms, rows, h, dtype)


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_norm_bf16_input_fp32_weight(rms):
    _run(rms, 8 if not GPU else 1024, 96 if not GPU else 4096, torch.bfloat16, torch.float32)


def test_norm_3d_input_and_fallback_reported():
    x = torch.randn(3, 2, 40, device=DEVICE, requires_grad=True)
    w = torch.ones(40, device=DEVICE, requires_grad=True)
    y = norms.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape
    assert_close(y, F.rms_norm(x.detach(), (40,), w.detach(), 1e-6), torch.float32)
    reset()
    xd = torch.randn(4, 8, dtype=torch.float64, device=DEVICE)
    yd = norms.rms_norm(xd, torch.ones(8, dtype=torch.float64, device=DEVICE), 1e-6)
    assert yd.dtype == torch.float64 and "cpu.reference(rms_norm)" in ran_impl("rms_norm")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_norm_large_mean_fp32(rms):
    """Rows whose mean is 100x their spread: the one-pass (shifted) LayerNorm variance must not
    cancel catastrophically."""
    _run(rms, 16 if not GPU else 512, 1000 if not GPU else 4096, torch.float32, offset=200.0)


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_norm_strided_input_and_gradient(rms):
    """A transposed (non-contiguous) 3-D input and a non-contiguous output gradient: the op reads
    a contiguous copy, and returns outputs and gradients in the input's shape."""
    torch.manual_seed(3)
    x = torch.randn(5, 3, 48, device=DEVICE).transpose(0, 1).requires_grad_()
    w = (torch.rand(48, device=DEVICE) + 0.5).requires_grad_()
    b = None if rms else torch.randn(48, device=DEVICE).requires_grad_()
    y = norms.rms_norm(x, w, 1e-5) if rms else norms.layer_norm(x, w, b, 1e-5)
    dy = torch.randn(48, 5, 3, device=DEVICE).permute(2, 1, 0)
    assert y.shape == x.shape == dy.shape and not dy.is_contiguous()
    y.backward(dy)
    leaves = [x, w] + ([] if rms else [b])
    ref = [t.detach().clone().requires_grad_() for t in leaves]
    yr = F.rms_norm(ref[0], (48,), ref[1], 1e-5) if rms else F.layer_norm(ref[0], (48,), ref[1], ref[2], 1e-5)
    yr.backward(dy)
    assert_close(y, yr, torch.float32, "y")
    for name, t, r in zip(("dx", "dw", "db"), leaves, ref):
        assert t.grad.shape == t.shape
        assert_close(t.grad, r.grad, torch.float32, name)

"""SwiGLU / bias-SwiGLU / bias-GeLU kernels, fwd+bwd, against fp32 torch."""
import pytest
import torch
import torch.nn.functional as F

from _cuda_helpers import DEVICE, DTYPES, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.cuda import activations

SHAPES = [(4096, 2 * 5461), (1000, 2 * 1111)] if GPU else [(7, 2 * 37), (3, 2 * 1500)]


@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["swiglu", "bias_swiglu"])
def test_swiglu(rows, width, dtype, bias):
    torch.manual_seed(width)
    x = torch.randn(rows, width, device=DEVICE).to(dtype).requires_grad_()
    bb = torch.randn(width, device=DEVICE).to(dtype).requires_grad_() if bias else None
    reset()
    y = activations.bias_swiglu(x, bb) if bias else activations.swiglu(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert ran_impl("bias_swiglu" if bias else "swiglu") == {"cuda.triton"}
    xr = x.detach().float().requires_grad_()
    br = bb.detach().float().requires_grad_() if bias else None
    a, g = torch.chunk(xr + br if bias else xr, 2, dim=-1)
    yr = F.silu(a) * g
    yr.backward(dy.float())
    assert_close(y, yr, dtype, "y")
    assert_close(x.grad, xr.grad, dtype, "dx")
    if bias:
        assert_close(bb.grad, br.grad, dtype, "dbias", scale=2.0)


@pytest.mark.parametrize("shape", [(2, 2048, 4099), (4096, 1024)] if GPU else [(3, 5, 1500), (4, 33)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(shape, dtype):
    torch.manual_seed(shape[-1])
    y = (torch.randn(shape, device=DEVICE) * 2).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_()
    reset()
    o = activations.bias_gelu(b, y)
    d = torch.randn_like(o)
    o.backward(d)
    assert ran_impl("bias_gelu") == {"cuda.triton"}
    yr, br = y.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    orf = F.gelu(yr + br, approximate="tanh")
    orf.backward(d.float())
    assert_close(o, orf, dtype, "out")
    assert_close(y.grad, yr.grad, dtype, "dy")
    assert_close(b.grad, br.grad, dtype, "dbias", scale=2.0)

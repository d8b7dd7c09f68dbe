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


@pytest.mark.parametrize("op", ["swiglu", "bias_swiglu", "bias_gelu"])
def test_strided_input_and_gradient(op):
    """Transposed (non-contiguous) 3-D inputs and output gradients: outputs and gradients come
    back in the input's shape and equal the fp32 reference."""
    torch.manual_seed(5)
    x = torch.randn(6, 4, 64, device=DEVICE).transpose(0, 1).requires_grad_()
    b = torch.randn(64 if op == "bias_gelu" else 64, device=DEVICE).requires_grad_()
    xr, br = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    if op == "bias_gelu":
        out, ref = activations.bias_gelu(b, x), F.gelu(xr + br, approximate="tanh")
    elif op == "swiglu":
        out, ref = activations.swiglu(x), F.silu(xr[..., :32]) * xr[..., 32:]
    else:
        h = xr + br
        out, ref = activations.bias_swiglu(x, b), F.silu(h[..., :32]) * h[..., 32:]
    d = torch.randn(out.shape[::-1], device=DEVICE).permute(*range(out.dim() - 1, -1, -1))
    assert out.shape == ref.shape == d.shape and not d.is_contiguous()
    out.backward(d)
    ref.backward(d)
    assert_close(out, ref, torch.float32, "out")
    assert x.grad.shape == x.shape
    assert_close(x.grad, xr.grad, torch.float32, "dx")
    if op != "swiglu":
        assert_close(b.grad, br.grad, torch.float32, "dbias")

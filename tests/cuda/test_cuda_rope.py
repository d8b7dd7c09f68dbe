"""RoPE kernel (bshd, rotate-half and interleaved, rot_dim <= d, mscale, strided input)."""
import pytest
import torch

from _cuda_helpers import DEVICE, DTYPES, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.reference import rope as reference
from megatron_adapt.backends.cuda import rope

# (s, b, h, d, rot_dim)
SHAPES = [(2048, 2, 16, 128, 128), (512, 3, 5, 96, 64), (100, 1, 40, 80, 80)] if GPU else \
    [(5, 2, 3, 8, 8), (4, 3, 2, 16, 8), (3, 2, 5, 12, 6)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_rope(shape, dtype, interleaved, mscale):
    s, b, h, d, r = shape
    torch.manual_seed(s * d + r)
    # A strided view (every other head of a larger buffer), as Megatron's q/k views of QKV.
    big = torch.randn(s, b, 2 * h, d, device=DEVICE).to(dtype)
    t = big[:, :, ::2].detach().requires_grad_()
    freqs = torch.randn(s, 1, 1, r, device=DEVICE) * 4
    reset()
    y = rope.rope(t, freqs, interleaved, mscale)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert ran_impl("rope") == {"cuda.triton"}
    tr = t.detach().float().requires_grad_()
    yr = reference(tr, freqs, interleaved, mscale)
    yr.backward(dy.float())
    assert_close(y, yr, dtype, "y")
    assert_close(t.grad, tr.grad, dtype, "dt")
    if r < d:
        assert torch.equal(y[..., r:], t[..., r:]), "channels past rot_dim pass through unchanged"

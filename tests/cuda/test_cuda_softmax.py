"""Scaled masked softmax kernel (causal, window, explicit bool mask), fwd+bwd, vs the reference."""
import pytest
import torch

from _cuda_helpers import DEVICE, DTYPES, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.reference import scaled_masked_softmax as reference
from megatron_adapt.backends.cuda import softmax

SHAPES = [(2, 4, 128, 2048), (1, 2, 64, 3001), (1, 1, 8, 20000)] if GPU else \
    [(2, 3, 5, 7), (1, 2, 4, 33), (1, 1, 3, 20000)]
CASES = {
    "plain": dict(mask=None, causal=False, window=None),
    "causal": dict(mask=None, causal=True, window=None),
    "window": dict(mask=None, causal=False, window=(3, 0)),
    "mask": dict(mask="pad", causal=False, window=None),
    "mask+causal": dict(mask="full", causal=True, window=None),
}


def _mask(kind, b, np_, sq, sk):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(sq * sk)
    if kind == "pad":  # [b, 1, 1, sk] padding mask; the first row fully masked
        m = torch.rand(b, 1, 1, sk, generator=g) > 0.7
        m[0] = True
        return m.expand(b, 1, sq, sk).to(DEVICE)
    return (torch.rand(b, np_, sq, sk, generator=g) > 0.5).to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_softmax(shape, dtype, case):
    c = CASES[case]
    b, np_, sq, sk = shape
    torch.manual_seed(sk)
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype).requires_grad_()
    mask = _mask(c["mask"], b, np_, sq, sk)
    scale = 0.125 if dtype != torch.float32 else 1.7
    reset()
    y = softmax.scaled_masked_softmax(x, mask, scale, c["causal"], c["window"], dtype != torch.float32)
    assert y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    assert ran_impl("scaled_masked_softmax") == {"cuda.triton"}
    xr = x.detach().float().requires_grad_()
    yr = reference(xr, mask, scale, c["causal"], c["window"], True)
    yr.backward(dy.float())
    assert_close(y, yr, dtype, "probs")
    assert_close(x.grad, xr.grad, dtype, "dx", scale=2.0)
    if mask is not None:
        assert (x.grad[mask.expand_as(x)] == 0).all(), "masked scores must get no gradient"


def test_fully_masked_row_is_uniform():
    x = torch.randn(1, 1, 2, 9, device=DEVICE)
    mask = torch.ones(1, 1, 2, 9, dtype=torch.bool, device=DEVICE)
    y = softmax.scaled_masked_softmax(x, mask, 2.0, False, None, True)
    assert torch.allclose(y, torch.full_like(y, 1 / 9))


def test_the_mask_is_not_a_saved_tensor():
    """Only the probabilities go through autograd's saved-tensor hooks: an activation offloader
    would otherwise copy the mask's broadcast view at b * np * sq * sk bytes per layer (Megatron's
    fine-grained offloading test counted 16 MiB a layer that offloading never freed)."""
    b, np_, sq, sk = 2, 4, 8, 16
    x = torch.randn(b, np_, sq, sk, device=DEVICE).requires_grad_()
    mask = (torch.rand(b, 1, sq, sk) > 0.7).to(DEVICE)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = softmax.scaled_masked_softmax(x, mask, 0.5, False, None, True)
    assert [tuple(t.shape) for t in saved] == [(b, np_, sq, sk)] and saved[0].dtype == y.dtype
    y.backward(torch.ones_like(y))
    assert (x.grad[mask.expand_as(x)] == 0).all()

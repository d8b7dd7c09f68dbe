"""Bias-dropout-add kernel: the forward's mask is the backward's, against fp32 torch with that
mask; keep rate; fresh masks per call, reproducible under a seed, fresh per CUDA-graph replay."""
import pytest
import torch

from _cuda_helpers import DEVICE, DTYPES, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.cuda import dropout

SHAPES = [(2048, 2, 2048), (1000, 3, 1111)] if GPU else [(3, 5, 1500), (4, 33)]


def _seed(s):
    torch.manual_seed(s)
    if GPU:
        torch.cuda.manual_seed(s)


def _inputs(shape, dtype, bias):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    r = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_() if bias else None
    return x, b, r


def _mask(out, x):
    """The keep mask times 1/(1-p), read through the backward (dout = 1)."""
    (g,) = torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)
    return g.float()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("prob", [0.0, 0.1, 0.5])
def test_bias_dropout_add(shape, dtype, bias, prob):
    _seed(shape[-1])
    x, b, r = _inputs(shape, dtype, bias)
    reset()
    out = dropout.bias_dropout_add(x, b, r, prob)
    assert ran_impl("bias_dropout_add") == {"cuda.triton"} and out.dtype == dtype
    keep = _mask(out, x)
    scale = 1.0 / (1.0 - prob)
    kept_values = keep[keep != 0]
    assert kept_values.numel() == 0 or (kept_values - scale).abs().max() <= scale * 2 ** -7
    n = keep.numel()
    kept = (keep != 0).float().mean().item()
    assert abs(kept - (1 - prob)) <= 6 * ((prob * (1 - prob) / n) ** 0.5) + 1e-9, kept
    xr, rr = x.detach().float().requires_grad_(), r.detach().float().requires_grad_()
    br = b.detach().float().requires_grad_() if bias else None
    ref = rr + ((xr + br) if bias else xr) * keep
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.float())
    assert_close(out, ref, dtype, "out")
    assert_close(x.grad, xr.grad, dtype, "dx")
    assert torch.equal(r.grad, dout), "d residual is dout itself"
    if bias:
        assert_close(b.grad, br.grad, dtype, "dbias", scale=2.0)


def test_fresh_masks_per_call_and_reproducible_under_a_seed():
    x, _, r = _inputs((64, 257), torch.float32, False)
    _seed(7)
    m1 = _mask(dropout.bias_dropout_add(x, None, r, 0.3), x)
    m2 = _mask(dropout.bias_dropout_add(x, None, r, 0.3), x)
    _seed(7)
    m3 = _mask(dropout.bias_dropout_add(x, None, r, 0.3), x)
    assert not torch.equal(m1, m2) and torch.equal(m1, m3)


def test_edges_prob_one_and_zero_and_wide_counters(monkeypatch):
    x, b, r = _inputs((16, 300), torch.float32, True)
    assert torch.equal(dropout.bias_dropout_add(x, b, r, 1.0), r)
    state = torch.cuda.get_rng_state() if GPU else torch.get_rng_state()
    out = dropout.bias_dropout_add(x, b, r, 0.0)
    assert torch.allclose(out, x + b + r, atol=1e-6)
    assert torch.equal(state, torch.cuda.get_rng_state() if GPU else torch.get_rng_state()), \
        "prob 0 draws no seed"
    monkeypatch.setattr(dropout, "WIDE_FROM", 0)   # the 64-bit Philox counters of >= 2^31 elements
    keep = _mask(dropout.bias_dropout_add(x, b, r, 0.5), x)
    assert 0.35 < (keep != 0).float().mean().item() < 0.65
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout.bias_dropout_add(x, b, r, 1.5)


def test_unsupported_inputs_fall_back_reported():
    x = torch.randn(4, 8, device=DEVICE)
    r = torch.randn(1, 8, device=DEVICE)          # broadcast residual: not the kernel's case
    reset()
    torch.manual_seed(0)
    out = dropout.bias_dropout_add(x, None, r, 0.0)
    assert "cpu.reference(bias_dropout_add)" in ran_impl("bias_dropout_add")
    assert torch.allclose(out, x + r)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_graph_replays_draw_fresh_masks():
    x, _, r = _inputs((256, 1024), torch.bfloat16, False)
    x, r = x.detach(), r.detach()
    static = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dropout.bias_dropout_add(x, None, r, 0.5)      # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static["out"] = dropout.bias_dropout_add(x, None, r, 0.5)
    g.replay()
    a = static["out"].clone()
    g.replay()
    b = static["out"].clone()
    assert not torch.equal(a, b)
    for o in (a, b):
        dropped = (o == r).float().mean().item()
        assert 0.45 < dropped < 0.55

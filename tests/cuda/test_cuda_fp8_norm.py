"""The norm inside the fp8 cast of the linear after it (backends/cuda/fp8_norm.py, op `fp8_norm`).

The Triton kernel runs under TRITON_INTERPRET=1 here (on a GPU, natively) and is checked against the
norm in fp32 rounded to the input dtype by torch, then the cast kernel (`fp8._cast_triton`, itself
checked against torch's cast in test_cuda_fp8.py), and its row statistics against torch's. The norm
-> fp8 linear chain is checked against norm -> fp8 linear, forward and backward (the norm's
backward then runs on the statistics the cast kernel wrote), with the same delayed-scaling state.
"""
import pytest
import torch

from megatron_adapt import report
from megatron_adapt.backends.cuda import fp8, fp8_norm, norms

from test_cuda_fp8 import DEV, E4
from test_cuda_fp8_swiglu import delayed, skip_bf16_on_cpu

pytestmark = pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")


def assert_a_few_neighbours_at_most(got, ref):
    """Equal but for at most 2 % of elements one fp8 step apart: the kernel sums a row's statistics
    in another order than torch, which can move a value's last bit across an fp8 rounding boundary
    (on CPU too). A wrong formula, statistic, scale or layout differs almost everywhere, and by more."""
    g, r = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    assert bool(((g - r).abs() <= 1).all()), "more than one fp8 step apart"
    assert int((g != r).sum()) <= max(2, g.numel() // 50), int((g != r).sum())


def inputs(rows, n, dtype, rms, seed=0):
    torch.manual_seed(seed)
    x = (torch.randn(rows, n) * 2 + 0.5).to(dtype).to(DEV)
    w = (torch.rand(n) + 0.5).to(dtype).to(DEV)
    b = None if rms else (torch.randn(n) * 0.1).to(dtype).to(DEV)
    return x, w, b


def deferred(x, w, b, rms, eps=1e-5):
    rstd = torch.full((x.shape[0],), -1.0, device=x.device)
    mean = rstd if rms else torch.full_like(rstd, -1.0)
    return fp8_norm.NormOutput(x.shape, x, x, w, b, eps, rms, mean, rstd), mean, rstd


@pytest.mark.parametrize("rows,n", [(40, 48), (17, 200), (64, 256)])
@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_cast_kernel_equals_norm_then_cast(rows, n, rms, dtype, monkeypatch):
    """The fp8 copy, its transposed copy, 1/scale, the amax recorded, and the rows' mean / rstd."""
    skip_bf16_on_cpu(dtype)
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w, b = inputs(rows, n, dtype, rms)
    assert fp8._triton_here(x)
    y, mean_ref, rstd_ref = fp8_norm.norm_reference(x, w, b, 1e-5, rms)
    s_ref, s_got = delayed(scale=8.0), delayed(scale=8.0)
    r8, _, rinv = fp8._cast_triton(y, E4, True, s_ref.scale["fwd"][0:1], s_ref.amax_history["fwd"][0, 0:1])
    d, mean, rstd = deferred(x, w, b, rms)
    report.reset_op_counts()
    g8, g8t, ginv = d.fp8_quantize(E4, True, s_got, "fwd", 0)
    assert report.op_counts()["fp8_norm"] == {"cuda.triton(norm + fp8 cast)": 1}
    assert_a_few_neighbours_at_most(g8, r8)
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
    assert torch.equal(ginv, rinv)
    torch.testing.assert_close(s_got.amax_history["fwd"][0, 0], s_ref.amax_history["fwd"][0, 0], rtol=2 ** -7, atol=0)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-5, atol=0)
    if not rms:
        torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-6)


class _NormRef(torch.autograd.Function):
    """The unfused chain's norm: the reference forward, autograd's backward of it."""
    @staticmethod
    def forward(ctx, x, w, b, rms):
        ctx.save_for_backward(x, w, b)
        ctx.rms = rms
        return fp8_norm.norm_reference(x.reshape(-1, x.shape[-1]), w, b, 1e-5, rms)[0].view(x.shape)

    @staticmethod
    def backward(ctx, d):
        x, w, b = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
            y = fp8_norm.norm_reference(leaves[0].reshape(-1, x.shape[-1]), leaves[1], leaves[2], 1e-5, ctx.rms)[0]
            grads = torch.autograd.grad(y.view(x.shape), [t for t in leaves if t is not None], d)
        return (*grads, None, None) if b is None else (*grads, None)


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("kernels", [False, True])
def test_norm_fp8_linear_chain_equals_the_unfused_chain(rms, kernels, monkeypatch):
    """Forward, dgrad, wgrad, the norm's input and weight (and bias) gradients, the amax recorded,
    and no fallback. kernels=False: on CPU the torch path (exact); True: the Triton kernels
    (interpreted on CPU) against the backend's norm kernels then the cast, as the unfused chain runs;
    the norm's backward is the same kernel both ways, fed the statistics the cast kernel wrote."""
    if DEV == "cpu":
        if kernels:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.setattr(fp8, "interpreting", lambda: False)
            monkeypatch.setattr(fp8_norm, "_triton_here", lambda t: False)
    elif not kernels:
        pytest.skip("the torch path is the CPU one")
    x0, g0, b0 = inputs(32, 64, torch.bfloat16, rms, seed=2)
    x0 = x0.view(2, 16, 64)
    w0 = (torch.randn(48, 64) * 0.2).to(torch.bfloat16).to(DEV)
    runs = {}
    report.reset_op_counts()
    for fused in (False, True):
        x, g, w = (t.clone().requires_grad_() for t in (x0, g0, w0))
        b = None if rms else b0.clone().requires_grad_()
        s = delayed(scale=1.0)
        if fused:
            h = fp8_norm.fp8_norm(x, g, b, 1e-5, rms)
        else:   # the unfused chain as it runs: the backend's norm kernels, or the reference on CPU
            h = norms._Norm.apply(x, g, b, 1e-5, rms) if kernels else _NormRef.apply(x, g, b, rms)
        if fused:
            assert type(h).__name__ == "NormOutput" and h.shape == (2, 16, 64)
        out = fp8.fp8_linear(h, w, None, s)
        (out.float() * torch.linspace(-1, 1, 48, device=DEV)).sum().backward()
        runs[fused] = [out.detach(), x.grad, g.grad, w.grad, s.amax_history["fwd"][:, 0].clone()]
        if not rms:
            runs[fused].append(b.grad)
    counts = report.op_counts()["fp8_norm"]
    impl = "cuda.triton" if (kernels or DEV != "cpu") else "torch"
    assert sum(v for k, v in counts.items() if k.startswith(impl)) == 1, counts
    assert not [o for o in report.as_dict()["ops"] if o["op"] == "fp8_norm" and o["fallback_reason"]]
    tol = dict(rtol=0, atol=0) if not kernels else dict(rtol=0.05, atol=0.05)
    for got, ref in zip(runs[True], runs[False]):
        scale = ref.float().abs().max().clamp_min(1e-12)
        torch.testing.assert_close(got.float() / scale, ref.float() / scale, **tol)


def test_any_other_use_computes_it_in_bf16_and_says_so():
    x, g, b = inputs(8, 32, torch.bfloat16, rms=False, seed=3)
    x.requires_grad_()
    h = fp8_norm.fp8_norm(x, g, b, 1e-5, False)
    assert type(h.view(8, 32)).__name__ == "NormOutput"   # the same tensor again: still deferred
    report.reset_op_counts()
    got = h * 1.0   # not an fp8 linear: computed here
    torch.testing.assert_close(got, fp8_norm.norm_reference(x.detach(), g, b, 1e-5, False)[0], rtol=0, atol=0)
    fb = [o for o in report.as_dict()["ops"] if o["op"] == "fp8_norm" and o["fallback_reason"]]
    assert fb and "deferred NormOutput" in fb[0]["fallback_reason"]
    weights = torch.linspace(-1, 1, 32, device=DEV)
    (got.float() * weights).sum().backward()
    ref = x.detach().float().requires_grad_()
    (torch.nn.functional.layer_norm(ref, (32,), g.float(), b.float(), 1e-5) * weights).sum().backward()
    torch.testing.assert_close(x.grad.float(), ref.grad, rtol=0.02, atol=0.02)


def test_tensorwise_scaling_is_refused():
    from megatron_adapt.backends.fp8_scaling import Fp8Recipe, Fp8Scaling

    x, w, _ = inputs(8, 32, torch.float32, rms=True)
    s = Fp8Scaling(Fp8Recipe(format="hybrid", recipe="tensorwise"), device=DEV)
    with pytest.raises(ValueError, match="delayed scaling only"):
        deferred(x, w, None, True)[0].fp8_quantize(E4, True, s, "fwd", 0)


def test_rows_wider_than_the_statistics_kernel_holds_fall_back_and_say_so(monkeypatch):
    """Rows wider than STATS_MAX (held whole in registers): the norm in fp32, then the cast kernel,
    reported; the same fp8 bytes and statistics."""
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w, _ = inputs(24, 48, torch.float32, rms=True)
    y, _, rstd_ref = fp8_norm.norm_reference(x, w, None, 1e-5, True)
    s_ref, s_got = delayed(scale=8.0), delayed(scale=8.0)
    r8, _, _ = fp8._cast_triton(y, E4, True, s_ref.scale["fwd"][0:1], s_ref.amax_history["fwd"][0, 0:1])
    monkeypatch.setattr(fp8_norm, "STATS_MAX", 32)
    d, _, rstd = deferred(x, w, None, True)
    report.reset_op_counts()
    g8, _, _ = d.fp8_quantize(E4, True, s_got, "fwd", 0)
    fb = [o for o in report.as_dict()["ops"] if o["op"] == "fp8_norm" and o["fallback_reason"]]
    assert fb and "rows of 48 elements" in fb[0]["fallback_reason"], fb
    assert torch.equal(g8.view(torch.uint8), r8.view(torch.uint8))
    torch.testing.assert_close(rstd, rstd_ref, rtol=0, atol=0)

"""SwiGLU inside the fp8 casts (backends/cuda/fp8_swiglu.py, op `fp8_swiglu`).

The two Triton kernels run under TRITON_INTERPRET=1 here (on a GPU, natively) and are checked
against SwiGLU (or its backward) in fp32 rounded to bf16 by torch, then the cast kernel
(`fp8._cast_triton`, itself checked against torch's cast in test_cuda_fp8.py, where the
interpreter's own fp8 rounding errors are spelled out). Triton's sigmoid may differ from torch's
by an fp32 ulp, which can move a bf16 rounding: a few elements may be one fp8 step apart. The linear chain fc1 -> fp8_swiglu -> fc2 is checked
against the unfused chain, forward and backward, with the same delayed-scaling state.
"""
import pytest
import torch

from megatron_adapt import report
from megatron_adapt.backends.cuda import fp8, fp8_swiglu
from megatron_adapt.backends.fp8_scaling import Fp8Recipe, Fp8Scaling

from test_cuda_fp8 import DEV, E4, E5

pytestmark = pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")


def delayed(fmt="hybrid", scale=4.0):
    s = Fp8Scaling(Fp8Recipe(format=fmt, recipe="delayed", amax_history_len=4), device=DEV)
    for d in s.scale:
        s.scale[d].fill_(scale)
    return s


def assert_equal_but_a_few_neighbours(got, ref):
    """Under the interpreter (CPU, fp32 inputs only: see skip_bf16_on_cpu) equal, since the
    reference cast kernel makes the same interpreter roundings. On a GPU equal but for at most 2 %
    of elements one fp8 step apart (an ulp of sigmoid moved a bf16 rounding). A wrong formula,
    scale or layout differs almost everywhere, and by more."""
    g, r = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    if DEV == "cpu":
        assert torch.equal(g, r)
        return
    assert bool(((g - r).abs() <= 1).all()), "more than one fp8 step apart"
    assert int((g != r).sum()) <= max(2, g.numel() // 50), int((g != r).sum())


def skip_bf16_on_cpu(dtype):
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates fp32 -> bf16 inside a kernel where torch and the "
                    "GPU round to nearest; bf16 inputs are checked on a GPU, fp32 ones here")


def assert_fused_cast_equals_cast_of(deferred, values, dtype, direction, scale):
    """The deferred tensor's fused cast against the cast kernel on `values` (torch's SwiGLU or its
    backward), each with fresh delayed state at `scale`: the fp8 tensor, its transposed copy, 1/scale
    and the amax recorded (that of the values cast, in x.dtype: to an ulp)."""
    s_ref, s_got = delayed(scale=scale), delayed(scale=scale)
    r8, _, rinv = fp8._cast_triton(values, dtype, True, s_ref.scale[direction][0:1],
                                   s_ref.amax_history[direction][0, 0:1])
    g8, g8t, ginv = deferred.fp8_quantize(dtype, True, s_got, direction, 0)
    assert_equal_but_a_few_neighbours(g8, r8)
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
    assert torch.equal(ginv, rinv)
    torch.testing.assert_close(s_got.amax_history[direction][0, 0], s_ref.amax_history[direction][0, 0],
                               rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("rows,f", [(40, 24), (64, 80), (17, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_cast_kernel_equals_swiglu_then_cast(rows, f, dtype, monkeypatch):
    skip_bf16_on_cpu(dtype)
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    x = (torch.randn(rows, 2 * f) * 3).to(dtype).to(DEV)
    assert fp8._triton_here(x)
    assert_fused_cast_equals_cast_of(fp8_swiglu.SwigluOutput((rows, f), x, x), fp8_swiglu.swiglu_reference(x),
                                     E4, "fwd", 4.0)
    assert report.op_counts()["fp8_swiglu"]["cuda.triton(swiglu + fp8 cast)"] >= 1


@pytest.mark.parametrize("rows,f", [(40, 24), (17, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_grad_cast_kernel_equals_swiglu_backward_then_cast(rows, f, dtype, monkeypatch):
    skip_bf16_on_cpu(dtype)
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(1)
    x = (torch.randn(rows, 2 * f) * 3).to(dtype).to(DEV)
    d = (torch.randn(rows, f) * 0.01).to(dtype).to(DEV)
    g_ref = fp8_swiglu.swiglu_grad_reference(x, d)
    assert_fused_cast_equals_cast_of(fp8_swiglu.SwigluGrad((rows, 2 * f), x, x, d), g_ref, E5, "bwd", 2.0 ** 10)
    # a wrong half (a and b swapped) would not pass: the two halves differ
    assert not torch.equal(g_ref[:, :f], g_ref[:, f:])


@pytest.mark.parametrize("grad", [False, True])
def test_the_one_pass_transposed_copy_equals_the_reloaded_one(grad, monkeypatch):
    """ONE_PASS_INPUTS: the transposed copy as the tile transposed in registers, byte for byte the
    reloaded path's (both outputs, 1/scale, amax). On a GPU at bf16 (the dtype it serves) over many
    tiles; under the interpreter at fp32 (bf16 rounds otherwise there), served for the test."""
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        dtype, (rows, f), served = torch.float32, (40, 24), (torch.float32,)
    else:
        dtype, (rows, f), served = torch.bfloat16, (1000, 776), fp8_swiglu.ONE_PASS_INPUTS
    assert dtype in served
    torch.manual_seed(2)
    x = (torch.randn(rows, 2 * f) * 3).to(dtype).to(DEV)
    d = (torch.randn(rows, f) * 0.01).to(dtype).to(DEV)
    deferred = fp8_swiglu.SwigluGrad((rows, 2 * f), x, x, d) if grad else fp8_swiglu.SwigluOutput((rows, f), x, x)
    fp8_dtype, direction, scale = (E5, "bwd", 2.0 ** 10) if grad else (E4, "fwd", 4.0)
    got = {}
    for one_pass in (True, False):
        monkeypatch.setattr(fp8_swiglu, "ONE_PASS_INPUTS", served if one_pass else ())
        state = delayed(scale=scale)
        g8, g8t, ginv = deferred.fp8_quantize(fp8_dtype, True, state, direction, 0)
        got[one_pass] = [g8.view(torch.uint8), g8t.view(torch.uint8), ginv, state.amax_history[direction][0, 0]]
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
    assert torch.equal(got[True][1], got[True][0].t().contiguous())


class _SwigluRef(torch.autograd.Function):
    """The unfused chain's SwiGLU with the same backward math (fp32, rounded once)."""
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return fp8_swiglu.swiglu_reference(y.reshape(-1, y.shape[-1])).view(*y.shape[:-1], -1)

    @staticmethod
    def backward(ctx, d):
        (y,) = ctx.saved_tensors
        return fp8_swiglu.swiglu_grad_reference(y.reshape(-1, y.shape[-1]), d.reshape(-1, d.shape[-1])).view(y.shape)


@pytest.mark.parametrize("kernels", [False, True])
def test_fc1_swiglu_fc2_chain_equals_the_unfused_chain(kernels, monkeypatch):
    """Forward, dgrad and both wgrads through fp8_linear, the amaxes recorded, and no fallback.
    kernels=False: on CPU the torch path (exact); True: the Triton kernels (interpreted on CPU)."""
    if DEV == "cpu":
        if kernels:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.setattr(fp8, "interpreting", lambda: False)
            monkeypatch.setattr(fp8_swiglu, "_triton_here", lambda t: False)
    elif not kernels:
        pytest.skip("the torch path is the CPU one")
    torch.manual_seed(2)
    x = torch.randn(2, 16, 32).to(torch.bfloat16).to(DEV)
    w1 = (torch.randn(96, 32) * 0.2).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(32, 48) * 0.2).to(torch.bfloat16).to(DEV)
    runs = {}
    report.reset_op_counts()
    for fused in (False, True):
        xs, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
        s1, s2 = delayed(scale=1.0), delayed(scale=1.0)
        y1 = fp8.fp8_linear(xs, a, None, s1)
        h = fp8_swiglu.fp8_swiglu(y1) if fused else _SwigluRef.apply(y1)
        if fused:
            assert type(h).__name__ == "SwigluOutput" and h.shape == (2, 16, 48)
        out = fp8.fp8_linear(h, b, None, s2)
        (out.float() * torch.linspace(-1, 1, 32, device=DEV)).sum().backward()
        runs[fused] = (out.detach(), xs.grad, a.grad, b.grad, s2.amax_history["fwd"][:, 0].clone(),
                       s1.amax_history["bwd"][:, 0].clone())
    counts = report.op_counts()["fp8_swiglu"]
    impl = "cuda.triton" if (kernels or DEV != "cpu") else "torch"
    assert sum(v for k, v in counts.items() if k.startswith(impl)) == 2, counts
    assert not [o for o in report.as_dict()["ops"] if o["op"] == "fp8_swiglu" and o["fallback_reason"]]
    tol = dict(rtol=0, atol=0) if not kernels else dict(rtol=0.07, atol=0.07)
    for got, ref in zip(runs[True], runs[False]):
        scale = ref.float().abs().max().clamp_min(1e-12)
        torch.testing.assert_close(got.float() / scale, ref.float() / scale, **tol)


def test_any_other_use_computes_it_in_bf16_and_says_so():
    torch.manual_seed(3)
    x = torch.randn(8, 32).to(torch.bfloat16).to(DEV).requires_grad_()
    h = fp8_swiglu.fp8_swiglu(x)
    report.reset_op_counts()
    got = h * 1.0   # not an fp8 linear: computed here
    torch.testing.assert_close(got, fp8_swiglu.swiglu_reference(x.detach()), rtol=0, atol=0)
    fb = [o for o in report.as_dict()["ops"] if o["op"] == "fp8_swiglu" and o["fallback_reason"]]
    assert fb and "deferred SwigluOutput" in fb[0]["fallback_reason"]
    got.float().sum().backward()
    a, b = x.detach().float().chunk(2, -1)
    sig = torch.sigmoid(a)
    ref = torch.cat([b * sig * (1 + a * (1 - sig)), a * sig], -1).to(torch.bfloat16)
    torch.testing.assert_close(x.grad, ref, rtol=0, atol=0)


def test_tensorwise_scaling_is_refused():
    x = torch.randn(8, 32).to(DEV)
    s = Fp8Scaling(Fp8Recipe(format="hybrid", recipe="tensorwise"), device=DEV)
    with pytest.raises(ValueError, match="delayed scaling only"):
        fp8_swiglu.SwigluOutput((8, 16), x, x).fp8_quantize(E4, True, s, "fwd", 0)

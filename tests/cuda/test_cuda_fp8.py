"""The cuda backend's fp8 linear (backends/cuda/fp8.py): cast kernel and GEMMs forward, dgrad, wgrad.

Without a GPU: torch 2.13's CPU build has `torch._scaled_mm` for float8_e4m3fn / float8_e5m2 (with
fp32 accumulation), so the op's autograd function runs here as it does on a GPU. Each GEMM is
checked two ways: exactly (to accumulation order) against an explicit emulation (the same fp8
tensors made by casting with torch's float8 dtypes, dequantized, an fp32 matmul), and against the
fp32 product of the unquantized operands at fp8 tolerances.

The Triton cast kernel runs under TRITON_INTERPRET=1. Triton 3.9's interpreter rounds fp32 -> fp8
wrongly in two ways: where rounding carries into the exponent (7.84 -> 4.0 instead of 8.0 in e4m3)
and at exact ties (-10.5 -> -11, half away from zero, where torch and the GPU round to even, -10).
The kernel's output is checked equal to torch's cast everywhere else, and exactly those elements
may differ (on a GPU every element must be equal). The linear tests use torch's cast
on CPU for that reason; on a GPU they run the kernel.
"""
import pytest
import torch

from megatron_adapt import report
from megatron_adapt.backends.cuda import fp8, fp8_wgrad
from megatron_adapt.backends.fp8_scaling import FP8_MAX, Fp8Recipe, Fp8Scaling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def exact_tol(ref, forward):
    """Against the fp32 emulation of the same fp8 operands. On CPU the GEMM is that emulation
    (exact to accumulation order). On a GPU the forward runs cuBLAS's fp8 GEMM with fast
    accumulation, as TE's forward does: Hopper accumulates it at reduced precision (an H100 gave
    3.9e-4 off an fp32 sum of outputs ~0.5), so it gets 2e-3 of the output's scale. dgrad and wgrad
    run without fast accumulation, but Hopper's fp8 tensor cores still keep fewer accumulator bits
    than fp32 (the limit DeepSeek-V3's report describes): an H100 gave 6.5e-5 of the scale, so they
    get 2e-4 of it. A wrong scale or operand is off by the order of the scale itself."""
    scale = ref.abs().max().item()
    if DEV == "cpu":
        return dict(rtol=1e-5, atol=1e-5 * max(scale, 1e-2))
    return dict(rtol=2e-3, atol=2e-3 * scale) if forward else dict(rtol=1e-3, atol=2e-4 * scale)


def cast(x, scale, dtype):
    """Emulated quantization: saturate(x * scale) in fp32, torch's round-to-nearest-even cast."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


def matches_torch_cast(got, ref, prescaled):
    """Equal, or (interpreter only) one of its two known rounding errors: the carry (ref a power of
    two rounded up to, got == ref / 2) and ties (prescaled exactly halfway between ref and got:
    the interpreter rounds half away from zero, torch and the GPU's cvt.rn to even)."""
    g, r = got.float(), ref.float()
    equal = g == r
    if DEV == "cpu" and fp8.interpreting():
        pow2 = (r != 0) & (torch.frexp(r.abs()).mantissa == 0.5)
        carry = pow2 & (g == r / 2) & (prescaled.abs() < r.abs())
        tie = (prescaled - r).abs() == (prescaled - g).abs()
        return bool((equal | carry | tie).all()), int((carry | tie).sum())
    return bool(equal.all()), 0


@pytest.fixture
def torch_cast_on_cpu(monkeypatch):
    """Linear tests: on CPU take torch's cast (exact), not the interpreted Triton kernel."""
    if DEV == "cpu":
        monkeypatch.setattr(fp8, "interpreting", lambda: False)


@pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("shape", [(48, 80), (37, 19), (16, 256)])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
def test_cast_kernel(dtype, shape, src):
    torch.manual_seed(1)
    x = (torch.randn(shape) * 5).to(src).to(DEV)
    x[0, 0] = -37.5   # the amax
    # tensorwise: amax found first, scale = fp8_max / amax in the kernel
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1)
    y, yt, sinv = fp8._cast_triton(x, dtype, True, None, amax)
    scale = FP8_MAX[dtype] / 37.5
    ok, carries = matches_torch_cast(y, cast(x, scale, dtype), x.float() * scale)
    assert ok, "tensorwise cast differs from torch's"
    assert torch.equal(yt.float(), y.float().t())
    torch.testing.assert_close(sinv, torch.tensor([1 / scale], device=DEV, dtype=torch.float32))
    # delayed: the given scale (outliers saturate), amax max-accumulated into the slot
    scale_t = torch.tensor([FP8_MAX[dtype] / 10.0], device=DEV)
    slot = torch.tensor([3.0], device=DEV)
    y, none, sinv = fp8._cast_triton(x, dtype, False, scale_t, slot)
    assert none is None and slot.item() == 37.5
    ok, _ = matches_torch_cast(y, cast(x, scale_t, dtype), x.float() * scale_t)
    assert ok and y.float().abs().max().item() == FP8_MAX[dtype]   # saturated, never NaN
    torch.testing.assert_close(sinv, 1 / scale_t)


def _reference(x, w, dy, recipe: Fp8Recipe):
    """Emulated fp8 GEMMs with current scaling (fp32 matmuls of dequantized fp8 tensors)."""
    def q(t, dtype):
        s = FP8_MAX[dtype] / t.float().abs().max()
        return cast(t, s, dtype).float() / s
    xq, wq, dyq = q(x, recipe.fwd_dtype), q(w, recipe.fwd_dtype), q(dy, recipe.bwd_dtype)
    return xq @ wq.t(), dyq @ wq, dyq.t() @ xq


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_tensorwise_forward_dgrad_wgrad(torch_cast_on_cpu, fmt, dtype, bias):
    torch.manual_seed(2)
    T, K, N = 64, 96, 48
    x = torch.randn(2, T // 2, K, device=DEV).to(dtype).requires_grad_()
    w = (torch.randn(N, K, device=DEV) * 0.05).to(dtype).requires_grad_()
    b = torch.randn(N, device=DEV).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(2, T // 2, N, device=DEV).to(dtype)
    recipe = Fp8Recipe(fmt, "tensorwise")
    y = fp8.fp8_linear(x, w, b, Fp8Scaling(recipe, DEV))
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    x2, dy2 = x.detach().reshape(T, K), dy.reshape(T, N)
    y_e, dx_e, dw_e = _reference(x2, w.detach(), dy2, recipe)
    if bias:
        y_e = y_e + b.detach().float()
        torch.testing.assert_close(b.grad.float(), dy2.float().sum(0), rtol=1e-2, atol=1e-2)
    # exact to accumulation order (and the output dtype's rounding) against the emulation
    bf16 = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else None
    torch.testing.assert_close(y.reshape(T, N).float(), y_e, **(bf16 or exact_tol(y_e, True)))
    torch.testing.assert_close(x.grad.reshape(T, K).float(), dx_e, **(bf16 or exact_tol(dx_e, False)))
    torch.testing.assert_close(w.grad.float(), dw_e, **(bf16 or exact_tol(dw_e, False)))
    # and within fp8's error of the fp32 product: e4m3 ~2^-4 per element, e5m2 ~2^-3
    xf, wf, dyf = x2.float(), w.detach().float(), dy2.float()

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()
    y_ref = xf @ wf.t() + (b.detach().float() if bias else 0)
    assert rel(y.reshape(T, N), y_ref) < 0.05
    grad_tol = 0.10 if fmt == "hybrid" else 0.05
    assert 1e-4 < rel(x.grad.reshape(T, K), dyf @ wf) < grad_tol   # > 1e-4: really quantized
    assert 1e-4 < rel(w.grad, dyf.t() @ xf) < grad_tol


def test_e4m3_format_casts_gradients_to_e4m3_hybrid_to_e5m2(torch_cast_on_cpu, monkeypatch):
    seen = []
    real = fp8.quantize

    def spy(x, dtype, *a, **k):
        seen.append(dtype)
        return real(x, dtype, *a, **k)
    monkeypatch.setattr(fp8, "quantize", spy)
    x = torch.randn(32, 32, device=DEV, requires_grad=True)
    w = torch.randn(16, 32, device=DEV, requires_grad=True)
    for fmt, grad_dtype in (("e4m3", E4), ("hybrid", E5)):
        seen.clear()
        fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(fmt), DEV)).sum().backward()
        assert seen == [E4, E4, grad_dtype], (fmt, seen)


def test_linear_delayed_uses_history_scales_and_updates_them(torch_cast_on_cpu):
    """Step 1 casts with scale 1 (no history yet) and records amaxes; step 2 casts with
    fp8_max / amax of step 1; the result equals the emulation with exactly those scales."""
    torch.manual_seed(3)
    x = (torch.randn(32, 64, device=DEV) * 0.01).requires_grad_()
    w = (torch.randn(32, 64, device=DEV) * 0.02).requires_grad_()
    dy = torch.randn(32, 32, device=DEV) * 1e-3
    state = Fp8Scaling(Fp8Recipe("hybrid", "delayed", amax_history_len=2, amax_compute_algo="max"), DEV)
    fp8.fp8_linear(x, w, None, state).backward(dy)
    ax, aw, ag = x.detach().abs().max(), w.detach().abs().max(), dy.abs().max()
    assert torch.equal(state.amax_history["fwd"][1], torch.stack([ax, aw]))
    assert torch.equal(state.amax_history["bwd"][1], ag.reshape(1))
    sx, sw, sg = 448.0 / ax, 448.0 / aw, 57344.0 / ag
    torch.testing.assert_close(state.scale["fwd"], torch.stack([sx, sw]))
    x.grad = w.grad = None
    y = fp8.fp8_linear(x, w, None, state)
    y.backward(dy)
    xq = cast(x.detach(), sx, E4).float() / sx
    wq = cast(w.detach(), sw, E4).float() / sw
    dyq = cast(dy, sg, E5).float() / sg
    y_e, dx_e, dw_e = xq @ wq.t(), dyq @ wq, dyq.t() @ xq
    torch.testing.assert_close(y, y_e, **exact_tol(y_e, True))
    torch.testing.assert_close(x.grad, dx_e, **exact_tol(dx_e, False))
    torch.testing.assert_close(w.grad, dw_e, **exact_tol(dw_e, False))


def test_wgrad_sink_gets_fp32_and_its_return_is_the_grad(torch_cast_on_cpu):
    x = torch.randn(32, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    main_grad = torch.ones(16, 32, device=DEV)
    got = []

    def sink(dw):
        got.append(dw.dtype)
        main_grad.add_(dw)
        return torch.zeros_like(w)
    fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(), DEV), sink).float().sum().backward()
    assert got == [torch.float32] and torch.equal(w.grad, torch.zeros_like(w))
    x.grad = None
    w2 = w.detach().clone().requires_grad_()
    fp8.fp8_linear(x, w2, None, Fp8Scaling(Fp8Recipe(), DEV)).float().sum().backward()
    torch.testing.assert_close(main_grad - 1, w2.grad.float(), rtol=1e-2, atol=1e-2)


def _nvmath_or_skip():
    if DEV != "cuda":
        pytest.skip("cuBLASLt's in-place accumulation runs on a GPU")
    if fp8_wgrad.unavailable():
        pytest.skip(fp8_wgrad.unavailable())


@pytest.mark.parametrize("m,n,k", [(48, 32, 96), (16, 64, 80), (272, 400, 1040)])
def test_wgrad_accumulate_adds_the_scaled_fp8_product_into_fp32(m, n, k):
    """cuBLASLt with beta = 1 in place (nvmath-python): c += sa * sb * a @ b^T, against the fp32
    product of the same fp8 operands; a second shape-equal call reuses the plan with new operands."""
    _nvmath_or_skip()
    torch.manual_seed(7)
    fp8_wgrad._plans.clear()
    for _ in range(2):
        a = (torch.randn(m, k, device=DEV) * 4).to(E5)
        b = (torch.randn(n, k, device=DEV) * 40).to(E4)
        sa, sb = torch.tensor([0.25], device=DEV), torch.tensor([0.01], device=DEV)
        c = torch.randn(m, n, device=DEV)
        ref = c + (a.float() @ b.float().t()) * 0.0025
        fp8_wgrad.accumulate(c, a, b, sa, sb)
        torch.testing.assert_close(c, ref, **exact_tol(ref - ref.mean(), forward=False))


def test_wgrad_accumulate_replays_in_a_cuda_graph():
    _nvmath_or_skip()
    a = torch.randn(64, 128, device=DEV).to(E5)
    b = torch.randn(32, 128, device=DEV).to(E4)
    s = torch.ones(1, device=DEV)
    c = torch.zeros(64, 32, device=DEV)
    fp8_wgrad.accumulate(c, a, b, s, s)    # planned outside the capture, as Megatron's warm-up runs do
    c.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_wgrad.accumulate(c, a, b, s, s)
    c.zero_()
    graph.replay()
    graph.replay()
    ref = 2 * (a.float() @ b.float().t())
    torch.testing.assert_close(c, ref, **exact_tol(ref, forward=False))


def test_in_place_runs_at_a_shapes_first_eager_call_and_inside_captures():
    """Eager calls after a shape's first keep _scaled_mm + add_ (less host time: eager fp8 waits on
    the host); the first call plans; a capture runs the plan."""
    _nvmath_or_skip()
    fp8_wgrad._plans.clear()
    a, b = torch.randn(32, 64, device=DEV).to(E5), torch.randn(16, 64, device=DEV).to(E4)
    c, s = torch.zeros(32, 16, device=DEV), torch.ones(1, device=DEV)
    assert fp8_wgrad.why_not(c, a, b) is None
    fp8_wgrad.accumulate(c, a, b, s, s)
    assert fp8_wgrad.why_not(c, a, b) is fp8_wgrad.EAGER
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert fp8_wgrad.why_not(c, a, b) is None
        fresh = fp8_wgrad.why_not(torch.zeros(48, 16, device=DEV), a.new_zeros(48, 64), b)
    assert "first call inside a CUDA-graph capture" in fresh


def test_wgrad_accumulate_is_refused_for_what_it_cannot_take():
    a, b = torch.zeros(32, 64).to(E5), torch.zeros(16, 64).to(E4)
    assert "cpu" in fp8_wgrad.why_not(torch.zeros(32, 16), a, b)
    if DEV == "cuda":
        a, b = a.cuda(), b.cuda()
        assert "bfloat16" in fp8_wgrad.why_not(torch.zeros(32, 16, device=DEV, dtype=torch.bfloat16), a, b)
        assert "contiguous" in fp8_wgrad.why_not(torch.zeros(16, 32, device=DEV).t(), a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_wgrad_accumulates_into_the_sinks_main_grad_in_the_gemm(recipe, monkeypatch, torch_cast_on_cpu):
    """A sink that exposes main_grad (Megatron's gradient-accumulation fusion, patches/fp8.py) gets
    the wgrad added by the GEMM itself and is called with None; main_grad then equals the add path's
    (a sink without the attribute: fp32 dW from cuBLASLt, added by the sink). On CPU the in-place
    GEMM is stood in for by the same math, to check the protocol; on a GPU it is cuBLASLt's."""
    monkeypatch.setattr(fp8_wgrad, "_plans", {})
    if DEV == "cpu":
        monkeypatch.setattr(fp8_wgrad, "why_not", lambda c, a, b: None)
        monkeypatch.setattr(fp8_wgrad, "accumulate",
                            lambda c, a, b, sa, sb: c.add_((a.float() @ b.float().t()) * (sa * sb)))
    else:
        _nvmath_or_skip()
    torch.manual_seed(8)
    x = torch.randn(64, 48, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(32, 48, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(64, 32, device=DEV, dtype=torch.bfloat16)
    grads, calls = [], []
    report.reset_op_counts()
    for fused in (True, False):
        main_grad = torch.full((32, 48), 0.5, device=DEV)

        def sink(dw, main_grad=main_grad):
            calls.append(dw is None)
            if dw is not None:
                main_grad.add_(dw)
            return torch.zeros(main_grad.shape, dtype=torch.bfloat16, device=DEV)
        if fused:
            sink.main_grad = main_grad
        wi = w.clone().requires_grad_()
        scaling = Fp8Scaling(Fp8Recipe(recipe=recipe), DEV)
        fp8.fp8_linear(x.clone().requires_grad_(), wi, None, scaling, sink).backward(dy)
        grads.append(main_grad)
        assert torch.equal(wi.grad, torch.zeros_like(wi))
    assert calls == [True, False]
    assert report.op_counts()["fp8_wgrad"] == {"cuda.cublaslt(beta=1, nvmath)": 1}
    torch.testing.assert_close(grads[0], grads[1], **exact_tol(grads[1] - 0.5, forward=False))
    assert not torch.equal(grads[0], torch.full_like(grads[0], 0.5))


def test_fp8_wgrad_off_keeps_wgrad_in_high_precision(torch_cast_on_cpu):
    torch.manual_seed(4)
    x = torch.randn(32, 32, device=DEV, requires_grad=True)
    w = torch.randn(16, 32, device=DEV, requires_grad=True)
    dy = torch.randn(32, 16, device=DEV)
    fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(wgrad=False), DEV)).backward(dy)
    torch.testing.assert_close(w.grad, dy.t() @ x.detach(), rtol=1e-5, atol=1e-5)


def test_odd_shapes_fall_back_reported_and_strict_raises(torch_cast_on_cpu, monkeypatch):
    x = torch.randn(30, 32, device=DEV, requires_grad=True)
    w = torch.randn(16, 32, device=DEV, requires_grad=True)
    y = fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(), DEV))
    torch.testing.assert_close(y, x.detach() @ w.detach().t())
    fb = [o for o in report.as_dict()["ops"] if o["op"] == "fp8_linear" and o["fallback_reason"]]
    assert fb and "multiples of 16: tokens=30" in fb[-1]["fallback_reason"], fb
    monkeypatch.setattr(report, "_strict", True)
    with pytest.raises(Exception, match="StrictFallback|MEGATRON_ADAPT_STRICT"):
        fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(), DEV))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a CUDA device")
def test_fp8_unavailable_without_a_gpu():
    assert fp8.fp8_unavailable() == "no CUDA device is visible"


# ---- blockwise (TE's Float8BlockScaling): 1 x 128 runs and 128 x 128 weight blocks ---------------

def _blockwise_capable():
    if DEV == "cuda" and fp8.fp8_unavailable("blockwise") is not None:
        pytest.skip(fp8.fp8_unavailable("blockwise"))


@pytest.mark.parametrize("dtype", [E4, E5])
def test_blockwise_quantizers_scale_each_run_and_block(torch_cast_on_cpu, dtype):
    """Every 1 x 128 run (and 128 x 128 block) gets its own scale: its largest element lands on the
    format's maximum, and runs 1e6 apart in magnitude both keep fp8's relative precision. The 1 x 128
    scales are laid out rows-contiguous, as cuBLASLt reads them."""
    torch.manual_seed(7)
    x = torch.randn(256, 384, device=DEV)
    x[:, :128] *= 1e-3
    x[:, 256:] *= 1e3
    q, s = fp8.quantize_runs(x, dtype)
    assert s.shape == (256, 3) and s.stride() == (1, 256), (s.shape, s.stride())
    qt, _ = fp8.quantize_runs(x.t(), dtype)           # a transposed view in: row-major fp8 out
    assert qt.is_contiguous(), qt.stride()            # (cuBLASLt takes row-major x column-major only)
    top = q.float().view(256, 3, 128).abs().amax(-1)
    assert torch.equal(top, torch.full_like(top, FP8_MAX[dtype]))
    back = (q.float().view(256, 3, 128) * s[..., None]).view(256, 384)
    bound = 0.07 if dtype == E4 else 0.13          # half an ulp (2^-4 / 2^-3) plus subnormals
    for c in range(3):
        part = slice(128 * c, 128 * (c + 1))
        assert ((back[:, part] - x[:, part]).norm() / x[:, part].norm()) < bound / 2
    w = torch.randn(256, 384, device=DEV)
    w[128:, 128:256] *= 1e-4
    wq, ws = fp8.quantize_blocks(w, dtype)
    assert ws.shape == (2, 3)
    blocks = wq.float().view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert torch.equal(blocks, torch.full_like(blocks, FP8_MAX[dtype]))
    torch.testing.assert_close(ws[1, 1], w[128:, 128:256].abs().max() / FP8_MAX[dtype], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_linear_blockwise_forward_dgrad_wgrad(torch_cast_on_cpu, fmt):
    """fp8_linear with --fp8-recipe blockwise against fp32 at fp8 tolerances; an input whose
    columns span 1e6 in magnitude keeps its small columns' weight gradient (a per-tensor scale
    flushes them to zero: tensorwise gives a relative error of 1.0 there)."""
    _blockwise_capable()
    torch.manual_seed(8)
    x = torch.randn(2, 256, 512, device=DEV, dtype=torch.bfloat16)
    x[..., :128] *= 1e-6       # a per-tensor scale flushes these to zero (wgrad error 1.0)
    x.requires_grad_()
    w = (torch.randn(512, 512, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(2, 256, 512, device=DEV, dtype=torch.bfloat16)
    sink_got = []
    y = fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(format=fmt, recipe="blockwise"), DEV),
                       lambda dw: sink_got.append(dw) or None)
    y.backward(dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (xf @ wf.t()).backward(dy.float())
    rel = lambda a, b: float((a.detach().float() - b).norm() / b.norm())   # noqa: E731
    grad_bound = 0.08 if fmt == "hybrid" else 0.05                  # e5m2 gradients in hybrid
    assert rel(y, xf.detach() @ wf.detach().t()) < 0.05
    assert rel(x.grad, xf.grad) < grad_bound
    assert rel(x.grad[..., :128], xf.grad[..., :128]) < grad_bound   # dgrad is along out: every column
    (dw,) = sink_got
    assert dw.dtype == torch.float32 and rel(dw, wf.grad) < grad_bound
    small = wf.grad[:, :128]          # the weight gradient's columns fed by the 1e-6 inputs
    assert rel(dw[:, :128], small) < grad_bound, "per-run scales keep the small inputs' wgrad"
    assert "cpu.scaled_mm(%s, blockwise)" % fmt in str(report.op_counts()) or DEV == "cuda"


@pytest.mark.skipif(DEV == "cpu", reason="on CPU the block-scaled GEMM is this emulation itself "
                    "(torch's CPU _scaled_mm takes no block scales); the GPU checks cuBLASLt's")
def test_blockwise_gemms_equal_the_emulation_on_the_gpu():
    """cuBLASLt's block-scaled GEMMs read the scale layouts as meant: each of the three pairings
    against the fp32 product of the same dequantized fp8 operands."""
    _blockwise_capable()
    torch.manual_seed(9)
    m, k, n = 1024, 512, 1536
    x, w, dy = torch.randn(m, k, device=DEV), torch.randn(n, k, device=DEV), torch.randn(m, n, device=DEV)
    x8, sx = fp8.quantize_runs(x, E4)
    w8, sw = fp8.quantize_blocks(w, E4)
    dy8, sdy = fp8.quantize_runs(dy, E5)
    xt8, sxt = fp8.quantize_runs(x.t(), E4)
    dyt8, sdyt = fp8.quantize_runs(dy.t(), E5)
    w8t = w8.t().contiguous()
    for name, a, sa, b, sb, out in (("forward", x8, sx, w8, sw, torch.bfloat16),
                                    ("dgrad", dy8, sdy, w8t, sw.t(), torch.bfloat16),
                                    ("wgrad", dyt8, sdyt, xt8, sxt, torch.float32)):
        got = fp8._block_gemm(a, sa, b, sb, out).float()
        ref = fp8._dequant(a, sa) @ fp8._dequant(b, sb).t()
        err = float((got - ref).norm() / ref.norm())
        assert err < (5e-3 if out == torch.bfloat16 else 1e-3), (name, err)


def test_blockwise_needs_multiples_of_512_else_reported_fallback(torch_cast_on_cpu):
    report.reset_op_counts()
    x = torch.randn(256, 384, device=DEV, requires_grad=True)
    w = torch.randn(512, 384, device=DEV, requires_grad=True)
    fp8.fp8_linear(x, w, None, Fp8Scaling(Fp8Recipe(recipe="blockwise"), DEV))
    fb = [o for o in report.as_dict()["ops"] if o["op"] == "fp8_linear" and o["fallback_reason"]]
    assert fb and "multiples of 512: tokens=256, in_features=384" in fb[-1]["fallback_reason"], fb


@pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("layout", ["rows", "transposed view", "blocks"])
def test_blockwise_kernels_equal_the_pytorch_quantizers(dtype, layout, monkeypatch):
    """The one-pass Triton quantizers (1 x 128 runs, read through a transposed view's strides, and
    128 x 128 blocks) against the same math in PyTorch: the same scales, and every fp8 element equal
    to torch's cast (under the interpreter, but for its two known rounding errors)."""
    from megatron_adapt.backends.fp8_scaling import current_scale

    if DEV == "cpu" and not fp8.interpreting():
        pytest.skip("the kernels run on a GPU or under TRITON_INTERPRET=1")
    torch.manual_seed(11)
    x = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    x[:, :128] *= 1e-6
    src = x.t() if layout == "transposed view" else x
    quantize = fp8.quantize_blocks if layout == "blocks" else fp8.quantize_runs
    q, s = quantize(src, dtype)
    monkeypatch.setattr(fp8, "_triton_here", lambda t: False)
    q_ref, s_ref = quantize(src, dtype)
    assert s.shape == s_ref.shape and s.stride() == s_ref.stride() and q.is_contiguous()
    torch.testing.assert_close(s, s_ref, rtol=5e-7, atol=0)
    r, c = src.shape
    if layout == "blocks":
        t = src.float().view(r // 128, 128, c // 128, 128)
        prescaled = (t * current_scale(t.abs().amax(dim=(1, 3)), FP8_MAX[dtype])[:, None, :, None]).view(r, c)
    else:
        t = src.float().contiguous().view(r, c // 128, 128)
        prescaled = (t * current_scale(t.abs().amax(-1), FP8_MAX[dtype])[..., None]).view(r, c)
    got, ref = q.float(), q_ref.float()
    if DEV == "cuda":
        # the kernel's scale can sit an ulp from torch's (scales within 5e-7 above): at elements a
        # hair from a rounding tie that moves one fp8 step (an H200: 8-12 of 131072); no other difference
        step = torch.where(ref != 0, ref.abs() * (2.0 ** -2 if dtype == E5 else 2.0 ** -3), torch.full_like(ref, 2.0 ** -9))
        assert ((got - ref).abs() <= step).all() and (got != ref).float().mean() < 1e-3, int((got != ref).sum())
        return
    # the interpreter rounds fp32 -> fp8 wrongly at carries (e.g. 123.9 -> 64, a few % of these
    # elements), ties and in the subnormals (module doc): there most elements are equal; a wrong
    # scale, layout or stride would leave almost none equal
    assert (got == ref).float().mean() > 0.9, float((got == ref).float().mean())


# ---------------------------------------------------------------- grouped (MoE experts)
def _grouped_reference(x, w, sizes, dy):
    """fp32 per-expert products and their gradients (experts with no rows: zero weight gradient)."""
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    y = torch.cat([xr[a:b] @ wr[e].t() for e, (a, b) in enumerate(zip(ends, ends[1:]))])
    y.backward(dy.float())
    return y, xr.grad, wr.grad


def _grouped_capable():
    if DEV == "cuda" and fp8.grouped_unavailable() is not None:
        pytest.skip(fp8.grouped_unavailable())


@pytest.mark.parametrize("sizes", [[32, 0, 48, 16], [64, 64, 64, 64], [16, 112, 0, 0]])
@pytest.mark.parametrize("wgrad", [True, False])
def test_grouped_forward_dgrad_wgrad(torch_cast_on_cpu, sizes, wgrad):
    """The experts' fp8 grouped linear against the fp32 product per expert: forward, dgrad and wgrad
    within e4m3's error with a scale per row, empty experts' weight gradients exactly zero, and
    --no-fp8-wgrad keeping the weight gradient in bf16 (nearer the reference)."""
    _grouped_capable()
    torch.manual_seed(5)
    e, n, k = len(sizes), 96, 128
    x = torch.randn(sum(sizes), k, device=DEV).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(e, n, k, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    report.reset_op_counts()
    y = fp8.fp8_grouped_gemm(x, w, sizes, Fp8Recipe(wgrad=wgrad))
    assert y.dtype == torch.bfloat16 and y.shape == (sum(sizes), n)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dxr, dwr = _grouped_reference(x, w, sizes, dy)
    rel = lambda a, b: float((a.detach().float() - b.detach()).norm() / b.detach().norm())  # noqa: E731
    assert rel(y, yr) < 0.05 and rel(x.grad, dxr) < 0.05, (rel(y, yr), rel(x.grad, dxr))
    assert rel(w.grad, dwr) < (0.05 if wgrad else 0.01), rel(w.grad, dwr)
    for i, size in enumerate(sizes):
        if size == 0:
            assert not w.grad[i].any()
    impls = report.op_counts()["fp8_grouped_gemm"]
    assert list(impls) == [f"{DEV}.scaled_grouped_mm(e4m3, rowwise; recipe tensorwise read as rowwise)"], impls


def test_grouped_operands_equal_the_emulation(torch_cast_on_cpu):
    """Each of the three grouped GEMMs (on a GPU: torch._scaled_grouped_mm, CUTLASS) against the
    fp32 product of the same dequantized operands: the scale layouts read as meant (per row, per
    (expert, output channel), per (expert, column) over the expert's tokens)."""
    _grouped_capable()
    torch.manual_seed(6)
    sizes, n, k = [48, 16, 0, 64], 160, 256
    e, t = len(sizes), sum(sizes)
    offs = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
    groups = torch.repeat_interleave(torch.arange(e, device=DEV), torch.tensor(sizes, device=DEV))
    x, dy = torch.randn(t, k, device=DEV), torch.randn(t, n, device=DEV)
    w = torch.randn(e, n, k, device=DEV)
    x8, sx = fp8.quantize_rowwise(x, E4)
    w8, sw = fp8.quantize_rowwise(w, E4)
    got = fp8._grouped_scaled_mm(x8, w8.transpose(-2, -1), sx, sw, offs, torch.bfloat16, True).float()
    deq_x, deq_w = x8.float() * sx[:, None], w8.float() * sw[..., None]
    ref = torch.cat([deq_x[groups == i] @ deq_w[i].t() for i in range(e)])
    assert float((got - ref).norm() / ref.norm()) < 5e-3
    dyt8, sdyt = fp8.quantize_group_columns(dy, groups, e, E4)
    xt8, sxt = fp8.quantize_group_columns(x, groups, e, E4)
    got = fp8._grouped_scaled_mm(dyt8, xt8.t(), sdyt, sxt, offs, torch.bfloat16, False).float()
    deq_dy = dyt8.float().t() * sdyt.view(e, n)[groups]
    deq_x = xt8.float().t() * sxt.view(e, k)[groups]
    ref = torch.stack([deq_dy[groups == i].t() @ deq_x[groups == i] for i in range(e)])
    assert float((got - ref).norm() / ref.norm()) < 5e-3
    assert not got[2].any()


def test_grouped_unaligned_rows_fall_back_reported():
    """Megatron pads every expert's rows to 16 under fp8 (Fp8Padding); rows that are not padded
    run the bf16 grouped GEMM, reported with the reason."""
    report.reset_op_counts()
    x = torch.randn(40, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 32, 64, device=DEV, dtype=torch.bfloat16)
    fp8.fp8_grouped_gemm(x, w, [24, 16], Fp8Recipe())
    fb = [o for o in report.as_dict()["ops"] if o["op"] == "fp8_grouped_gemm" and o["fallback_reason"]]
    assert fb and "expert row counts [24] not multiples of 16" in fb[-1]["fallback_reason"], fb


def _grouped_inputs(seed, sizes, n, k):
    """x [T, k] and the stacked weight w [E, n, k] (both bf16, requiring grad) and dy [T, n] for a
    grouped-linear test, drawn in that order after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    x = torch.randn(sum(sizes), k, device=DEV).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(len(sizes), n, k, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(sum(sizes), n, device=DEV).to(torch.bfloat16)
    return x, w, dy


def _stand_in_for_cublaslt(monkeypatch):
    """On CPU: the in-place per-expert path taken, its GEMM the same math (the protocol is tested)."""
    monkeypatch.setattr(fp8_wgrad, "experts_why_not", lambda gemms, static_sizes: None)
    monkeypatch.setattr(fp8_wgrad, "accumulate",
                        lambda c, a, b, sa, sb: c.add_((a.float() @ b.float().t()) * (sa * sb)))


def _wgrad_paths():
    return {k: v for k, v in report.op_counts().get("fp8_wgrad", {}).items() if k.startswith("experts")}


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_row_amaxes_give_the_per_expert_cast_bit_for_bit(path, monkeypatch):
    """The rowwise cast's row amaxes (quantize_rowwise(..., row_amax=True), the forward's x and the
    dgrad's dy) stand in for the per-expert amax launch of the wgrad's cast: the same fp8 tensor and
    scales to the bit, long rows (the two-pass kernel) too; the row amaxes equal |t|.amax(-1)."""
    if path == "triton" and (fp8.triton is None or (DEV == "cpu" and not fp8.interpreting())):
        pytest.skip("the Triton kernels run on CPU under TRITON_INTERPRET=1 only")
    if path == "torch":
        monkeypatch.setattr(fp8, "triton", None)
    torch.manual_seed(12)
    for sizes, c in (([40, 0, 16, 24], 80), ([3, 0, 2], fp8.ROWS_IN_ONE_READ + 48)):
        ends = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
        groups = torch.repeat_interleave(torch.arange(len(sizes), device=DEV), torch.tensor(sizes, device=DEV))
        x = torch.randn(sum(sizes), c, device=DEV, dtype=torch.bfloat16) * 3
        x[3, 5] = -70.0                                       # one expert's amax from one element
        x8, sx, amax = fp8.quantize_rowwise(x, E4, row_amax=True)
        assert torch.equal(amax, x.float().abs().amax(-1))
        assert all(torch.equal(a, b) for a, b in zip((x8, sx), fp8.quantize_rowwise(x, E4)))
        if c > 80:   # the long rows' kernel checked above; the column cast does not depend on row length
            continue
        got = fp8.quantize_group_columns(x, groups, len(sizes), E4, ends, True, amax)
        ref = fp8.quantize_group_columns(x, groups, len(sizes), E4, ends, True)
        assert torch.equal(got[0].float(), ref[0].float()) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("in_place", [False, True])
def test_grouped_fp8_wgrad_goes_into_the_experts_main_grads(torch_cast_on_cpu, monkeypatch, in_place):
    """Given main_grads (Megatron's gradient-accumulation fusion), each expert's fp8 wgrad is added
    into its fp32 main_grad: by one cuBLASLt GEMM per expert with beta = 1 (in place), or by the
    grouped GEMM's bf16 dW and one _foreach_add_. Either equals the dW of the call without
    main_grads (the same per-expert-scaled operands; in place skips dW's bf16 rounding), an empty
    expert's main_grad is untouched, and w's gradient is only a placeholder of its shape. On CPU the
    in-place GEMM is stood in for by the same math; on a GPU it is cuBLASLt's, planned at this eager
    call because the sizes are static."""
    _grouped_capable()
    monkeypatch.setattr(fp8_wgrad, "_plans", {})
    if in_place and DEV == "cpu":
        _stand_in_for_cublaslt(monkeypatch)
    elif in_place:
        _nvmath_or_skip()
    sizes, n, k = [32, 0, 48, 16], 64, 96
    x, w, dy = _grouped_inputs(9, sizes, n, k)
    y = fp8.fp8_grouped_gemm(x, w, sizes, Fp8Recipe())
    y.backward(dy)
    ref = w.grad.float()
    main_grads = [torch.full((n, k), 0.5, device=DEV) for _ in sizes]
    w2 = w.detach().clone().requires_grad_()
    report.reset_op_counts()
    y2 = fp8.fp8_grouped_gemm(x, w2, sizes, Fp8Recipe(), main_grads=main_grads, static_sizes=in_place)
    assert torch.equal(y2, y)
    y2.backward(dy)
    assert w2.grad.shape == w.shape
    got = torch.stack(main_grads) - 0.5
    assert torch.equal(main_grads[1], torch.full((n, k), 0.5, device=DEV))
    if in_place:
        assert _wgrad_paths() == {"experts: cuda.cublaslt(beta=1, nvmath) per expert": 1}, _wgrad_paths()
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    else:
        why = "tensors on cpu" if DEV == "cpu" else "eager, dropless"
        assert _wgrad_paths() == {f"experts: {DEV}.scaled_grouped_mm+main_grad._foreach_add_ ({why})": 1}
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    assert got.abs().sum() > 0


@pytest.mark.parametrize("case", ["no fp8 wgrad", "bf16 fallback"])
def test_grouped_high_precision_wgrad_goes_into_the_experts_main_grads(torch_cast_on_cpu, case):
    """main_grads' protocol holds off the fp8 wgrad path too: --no-fp8-wgrad's bf16 dW, and the
    bf16 grouped GEMM of a call that falls back (rows not padded to 16), are added into them."""
    _grouped_capable()
    torch.manual_seed(10)
    sizes, n, k = ([32, 16], 48, 64) if case == "no fp8 wgrad" else ([24, 16], 48, 64)
    x = torch.randn(sum(sizes), k, device=DEV).to(torch.bfloat16)
    w = (torch.randn(len(sizes), n, k, device=DEV) * 0.05).to(torch.bfloat16)
    dy = torch.randn(sum(sizes), n, device=DEV).to(torch.bfloat16)
    recipe = Fp8Recipe(wgrad=case != "no fp8 wgrad")
    w1 = w.clone().requires_grad_()
    fp8.fp8_grouped_gemm(x, w1, sizes, recipe).backward(dy)
    main_grads = [torch.zeros(n, k, device=DEV) for _ in sizes]
    w2 = w.clone().requires_grad_()
    fp8.fp8_grouped_gemm(x, w2, sizes, recipe, main_grads=main_grads).backward(dy)
    torch.testing.assert_close(torch.stack(main_grads), w1.grad.float(), rtol=0, atol=0)
    assert w1.grad.abs().sum() > 0


@pytest.mark.skipif(DEV == "cpu", reason="captures a CUDA graph")
def test_grouped_fp8_wgrad_in_place_per_expert_replays_in_a_cuda_graph():
    """Inside a capture (planned at the eager warm-up call, as Megatron's warm-up runs make it) the
    per-expert in-place GEMMs are recorded and each replay adds once more; an eager call after the
    plan takes the grouped GEMM + _foreach_add_ (less host time), equal within dW's bf16 rounding."""
    _grouped_capable()
    _nvmath_or_skip()
    fp8_wgrad._plans.clear()
    torch.manual_seed(11)
    sizes, n, k = [64, 64, 64, 64], 128, 256
    offs = fp8.group_offsets(sizes, DEV)
    groups = torch.repeat_interleave(torch.arange(4, device=DEV), torch.tensor(sizes, device=DEV))
    dyt8, sdyt = fp8.quantize_group_columns(torch.randn(256, n, device=DEV), groups, 4, E4, offs, per_group=True)
    xt8, sxt = fp8.quantize_group_columns(torch.randn(256, k, device=DEV), groups, 4, E4, offs, per_group=True)
    main_grads = [torch.zeros(n, k, device=DEV) for _ in sizes]
    run = lambda: fp8._experts_wgrad_into_main_grads(main_grads, dyt8, xt8, sdyt, sxt, offs, sizes, True)  # noqa: E731
    report.reset_op_counts()
    run()                                   # eager, first: plans and runs in place
    once = torch.stack(main_grads).clone()
    run()                                   # eager, planned: grouped GEMM + _foreach_add_
    torch.testing.assert_close(torch.stack(main_grads), 2 * once, rtol=1e-2, atol=1e-2 * once.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for mg in main_grads:
        mg.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.stack(main_grads), 2 * once, rtol=1e-5, atol=1e-5 * once.abs().max().item())
    paths = _wgrad_paths()
    assert paths["experts: cuda.cublaslt(beta=1, nvmath) per expert"] == 2, paths
    assert paths["experts: cuda.scaled_grouped_mm+main_grad._foreach_add_ (eager)"] == 1, paths


@pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("which", ["rows", "long rows", "group columns", "group columns per expert",
                                   "group columns per expert, from row amaxes", "weight columns"])
def test_grouped_quantizer_kernels_equal_the_pytorch_quantizers(which, monkeypatch):
    """The Triton quantizers of the grouped linear against the same math in PyTorch: the same
    scales (to an ulp of the reciprocal), every fp8 element equal to torch's cast (under the
    interpreter, but for its two known rounding errors)."""
    if DEV == "cpu" and not fp8.interpreting():
        pytest.skip("the kernels run on CPU under TRITON_INTERPRET=1 only")
    torch.manual_seed(8)
    sizes, c = [40, 0, 17, 64], 80
    x = torch.randn(sum(sizes), c, device=DEV, dtype=torch.bfloat16) * 3
    ends = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
    groups = torch.repeat_interleave(torch.arange(len(sizes), device=DEV), torch.tensor(sizes, device=DEV))
    w = torch.randn(3, 48, c, device=DEV, dtype=torch.bfloat16)
    long_rows = torch.randn(5, fp8.ROWS_IN_ONE_READ + 48, device=DEV, dtype=torch.bfloat16)
    run = {"rows": lambda: fp8.quantize_rowwise(w, E4),    # whole rows in one read
           "long rows": lambda: fp8.quantize_rowwise(long_rows, E4),   # two passes per row
           "group columns": lambda: fp8.quantize_group_columns(x, groups, len(sizes), E4, ends),
           "group columns per expert": lambda: fp8.quantize_group_columns(x, groups, len(sizes), E4, ends, True),
           "group columns per expert, from row amaxes": lambda: fp8.quantize_group_columns(
               x, groups, len(sizes), E4, ends, True, fp8.quantize_rowwise(x, E4, row_amax=True)[2]),
           "weight columns": lambda: fp8.quantize_weight_columns(w, E4)}[which]
    got8, got_s = run()
    monkeypatch.setattr(fp8, "triton", None)            # the PyTorch path
    ref8, ref_s = run()
    assert got8.shape == ref8.shape and got8.dtype == ref8.dtype and got_s.shape == ref_s.shape
    torch.testing.assert_close(got_s, ref_s, rtol=1e-6, atol=0)
    if which.startswith("group columns per expert"):   # one scale per expert, the amax of all its rows
        per = ref_s.view(len(sizes), c)
        assert torch.equal(per, per[:, :1].expand_as(per))
        amax = x.float().abs().split(sizes)[2].amax()
        torch.testing.assert_close(per[2, 0], amax / FP8_MAX[E4], rtol=1e-6, atol=0)
    got, ref = got8.float(), ref8.float()
    if DEV == "cuda":   # as the blockwise kernels' test: a scale an ulp off moves an element one step at most
        step = torch.where(ref != 0, ref.abs() * 2.0 ** -3, torch.full_like(ref, 2.0 ** -9))
        assert ((got - ref).abs() <= step).all() and (got != ref).float().mean() < 1e-3, int((got != ref).sum())
        return
    # the interpreter's known rounding errors (module doc) touch a few % of the elements; a wrong
    # scale, layout or group boundary would leave almost none equal
    assert (got == ref).float().mean() > 0.9, float((got == ref).float().mean())


@pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("shape", [(48, 80), (37, 19), (3, 2100)])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
def test_amax_kernel_equals_torchs_inf_norm(shape, src):
    """The tensorwise amax pass (one Triton read, per-tile maxima atomically combined) gives exactly
    torch's inf-norm, also over rows with a stride (a column slice), and inf where there is a NaN."""
    if DEV == "cpu" and not fp8.interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    torch.manual_seed(2)
    wide = (torch.randn(shape[0], shape[1] + 7) * 3).to(src).to(DEV)
    wide[-1, shape[1] + 3] = 1e4          # outside the slice: must not count
    x = wide[:, :shape[1]]
    x[shape[0] // 2, shape[1] - 1] = -91.5
    assert x.stride(0) != x.shape[1]
    got = fp8._amax_triton(x)
    ref = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1)
    assert got.dtype == torch.float32 and torch.equal(got, ref) and got.item() == 91.5
    x[0, 0] = float("nan")
    assert fp8._amax_triton(x).item() == float("inf")
    # and quantize's tensorwise scale is the one that amax gives
    _, _, sinv = fp8.quantize(x[1:], E4, False, None)
    torch.testing.assert_close(sinv, torch.tensor([91.5 / FP8_MAX[E4]], device=DEV))


@pytest.mark.skipif(fp8.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_delayed_update_kernel_equals_the_reference(length, algo, fmt):
    """The one-launch delayed-scaling update leaves the history and the scales exactly as
    Fp8Scaling.update does: the roll, the zeroed row, amax by either algorithm, the margin, the
    interval, and the kept scale where the amax is 0, inf or NaN."""
    if DEV == "cpu" and not fp8.interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    recipe = Fp8Recipe(format=fmt, recipe="delayed", margin=1, interval=2, amax_history_len=length,
                       amax_compute_algo=algo)
    torch.manual_seed(3)
    rows = [torch.rand(length, 2) * 50, torch.zeros(length, 2), torch.rand(length, 2)]
    rows[2][0, 0], rows[2][-1, 1] = float("inf"), float("nan")
    for hist_fwd in rows:
        ref, got = Fp8Scaling(recipe, device=DEV), Fp8Scaling(recipe, device=DEV)
        for s in (ref, got):
            s.amax_history["fwd"].copy_(hist_fwd)
            s.amax_history["bwd"].copy_(hist_fwd[:, :1] * 3)
            s.scale["fwd"].copy_(torch.tensor([7.0, 9.0]))
        for step in range(3):    # interval 2: the scale changes at updates 1 and 3 only
            for d in ("fwd", "bwd"):
                ref.update(d)
                fp8._delayed_update(got, d)
                torch.testing.assert_close(got.amax_history[d], ref.amax_history[d], rtol=0, atol=0, equal_nan=True)
                torch.testing.assert_close(got.scale[d], ref.scale[d], rtol=1e-6, atol=0)
                assert got.updates[d] == ref.updates[d]
            for s in (ref, got):   # this step's amaxes recorded, as the casts would
                s.amax_history["fwd"][0].copy_(torch.tensor([3.0 + step, 0.5]))


# ---------------------------------------------------------------- the fp8 weight cache (TE's, across micro-batches)
def _fresh(w, recipe="tensorwise"):
    """quantize(w) as the forward casts it, with a throwaway state (the reference for a cache)."""
    return fp8.quantize(w, E4, True, Fp8Scaling(Fp8Recipe("hybrid", recipe), DEV), "fwd", 1)


def _same(a, b):
    return all((x is None and y is None) or torch.equal(x.float(), y.float()) for x, y in zip(a, b))


def _casts():
    return dict(report.op_counts().get("fp8_weight_cast", {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weight_cache_casts_at_the_first_micro_batch_and_reuses_it_after(torch_cast_on_cpu, recipe):
    """skip False casts into the cache; skip True reuses it with no kernel, forward and dgrad (even
    where the weight's values changed behind its version counter, as Megatron's optimizers write
    them: the step's next first micro-batch casts again); an in-place update that moves the weight's
    version is cast again even with skip True."""
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache

    torch.manual_seed(5)
    x = torch.randn(32, 64, device=DEV).requires_grad_()
    w = (torch.randn(48, 64, device=DEV) * 0.05).requires_grad_()
    dy = torch.randn(32, 48, device=DEV)
    state = Fp8Scaling(Fp8Recipe("hybrid", recipe), DEV)
    cache = Fp8WeightCache()
    report.reset_op_counts()
    fp8.fp8_linear(x, w, None, state, weight_cache=cache).backward(dy)
    held = cache.tensors
    assert held is not None and held[1] is not None
    old_w8 = held[0].clone()
    old = w.detach().clone()
    w.data.mul_(2.0)                      # a step's update through .data: no version change
    cache.skip = True
    x.grad = None
    y = fp8.fp8_linear(x, w, None, state, weight_cache=cache)
    y.backward(dy)
    assert cache.tensors is held and torch.equal(held[0].float(), old_w8.float())
    ref = Fp8Scaling(Fp8Recipe("hybrid", "tensorwise"), DEV)
    y_old = fp8.fp8_linear(x.detach(), old, None, ref)    # the same product with the old weight
    if recipe == "tensorwise":
        assert torch.equal(y, y_old)
    else:   # delayed: the input's scale moved on; the weight's is the cached one
        torch.testing.assert_close(y, y_old, rtol=0.1, atol=0.1 * y_old.abs().max().item())
    cache.skip = False                    # the next step's first micro-batch
    fp8.fp8_linear(x, w, None, state, weight_cache=cache)
    assert cache.tensors is held
    if recipe == "tensorwise":
        assert _same(held, _fresh(w.detach()))
    with torch.no_grad():
        w.mul_(0.5)                       # in place on the parameter: its version moves
    cache.skip = True
    fp8.fp8_linear(x, w, None, state, weight_cache=cache)
    if recipe == "tensorwise":
        assert _same(held, _fresh(w.detach()))
    assert _casts() == {"cast (cache made)": 1, "cached (later micro-batch)": 1, "cast into the cache": 2}


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weight_cache_flag_keeps_or_casts_as_the_device_flag_says(recipe):
    """The flagged cast a CUDA graph records: flag 1 leaves the cache (and the weight's amax slot)
    as it is, flag 0 casts into it. Triton's kernel where it runs here (GPU, or the interpreter on
    CPU), else torch's cast; compared with the same path's fresh cast."""
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache

    torch.manual_seed(6)
    w = torch.randn(48, 64, device=DEV) * 0.05
    state = Fp8Scaling(Fp8Recipe("hybrid", recipe), DEV)
    cache = Fp8WeightCache()
    fp8.quantize_weight(w, E4, True, state, cache)
    before = [t.clone() for t in cache.tensors]
    w.mul_(3.0)
    state.amax_history["fwd"].zero_()
    cache.skip = torch.ones(1, device=DEV)
    fp8.quantize_weight(w, E4, True, state, cache)
    assert _same(cache.tensors, before)
    assert state.amax_history["fwd"][0, 1].item() == 0.0          # no amax recorded either
    cache.skip = torch.zeros(1, device=DEV)
    fp8.quantize_weight(w, E4, True, state, cache)
    if recipe == "tensorwise":
        assert _same(cache.tensors, _fresh(w))
    else:
        assert state.amax_history["fwd"][0, 1].item() == w.abs().max().item()
        assert not _same(cache.tensors, before)


@pytest.mark.skipif(DEV == "cpu", reason="captures a CUDA graph")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weight_cache_in_a_cuda_graph_follows_the_flag_at_each_replay(recipe):
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache

    w = torch.randn(256, 128, device=DEV) * 0.05
    state = Fp8Scaling(Fp8Recipe("hybrid", recipe), DEV)
    cache = Fp8WeightCache()
    fp8.quantize_weight(w, E4, True, state, cache)       # made outside, as Megatron's warm-up does
    flag = torch.zeros(1, device=DEV)
    cache.skip = flag
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.quantize_weight(w, E4, True, state, cache)
    before = [t.clone() for t in cache.tensors]
    w.mul_(2.0)
    flag.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(cache.tensors, before)
    flag.fill_(0.0)
    graph.replay()
    torch.cuda.synchronize()
    if recipe == "tensorwise":
        assert _same(cache.tensors, _fresh(w))
    assert not _same(cache.tensors, before)


# ---------------------------------------------------------------- the experts' fp8 weight cache
def _flat(held):
    return [t for pair in held for t in pair]


def test_grouped_weight_cache_casts_at_the_first_micro_batch_and_reuses_it_after(torch_cast_on_cpu):
    """The experts' grouped linear with a weight cache: the first call casts both weight operands
    into it (forward and dgrad, equal to the bit to the uncached op); skip True reuses them with no
    kernel, even where the weights changed behind their version counter (as Megatron's optimizers
    write them: the next step's first micro-batch casts again); skip False casts into the same
    tensors."""
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache

    _grouped_capable()
    sizes, n, k = [32, 16, 0, 48], 64, 96
    x, w, dy = _grouped_inputs(7, sizes, n, k)

    def run(weight, cache):
        x.grad = weight.grad = None
        y = fp8.fp8_grouped_gemm(x, weight, sizes, Fp8Recipe(), weight_cache=cache)
        y.backward(dy)
        return y.detach().clone(), x.grad.clone(), weight.grad.clone()

    ref = run(w, None)
    cache = Fp8WeightCache()
    report.reset_op_counts()
    got = run(w, cache)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    held = cache.tensors
    assert [t.shape for t in _flat(held)] == [(4, n, k), (4, n), (4, k, n), (4, k)]
    old = w.detach().clone()
    w.data.mul_(2.0)                                       # through .data: no version change
    cache.skip = True
    got = run(w, cache)
    assert cache.tensors is held
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])   # the old weights' product
    cache.skip = False                                     # the next step's first micro-batch
    got = run(w, cache)
    assert cache.tensors is held
    fresh = run(w.detach().clone().requires_grad_(), None)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], fresh[:2]))
    assert not torch.equal(got[0], ref[0]) and torch.equal(old * 2, w.detach())
    assert _casts() == {"experts: cast (cache made)": 1, "experts: cached (later micro-batch)": 1,
                        "experts: cast into the cache": 1}, _casts()


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_grouped_weight_cache_flag_keeps_or_casts_as_the_device_flag_says(path, monkeypatch):
    """The flagged casts a CUDA graph records for the experts' weights (rows, and per-(expert, input)
    columns): flag 1 leaves the cache as it is, flag 0 casts into it, equal to a fresh cast by the
    same path. The Triton kernels where they run here (GPU, or the interpreter on CPU)."""
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache

    if path == "triton" and (fp8.triton is None or (DEV == "cpu" and not fp8.interpreting())):
        pytest.skip("the Triton kernels run on CPU under TRITON_INTERPRET=1 only")
    if path == "torch":
        monkeypatch.setattr(fp8, "triton", None)
    torch.manual_seed(8)
    w = (torch.randn(3, 48, 80, device=DEV) * 0.05).to(torch.bfloat16)
    cache = Fp8WeightCache()
    fp8.quantize_expert_weights(w, E4, cache)
    before = [t.clone() for t in _flat(cache.tensors)]
    w.mul_(3.0)
    cache.skip = torch.ones(1, device=DEV)
    fp8.quantize_expert_weights(w, E4, cache)
    assert _same(_flat(cache.tensors), before)
    cache.skip = torch.zeros(1, device=DEV)
    fp8.quantize_expert_weights(w, E4, cache)
    fresh = [*fp8.quantize_rowwise(w, E4), *fp8.quantize_weight_columns(w, E4)]
    assert _same(_flat(cache.tensors), fresh) and not _same(_flat(cache.tensors), before)


@pytest.mark.skipif(DEV == "cpu", reason="captures a CUDA graph")
def test_grouped_weight_cache_in_a_cuda_graph_follows_the_flag_at_each_replay():
    from megatron_adapt.backends.fp8_scaling import Fp8WeightCache

    _grouped_capable()
    w = (torch.randn(8, 512, 256, device=DEV) * 0.05).to(torch.bfloat16)
    cache = Fp8WeightCache()
    fp8.quantize_expert_weights(w, E4, cache)          # made outside, as Megatron's warm-up does
    flag = torch.zeros(1, device=DEV)
    cache.skip = flag
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.quantize_expert_weights(w, E4, cache)
    before = [t.clone() for t in _flat(cache.tensors)]
    w.mul_(2.0)
    flag.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(_flat(cache.tensors), before)
    flag.fill_(0.0)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(_flat(cache.tensors), [*fp8.quantize_rowwise(w, E4), *fp8.quantize_weight_columns(w, E4)])

"""Tier 2: the cpu backend's ops against fp32 references written from the math, forward and
backward, over dtypes and shapes (odd sizes, long rows, large vocabularies). Tolerances: fp32
1e-5 relative, bf16 / fp16 2e-2 (outputs are rounded to the input dtype); attention in bf16 4e-2
(SDPA's CPU kernels multiply and normalise in bf16, the reference in fp32)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_adapt.backends.cpu import activations, attention, cross_entropy, multi_tensor, norms, rope, softmax

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(a, b, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def grads(fn, *inputs, seed=0):
    """Output and input grads of sum(out * g) for a fixed random g."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    (out.float() * g.float()).sum().backward()
    return out.detach(), [x.grad for x in xs if x.requires_grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (4, 2, 257), (2, 65536)])
def test_rms_norm(dtype, shape):
    x, w = torch.randn(shape).to(dtype), (torch.rand(shape[-1]) + 0.5).to(dtype)

    def ref(x, w):
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    out, g = grads(lambda x, w: norms.rms_norm(x, w, 1e-5), x, w)
    out_r, g_r = grads(ref, x, w)
    close(out, out_r, dtype)
    close(g[0], g_r[0], dtype)
    torch.testing.assert_close(g[1].float(), g_r[1].float(), atol=TOL[dtype] * shape[0] * 10, rtol=TOL[dtype] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (6, 1023)])
def test_layer_norm(dtype, shape):
    x, w, b = torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype), torch.randn(shape[-1]).to(dtype)

    def ref(x, w, b):
        x32 = x.float()
        mu, var = x32.mean(-1, keepdim=True), x32.var(-1, unbiased=False, keepdim=True)
        return (x32 - mu) / torch.sqrt(var + 1e-5) * w.float() + b.float()

    out, g = grads(lambda x, w, b: norms.layer_norm(x, w, b, 1e-5), x, w, b)
    out_r, g_r = grads(ref, x, w, b)
    close(out, out_r, dtype)
    close(g[0], g_r[0], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_param_grads_over_many_rows(dtype):
    """Weight and bias gradients sum over every row: in bf16 / fp16 they must be accumulated in
    fp32 (as TE / apex do). PyTorch's CPU layer_norm sums them in the input dtype: relative error
    0.71 for the bf16 weight grad at 16384 x 128. Megatron's test_thd_correctness compares SBHD
    and THD gradients at cosine 0.999 and failed on it."""
    x = torch.randn(16384, 128).to(dtype)
    w, b = (torch.randn(128) * 0.1 + 1).to(dtype), (torch.randn(128) * 0.1).to(dtype)
    _, g = grads(lambda x, w, b: norms.layer_norm(x, w, b, 1e-5), x, w, b)
    _, g_r = grads(lambda x, w, b: F.layer_norm(x.double(), (128,), w.double(), b.double(), 1e-5), x, w, b)
    for ours, ref, name in zip(g[1:], g_r[1:], ("weight", "bias")):
        err = ((ours.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"layer_norm {name} grad, {dtype}: relative error {err:.4f} to fp64"


def ce_reference(logits, target, smoothing):
    logp = torch.log_softmax(logits.double(), -1)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if smoothing == 0:
        return nll
    k = logits.size(-1)
    s = smoothing * k / (k - 1)
    return (1 - s) * nll - s * logp.mean(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 32000])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_single_partition(dtype, vocab, smoothing):
    logits = (torch.randn(3, 4, vocab) * 3).to(dtype)
    target = torch.randint(0, vocab, (3, 4))
    out, g = grads(lambda l: cross_entropy.vocab_parallel_cross_entropy(l, target, smoothing, None), logits)
    out_r, g_r = grads(lambda l: ce_reference(l, target, smoothing), logits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_r, atol=1e-4, rtol=1e-4)
    close(g[0], g_r[0].float(), dtype)


def test_cross_entropy_does_not_modify_fp32_logits():
    logits = torch.randn(5, 11)
    keep = logits.clone()
    cross_entropy.vocab_parallel_cross_entropy(logits, torch.randint(0, 11, (5,)), 0.0, None)
    assert torch.equal(logits, keep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window,with_mask", [(True, None, False), (False, None, True),
                                                     (False, (3, 0), False), (True, None, True)])
@pytest.mark.parametrize("sq,sk", [(8, 8), (5, 5), (1, 9)])
def test_scaled_masked_softmax(dtype, causal, window, with_mask, sq, sk):
    if causal and sq != sk and sq > 1:
        pytest.skip("causal needs sq == sk")
    x = torch.randn(2, 3, sq, sk).to(dtype)
    mask = (torch.rand(2, 1, sq, sk) > 0.6) if with_mask else None

    def ref(x):
        s = x.float() * 0.5
        m = torch.zeros(sq, sk, dtype=torch.bool)
        if window is not None:
            i = torch.arange(sq).unsqueeze(1) + (sk - sq)
            j = torch.arange(sk).unsqueeze(0)
            m = (j < i - window[0]) | (j > i + window[1])
        elif causal and sq > 1:
            m = torch.arange(sk).unsqueeze(0) > torch.arange(sq).unsqueeze(1) + (sk - sq)
        if mask is not None:
            m = m | mask
        return torch.softmax(s.masked_fill(m, -10000.0), -1)

    out, g = grads(lambda x: softmax.scaled_masked_softmax(x, mask, 0.5, causal, window, True), x)
    out_r, g_r = grads(ref, x)
    assert out.dtype == dtype
    close(out, out_r, dtype)
    close(g[0], g_r[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("mode", ["causal", "mask", "window", "none"])
def test_attention(dtype, hq, hkv, mode):
    b, s, d = 2, 9, 8
    q, k, v = (torch.randn(b, h, s, d).to(dtype) for h in (hq, hkv, hkv))
    mask = torch.rand(b, 1, s, s) > 0.7 if mode == "mask" else None
    if mask is not None:
        mask[..., 0] = False
    window = (2, 0) if mode == "window" else None

    def ref(q, k, v):
        rep = hq // hkv
        k32, v32 = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
        scores = q.float() @ k32.transpose(-1, -2) * 0.3
        m = torch.zeros(s, s, dtype=torch.bool)
        if mode == "causal":
            m = torch.ones(s, s, dtype=torch.bool).triu(1)
        if mode == "window":
            i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
            m = (j < i - 2) | (j > i)
        if mask is not None:
            m = m | mask
        return torch.softmax(scores.masked_fill(m, float("-inf")), -1) @ v32

    fn = lambda q, k, v: attention.attention(q, k, v, attn_mask=mask, causal=mode == "causal", scale=0.3,
                                             window_size=window)
    out, g = grads(fn, q, k, v)
    out_r, g_r = grads(ref, q, k, v)
    for a, r in zip([out] + g, [out_r] + g_r):
        close(a, r, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [8, 4])
def test_rope(dtype, interleaved, rot):
    t = torch.randn(5, 2, 3, 8).to(dtype)
    pos = torch.arange(5).float().view(5, 1, 1, 1)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    theta = (pos * inv)  # [s,1,1,rot/2]
    freqs = torch.repeat_interleave(theta, 2, -1) if interleaved else torch.cat([theta, theta], -1)

    def ref(t):
        x = t.float()
        xr, xp = x[..., :rot], x[..., rot:]
        if interleaved:
            pairs = xr.reshape(*xr.shape[:-1], rot // 2, 2)
            c = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(theta), theta)
            out = torch.view_as_real(c).flatten(-2)
        else:
            half = rot // 2
            c = torch.complex(xr[..., :half], xr[..., half:]) * torch.polar(torch.ones_like(theta), theta)
            out = torch.cat([c.real, c.imag], -1)
        return torch.cat([out, xp], -1)

    out, g = grads(lambda t: rope.rope(t, freqs, interleaved), t)
    out_r, g_r = grads(ref, t)
    close(out, out_r, dtype)
    close(g[0], g_r[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [1, 37, 2048])
def test_swiglu_and_bias_variants(dtype, f):
    x, bias = torch.randn(4, 2 * f).to(dtype), torch.randn(2 * f).to(dtype)
    y_ref = lambda x: x.float()[:, :f] * torch.sigmoid(x.float()[:, :f]) * x.float()[:, f:]
    out, g = grads(activations.swiglu, x)
    out_r, g_r = grads(y_ref, x)
    close(out, out_r, dtype)
    close(g[0], g_r[0], dtype)
    out, g = grads(activations.bias_swiglu, x, bias)
    out_r, g_r = grads(lambda x, b: y_ref(x.float() + b.float()), x, bias)
    close(out, out_r, dtype)
    close(g[1], g_r[1], dtype) if dtype == torch.float32 else None


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_is_the_tanh_approximation(dtype):
    y, b = torch.randn(6, 33).to(dtype), torch.randn(33).to(dtype)
    ref = lambda b, y: 0.5 * (y.float() + b.float()) * (1 + torch.tanh(0.7978845608028654 * (y.float() + b.float()) * (1 + 0.044715 * (y.float() + b.float()) ** 2)))
    out, g = grads(activations.bias_gelu, b, y)
    out_r, g_r = grads(ref, b, y)
    close(out, out_r, dtype)


def test_multi_tensor_l2norm_and_scale():
    ts = [torch.randn(3, 5), torch.randn(1000), torch.randn(7).bfloat16()]
    expected = torch.sqrt(sum((t.float() ** 2).sum() for t in ts))
    torch.testing.assert_close(multi_tensor.l2norm(ts), expected, rtol=1e-5, atol=1e-5)
    dst = [torch.empty_like(t) for t in ts]
    multi_tensor.scale(ts, dst, 0.5)
    for s, d in zip(ts, dst):
        torch.testing.assert_close(d, s * 0.5)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_factory_matches_torch(adam_w_mode):
    from megatron_adapt.backends.cpu.optimizers import Adam

    p1 = torch.nn.Parameter(torch.randn(10))
    p2 = torch.nn.Parameter(p1.detach().clone())
    opt = Adam([p1], lr=0.1, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)([p2], lr=0.1, weight_decay=0.1)
    for _ in range(3):
        for p in (p1, p2):
            p.grad = torch.ones(10) * 0.3
        opt.step()
        ref.step()
    torch.testing.assert_close(p1, p2)
    with pytest.raises(TypeError, match="exp_avg_dtype"):
        Adam([p1], exp_avg_dtype=torch.bfloat16)


def test_adam_takes_fused_adam_states_without_a_per_parameter_step():
    """Megatron's init_state_fn (sharded checkpoint loading) writes FusedAdam-style states:
    exp_avg / exp_avg_sq and no `step`. torch's Adam raised KeyError 'step' on load_state_dict and
    on step(); ours takes the group's step (FusedAdam keeps it there), else 0."""
    from megatron_adapt.backends.cpu.optimizers import Adam

    p1 = torch.nn.Parameter(torch.randn(10))
    p2 = torch.nn.Parameter(p1.detach().clone())
    opt, ref = Adam([p1], lr=0.1, weight_decay=0.1), torch.optim.AdamW([p2], lr=0.1, weight_decay=0.1)
    opt.state[p1]["exp_avg"], opt.state[p1]["exp_avg_sq"] = torch.zeros(10), torch.zeros(10)
    for _ in range(2):          # a state created but never stepped counts from 0, as a fresh one
        for p in (p1, p2):
            p.grad = torch.ones(10) * 0.3
        opt.step()
        ref.step()
    torch.testing.assert_close(p1, p2)
    assert float(opt.state[p1]["step"]) == 2.0
    saved = opt.state_dict()
    del saved["state"][0]["step"]
    saved["param_groups"][0]["step"] = 7          # as TE's FusedAdam saves it
    again = Adam([torch.nn.Parameter(p1.detach().clone())], lr=0.1)
    again.load_state_dict(saved)
    (state,) = again.state.values()
    assert set(state) == {"exp_avg", "exp_avg_sq"}       # loaded as saved
    (param,) = again.param_groups[0]["params"]
    param.grad = torch.ones(10)
    again.step()                                          # counts on from the group's step
    assert torch.is_tensor(state["step"]) and float(state["step"]) == 8.0
    with pytest.raises(KeyError, match="step"):   # torch's own Adam, for contrast
        plain = torch.optim.AdamW([torch.nn.Parameter(p1.detach().clone())], lr=0.1)
        plain.load_state_dict(saved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3, 5), (37, 24, 40), (300, 17, 65)])
def test_wgrad_accumulate_adds_the_weight_gradient_into_main_grad(dtype, shape):
    """Gradient-accumulation fusion: main_grad (fp32) += grad_output^T @ input, in place, on top of
    what main_grad already holds (micro-batches accumulate)."""
    from megatron_adapt.backends.cpu import matmul

    t, n_in, n_out = shape
    x, dy = torch.randn(t, n_in).to(dtype), torch.randn(t, n_out).to(dtype)
    main_grad = torch.randn(n_out, n_in)
    expect = main_grad.double() + dy.double().t() @ x.double()
    matmul.wgrad_accumulate(x, dy, main_grad)
    matmul.wgrad_accumulate(x, dy, main_grad)           # a second micro-batch
    expect += dy.double().t() @ x.double()
    torch.testing.assert_close(main_grad.double(), expect, atol=1e-4 * max(1, t ** 0.5), rtol=1e-5)


def test_adam_takes_lr_none_like_fused_adam():
    """Megatron's OptimizerConfig(lr=None) default reaches Adam(lr=None) (apex / TE FusedAdam take
    it; the scheduler or the param group sets it): None stays where no group gave one."""
    from megatron_adapt.backends.cpu.optimizers import Adam

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = Adam([{"params": [a], "lr": 0.1}, {"params": [b]}], lr=None)
    assert [g["lr"] for g in opt.param_groups] == [0.1, None] and opt.defaults["lr"] is None
    opt.param_groups[1]["lr"] = 0.01  # as Megatron's scheduler does before the first step
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.step()
    assert torch.allclose(a, torch.full((2,), 0.9)) and torch.allclose(b, torch.full((3,), 0.99))
    assert Adam([a], lr=0.5).param_groups[0]["lr"] == 0.5

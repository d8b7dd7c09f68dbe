"""Every npu op, through the torch_npu EMULATION, against the fp32 PyTorch reference
(backends/reference.py): forward and backward over a table of dtypes and shapes, and which
implementation the report says ran (kernel vs reported fallback).

Tolerances (output and gradients, compared in fp32 against the reference run on fp32 copies of
the inputs): fp32 atol=rtol=1e-5 (2e-5 for attention), fp16 atol=rtol=2e-3, bf16 atol=rtol=2e-2.
"""
import math

import pytest
import torch

from megatron_adapt.errors import StrictFallbackError

from megatron_adapt.backends import cpu as cpu_backend
from megatron_adapt.backends import npu as npu_backend
from megatron_adapt.backends import reference

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = list(TOL)


def npu(name):
    return npu_backend.BACKEND.op(name)


def ref(name):
    return getattr(reference, name)


def leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_(True)


def ops_ran(report, op):
    """What the npu backend ran for `op` (the reference's own "cpu.*" entries left out)."""
    return {impl: n for impl, n in report.op_counts().get(op, {}).items() if not impl.startswith("cpu.")}


def fallbacks(report, op):
    return {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"]
            if o["op"] == op and o["fallback_reason"]}


def compare(fn_npu, fn_ref, inputs, dtype, tol=None, grad_inputs=None, out_dtype=None):
    """Run fn_npu on `inputs` cast to dtype and fn_ref on fp32 copies of those same (rounded)
    values; compare the output and every input's gradient."""
    atol, rtol = tol or TOL[dtype]
    lo = [leaf(t, dtype) if t.is_floating_point() else t for t in inputs]
    hi = [leaf(t.to(dtype), torch.float32) if t.is_floating_point() else t for t in inputs]
    out = fn_npu(*lo)
    expect = fn_ref(*hi)
    assert out.dtype == (out_dtype or dtype) and out.shape == expect.shape
    torch.testing.assert_close(out.float(), expect, atol=atol, rtol=rtol)
    g = torch.randn_like(expect)
    out.backward(g.to(dtype))
    expect.backward(g)
    for i in (grad_inputs if grad_inputs is not None else range(len(inputs))):
        if lo[i].is_floating_point():
            torch.testing.assert_close(lo[i].grad.float(), hi[i].grad, atol=atol * 4, rtol=rtol * 4,
                                       msg=lambda m: f"grad of input {i}: {m}")


# ------------------------------------------------------------------------------------------ norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 33), (7, 128), (1, 2, 3, 17)])
def test_rms_norm(torch_npu, report, dtype, shape):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.rand(shape[-1]) + 0.5
    compare(lambda x, w: npu("rms_norm")(x, w, 1e-5), lambda x, w: ref("rms_norm")(x, w, 1e-5),
            [x, w], dtype)
    assert ops_ran(report, "rms_norm") == {"npu.torch_npu.npu_rms_norm": 1}


def test_rms_norm_casts_a_mismatched_weight(torch_npu):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.ones(16, requires_grad=True)  # fp32 master weight: the kernel needs x's dtype
    y = npu("rms_norm")(x, w, 1e-6)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(torch_npu, report, dtype):
    torch.manual_seed(1)
    x, w, b = torch.randn(4, 3, 45), torch.rand(45) + 0.5, torch.randn(45)
    compare(lambda x, w, b: npu("layer_norm")(x, w, b, 1e-5), lambda x, w, b: ref("layer_norm")(x, w, b, 1e-5),
            [x, w, b], dtype, tol=(TOL[dtype][0] * 2, TOL[dtype][1] * 2))
    assert ops_ran(report, "layer_norm") == {"npu.torch.F.layer_norm": 1}


# ------------------------------------------------------------------------------------ activations
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 74), (2, 3, 256), (1, 2)])
def test_swiglu_and_bias_swiglu(torch_npu, report, dtype, shape):
    torch.manual_seed(2)
    x, bias = torch.randn(shape), torch.randn(shape[-1])
    compare(npu("swiglu"), ref("swiglu"), [x], dtype)
    compare(npu("bias_swiglu"), ref("bias_swiglu"), [x, bias], dtype)
    assert ops_ran(report, "swiglu") == {"npu.torch_npu.npu_swiglu": 1}
    assert ops_ran(report, "bias_swiglu") == {"npu.torch_npu.npu_swiglu": 1}


def test_swiglu_non_contiguous_input(torch_npu):
    x = torch.randn(10, 6).t()  # the kernel rejects non-contiguous input: the backend copies
    torch.testing.assert_close(npu("swiglu")(x), ref("swiglu")(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(torch_npu, report, dtype):
    torch.manual_seed(3)
    compare(npu("bias_gelu"), ref("bias_gelu"), [torch.randn(37), torch.randn(3, 37)], dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_bias_dropout_add(torch_npu, report, bias):
    """Megatron's arithmetic in torch ops: the same masks as the reference under one seed."""
    x, r = torch.randn(4, 3, 37), torch.randn(4, 3, 37)
    b = torch.randn(37) if bias else None
    torch.manual_seed(5)
    out = npu("bias_dropout_add")(x, b, r, 0.3)
    torch.manual_seed(5)
    torch.testing.assert_close(out, ref("bias_dropout_add")(x, b, r, 0.3), rtol=0, atol=0)
    assert 0.15 < (out == r).float().mean().item() < 0.45
    assert ops_ran(report, "bias_dropout_add") == {"npu.torch": 1}


# ---------------------------------------------------------------------------------------- softmax
SOFTMAX_CASES = [
    # (shape [b, np, sq, sk], mask kind, causal, window, kernel?)
    ((2, 3, 64, 96), None, False, None, True),
    ((2, 2, 64, 64), None, True, None, True),
    ((1, 2, 32, 96), None, True, None, True),          # causal, bottom-right aligned (sq < sk)
    ((2, 2, 64, 64), "padding", False, None, True),
    ((2, 2, 64, 64), "full", True, None, True),
    ((1, 2, 64, 64), None, True, (8, 0), True),       # sliding window
    ((2, 2, 40, 64), None, True, None, False),        # sq not a multiple of 32
    ((2, 2, 64, 4128), None, False, None, False),     # sk > 4096
    ((1, 1, 16, 32), None, False, None, False),       # sq < 32
]


def _softmax_mask(kind, b, np_, sq, sk):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(5)
    if kind == "padding":
        m = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        m[..., -7:] = True
        return m
    m = torch.rand(b, 1, sq, sk, generator=g) > 0.7
    m[..., 0] = False   # never a fully masked row
    return m


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,kind,causal,window,kernel", SOFTMAX_CASES)
def test_scaled_masked_softmax(torch_npu, report, dtype, shape, kind, causal, window, kernel):
    torch.manual_seed(4)
    mask = _softmax_mask(kind, shape[0], shape[1], shape[2], shape[3])
    x = torch.randn(shape) * 3

    def run(op):
        return lambda s: op(s, mask, 0.7, causal, window, True)
    compare(run(npu("scaled_masked_softmax")), run(ref("scaled_masked_softmax")), [x], dtype)
    ran = ops_ran(report, "scaled_masked_softmax")
    if kernel:
        assert ran == {"npu.torch_npu.npu_scaled_masked_softmax": 1}
    else:
        assert ran == {"npu.torch (reference)": 1}
        assert "npu.torch (reference)" in fallbacks(report, "scaled_masked_softmax")


def test_softmax_fp32_falls_back_reported(torch_npu, report):
    x = torch.randn(1, 1, 64, 64)
    torch.testing.assert_close(npu("scaled_masked_softmax")(x, None, None, True),
                               ref("scaled_masked_softmax")(x, None, None, True))
    assert "dtype torch.float32" in fallbacks(report, "scaled_masked_softmax")["npu.torch (reference)"]


# -------------------------------------------------------------------------------------- attention
ATTN_CASES = [
    # (b, hq, hkv, sq, sk, d, causal, window, mask kind, sparse_mode expected)
    (2, 4, 4, 37, 37, 16, True, None, None, 2),
    (1, 4, 4, 17, 29, 8, True, None, None, 3),        # causal, sq < sk: bottom-right
    (2, 8, 2, 33, 33, 16, False, None, None, 0),      # GQA 4:1, no mask
    (1, 6, 3, 40, 40, 8, True, (5, 0), None, 4),      # sliding window, GQA
    (2, 2, 2, 24, 31, 8, False, (3, 2), None, 4),     # two-sided window, sq != sk
    (2, 4, 2, 19, 19, 8, True, None, "padding", 0),   # padding mask + causal -> B1SS
    (1, 4, 4, 21, 23, 8, False, None, "heads", 0),    # per-head mask [1, h, sq, sk] -> BNSS
    (2, 2, 1, 13, 13, 24, False, None, "ss", 0),      # 2-D mask -> SS
]


def _attn_mask(kind, b, h, sq, sk):
    g = torch.Generator().manual_seed(7)
    if kind is None:
        return None
    if kind == "padding":
        m = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        m[-1, ..., -5:] = True
        return m
    shape = (1, h, sq, sk) if kind == "heads" else (sq, sk)
    m = torch.rand(shape, generator=g) > 0.6
    m[..., 0] = False
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,window,kind,mode", ATTN_CASES)
def test_attention(torch_npu, report, monkeypatch, dtype, b, hq, hkv, sq, sk, d, causal, window, kind, mode):
    torch.manual_seed(8)
    seen = []
    real = torch_npu.npu_fusion_attention

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append((args[4], kwargs.get("sparse_mode"), result))
        return result
    monkeypatch.setattr(torch_npu, "npu_fusion_attention", spy)
    # Megatron's q/k/v are [s, b, h, d]; the op sees [b, h, s, d] views of them.
    q = torch.randn(sq, b, hq, d)
    k = torch.randn(sk, b, hkv, d)
    v = torch.randn(sk, b, hkv, d)
    mask = _attn_mask(kind, b, hq, sq, sk)
    scale = 1 / math.sqrt(d) * 1.1

    def run(op):
        return lambda q, k, v: op(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                  attn_mask=mask, causal=causal, scale=scale, dropout_p=0.0, window_size=window)
    tol = (2e-5, 2e-5) if dtype == torch.float32 else None
    compare(run(npu("attention")), run(ref("attention")), [q, k, v], dtype, tol=tol)
    assert ops_ran(report, "attention") == {"npu.torch_npu.npu_fusion_attention": 1}
    (layout, sparse_mode, result), = seen
    assert (layout, sparse_mode) == ("SBH", mode)
    assert isinstance(result, tuple) and len(result) == 7
    assert result[1].shape == (b, hq, sq, 8) and result[1].dtype == torch.float32


def test_attention_default_scale_and_dropout(torch_npu, report):
    torch.manual_seed(9)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    torch.testing.assert_close(npu("attention")(q, k, v, causal=True),
                               ref("attention")(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
    q.requires_grad_(True)
    torch.manual_seed(10)
    a = npu("attention")(q, k, v, causal=True, dropout_p=0.5)
    torch.manual_seed(10)
    b = npu("attention")(q, k, v, causal=True, dropout_p=0.5)
    torch.testing.assert_close(a, b)              # keep_prob = 0.5, reproducible under one seed
    assert not torch.allclose(a, npu("attention")(q, k, v, causal=True))
    a.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("why,kwargs", [
    ("head dim", dict(d=800)),
    ("heads", dict(hq=6, hkv=4)),
    ("unbounded", dict(window=(-1, 0))),
])
def test_attention_falls_back_reported(torch_npu, report, why, kwargs):
    d, hq, hkv = kwargs.get("d", 8), kwargs.get("hq", 2), kwargs.get("hkv", 2)
    q, k, v = torch.randn(1, hq, 5, d), torch.randn(1, hkv, 5, d), torch.randn(1, hkv, 5, d)
    if hq % hkv:
        with pytest.raises(Exception):   # nor can the reference do 6:4 GQA; the fallback is still reported
            npu("attention")(q, k, v)
    else:
        npu("attention")(q, k, v, causal=True, window_size=kwargs.get("window"))
    assert why in fallbacks(report, "attention")["npu.torch.sdpa (reference)"]


# ------------------------------------------------------------------------------------------- rope
ROPE_CASES = [
    # (s, b, h, d, rot, interleaved, mscale)
    (7, 2, 3, 16, 16, False, 1.0),
    (9, 1, 4, 32, 16, False, 1.0),     # partial rotary
    (5, 3, 2, 8, 8, True, 1.0),        # interleaved pairs
    (6, 2, 2, 12, 12, False, 1.25),    # mscale (YaRN)
    (6, 2, 2, 20, 10, True, 0.9),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,b,h,d,rot,interleaved,mscale", ROPE_CASES)
def test_rope(torch_npu, report, dtype, s, b, h, d, rot, interleaved, mscale):
    torch.manual_seed(11)
    t = torch.randn(s, b, h, d)
    freqs = torch.randn(s, 1, 1, rot) * 3
    compare(lambda t: npu("rope")(t, freqs, interleaved, mscale),
            lambda t: ref("rope")(t, freqs, interleaved, mscale), [t], dtype)
    if interleaved and torch_npu.PROFILE == "6.0.0":    # no rotary_mode before 7.0.0: chosen at load
        assert ops_ran(report, "rope") == {"npu.torch (reference)": 1}
        assert "no rotary_mode (Ascend Extension 7.0.0" in fallbacks(report, "rope")["npu.torch (reference)"]
    else:
        assert ops_ran(report, "rope") == {"npu.torch_npu.npu_rotary_mul" + (".interleave" if interleaved else ""): 1}


@pytest.mark.parametrize("refusal", [TypeError("npu_rotary_mul() got an unexpected keyword argument 'rotary_mode'"),
                                     RuntimeError("rotary_mode 'interleave' is not supported on this SoC")])
def test_rope_interleave_refused_at_run_time_falls_back_reported(torch_npu, report, monkeypatch, refusal):
    """A build whose npu_rotary_mul takes the keyword but refuses the mode (or lacks it despite its
    version): the first interleaved call falls back, named, and later ones do not call it again."""
    from megatron_adapt.backends.npu import _lib

    if not _lib.api().rotary_mode:
        pytest.skip(f"{torch_npu.PROFILE}: interleave is not attempted at all (covered by test_rope)")
    real, calls = torch_npu.npu_rotary_mul, []

    def refusing(input, r1, r2, rotary_mode="half"):  # noqa: A002
        calls.append(rotary_mode)
        if rotary_mode == "interleave":
            raise refusal
        return real(input, r1, r2, rotary_mode)
    monkeypatch.setattr(torch_npu, "npu_rotary_mul", refusing)
    monkeypatch.delitem(_lib.PROBES, "rope.interleave", raising=False)   # not probed yet
    t, freqs = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)
    for _ in range(2):
        torch.testing.assert_close(npu("rope")(t, freqs, True), ref("rope")(t, freqs, True))
    npu("rope")(t, freqs, False)   # rotate-half still takes the kernel
    assert calls == ["interleave", "half"]
    assert ops_ran(report, "rope") == {"npu.torch (reference)": 2, "npu.torch_npu.npu_rotary_mul": 1}
    assert type(refusal).__name__ in fallbacks(report, "rope")["npu.torch (reference)"]
    report.set_context(strict=True)
    with pytest.raises(StrictFallbackError, match="rope.*refused"):
        npu("rope")(t, freqs, True)


# ---------------------------------------------------------------------------------- cross entropy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(torch_npu, report, dtype, smoothing):
    torch.manual_seed(12)
    logits, target = torch.randn(3, 5, 1001) * 4, torch.randint(0, 1001, (3, 5))
    compare(lambda x: npu("vocab_parallel_cross_entropy")(x, target, smoothing, None),
            lambda x: ref("vocab_parallel_cross_entropy")(x, target, smoothing, None),
            [logits], dtype, tol=(TOL[dtype][0] * 5, TOL[dtype][1] * 5), out_dtype=torch.float32)
    assert ops_ran(report, "vocab_parallel_cross_entropy") == {"npu.torch": 1}


# ------------------------------------------------------------------- multi-tensor, optimizer, rng
def test_multi_tensor(torch_npu, report):
    torch.manual_seed(13)
    ts = [torch.randn(7), torch.randn(3, 5).bfloat16(), torch.randn(1)]
    expect = torch.sqrt(sum((t.float() ** 2).sum() for t in ts))
    torch.testing.assert_close(npu("multi_tensor_l2norm")(ts), expect, rtol=1e-5, atol=1e-5)
    dst = [torch.empty_like(t) for t in ts]
    npu("multi_tensor_scale")(ts, dst, 0.5)
    for s, d in zip(ts, dst):
        torch.testing.assert_close(d, s * 0.5)
    assert set(report.op_counts()) >= {"multi_tensor_l2norm", "multi_tensor_scale"}


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_reference(torch_npu, report, adam_w_mode):
    torch.manual_seed(14)
    init = [torch.randn(5, 3), torch.randn(7)]
    runs = []
    for adam in (npu("adam"), cpu_backend.BACKEND.op("adam")):   # fused against foreach
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = adam(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                   adam_w_mode=adam_w_mode)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs.append((params, opt))
    (p_npu, opt_npu), (p_ref, _) = runs
    assert opt_npu.defaults["fused"] is True
    for a, b in zip(p_npu, p_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert set(opt_npu.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    name = "AdamW" if adam_w_mode else "Adam"
    assert ops_ran(report, "adam") == {f"npu.torch.fused.{name}": 1}


def test_rng_state_is_the_npu_generator(torch_npu):
    state = npu("rng_get_state")()
    a = torch.rand(4)                  # the emulated NPU generator is the CPU default generator
    npu("rng_set_state")(state)
    torch.testing.assert_close(torch.rand(4), a)
    assert torch.equal(npu("rng_get_state")(), torch.npu.default_generators[0].get_state())


def test_every_op_of_the_contract_is_implemented():
    from megatron_adapt.ops import OPS

    assert set(npu_backend.OPS) == set(OPS) - {"fp8_linear", "fp8_grouped_gemm", "fp8_swiglu"}   # fp8_unavailable says why
    for name in npu_backend.OPS:
        assert callable(npu_backend.BACKEND.op(name))


# ---------------------------------------------------------------------- gradient-accumulation fusion
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_accumulate_into_fp32_main_grad(torch_npu, report, dtype):
    """bf16 through torch_npu._npu_matmul_add_fp32 from 7.0.0 on; fp16 (ATB: no transposeA with
    float16) and 6.0.0 (no ATB op) through the reported addmm_ fallback."""
    torch.manual_seed(15)
    x, dy = torch.randn(37, 24).to(dtype), torch.randn(37, 40).to(dtype)
    main_grad = torch.randn(40, 24)
    expect = main_grad + dy.float().t() @ x.float()
    npu("wgrad_accumulate")(x, dy, main_grad)
    torch.testing.assert_close(main_grad, expect, atol=1e-4, rtol=1e-5)
    if torch_npu.PROFILE == "6.0.0":
        assert "has no _npu_matmul_add_fp32" in fallbacks(report, "wgrad_accumulate")[FALLBACK_WGRAD]
    elif dtype == torch.float16:
        assert "transposeA with float16" in fallbacks(report, "wgrad_accumulate")[FALLBACK_WGRAD]
    else:
        assert ops_ran(report, "wgrad_accumulate") == {"npu.torch_npu._npu_matmul_add_fp32": 1}
        assert not hasattr(torch_npu, "npu_matmul_add_fp32")   # the public-looking name does not exist


FALLBACK_WGRAD = "cpu.reference(wgrad_accumulate)"


def test_wgrad_accumulate_fallbacks_reported_and_strict(torch_npu, report, monkeypatch):
    from megatron_adapt.backends.npu import _lib

    x, dy, main_grad = torch.randn(5, 3).bfloat16(), torch.randn(5, 4).bfloat16(), torch.zeros(4, 3)
    if _lib.api().matmul_add_fp32:   # ATB loader failing (NNAL not installed): named, remembered
        def no_nnal(*args):
            raise OSError("libatb.so: cannot open shared object file")
        monkeypatch.setattr(torch_npu, "_npu_matmul_add_fp32", no_nnal)
    npu("wgrad_accumulate")(x, dy, main_grad)
    torch.testing.assert_close(main_grad, dy.float().t() @ x.float())
    why = fallbacks(report, "wgrad_accumulate")[FALLBACK_WGRAD]
    assert ("libatb.so" in why) if _lib.api().matmul_add_fp32 else ("no _npu_matmul_add_fp32" in why)
    _lib.PROBES.pop("matmul_add.unavailable", None)
    report.set_context(strict=True)
    with pytest.raises(StrictFallbackError, match="wgrad_accumulate"):
        npu("wgrad_accumulate")(x.half(), dy.half(), main_grad)


def test_attention_batch_first_views_go_as_bsh(torch_npu, report, monkeypatch):
    """q/k/v viewed from batch-first memory (MEGATRON_ADAPT_ATTENTION_LAYOUT=bshd) reach the kernel
    as layout "BSH" with no copy, and give the same result as the SBH path."""
    torch.manual_seed(16)
    layouts = []
    real = torch_npu.npu_fusion_attention

    def spy(*args, **kwargs):
        layouts.append(args[4])
        return real(*args, **kwargs)
    monkeypatch.setattr(torch_npu, "npu_fusion_attention", spy)
    s, b, h, d = 19, 2, 4, 8
    sbhd = [torch.randn(s, b, h, d) for _ in range(3)]
    bshd = [t.transpose(0, 1).contiguous() for t in sbhd]
    out_sbh = npu("attention")(*(t.permute(1, 2, 0, 3) for t in sbhd), causal=True)
    out_bsh = npu("attention")(*(t.transpose(1, 2) for t in bshd), causal=True)
    assert layouts == ["SBH", "BSH"]
    torch.testing.assert_close(out_bsh, out_sbh, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_sbh, ref("attention")(*(t.permute(1, 2, 0, 3) for t in sbhd), causal=True),
                               atol=2e-5, rtol=2e-5)

"""Other libraries' kernels as candidates (backends/cuda/providers.py).

- Liger-Kernel for real: its cross entropy runs under the Triton interpreter, so the forced mode
  (MEGATRON_ADAPT_EXTERNAL=liger) is checked in CI; with a GPU, the measured mode (auto) runs
  the tournament on real kernels and whatever wins must match the fp32 reference.
- The tournament itself (`measure`) on CPU functions whose speed and correctness we control.
- apex: its two norm functions, emulated with apex's public signatures (apex needs a CUDA build
  and is not installable here); a real apex that differs is caught by the agreement check.
"""
import sys
import time
import types

import pytest
import torch

from megatron_adapt import report
from megatron_adapt.backends.cuda import providers
from megatron_adapt.config import Config
from megatron_adapt.errors import ConfigError

from _cuda_helpers import DEVICE, GPU, assert_close, ran_impl, reset


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    providers.reset()
    reset()
    yield
    providers.reset()
    reset()


def _rms_ref(x, w, eps=1e-5):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def test_unknown_mode_is_a_config_error(monkeypatch):
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "tritonx")
    with pytest.raises(ConfigError, match="MEGATRON_ADAPT_EXTERNAL"):
        Config.resolve()
    assert Config.resolve(external="OFF").external == "off"


@pytest.mark.skipif(providers.library_installed("apex"), reason="apex is installed here")
def test_a_requested_library_that_is_missing_is_a_clear_error(monkeypatch):
    from megatron_adapt.backends.cuda.norms import rms_norm
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "apex")
    with pytest.raises(ConfigError, match="apex is not installed"):
        rms_norm(torch.randn(4, 8), torch.randn(8), 1e-5)


# ---- the tournament, on functions whose speed and correctness the test sets ------------------

def _slow(fn, ms):
    def run(*args):
        time.sleep(ms / 1e3)
        return fn(*args)
    return run


def _cand(name, fn):
    return providers.Candidate("lib", name, "torch", lambda *a: None, fn)


def _torch_rms(x, w, eps):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w)


ARGS = (torch.randn(8, 32, requires_grad=True), torch.randn(32, requires_grad=True), 1e-5)


def test_a_faster_agreeing_candidate_wins_and_broken_ones_are_rejected():
    def wrong(x, w, eps):
        return _torch_rms(x, w, eps) * 1.1

    def raises(x, w, eps):
        raise TypeError("unexpected keyword 'memory_efficient'")

    winner, notes = providers.measure(_slow(_torch_rms, 4), [
        _cand("wrong", wrong), _cand("raises", raises), _cand("fast", _torch_rms)], ARGS)
    assert winner is not None and winner.impl == "fast", notes
    assert notes["wrong"].startswith("rejected: output differs"), notes
    assert "raised TypeError" in notes["raises"], notes
    assert notes["ours_ms"] >= 4 > notes["fast"], notes


def test_ours_stays_unless_a_candidate_is_clearly_faster():
    winner, notes = providers.measure(_torch_rms, [_cand("slow", _slow(_torch_rms, 4))], ARGS)
    assert winner is None and notes["slow"] > notes["ours_ms"], notes
    # a tie (both take 40 ms): ours. On a loaded 2-core CI host a sleep overshoots by up to ~1 ms
    # (11.90 against 11.13 ms seen for 10 ms sleeps, outside MARGIN's 5 %); at 40 ms that is ~2 %
    winner, notes = providers.measure(_slow(_torch_rms, 40), [_cand("same", _slow(_torch_rms, 40))], ARGS)
    assert winner is None, notes


def test_gradient_disagreement_rejects():
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, eps):
            return _torch_rms(x, w, eps).detach()

        @staticmethod
        def backward(ctx, dy):
            return dy, None, None   # wrong dx, and no dw

    winner, notes = providers.measure(_slow(_torch_rms, 4), [_cand("badgrad", BadGrad.apply)], ARGS)
    assert winner is None and notes["badgrad"].startswith("rejected: gradient"), notes


def test_out_of_memory_while_timing_ours_keeps_ours():
    def ours(x, w, eps):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    winner, notes = providers.measure(ours, [_cand("fast", _torch_rms)], ARGS)
    assert winner is None and "out of GPU memory" in notes["ours_ms"], notes


def test_signatures_beyond_the_cap_run_ours_unmeasured(monkeypatch):
    """Shapes that change every call (packed sequences) must not start a tournament each time."""
    monkeypatch.setattr(providers, "MAX_SIGNATURES", 2)
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "liger")
    fast = providers.Candidate("liger", "fake.fast", "torch", lambda *a: None, _torch_rms)
    monkeypatch.setitem(providers.CANDIDATES, "rms_norm", [fast])
    op = providers.selectable("rms_norm")(_torch_rms)
    for rows in (3, 4, 5, 6):
        op(torch.randn(rows, 16), torch.randn(16), 1e-5)
    sel = report.as_dict()["selections"]
    assert [s["chosen"] for s in sel] == ["fake.fast", "fake.fast", "ours"], sel
    assert "more than 2 input signatures" in sel[-1]["how"]
    assert report.op_counts()["rms_norm"] == {"fake.fast": 2}   # ours (the bare function) reports nothing


# ---- Liger-Kernel, the real library ---------------------------------------------------------

needs_liger = pytest.mark.skipif(not providers.installed("liger_kernel"),
                                 reason="Liger-Kernel not installed (pip install liger-kernel; CI installs it)")


def _ce_inputs(rows=12, vocab=70, dtype=torch.float32):
    logits = torch.randn(rows, vocab, device=DEVICE, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device=DEVICE)
    return logits, target


@needs_liger
def test_forced_liger_cross_entropy_runs_liger_and_matches_reference(monkeypatch):
    from megatron_adapt.backends.cuda.cross_entropy import vocab_parallel_cross_entropy as ce
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "liger")
    logits, target = _ce_inputs()
    ref = torch.nn.functional.cross_entropy(logits.detach().double(), target, reduction="none")
    x = logits * 1.0   # Liger writes its gradient into its input: hand it a non-leaf, as Megatron does
    loss = ce(x, target, 0.0, None)
    g = torch.rand_like(loss)
    loss.backward(g)
    assert ran_impl("vocab_parallel_cross_entropy") == {"liger.LigerCrossEntropyFunction"}
    assert loss.dtype == torch.float32
    assert_close(loss, ref, torch.float32, "liger CE loss")
    lg = logits.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(lg, target, reduction="none").backward(g.double())
    assert_close(logits.grad, lg.grad, torch.float32, "liger CE grad")
    (sel,) = report.as_dict()["selections"]
    assert sel["chosen"] == "liger.LigerCrossEntropyFunction" and "not measured" in sel["how"]


@needs_liger
def test_forced_liger_keeps_ours_where_liger_cannot_serve(monkeypatch):
    from megatron_adapt.backends.cuda.cross_entropy import vocab_parallel_cross_entropy as ce
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "liger")
    logits, target = _ce_inputs()
    ce(logits * 1.0, target, 0.1, None)     # label smoothing: Megatron's formula, not Liger's
    assert ran_impl("vocab_parallel_cross_entropy") == {"cuda.triton.online_softmax"}
    (sel,) = report.as_dict()["selections"]
    assert sel["chosen"] == "ours" and "label smoothing" in str(sel["candidates"])
    assert "ours" in report.format_table() and "cannot serve" in report.format_table()


@needs_liger
def test_off_and_auto_without_a_gpu_run_ours_without_deciding(monkeypatch):
    from megatron_adapt.backends.cuda.cross_entropy import vocab_parallel_cross_entropy as ce
    for mode in ("off",) + (() if GPU else ("auto",)):
        monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", mode)
        logits, target = _ce_inputs()
        ce(logits * 1.0, target, 0.0, None)
        assert ran_impl("vocab_parallel_cross_entropy") == {"cuda.triton.online_softmax"}, mode
        assert report.as_dict()["selections"] == [], mode
        reset()


@needs_liger
@pytest.mark.skipif(not GPU, reason="the measured choice times kernels on a GPU")
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu", "vocab_parallel_cross_entropy"])
def test_auto_measures_on_the_gpu_and_the_winner_is_correct(monkeypatch, op):
    from megatron_adapt.backends.cuda import BACKEND
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "auto")
    fn = BACKEND.op(op)
    t, h = 4096, 4096
    if op == "vocab_parallel_cross_entropy":
        logits, target = _ce_inputs(4096, 32000, torch.bfloat16)
        out = fn(logits * 1.0, target, 0.0, None)
        ref = torch.nn.functional.cross_entropy(logits.detach().float(), target, reduction="none")
        assert_close(out, ref, torch.bfloat16, op)
    elif op == "swiglu":
        x = torch.randn(t, 2 * h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        a, b = x.detach().float().chunk(2, -1)
        assert_close(fn(x), torch.nn.functional.silu(a) * b, torch.bfloat16, op)
    else:
        x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        if op == "rms_norm":
            out, ref = fn(x, w, 1e-5), _rms_ref(x.detach(), w.detach())
        else:
            bias = torch.randn(h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            out = fn(x, w, bias, 1e-5)
            ref = torch.nn.functional.layer_norm(x.detach().float(), (h,), w.detach().float(),
                                                 bias.detach().float(), 1e-5)
        assert_close(out, ref, torch.bfloat16, op)
    (sel,) = report.as_dict()["selections"]
    assert sel["how"].startswith("measured") and sel["candidates"]["ours_ms"] > 0, sel
    print(f"\n{op}: {sel['chosen']} {sel['candidates']}")
    assert ran_impl(op) == {"cuda.triton" if sel["chosen"] == "ours" and op != "vocab_parallel_cross_entropy"
                            else "cuda.triton.online_softmax" if sel["chosen"] == "ours" else sel["chosen"]}


# ---- apex, emulated with its public signatures ------------------------------------------------

@pytest.fixture
def fake_apex(monkeypatch):
    """apex.normalization.fused_layer_norm's two functions (input, weight[, bias],
    normalized_shape, eps), computed in torch; `fused_layer_norm_cuda` is apex's compiled
    extension, whose presence is what says apex can run."""
    mod = types.ModuleType("apex.normalization.fused_layer_norm")
    mod.fused_rms_norm_affine = lambda x, w, shape, eps=1e-6: torch.nn.functional.rms_norm(x, shape, w, eps)
    mod.fused_layer_norm_affine = (
        lambda x, w, b, shape, eps=1e-6: torch.nn.functional.layer_norm(x, shape, w, b, eps))
    for name, m in {"apex": types.ModuleType("apex"), "apex.normalization": types.ModuleType("n"),
                    "apex.normalization.fused_layer_norm": mod,
                    "fused_layer_norm_cuda": types.ModuleType("fused_layer_norm_cuda")}.items():
        monkeypatch.setitem(sys.modules, name, m)
    providers.reset()


def test_forced_apex_norms_call_apex_functions(monkeypatch, fake_apex):
    from megatron_adapt.backends.cuda.norms import layer_norm, rms_norm
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "apex")
    x = torch.randn(6, 40, requires_grad=True)
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    assert_close(rms_norm(x, w, 1e-5), _rms_ref(x.detach(), w.detach()), torch.float32, "rms")
    assert_close(layer_norm(x, w, b, 1e-5),
                 torch.nn.functional.layer_norm(x.detach(), (40,), w.detach(), b.detach(), 1e-5),
                 torch.float32, "ln")
    assert ran_impl("rms_norm") == {"apex.fused_rms_norm_affine"}
    assert ran_impl("layer_norm") == {"apex.fused_layer_norm_affine"}


def test_ranks_of_the_replica_group_choose_together():
    """Two gloo ranks: a candidate faster on rank 0 only is chosen by neither (the slowest
    timing counts, so replicated values stay identical); faster on both, it is chosen by both."""
    import multiprocessing as mp
    import os
    import tempfile

    import _providers_agree_worker

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_providers_agree_worker.run, args=(r, 2, init_file, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (won0, ranks0, local0), (won0b, _, _) = got[0]
    (won1, ranks1, local1), (won1b, _, _) = got[1]
    assert ranks0 == ranks1 == 2
    assert local0 < 20 < local1, (local0, local1)     # rank 0 alone would have chosen it
    assert not won0 and not won1
    assert won0b and won1b


# ---- FlashAttention-4 (flash-attn-4) as the attention candidate ---------------------------------

def _attn_ref(q, k, v, causal):
    """fp32 reference in our op's [b, h, s, d] layout, GQA by repetition."""
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    r = qf.size(1) // kf.size(1)
    kf, vf = kf.repeat_interleave(r, 1), vf.repeat_interleave(r, 1)
    return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn.cute.flash_attn_func's contract: q/k/v [b, s, h, d] (any strides, last dim
    contiguous), returns (out [b, s, h, d], lse) -- computed in torch, checking the layout."""
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kw):
        assert q.dim() == 4 and q.stride(-1) == 1 and k.shape[2] <= q.shape[2], (q.shape, k.shape)
        calls.append((tuple(q.shape), causal))
        out = _attn_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
        return out.to(q.dtype).transpose(1, 2), None
    mod = types.ModuleType("flash_attn.cute")
    mod.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", mod)
    providers.reset()
    return calls


def test_fa4_serves_only_what_it_computes_exactly():
    q = torch.randn(2, 8, 16, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 16, 64, dtype=torch.bfloat16)
    serves = providers._fa4_serves
    assert "dropout" in serves(q, k, k, None, True, None, 0.1)
    assert "mask" in serves(q, k, k, torch.zeros(16, 16, dtype=torch.bool), False)
    assert "sliding window" in serves(q, k, k, None, True, None, 0.0, (4, 0))
    assert "dtype" in serves(q.float(), k.float(), k.float(), None, True)
    assert "head dim" in serves(q[..., :60], k[..., :60], k[..., :60], None, True)
    assert "query heads" in serves(q[:, :7], k[:, :2], k[:, :2], None, True)
    assert "sq != sk" in serves(q, k[:, :, :8], k[:, :, :8], None, True)
    assert "GPU" in serves(q, k, k, None, True)   # everything else fine: the device decides


def test_fa4_layout_and_gqa_match_the_reference(fake_fa4):
    # distinct b, h, s so that a transposed layout would fail the shape or the values
    q = torch.randn(3, 8, 20, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 3, 2, 20, 64, dtype=torch.bfloat16).unbind(0)
    sbhd = torch.randn(20, 3, 8, 64, dtype=torch.bfloat16).permute(1, 2, 0, 3)  # Megatron's view
    for qq in (q, sbhd):
        out = providers._fa4_attention(qq, k, v, None, True, None, 0.0, None)
        assert out.shape == qq.shape
        assert_close(out, _attn_ref(qq, k, v, True), torch.bfloat16, "fa4 layout")
    assert fake_fa4 == [((3, 20, 8, 64), True)] * 2


def test_fa4_forced_on_cpu_keeps_ours_with_every_keyword_argument(monkeypatch, fake_fa4):
    """Forced flash_attn cannot serve CPU tensors: ours runs, and the keyword arguments the
    wrapper binds to positions keep their values (causal=True after an omitted attn_mask)."""
    from megatron_adapt.backends.cuda.attention import attention
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "flash_attn")
    q, k, v = torch.randn(3, 1, 4, 12, 16).unbind(0)
    out = attention(q, k, v, causal=True)
    assert_close(out, _attn_ref(q, k, v, True), torch.float32, "causal kept")
    (sel,) = report.as_dict()["selections"]
    assert sel["chosen"] == "ours" and "cannot serve" in str(sel["candidates"]), sel
    assert fake_fa4 == []


fa4_installed = pytest.mark.skipif(not providers.installed("flash_attn.cute"),
                                   reason="flash-attn-4 is not installed")


@fa4_installed
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="FlashAttention-4 needs a Hopper or newer GPU")
@pytest.mark.parametrize("hkv", [8, 2])
def test_fa4_measured_on_the_gpu_and_correct(monkeypatch, hkv):
    from megatron_adapt.backends.cuda import BACKEND
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "auto")
    fn = BACKEND.op("attention")
    b, h, s, d = 2, 8, 1024, 128
    q = torch.randn(s, b, h, d, device=DEVICE, dtype=torch.bfloat16).permute(1, 2, 0, 3).requires_grad_()
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = fn(q, k, v, None, True, None, 0.0, None)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    r = qr.size(1) // kr.size(1)
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr.repeat_interleave(r, 1),
                                                           vr.repeat_interleave(r, 1), is_causal=True)
    assert_close(out, ref, torch.bfloat16, "attention")
    dy = torch.randn_like(ref)
    for g, gr in zip(torch.autograd.grad(out, (q, k, v), dy.to(out.dtype)),
                     torch.autograd.grad(ref, (qr, kr, vr), dy)):
        assert_close(g, gr, torch.bfloat16, "attention grad")
    (sel,) = report.as_dict()["selections"]
    assert sel["how"].startswith("measured") and "flash_attn_4.flash_attn_func" in sel["candidates"], sel
    print(f"\nattention hkv={hkv}: {sel['chosen']} {sel['candidates']}")
    # with dropout it cannot serve: ours, and said so
    fn(q, k, v, None, True, None, 0.1, None)
    assert "dropout" in str(report.as_dict()["selections"][-1]["candidates"])

"""Mamba-2 Triton kernels (SSD scan, causal conv1d, gated RMSNorm), forward and backward, against
the fp32 sequential-scan reference (reference.ssd_scan_sequential: one step at a time, no
chunking) and fp32 PyTorch. Under TRITON_INTERPRET=1 on CPU with small shapes; on a GPU larger."""
import pytest
import torch
import torch.nn.functional as F

from _cuda_helpers import DEVICE, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends import reference
from megatron_adapt.backends.cuda import ssm

# (b, l, h, p, g, n, chunk): a ragged last chunk, several chunks, groups shared by heads, p < 16
CASES = [(2, 203, 8, 64, 2, 64, 64), (1, 1000, 4, 64, 1, 128, 128), (2, 300, 6, 32, 3, 16, 128)] if GPU else \
    [(2, 45, 4, 8, 2, 16, 16), (1, 37, 2, 16, 1, 8, 32), (1, 64, 3, 4, 3, 4, 16)]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(b, l, h, p, g, n, dtype, seed=0):
    torch.manual_seed(seed)
    mk = lambda *s, scale=1.0: (torch.randn(*s, device=DEVICE) * scale).to(dtype).requires_grad_()
    return dict(x=mk(b, l, h, p), dt=mk(b, l, h, scale=0.5), A=(-torch.rand(h, device=DEVICE) - 0.2).requires_grad_(),
                B=mk(b, l, g, n, scale=0.5), C=mk(b, l, g, n, scale=0.5),
                D=torch.randn(h, device=DEVICE).requires_grad_(), z=mk(b, l, h, p),
                dt_bias=(torch.randn(h, device=DEVICE) * 0.3).requires_grad_(),
                initial_states=torch.randn(b, h, p, n, device=DEVICE).requires_grad_())


def _fp32_leaves(inp):
    return {k: v.detach().float().requires_grad_() for k, v in inp.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["full", "plain"])
def test_ssd_scan_forward_backward_against_sequential(case, dtype, variant):
    b, l, h, p, g, n, Q = case
    inp = _inputs(b, l, h, p, g, n, dtype)
    if variant == "plain":   # no D, z, dt bias, initial states; dt taken as given (positive)
        for k in ("D", "z", "dt_bias", "initial_states"):
            inp.pop(k)
        inp["dt"] = (torch.rand(b, l, h, device=DEVICE) * 0.3).to(dtype).requires_grad_()
        kw = dict(dt_softplus=False)
    else:
        kw = dict(dt_softplus=True, dt_limit=(0.0, float("inf")) if g == 2 else (0.05, 1.5))
    ref_in = _fp32_leaves(inp)
    reset()
    y, final = ssm.ssd_scan(chunk_size=Q, return_final_states=True, **inp, **kw)
    assert ran_impl("ssd_scan") == {"cuda.triton.ssd_scan"}
    yr, fr = reference.ssd_scan_sequential(return_final_states=True, **ref_in, **kw)
    assert y.dtype == dtype and final.dtype == torch.float32
    assert_close(y, yr, dtype, "y")
    assert_close(final, fr, torch.float32 if dtype == torch.float32 else dtype, "final state")
    dy, dfin = torch.randn_like(yr), torch.randn_like(fr)
    (y.float() * dy).sum().add_((final * dfin).sum()).backward()
    (yr * dy).sum().add_((fr * dfin).sum()).backward()
    for k, t in inp.items():
        assert t.grad is not None, k
        assert t.grad.dtype == t.dtype, k
        # gradients summed over l (A, D, dt_bias) or over heads (B, C): a little more rounding
        assert_close(t.grad, ref_in[k].grad, dtype, f"d{k}", scale=1.0 if dtype == torch.float32 else 2.0)


def test_ssd_scan_matches_the_chunked_reference_and_reports_fallbacks():
    inp = _inputs(1, 40, 2, 8, 1, 8, torch.float32, seed=3)
    out = ssm.ssd_scan(chunk_size=16, dt_softplus=True, **inp)
    ref = reference.ssd_scan(chunk_size=16, dt_softplus=True, **_fp32_leaves(inp))
    assert_close(out, ref, torch.float32, "vs chunked reference")
    reset()
    seq = torch.zeros(1, 40, dtype=torch.long, device=DEVICE)
    seq[:, 20:] = 1
    out = ssm.ssd_scan(chunk_size=16, dt_softplus=True, seq_idx=seq, **inp)   # packed: the reference
    assert ran_impl("ssd_scan") == {"cpu.reference(ssd_scan)", "cpu.reference.ssd_scan"}
    assert_close(out, reference.ssd_scan_sequential(dt_softplus=True, seq_idx=seq, **_fp32_leaves(inp)),
                 torch.float32, "seq_idx")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("shape,w", [((2, 45, 24), 4), ((1, 7, 70), 3)] if not GPU else
                         [((4, 2048, 1536), 4), ((2, 1000, 2100), 4)])
def test_causal_conv1d(shape, w, act, dtype):
    torch.manual_seed(1)
    b, l, d = shape
    # channel-last view of a wider tensor, as Megatron's in_proj output slice
    full = torch.randn(b, l, d + 5, device=DEVICE).to(dtype)
    x = full[..., 2:2 + d].requires_grad_()
    x.retain_grad()
    weight = (torch.randn(d, w, device=DEVICE) * 0.5).to(dtype).requires_grad_()
    bias = torch.randn(d, device=DEVICE).to(dtype).requires_grad_()
    reset()
    y = ssm.causal_conv1d(x, weight, bias, act)
    assert ran_impl("causal_conv1d") == {"cuda.triton.causal_conv1d"}
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, weight, bias))
    yr = F.conv1d(F.pad(xr.transpose(1, 2), (w - 1, 0)), wr.unsqueeze(1), br, groups=d).transpose(1, 2)
    yr = F.silu(yr) if act else yr
    assert_close(y, yr, dtype, "y")
    g = torch.randn_like(yr)
    y.backward(g.to(dtype))
    yr.backward(g)
    for name, t, r in (("dx", x, xr), ("dw", weight, wr), ("db", bias, br)):
        assert_close(t.grad, r.grad, dtype, name, scale=1.0 if name == "dx" else 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_rms_norm_gated(gated, before, dtype):
    torch.manual_seed(2)
    rows, d, gs = (37, 96, 32) if not GPU else (8192, 4096, 1024)
    x = torch.randn(rows, d, device=DEVICE).to(dtype).requires_grad_()
    z = torch.randn(rows, d, device=DEVICE).to(dtype).requires_grad_() if gated else None
    w = (torch.rand(d, device=DEVICE) + 0.5).to(dtype).requires_grad_()
    reset()
    y = ssm.rms_norm_gated(x, w, z, 1e-5, gs, before)
    assert ran_impl("rms_norm_gated") == {"cuda.triton.rms_norm_gated"}
    leaves = [x, w] + ([z] if gated else [])
    ref = [t.detach().float().requires_grad_() for t in leaves]
    yr = reference.rms_norm_gated(ref[0], ref[1], ref[2] if gated else None, 1e-5, gs, before)
    assert_close(y, yr, dtype, "y")
    g = torch.randn_like(yr)
    y.backward(g.to(dtype))
    yr.backward(g)
    for name, t, r in zip(("dx", "dw", "dz"), leaves, ref):
        assert_close(t.grad, r.grad, dtype, name, scale=1.0 if name != "dw" else 2.0)

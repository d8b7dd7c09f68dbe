"""The cpu backend's Mamba-2 ops (the references) against the fp32 sequential scan and PyTorch:
the chunked SSD scan forward and backward (D, z, dt bias + softplus, dt limits, initial and
final states, packed sequences through seq_idx), the causal conv1d and the gated RMSNorm; and the
npu backend's ops are the same references, reported as fallbacks."""
import pytest
import torch
import torch.nn.functional as F

from megatron_adapt import report
from megatron_adapt.backends import load, reference


def _leaves(b=2, l=45, h=4, p=6, g=2, n=5, seed=0):
    torch.manual_seed(seed)
    r = lambda *s, k=1.0: (torch.randn(*s) * k).requires_grad_()
    return dict(x=r(b, l, h, p), dt=r(b, l, h, k=0.5), A=(-torch.rand(h) - 0.2).requires_grad_(),
                B=r(b, l, g, n, k=0.5), C=r(b, l, g, n, k=0.5), D=r(h), z=r(b, l, h, p),
                dt_bias=r(h, k=0.3), initial_states=r(b, h, p, n))


@pytest.mark.parametrize("chunk", [8, 16, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_scan_matches_sequential_forward_and_backward(chunk, packed):
    inp = _leaves()
    ref = {k: v.detach().clone().requires_grad_() for k, v in inp.items()}
    seq = torch.tensor([[0] * 10 + [1] * 30 + [2] * 5, [0] * 45]) if packed else None
    kw = dict(dt_softplus=True, dt_limit=(0.02, 2.0), seq_idx=seq, return_final_states=True)
    report.reset_op_counts()
    y, s = load("cpu").op("ssd_scan")(chunk_size=chunk, **inp, **kw)
    assert report.op_counts()["ssd_scan"] == {"cpu.reference.ssd_scan": 1}
    yr, sr = reference.ssd_scan_sequential(**ref, **kw)
    torch.testing.assert_close(y, yr, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s, sr, atol=2e-5, rtol=2e-5)
    g, gs = torch.randn_like(y), torch.randn_like(s)
    ((y * g).sum() + (s * gs).sum()).backward()
    ((yr * g).sum() + (sr * gs).sum()).backward()
    for k in inp:
        torch.testing.assert_close(inp[k].grad, ref[k].grad, atol=1e-4, rtol=1e-4, msg=k)


def test_packed_sequences_do_not_leak_state():
    inp = {k: v.detach() for k, v in _leaves(b=1).items()}
    seq = torch.tensor([[0] * 20 + [1] * 25])
    both = reference.ssd_scan(chunk_size=16, dt_softplus=True, seq_idx=seq, **{**inp, "initial_states": None})
    second = {k: (v[:, 20:] if v.dim() >= 3 and v.size(1) == 45 else v) for k, v in inp.items()}
    alone = reference.ssd_scan(chunk_size=16, dt_softplus=True, **{**second, "initial_states": None})
    torch.testing.assert_close(both[:, 20:], alone, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_and_gated_norm():
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 11, 6), torch.randn(6, 4), torch.randn(6)
    y = load("cpu").op("causal_conv1d")(x, w, b, "silu")
    expect = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), b, groups=6)).transpose(1, 2)
    torch.testing.assert_close(y, expect)
    seq = torch.tensor([[0] * 4 + [1] * 7] * 2)
    packed = reference.causal_conv1d(x, w, b, None, seq)
    torch.testing.assert_close(packed[:, 4:], reference.causal_conv1d(x[:, 4:], w, b, None))
    xz, z, wn = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5
    y = load("cpu").op("rms_norm_gated")(xz, wn, z, 1e-5, 4, False)
    g = (xz * F.silu(z)).view(3, 2, 4)
    expect = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 8) * wn
    torch.testing.assert_close(y, expect)


def test_decode_steps_reproduce_the_full_sequence_ops():
    """Token-at-a-time decoding (the conv-state and SSM-state caches, Megatron's causal_conv1d_update
    and selective_state_update contracts) gives the full-sequence conv and the sequential scan, in
    cache slots chosen by index; a padding row (slot -1) gives zeros and touches no state; the
    intermediate buffers hold the state after each token; two tokens per call equal two calls."""
    torch.manual_seed(3)
    b, l, d, w, L = 2, 9, 6, 4, 4
    x, wt, bias = torch.randn(b, l, d), torch.randn(d, w), torch.randn(d)
    conv = load("cpu").op("ssm_conv_update")
    state = torch.zeros(4, d, L)                        # 4 slots; rows use slots 2 and 0
    idx = torch.tensor([2, 0])
    ys = [conv(x[:, t], state, wt, bias, True, idx) for t in range(l - 2)]
    inter = torch.zeros(4, 2, d, L)
    ys.append(conv(x[:, l - 2:], state, wt, bias, True, idx, inter))          # the last two at once
    y = torch.cat([torch.stack(ys[:-1], 1), ys[-1]], 1)
    torch.testing.assert_close(y, reference.causal_conv1d(x, wt, bias, "silu"))
    torch.testing.assert_close(state[idx], x[:, l - L:].transpose(1, 2))
    torch.testing.assert_close(inter[idx, 1], state[idx])
    torch.testing.assert_close(inter[idx, 0], x[:, l - L - 1:l - 1].transpose(1, 2))
    before = state.clone()
    pad = conv(x[:, 0], state, wt, bias, True, torch.tensor([-1, 1]))
    assert torch.equal(pad[0], torch.zeros(d)) and torch.equal(state[[0, 2, 3]], before[[0, 2, 3]])

    inp = {k: v.detach() for k, v in _leaves(b=2, l=7).items()}
    h, p, n = inp["x"].shape[2], inp["x"].shape[3], inp["B"].shape[3]
    yr, sr = reference.ssd_scan_sequential(**inp, dt_softplus=True, return_final_states=True)
    step = load("cpu").op("ssm_state_update")
    ssm = torch.zeros(3, h, p, n)
    ssm[[1, 2]] = inp["initial_states"]
    rows = torch.tensor([1, 2])
    A = inp["A"][:, None, None].expand(h, p, n)         # as the mixer passes them: per head and dim
    dt_bias, D = inp["dt_bias"][:, None].expand(h, p), inp["D"][:, None].expand(h, p)
    out = []
    for t in range(7):
        dt = inp["dt"][:, t, :, None].expand(b, h, p)
        out.append(step(ssm, inp["x"][:, t], dt, A, inp["B"][:, t], inp["C"][:, t], D, inp["z"][:, t],
                        dt_bias, True, rows))
    torch.testing.assert_close(torch.stack(out, 1), yr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm[rows], sr, atol=1e-5, rtol=1e-5)
    assert torch.equal(ssm[0], torch.zeros(h, p, n))
    from megatron_adapt.backends.npu import ssm as npu_ssm   # the module: no torch_npu needed

    report.reset_op_counts()
    npu_ssm.ssm_state_update(ssm, inp["x"][:, 0], dt, A, inp["B"][:, 0], inp["C"][:, 0])
    assert report.op_counts()["ssm_state_update"] == {"npu.reference.ssm_state_update": 1}

"""Stand-ins, in fp32 torch on any device, for aten's variable-length flash attention kernels
(`_flash_attention_forward` / `_flash_attention_backward`, GPU only) with their signatures and
layouts: q/k/v [total, heads, d], int32 cumulative offsets, the log-sum-exp as [heads, total]
(LAYOUT "hT") or [batch, heads, max_q] ("bhs"), causal bottom-right aligned, GQA by head counts.
The backward takes the caller's out and lse, as flash's does, so a ring's merged values flow
through it. They let the CPU tests check the code around the kernels: gathers, offsets, layouts,
pieces and merges. `calls` counts forward calls."""
import torch

LAYOUT = ["hT"]
calls = [0]


def _scores(q, k, causal, scale):
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(q.size(1) // k.size(1), 1))
    s = s * (scale if scale is not None else q.size(-1) ** -0.5)
    if causal:
        sq, sk = q.size(0), k.size(0)
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq), float("-inf"))
    return s


def _segments(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, scale=None, window_size_left=None,
            window_size_right=None, **_):
    assert dropout_p == 0.0 and window_size_left is None and window_size_right is None
    calls[0] += 1
    h = q.size(1)
    out = torch.zeros(q.shape[0], h, v.size(-1))
    lse_ht = torch.full((h, q.size(0)), float("-inf"))
    for a, b, c, d in _segments(cu_q, cu_k):
        s = _scores(q[a:b], k[c:d], causal, scale)                     # [h, sq, sk]
        lse_ht[:, a:b] = torch.logsumexp(s, -1)
        vv = v[c:d].float().repeat_interleave(h // v.size(1), 1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    if LAYOUT == ["hT"]:
        lse = lse_ht
    else:
        n = cu_q.numel() - 1
        lse = torch.full((n, h, max_q), float("-inf"))
        for i, (a, b, _, _) in enumerate(_segments(cu_q, cu_k)):
            lse[i, :, :b - a] = lse_ht[:, a:b]
    e = torch.empty(0)
    return out.to(q.dtype), lse, torch.empty(2, dtype=torch.long), e, e


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, unused, scale=None,
             window_size_left=None, window_size_right=None, **_):
    h, hkv = q.size(1), k.size(1)
    dq = torch.zeros(q.shape)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    sc = scale if scale is not None else q.size(-1) ** -0.5
    for i, (a, b, c, d) in enumerate(_segments(cu_q, cu_k)):
        l = lse[:, a:b] if LAYOUT == ["hT"] else lse[i, :, :b - a]       # [h, sq]
        s = _scores(q[a:b], k[c:d], causal, scale)
        p = torch.exp(s - l.unsqueeze(-1))
        g, o = dout[a:b].float(), out[a:b].float()
        kk = k[c:d].float().repeat_interleave(h // hkv, 1)
        vv = v[c:d].float().repeat_interleave(h // hkv, 1)
        dvv = torch.einsum("hqk,qhd->khd", p, g)
        dp = torch.einsum("qhd,khd->hqk", g, vv)
        ds = p * (dp - (g * o).sum(-1).t().unsqueeze(-1))
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * sc
        dkk = torch.einsum("hqk,qhd->khd", ds, q[a:b].float()) * sc
        dk[c:d] = dkk.view(d - c, hkv, h // hkv, -1).sum(2)
        dv[c:d] = dvv.view(d - c, hkv, h // hkv, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

"""Packed (thd) attention cases and their truth: full attention over all T tokens under an
explicit block-diagonal mask, in fp32 (tests/ops, tests/cuda, tests/npu share them)."""
import torch

# name -> (lengths, padded slot sizes | None, tail tokens after the last slot, hq, hkv, causal, window)
CASES = {
    "uneven": ([5, 1, 9, 3], None, 0, 4, 4, True, None),
    "gqa": ([7, 2, 1, 6], None, 0, 4, 2, True, None),
    "mqa_len1_first": ([1, 8, 4], None, 0, 4, 1, True, None),
    "padded": ([5, 1, 9, 3], [8, 4, 12, 4], 2, 4, 2, True, None),
    "window": ([6, 11, 1], None, 0, 4, 2, True, (3, 0)),
    "padded_window": ([6, 11, 1], [8, 12, 2], 0, 2, 2, True, (3, 0)),
    "non_causal": ([4, 1, 7], None, 0, 2, 1, False, None),
}


def cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def make(name, dtype=torch.float32, d=8, device="cpu", seed=0):
    """(q, k, v, kwargs for attention_thd, truth function of (q, k, v))."""
    lengths, slots, tail, hq, hkv, causal, window = CASES[name]
    slots = slots or lengths
    total = sum(slots) + tail
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    cu_s = cu(lengths).to(device)
    cu_p = None if slots is lengths else cu(slots).to(device)
    kwargs = dict(cu_seqlens_q=cu_s, cu_seqlens_kv=cu_s, cu_seqlens_q_padded=cu_p, cu_seqlens_kv_padded=cu_p,
                  causal=causal, scale=0.37, dropout_p=0.0, window_size=window)
    doc = torch.full((total,), -1)
    pos = torch.zeros(total, dtype=torch.long)
    start = 0
    for i, (n, slot) in enumerate(zip(lengths, slots)):
        doc[start:start + n] = i
        pos[start:start + n] = torch.arange(n)
        start += slot
    return q, k, v, kwargs, lambda q, k, v: truth(q, k, v, doc.to(q.device), pos.to(q.device), causal, window, 0.37)


def truth(q, k, v, doc, pos, causal, window, scale):
    """fp32 full attention over [T] with mask: other document, padding, causal, window; padding rows 0."""
    rep = q.size(1) // k.size(1)
    q32, k32, v32 = q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q32, k32) * scale
    qd, kd, qp, kp = doc[:, None], doc[None, :], pos[:, None], pos[None, :]
    masked = (qd != kd) | (kd < 0)
    if causal:
        masked = masked | (kp > qp)
    if window is not None:
        masked = masked | (kp < qp - window[0]) | (kp > qp + window[1])
    s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)      # padding rows see nothing: zeros
    out = torch.einsum("hqk,khd->qhd", p, v32)
    return out * (doc >= 0).view(-1, 1, 1)


def grads(fn, q, k, v, seed=1):
    """fn's output and the gradients of sum(out * g) w.r.t. q, k, v (fp32 copies)."""
    xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out.float() * g).sum().backward()
    return [out.detach().float()] + [x.grad.float() if x.grad is not None else torch.zeros_like(x, dtype=torch.float)
                                     for x in xs]


BENCH_LENGTHS = [700, 1, 1500, 333, 64, 900, 250, 348]


def bench_shape(device, hkv=4, padded=False, causal=True):
    """The GPU tests' bench-like case: 8 documents (one of length 1), 16 query heads over hkv, d128,
    bf16; padded: 5 rows of padding after each document and 7 after the last slot.
    -> q, k, v, the attention_thd keywords, cu_seqlens_padded (or None)."""
    slots = [n + (5 if padded else 0) for n in BENCH_LENGTHS]
    total = sum(slots) + (7 if padded else 0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 16, 128, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(total, hkv, 128, generator=g).to(device, torch.bfloat16) for _ in range(2))
    c = cu(BENCH_LENGTHS).to(device)
    c_p = cu(slots).to(device) if padded else None
    kw = dict(cu_seqlens_q=c, cu_seqlens_kv=c, cu_seqlens_q_padded=c_p, cu_seqlens_kv_padded=c_p, causal=causal)
    return q, k, v, kw, c_p

"""Attention through SDPA: causal, padding / arbitrary masks, sliding window, GQA, vs fp32 math."""
import pytest
import torch

from _cuda_helpers import DEVICE, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.reference import build_mask
from megatron_adapt.backends.cuda import attention as attn

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (b, hq, hkv, sq, sk, d)
SHAPES = [(2, 8, 8, 512, 512, 128), (2, 8, 2, 384, 384, 64)] if GPU else \
    [(2, 4, 4, 16, 16, 8), (1, 4, 2, 12, 12, 16)]


def _ref(q, k, v, mask, scale):
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "padding", "arbitrary", "window", "none"])
def test_attention(shape, dtype, kind):
    b, hq, hkv, sq, sk, d = shape
    torch.manual_seed(sq + d)
    q = torch.randn(b, hq, sq, d, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, sk, d, device=DEVICE).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, sk, d, device=DEVICE).to(dtype).requires_grad_()
    mask, causal, window = None, False, None
    if kind == "causal":
        causal = True
    elif kind == "padding":
        mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool, device=DEVICE)
        mask[0, ..., sk // 2:] = True
    elif kind == "arbitrary":
        mask = torch.rand(b, 1, sq, sk, device=DEVICE) > 0.6
        mask[..., 0] = False  # keep one key per row: rows with none are undefined in SDPA
    elif kind == "window":
        window = (sk // 4, 0)
    scale = d ** -0.5
    reset()
    out = attn.attention(q, k, v, attn_mask=mask, causal=causal, scale=scale, window_size=window)
    dout = torch.randn_like(out)
    out.backward(dout)
    impls = ran_impl("attention")
    assert len(impls) == 1 and next(iter(impls)).startswith("cuda.sdpa.")
    full = build_mask(sq, sk, causal, window, mask, DEVICE)
    leaves = [q, k, v]
    refs = [t.detach().float().requires_grad_() for t in leaves]
    outr = _ref(*refs, full, scale)
    outr.backward(dout.float())
    slack = 4.0 if GPU and dtype == torch.float32 else 2.0  # fp32 SDPA on GPU may use TF32
    assert_close(out, outr, dtype, "out", scale=slack)
    for name, t, r in zip("qkv", leaves, refs):
        assert_close(t.grad, r.grad, dtype, f"d{name}", scale=2 * slack)


@pytest.mark.skipif(not GPU, reason="which fused SDPA kernel serves is a GPU question")
def test_fused_path_on_gpu():
    q = torch.randn(2, 8, 1024, 128, device=DEVICE, dtype=torch.bfloat16)
    reset()
    attn.attention(q, q, q, causal=True)
    impl = next(iter(ran_impl("attention")))
    assert impl in ("cuda.sdpa.cudnn", "cuda.sdpa.flash"), impl

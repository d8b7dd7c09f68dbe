"""multi_tensor l2norm / scale and the fused optimizers."""
import pytest
import torch

from _cuda_helpers import DEVICE, GPU
from megatron_adapt.backends.cuda import multi_tensor


def test_l2norm_mixed_dtypes_stays_on_device():
    ts = [torch.randn(n, device=DEVICE).to(dt) for n, dt in
          ((17, torch.float32), (300, torch.bfloat16), (5, torch.float16))]
    out = multi_tensor.l2norm(ts)
    assert out.device.type == DEVICE.type and out.dtype == torch.float32
    ref = torch.cat([t.double().flatten() for t in ts]).norm()
    assert abs(out.item() - ref.item()) <= 1e-5 * ref.item()


def test_scale_copy_and_inplace():
    srcs = [torch.randn(n, device=DEVICE) for n in (3, 40)]
    dsts = [torch.empty_like(s) for s in srcs]
    multi_tensor.scale(srcs, dsts, 0.25)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s * 0.25)
    keep = [s.clone() for s in srcs]
    multi_tensor.scale(srcs, srcs, 2.0)
    for s, k in zip(srcs, keep):
        assert torch.equal(s, k * 2.0)


@pytest.mark.skipif(not GPU, reason="fused AdamW / SGD are CUDA kernels")
def test_fused_adamw_matches_foreach():
    from megatron_adapt.backends.cuda.optimizers import Adam
    p1 = [torch.randn(1000, device=DEVICE, requires_grad=True) for _ in range(3)]
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    o1 = Adam(p1, lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW(p2, lr=1e-2, weight_decay=0.1, foreach=True)
    for _ in range(3):
        for a, b in zip(p1, p2):
            g = torch.randn_like(a)
            a.grad, b.grad = g, g.clone()
        o1.step(), o2.step()
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)

"""The cuda backend's context-parallel blocks (FlashBlocks: each ring block cut into all-visible
and causal pieces, one varlen flash call per piece, merged by log-sum-exp; the backward from the
ring's final out / lse) against the torch-math blocks, one process, on a GPU: every (rank, source)
block of Megatron's load-balanced split at CP 2 and 4, bf16, GQA, forward and backward. The ring,
merges and collectives around them are tests/ops/test_cp_attention.py's (kernels stood in there)."""
import pytest
import torch

from _cuda_helpers import DEVICE, assert_close, ran_impl, reset

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="the flash kernels run on a GPU only")


@pytest.mark.parametrize("cp_size", [2, 4])
def test_flash_blocks_match_math_blocks(cp_size):
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.cuda import attention as attn

    b, hq, hkv, d, s_local, scale = 2, 8, 2, 128, 512, 0.088
    g = torch.Generator(device="cpu").manual_seed(0)
    for rank in range(cp_size):
        qpos, qdoc = cp.sbhd_meta(b, s_local, cp_size, rank, DEVICE)
        for src in range(cp_size):
            kpos, kdoc = cp.sbhd_meta(b, s_local, cp_size, src, DEVICE)
            ok = cp.visible(qpos, qdoc, kpos, kdoc, True, None)
            if not bool(ok.any()):
                continue
            q = torch.randn(b, hq, s_local, d, generator=g).to(DEVICE, torch.bfloat16)
            k, v = (torch.randn(b, hkv, s_local, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
            reset()
            out, lse = attn.FlashBlocks.fwd(q, k, v, ok, scale, None)
            assert "cuda.torch.block" not in ran_impl("attention_cp"), (rank, src)
            want_out, want_lse = cp._block_fwd(q, k, v, ok, scale, None)
            assert_close(out, want_out, torch.bfloat16, f"out r{rank} s{src}")
            torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=0)
            dout = torch.randn(out.shape, generator=g).to(DEVICE)
            got = attn.FlashBlocks.bwd(q, k, v, ok, scale, want_out, dout, want_lse, None)
            want = cp._block_bwd(q, k, v, ok, scale, want_out, dout, want_lse, None)
            for name, a, w in zip(("dq", "dk", "dv"), got, want):
                assert a.shape == w.shape, (name, a.shape, w.shape)
                assert_close(a, w, torch.bfloat16, f"{name} r{rank} s{src}")


def test_windows_take_the_math_blocks():
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.cuda import attention as attn

    qpos, qdoc = cp.sbhd_meta(1, 256, 2, 0, DEVICE)
    ok = cp.visible(qpos, qdoc, qpos, qdoc, True, (37, 0))
    q, k, v = (torch.randn(1, 4, 256, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    reset()
    out, lse = attn.FlashBlocks.fwd(q, k, v, ok, 0.125, None)
    assert ran_impl("attention_cp") == {"cuda.torch.block"}
    want, _ = cp._block_fwd(q, k, v, ok, 0.125, None)
    torch.testing.assert_close(out, want)

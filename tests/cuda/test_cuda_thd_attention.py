"""Packed (thd) attention on the cuda backend: the sequences as one padded batch through SDPA
(is_causal where causal, else a key-padding mask), against full attention under an explicit
block-diagonal mask (tests/thd_cases.py), forward and backward. On CPU tensors without a GPU
(SDPA's CPU kernels); the flash / cuDNN paths and the speed need an H100 (scripts/bench_kernels.py)."""
import pytest
import torch

import thd_cases
from _cuda_helpers import DEVICE, ran_impl, reset
from megatron_adapt.backends.cuda import attention as attn


@pytest.mark.parametrize("case", list(thd_cases.CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_batch_matches_block_diagonal_attention(case, dtype):
    reset()
    q, k, v, kw, truth = thd_cases.make(case, dtype, device=DEVICE)
    got = thd_cases.grads(lambda q, k, v: attn.attention_thd(q, k, v, **kw), q, k, v)
    want = thd_cases.grads(truth, q.float(), k.float(), v.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{case} {name}: {m}")
    assert all(i.startswith("cuda.sdpa.padded_batch.") for i in ran_impl("attention_thd")), ran_impl("attention_thd")


def test_q_and_kv_lengths_that_differ_go_one_sequence_at_a_time():
    reset()
    q = torch.randn(6, 2, 8, device=DEVICE)
    k = v = torch.randn(9, 2, 8, device=DEVICE)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    out = attn.attention_thd(q, k, v, cu_q, cu_k, causal=True)
    from megatron_adapt.backends import reference
    want = torch.cat([reference.attention(q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None],
                                          v[c:d].transpose(0, 1)[None], None, True)[0].transpose(0, 1)
                      for a, b, c, d in ((0, 2, 0, 4), (2, 6, 4, 9))])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert ran_impl("attention_thd") == {"cuda.sdpa.per_sequence"}


def test_increasing_check():
    q, k, v, kw, _ = thd_cases.make("uneven", device=DEVICE)
    kw["cu_seqlens_q"] = torch.tensor([0, 9, 6, 15, 18], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="non-decreasing"):
        attn.attention_thd(q, k, v, **kw)

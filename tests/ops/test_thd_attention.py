"""Packed (thd) attention, the cpu backend's op (the reference): forward and backward against full
attention under an explicit block-diagonal mask (tests/thd_cases.py), fp32 1e-5, bf16 2e-2; and
its refusals of malformed offsets and non-thd inputs."""
import pytest
import torch

import thd_cases
from megatron_adapt import report
from megatron_adapt.backends import reference
from megatron_adapt.backends.cpu import attention


@pytest.mark.parametrize("case", list(thd_cases.CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thd_matches_block_diagonal_attention(case, dtype):
    q, k, v, kw, truth = thd_cases.make(case, dtype)
    got = thd_cases.grads(lambda q, k, v: attention.attention_thd(q, k, v, **kw), q, k, v)
    want = thd_cases.grads(truth, q.float(), k.float(), v.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{case} {name}: {m}")
    assert report.op_counts()["attention_thd"].get("cpu.torch.sdpa.per_sequence")


def test_padding_rows_are_zero_with_zero_gradient():
    q, k, v, kw, _ = thd_cases.make("padded")
    out, dq, dk, dv = thd_cases.grads(lambda q, k, v: attention.attention_thd(q, k, v, **kw), q, k, v)
    pad = torch.tensor([5, 6, 7, 9, 10, 11, 21, 22, 23, 27, 28, 29])
    assert out[pad].abs().max() == 0 and dq[pad].abs().max() == 0
    assert dk[pad].abs().max() == 0 and dv[pad].abs().max() == 0


@pytest.mark.parametrize("bad,message", [
    (torch.tensor([0, 5, 3, 9], dtype=torch.int32), "cu_seqlens_q must be non-decreasing"),
    (torch.tensor([1, 5, 9], dtype=torch.int32), "cu_seqlens_q must start at 0"),
    (torch.tensor([0.0, 5.0, 9.0]), "cu_seqlens_q must be a 1-D integer tensor"),
    (torch.tensor([0, 5, 40], dtype=torch.int32), "past the 18 packed tokens"),
])
def test_malformed_offsets_are_refused(bad, message):
    q, k, v, kw, _ = thd_cases.make("uneven")
    kw["cu_seqlens_q"] = bad
    with pytest.raises(ValueError, match=message):
        attention.attention_thd(q, k, v, **kw)


def test_sbhd_tensors_into_the_thd_op_are_refused():
    q = torch.randn(2, 4, 9, 8)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed \(thd\) attention takes q/k/v as \[T, heads, d\]"):
        attention.attention_thd(q, q, q, cu, cu)


def test_offsets_are_read_once_per_tensor_until_written(monkeypatch):
    """One cu_seqlens tensor serves every layer of a step: its values are read (on a GPU, a sync)
    once; an in-place write, or another tensor, reads again."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    reads = []
    real = reference._checked_offsets
    monkeypatch.setattr(reference, "_checked_offsets", lambda t, name: reads.append(name) or real(t, name))
    assert reference.thd_segments(cu, None, 5) == [(0, 3), (3, 2)]
    assert reference.thd_segments(cu, None, 5) == [(0, 3), (3, 2)]
    assert len(reads) == 1
    cu[1] = 1
    assert reference.thd_segments(cu, None, 5) == [(0, 1), (1, 4)]
    assert len(reads) == 2
    assert reference.thd_segments(cu.clone(), None, 5) == [(0, 1), (1, 4)]
    assert len(reads) == 3
    with torch.inference_mode():
        frozen = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert reference.thd_segments(frozen, None, 5) == [(0, 2), (2, 3)]
    assert reference.thd_segments(frozen, None, 5) == [(0, 2), (2, 3)]
    assert len(reads) == 5

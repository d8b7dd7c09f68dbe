"""Packed (thd) attention on the npu backend: npu_fusion_attention in layout "TND" with
actual_seq_qlen / actual_seq_kvlen as cumulative end offsets (lists of ints), through the torch_npu
emulation, against full attention under an explicit block-diagonal mask (tests/thd_cases.py):
forward and backward, fp32 1e-5, bf16 2e-2. Padding between sequences enters the kernel inside
each padded slot (hidden by the causal mask) and is zeroed; masks that would see it take the
reference, reported."""
import pytest
import torch

import thd_cases
from megatron_adapt.backends import npu as npu_backend

IMPL = "npu.torch_npu.npu_fusion_attention(TND)"


def op():
    return npu_backend.BACKEND.op("attention_thd")


@pytest.mark.parametrize("case", list(thd_cases.CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tnd_matches_block_diagonal_attention(torch_npu, report, monkeypatch, case, dtype):
    calls = []
    real = torch_npu.npu_fusion_attention

    def spy(*args, **kwargs):
        calls.append((args[4], kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch_npu, "npu_fusion_attention", spy)
    q, k, v, kw, truth = thd_cases.make(case, dtype)
    got = thd_cases.grads(lambda q, k, v: op()(q, k, v, **kw), q, k, v)
    want = thd_cases.grads(truth, q.float(), k.float(), v.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{case} {name}: {m}")
    assert set(report.op_counts()["attention_thd"]) == {IMPL}
    (layout, kwargs), = calls
    lengths, slots = thd_cases.CASES[case][:2]
    ends = thd_cases.cu([n for n in (slots or lengths)]).tolist()[1:]
    assert layout == "TND" and kwargs["actual_seq_qlen"] == ends and kwargs["actual_seq_kvlen"] == ends
    assert all(type(x) is int for x in kwargs["actual_seq_qlen"])
    assert kwargs["sparse_mode"] == (4 if thd_cases.CASES[case][6] else 3 if thd_cases.CASES[case][5] else 0)


def test_padding_under_a_mask_that_sees_it_takes_the_reference(torch_npu, report):
    q, k, v, kw, truth = thd_cases.make("padded")
    kw["causal"] = False
    out = op()(q, k, v, **kw)
    doc_rows = out.abs().sum((1, 2)) > 0
    assert doc_rows.sum() == 18      # the 18 tokens of the 4 sequences, padding rows zero
    falls = {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"]
             if o["op"] == "attention_thd" and o["fallback_reason"]}
    assert "padding between sequences" in falls["npu.torch.sdpa (reference)"]


def test_decreasing_offsets_are_refused(torch_npu):
    q, k, v, kw, _ = thd_cases.make("gqa")
    kw["cu_seqlens_kv"] = torch.tensor([0, 7, 5, 10, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_kv must be non-decreasing"):
        op()(q, k, v, **kw)

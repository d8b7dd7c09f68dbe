"""Packed (thd) attention on the cuda backend against full attention under an explicit
block-diagonal mask (tests/thd_cases.py), forward and backward. On a GPU, bf16 goes through torch's
variable-length flash kernel and fp32 as one padded batch through SDPA; without a GPU (CPU tensors,
SDPA's CPU kernels) every case takes the padded batch. The speed is scripts/bench_kernels.py's."""
import pytest
import torch

import thd_cases
from _cuda_helpers import DEVICE, assert_close, ran_impl, reset
from megatron_adapt.backends.cuda import attention as attn
from megatron_adapt.backends.cuda import cudnn_thd


def gpu_impl(q, k, v, kw):
    """What bf16 on a GPU takes: cuDNN's ragged graphs where they serve (Hopper, with
    nvidia-cudnn-frontend; tests/cuda/test_cuda_thd_cudnn.py), else torch's varlen flash kernel."""
    from megatron_adapt.backends import reference
    segs_q = reference.thd_segments(kw["cu_seqlens_q"], kw.get("cu_seqlens_q_padded"), q.size(0))
    segs_kv = reference.thd_segments(kw["cu_seqlens_kv"], kw.get("cu_seqlens_kv_padded"), k.size(0))
    why = cudnn_thd.why_not(q, k, v, segs_q, segs_kv, kw.get("causal", True), kw.get("dropout_p", 0.0),
                            kw.get("window_size"))
    return "cuda.cudnn.ragged" if why is None else "cuda.flash.varlen"


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
    if DEVICE.type == "cuda" and dtype == torch.bfloat16:
        assert ran_impl("attention_thd") == {gpu_impl(q, k, v, kw)}
    else:
        assert all(i.startswith("cuda.sdpa.padded_batch.") for i in ran_impl("attention_thd")), ran_impl("attention_thd")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's varlen flash kernel runs on a GPU only")
@pytest.mark.parametrize("padded", [False, True])
def test_thd_at_bench_shape(padded):
    """8 documents (one of length 1), GQA 16/4 heads, d128, bf16, against one SDPA per document in fp32."""
    reset()
    q, k, v, kw, _ = thd_cases.bench_shape(DEVICE, padded=padded)
    got = thd_cases.grads(lambda q, k, v: attn.attention_thd(q, k, v, **kw), q, k, v)
    from megatron_adapt.backends import reference
    want = thd_cases.grads(lambda q, k, v: reference.attention_thd(q, k, v, **kw), q.float(), k.float(), v.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, torch.bfloat16, name)      # ||a - b|| / ||b|| <= 1.2e-2
    assert ran_impl("attention_thd") == {gpu_impl(q, k, v, kw)}


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


class _VarlenOnCpu:
    """Stands in for aten's varlen flash kernel (GPU only) with the reference over the same
    cumulative offsets, so the gathers, the offsets and the scatter back are checked here on
    every case."""
    calls = 0

    @staticmethod
    def apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, left, right):
        from megatron_adapt.backends import reference
        _VarlenOnCpu.calls += 1
        assert cu_q.dtype == torch.int32 and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        assert q.size(0) == int(cu_q[-1]) and k.size(0) == int(cu_k[-1])     # compacted rows only
        window = None if left is None else (left, right)
        return reference.attention_thd(q, k, v, cu_q, cu_k, causal=causal, scale=scale, window_size=window)


@pytest.mark.parametrize("case", list(thd_cases.CASES))
def test_varlen_gather_offsets_and_scatter(monkeypatch, case):
    monkeypatch.setattr(attn, "_FlashVarlen", _VarlenOnCpu)
    from megatron_adapt.backends import reference
    q, k, v, kw, truth = thd_cases.make(case, torch.float32)
    segs_q = reference.thd_segments(kw["cu_seqlens_q"], kw["cu_seqlens_q_padded"], q.size(0))
    segs_kv = reference.thd_segments(kw["cu_seqlens_kv"], kw["cu_seqlens_kv_padded"], k.size(0))
    _VarlenOnCpu.calls = 0
    got = thd_cases.grads(lambda q, k, v: attn._varlen(q, k, v, segs_q, segs_kv, kw["causal"], kw["scale"], 0.0,
                                                       kw["window_size"]), q, k, v)
    want = thd_cases.grads(truth, q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case} {name}: {m}")
    assert _VarlenOnCpu.calls == 1


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's varlen flash kernel runs on a GPU only")
@pytest.mark.parametrize("case", list(thd_cases.CASES))
def test_device_offsets_path_matches_block_diagonal_attention(case):
    """The path a CUDA-graph capture takes (offsets never read on the host), run eagerly: forward and
    backward against the fp32 truth, padding rows 0 in the output and in every gradient."""
    reset()
    q, k, v, kw, truth = thd_cases.make(case, torch.bfloat16, device=DEVICE)
    args = [kw[n] for n in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                            "causal", "scale", "dropout_p", "window_size")]
    got = thd_cases.grads(lambda q, k, v: attn._varlen_on_device(q, k, v, *args), q, k, v)
    want = thd_cases.grads(truth, q.float(), k.float(), v.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_a_captured_call_follows_the_offsets_of_each_replay():
    """Megatron's graph runners capture packed attention once and replay it with new cu_seqlens
    (RL's get_logprobs): the replay's output equals the eager path's for the offsets of that replay,
    empty sequences (repeated offsets, as RL's default packing makes) included."""
    reset()
    q, k, v, kw, _ = thd_cases.make("uneven", torch.bfloat16, device=DEVICE)
    cu = kw["cu_seqlens_q"].clone()
    static = dict(kw, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn.attention_thd(q, k, v, **static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.attention_thd(q, k, v, **static)
    assert "cuda.flash.varlen(device offsets, captured)" in ran_impl("attention_thd")
    for lengths in ([5, 1, 9, 3], [2, 8, 4, 4], [18, 0, 0, 0], [3, 3, 0, 4]):
        cu.copy_(thd_cases.cu(lengths).to(DEVICE))
        graph.replay()
        want = attn.attention_thd(q, k, v, **dict(kw, cu_seqlens_q=cu.clone(), cu_seqlens_kv=cu.clone()))
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{lengths}: {m}")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_padded_slots_without_causal_are_refused_in_a_capture():
    q, k, v, kw, _ = thd_cases.make("padded", torch.bfloat16, device=DEVICE)
    with pytest.raises(RuntimeError, match="causal attention only"):
        attn._varlen_on_device(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_kv"], kw["cu_seqlens_q_padded"],
                               kw["cu_seqlens_kv_padded"], False, 0.37, 0.0, None)

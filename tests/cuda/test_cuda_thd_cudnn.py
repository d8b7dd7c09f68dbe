"""Packed (thd) attention through cuDNN's ragged graphs (backends/cuda/cudnn_thd.py). The ragged
offsets, lengths and buckets are checked everywhere; the kernels on a Hopper GPU with
nvidia-cudnn-frontend installed, against the fp32 reference, forward and backward."""
import pytest
import torch

import thd_cases
from _cuda_helpers import DEVICE, assert_close, ran_impl, reset
from megatron_adapt.backends import reference
from megatron_adapt.backends.cuda import attention as attn
from megatron_adapt.backends.cuda import cudnn_thd


@pytest.fixture(autouse=True)
def _cudnn_frontend_allowed(monkeypatch):
    """tests/cuda/conftest.py keeps other libraries' kernels out (MEGATRON_ADAPT_EXTERNAL=off);
    here the cuDNN frontend's graphs are the path under test, as a user's default (auto) takes them."""
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "auto")


def test_ragged_offsets_lengths_and_buckets():
    """5 sequences with padding between them: 8 in the bucket (3 empty ones at the end), offsets in
    elements of q's and kv's rows, the longest (700) rounded up to 1024."""
    segs = [(0, 700), (705, 1), (711, 300), (1011, 64), (1080, 5)]
    b, s, off_q, off_kv, seq_len = cudnn_thd._layout(segs, 1100, 16, 4, 128, torch.device("cpu"))
    assert (b, s) == (8, 1024)
    starts = [0, 705, 711, 1011, 1080, 1100, 1100, 1100, 1100]
    assert off_q.flatten().tolist() == [x * 16 * 128 for x in starts]
    assert off_kv.flatten().tolist() == [x * 4 * 128 for x in starts]
    assert seq_len.flatten().tolist() == [700, 1, 300, 64, 5, 0, 0, 0]
    assert off_q.dtype == seq_len.dtype == torch.int32 and off_q.shape == (9, 1, 1, 1)
    assert cudnn_thd._layout([(0, 3)], 3, 1, 1, 8, torch.device("cpu"))[:2] == (1, 64)


def test_what_it_does_not_serve_says_why():
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    segs = [(0, 4)]
    assert cudnn_thd.why_not(q, q, q, segs, segs, True, 0.0, None) == "not a CUDA tensor"
    if DEVICE.type != "cuda" or not cudnn_thd.available():
        return
    q = q.to(DEVICE)
    if torch.cuda.get_device_capability() < (9, 0):
        return
    assert "dropout" in cudnn_thd.why_not(q, q, q, segs, segs, True, 0.1, None)
    assert "window" in cudnn_thd.why_not(q, q, q, segs, segs, True, 0.0, (3, 0))
    assert "differ" in cudnn_thd.why_not(q, q, q, segs, [(0, 3)], True, 0.0, None)
    assert "dtype" in cudnn_thd.why_not(q.float(), q.float(), q.float(), segs, segs, True, 0.0, None)
    big = torch.zeros(16384, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    skewed = [(0, 8192)] + [(8192 + 128 * i, 128) for i in range(64)]
    assert "softmax statistics" in cudnn_thd.why_not(big, big, big, skewed, skewed, True, 0.0, None)


def test_padded_statistics_bound():
    """One long document among many short ones: the backward's padded statistics ([128, h, 8192])
    would be 64x the rows, so the varlen flash kernel serves; the bench's 8 documents up to 6339
    tokens in 16384 rows ([8, h, 8192]: 4x), 32 documents up to 4095 ([32, h, 4096]: 8x) and tiny
    inputs stay on cuDNN."""
    skewed = [(0, 8192)] + [(8192 + 128 * i, 128) for i in range(64)]
    assert "padded to more than 32x the rows" in cudnn_thd.stats_too_padded(skewed, 16384)
    assert cudnn_thd.stats_too_padded([(0, 4095)] + [(4095 + 390 * i, 390) for i in range(31)], 16384) is None
    bench = [(0, 6339)] + [(6339 + 1000 * i, 1000) for i in range(7)]
    assert cudnn_thd.stats_too_padded(bench, 16384) is None
    assert cudnn_thd.stats_too_padded([(0, 0), (0, 5)], 5) is None


needs_cudnn = pytest.mark.skipif(
    DEVICE.type != "cuda" or not cudnn_thd.available() or torch.cuda.get_device_capability() < (9, 0),
    reason="cuDNN's ragged graphs: a Hopper GPU and nvidia-cudnn-frontend")


@needs_cudnn
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("hkv,causal", [(4, True), (16, True), (4, False)])
def test_cudnn_ragged_at_bench_shape(padded, hkv, causal):
    """8 documents (one of length 1), 16 query heads, d128, bf16, padding between documents and
    after the last, against the fp32 reference, forward and backward."""
    reset()
    q, k, v, kw, cu_p = thd_cases.bench_shape(DEVICE, hkv, padded, causal)
    total, lengths = q.size(0), thd_cases.BENCH_LENGTHS
    got = thd_cases.grads(lambda q, k, v: attn.attention_thd(q, k, v, **kw), q, k, v)
    want = thd_cases.grads(lambda q, k, v: reference.attention_thd(q, k, v, **kw), q.float(), k.float(), v.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, torch.bfloat16, name)
        assert torch.isfinite(a).all(), name
    if padded:   # rows outside every document: zero output, zero gradients
        pad = torch.ones(total, dtype=torch.bool)
        for start, n in zip(cu_p.tolist(), lengths):
            pad[start:start + n] = False
        for name, a in zip(("out", "dq", "dk", "dv"), got):
            assert a[pad.to(a.device)].abs().max() == 0, name
    assert ran_impl("attention_thd") == {"cuda.cudnn.ragged"}


@needs_cudnn
def test_graphs_are_reused_within_a_bucket():
    """Other document lengths with the same count and longest bucket build no new graph."""
    def run(lengths):
        total = sum(lengths)
        q = torch.randn(total, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        cu = thd_cases.cu(lengths).to(DEVICE)
        attn.attention_thd(q, q, q, cu, cu, causal=True).sum().backward()
    run([100, 200, 700])
    before = cudnn_thd.graph_count()
    run([300, 600, 100])        # 3 sequences -> bucket 4, longest 600 -> 1024 as before; T the same
    assert cudnn_thd.graph_count() == before
    run([300, 500, 200, 1, 2])  # 5 sequences -> bucket 8: one new forward and one new backward graph
    assert cudnn_thd.graph_count() == before + 2


@needs_cudnn
@pytest.mark.parametrize("case", ["uneven", "gqa", "mqa_len1_first", "padded", "non_causal"])
def test_cudnn_ragged_small_cases(case):
    reset()
    q, k, v, kw, truth = thd_cases.make(case, torch.bfloat16, d=64, device=DEVICE)
    got = thd_cases.grads(lambda q, k, v: attn.attention_thd(q, k, v, **kw), q, k, v)
    want = thd_cases.grads(truth, q.float(), k.float(), v.float())
    # cuDNN's backward rounds dS to bf16 as its dense kernel does: a few elements of dq / dk land 2 bf16
    # ulps off at these magnitudes (max |diff| 0.028-0.039 on an H200). Checked as the bench-shape
    # case is, by norm, plus a bound on any one element that a masking error would break.
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, torch.bfloat16, f"{case} {name}")
        assert (a.float() - b).abs().max() <= 0.0625, f"{case} {name}"
    assert ran_impl("attention_thd") == {"cuda.cudnn.ragged"}


@needs_cudnn
def test_external_off_keeps_to_the_varlen_flash_kernel(monkeypatch):
    from megatron_adapt.backends.cuda import providers
    monkeypatch.setattr(providers, "_mode", lambda: "off")
    reset()
    q = torch.randn(64, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    cu = thd_cases.cu([20, 44]).to(DEVICE)
    attn.attention_thd(q, q, q, cu, cu, causal=True)
    assert ran_impl("attention_thd") == {"cuda.flash.varlen"}

"""The cuda backend's MoE ops against fp64 references, forward and backward, with uneven tokens
per expert and experts with no tokens.

grouped_gemm: on an H100 (capability 9.0) bf16 runs torch._grouped_mm; fp32/fp16 and operands
whose strides are not 16-byte aligned run the per-expert loop, reported as a fallback. Without a
GPU the torch._grouped_mm autograd function is checked on CPU tensors (PyTorch has a CPU
implementation of the same op) and the public op reports the fallback for CPU tensors.
Permutation / chunk sort / router: device-side PyTorch, checked against the references on the
test device, with no host synchronisation needed for the output sizes.
"""
import pytest
import torch

from _cuda_helpers import DEVICE, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends import reference as ref
from megatron_adapt.backends.cuda import moe

SIZES = [[37, 0, 120, 5, 0, 64, 1, 29], [0, 0, 16], [256]]
HOPPER = GPU and torch.cuda.get_device_capability()[0] >= 9


def reference(x, w, sizes, trans_b=False):
    rows, r0 = [], 0
    for e, n in enumerate(sizes):
        rows.append(x[r0:r0 + n].double() @ (w[e].t() if trans_b else w[e]).double())
        r0 += n
    return torch.cat(rows)


def run(fn, x, w, sizes, trans_b):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w, sizes, trans_b)
    g = torch.randn(y.shape, device=y.device, generator=torch.Generator(y.device).manual_seed(1)).to(y.dtype)
    y.backward(g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = reference(xr, wr, sizes, trans_b)
    yr.backward(g.double())
    return (y, x.grad, w.grad), (yr, xr.grad, wr.grad)


def operands(sizes, dtype, trans_b, k=64, n=96):
    torch.manual_seed(0)
    e = len(sizes)
    x = torch.randn(sum(sizes), k, device=DEVICE).to(dtype)
    w = (torch.randn(e, n, k, device=DEVICE) if trans_b else torch.randn(e, k, n, device=DEVICE)) * 0.1
    return x, w.to(dtype)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_mm_function_bf16(sizes, trans_b):
    """The torch._grouped_mm path itself (on CPU tensors when there is no GPU)."""
    x, w = operands(sizes, torch.bfloat16, trans_b)
    if GPU and not HOPPER:
        pytest.skip("torch._grouped_mm needs compute capability 9.0+")
    ours, ref = run(lambda x, w, s, t: moe.grouped_mm(x, w, torch.tensor(s), t), x, w, sizes, trans_b)
    for what, a, b in zip(("y", "dx", "dw"), ours, ref):
        assert_close(a, b, torch.bfloat16, what, scale=1.5)
    for e, cnt in enumerate(sizes):
        if cnt == 0:
            assert (ours[2][e] == 0).all(), "empty expert's weight gradient must be zero"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_grouped_gemm_op_path_and_fallbacks(dtype):
    sizes = SIZES[0]
    x, w = operands(sizes, dtype, False)
    reset()
    ours, ref = run(lambda x, w, s, t: moe.grouped_gemm(x, w, torch.tensor(s), t), x, w, sizes, False)
    for what, a, b in zip(("y", "dx", "dw"), ours, ref):
        assert_close(a, b, dtype, what, scale=1.5)
    fast = HOPPER and dtype == torch.bfloat16
    assert ran_impl("grouped_gemm") == ({"cuda.torch._grouped_mm"} if fast else {"cuda.loop(matmul per expert)"})
    if not fast:
        from megatron_adapt import report
        assert report.as_dict()["ops"][0]["fallback_reason"]


def test_grouped_gemm_unaligned_falls_back_with_reason():
    x, w = operands([3, 4], torch.bfloat16, False, k=20, n=12)
    assert "multiples of 8" in (moe.grouped_mm_reason(x, w) or "")


def test_permute_unpermute_sort_router_on_device():
    torch.manual_seed(0)
    t, e, k, h = (4096, 16, 2, 256) if GPU else (64, 8, 2, 32)
    logits = torch.randn(t, e, device=DEVICE)
    logits[:, 3] = -1e4  # an expert no token picks
    reset()
    probs, routing_map = moe.moe_topk_router(logits, k, False, None, None, None, "softmax", None)
    r_probs, r_map = ref.moe_topk_router(logits.cpu(), k)
    assert torch.equal(routing_map.cpu(), r_map) and torch.allclose(probs.cpu(), r_probs, atol=1e-6)
    x = torch.randn(t, h, device=DEVICE, requires_grad=True)
    out, pprobs, row_map = moe.moe_permute(x, routing_map, probs, t * k)
    rows = row_map.cpu()
    assert torch.equal(out.detach().cpu(), x.detach().cpu()[rows % t])
    assert (rows // t).diff().ge(0).all(), "rows must be expert-major"
    y = moe.moe_unpermute(out, row_map, (t, h), probs)
    expect = x.detach().double() * probs.sum(-1, keepdim=True).double()
    assert_close(y, expect, torch.float32, "unpermute")
    y.sum().backward()
    assert_close(x.grad, probs.sum(-1, keepdim=True).expand(t, h), torch.float32, "d tokens")
    counts = routing_map.sum(0)
    order = torch.randperm(e, device=DEVICE)
    sorted_out, _ = moe.moe_sort_chunks(out.detach(), counts, order)
    chunks = torch.split(out.detach().cpu(), counts.tolist())
    assert torch.equal(sorted_out.cpu(), torch.cat([chunks[i] for i in order.tolist()]))
    assert ran_impl("moe_permute") and ran_impl("moe_unpermute") and ran_impl("moe_sort_chunks")


# ---- inside a CUDA graph: what Megatron's whole-layer graphs capture with capacity-padded dispatch --

@pytest.mark.parametrize("sizes", [[16, 16, 16, 16], SIZES[0], [0, 0, 16], [0, 0, 0]])
def test_offsets_on_device_are_the_cumsum(sizes):
    """The offsets grouped_gemm builds while a graph is captured (kernels only, no host copy)."""
    off = moe.offsets_on_device(sizes, DEVICE)
    assert off.dtype == torch.int32 and off.device.type == DEVICE.type
    assert off.cpu().tolist() == torch.tensor(sizes).cumsum(0).tolist()


def _padded_moe_step(x, router_w, w1, topk, capacity, m_splits, cuda_moe):
    """One MoE block as Megatron's alltoall dispatcher runs it with --moe-expert-capacity-factor
    and --moe-pad-expert-input-to-capacity (fused permutation and router), forward and backward:
    router top-k, each expert keeps its `capacity` best tokens (padded), permute to
    capacity * experts rows, grouped GEMM with host split sizes, weighted unpermute."""
    e = router_w.shape[0]
    logits = x @ router_w.t()
    probs, _ = cuda_moe.moe_topk_router(logits, topk, False, None, None, None, "softmax", None)
    _, keep = torch.topk(probs, k=capacity, dim=0, sorted=False)          # Megatron's pad_to_capacity
    routing_map = torch.zeros_like(probs).scatter(0, keep, 1).bool()
    probs = probs * routing_map
    permuted, pprobs, row_map = cuda_moe.moe_permute(x, routing_map, probs, capacity * e)
    h = cuda_moe.grouped_gemm(permuted, w1, m_splits, True)
    y = cuda_moe.moe_unpermute(h, row_map, (x.shape[0], h.shape[1]), probs)
    loss = y.float().square().mean()
    return (loss, *torch.autograd.grad(loss, (x, router_w, w1)))


@pytest.mark.skipif(not GPU, reason="needs a GPU (a real CUDA graph capture)")
@pytest.mark.parametrize("m_splits", ["list", "cpu_tensor"])
def test_capacity_padded_moe_ops_capture_and_replay(m_splits):
    """Router, permute, grouped GEMM (host split sizes, as TEGroupedMLP passes them), unpermute and
    their backward captured in one CUDA graph, replayed on new inputs: the same results as eager.
    No op reads anything back to the host or copies host memory inside the capture."""
    torch.manual_seed(0)
    t, hdim, n, e, topk = 512, 128, 256, 8, 2
    capacity = t * topk // e
    dtype = torch.bfloat16
    splits = [capacity] * e if m_splits == "list" else torch.full((e,), capacity, dtype=torch.long)
    x = torch.randn(t, hdim, device="cuda", dtype=dtype, requires_grad=True)
    router_w = (torch.randn(e, hdim, device="cuda", dtype=dtype) * 0.1).requires_grad_()
    w1 = (torch.randn(e, n, hdim, device="cuda", dtype=dtype) * 0.05).requires_grad_()
    step = lambda: _padded_moe_step(x, router_w, w1, topk, capacity, splits, moe)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (1, 2):
        torch.manual_seed(seed)
        fresh = torch.randn(t, hdim, device="cuda", dtype=dtype)
        with torch.no_grad():
            x.copy_(fresh)
        graph.replay()
        eager = step()
        for what, a, b in zip(("loss", "dx", "d router", "d w1"), static, eager):
            assert torch.equal(a, b) or assert_close(a, b, dtype, what) is None, what
    if HOPPER:
        assert "cuda.torch._grouped_mm" in ran_impl("grouped_gemm")


@pytest.mark.skipif(not GPU, reason="needs a GPU (a real CUDA graph capture)")
def test_grouped_gemm_uneven_host_splits_capture():
    """Uneven host split sizes (empty experts included) inside a capture: the fill-kernel offsets."""
    x, w = operands(SIZES[0], torch.bfloat16, True)
    sizes = list(SIZES[0])
    eager = moe.grouped_gemm(x, w, sizes, True)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.grouped_gemm(x, w, sizes, True)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static = moe.grouped_gemm(x, w, sizes, True)
    graph.replay()
    assert torch.equal(static, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_gemm_wgrad_op(dtype, sizes):
    """--delay-wgrad-compute's grouped weight gradient dw[e] = dy_e^T @ x_e ([E, n, k], the weight
    gradient of grouped_gemm(x, w [E, n, k], trans_b=True)) against fp64: torch._grouped_mm with
    K-axis groups on Hopper bf16, else the loop with its reason (what runs without a GPU)."""
    x, w = operands(sizes, dtype, True)
    reset()
    ours, ref = run(lambda x, w, s, t: moe.grouped_gemm(x, w, torch.tensor(s), t), x, w, sizes, True)
    g = torch.randn(ours[0].shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1)).to(dtype)
    reset()
    dw = moe.grouped_gemm_wgrad(g, x, torch.tensor(sizes))
    assert dw.shape == w.shape
    assert_close(dw, ref[2], dtype, "dw", scale=1.5)
    fast = HOPPER and dtype == torch.bfloat16 and sum(sizes) > 0
    assert ran_impl("grouped_gemm_wgrad") == (
        {"cuda.torch._grouped_mm(k-axis groups)"} if fast else {"cuda.loop(matmul per expert)"})

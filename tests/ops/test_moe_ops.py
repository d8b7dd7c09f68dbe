"""Tier 2: the cpu backend's MoE ops (the references in backends/reference.py, which the cuda
backend also runs for permutation and routing, and whose loop is every backend's grouped-GEMM
fallback) against fp32/fp64 references written from the math, forward and backward: uneven
tokens per expert, experts with no tokens."""
import pytest
import torch
import torch.nn.functional as F

from megatron_adapt.backends.cpu import moe

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
SIZES = [[5, 0, 3, 9, 0, 1], [0, 0, 4], [7]]


def ref_grouped(x, w, sizes, trans_b=False):
    rows, r0 = [], 0
    for e, n in enumerate(sizes):
        we = w[e].t() if trans_b else w[e]
        rows.append(x[r0:r0 + n].double() @ we.double())
        r0 += n
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_fwd_bwd(dtype, sizes, trans_b):
    e, k, n = len(sizes), 24, 40
    x = torch.randn(sum(sizes), k).to(dtype).requires_grad_()
    w = (torch.randn(e, n, k) if trans_b else torch.randn(e, k, n)).mul(0.2).to(dtype).requires_grad_()
    y = moe.grouped_gemm(x, w, torch.tensor(sizes), trans_b)
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = ref_grouped(xr, wr, sizes, trans_b)
    yr.backward(g.double())
    tol = TOL[dtype] * 4
    torch.testing.assert_close(y.double(), yr, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=tol * 4, rtol=tol)
    for ex, cnt in enumerate(sizes):
        if cnt == 0:
            assert (w.grad[ex] == 0).all()


def test_grouped_gemm_rejects_sizes_that_do_not_split_x():
    with pytest.raises(ValueError, match="does not split"):
        moe.grouped_gemm(torch.randn(5, 4), torch.randn(2, 4, 4), torch.tensor([2, 2]))


def routing(num_tokens, num_experts, topk, empty=(1,)):
    """A top-k routing map with experts `empty` never chosen (uneven load)."""
    logits = torch.randn(num_tokens, num_experts)
    logits[:, list(empty)] = -1e9
    idx = logits.topk(topk, dim=-1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.softmax(torch.randn(num_tokens, num_experts), -1) * routing_map
    return routing_map, probs


def ref_permute(tokens, routing_map, probs):
    """Megatron's order: experts in order, tokens ascending within each."""
    rows, p, src = [], [], []
    for e in range(routing_map.shape[1]):
        for t in range(routing_map.shape[0]):
            if routing_map[t, e]:
                rows.append(tokens[t].double()), p.append(probs[t, e].double()), src.append(t)
    return torch.stack(rows), torch.stack(p), src


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_count", [True, False])
def test_permute_unpermute_fwd_bwd(dtype, with_count):
    t, e, k, h = 13, 6, 2, 16
    routing_map, probs = routing(t, e, k, empty=(1, 4))
    tokens = torch.randn(t, h).to(dtype).requires_grad_()
    probs = probs.to(dtype).requires_grad_()
    out, pprobs, row_map = moe.moe_permute(tokens, routing_map, probs, t * k if with_count else None)
    rows, p_ref, src = ref_permute(tokens.detach(), routing_map, probs.detach())
    torch.testing.assert_close(out.double(), rows, atol=0, rtol=0)
    torch.testing.assert_close(pprobs.double(), p_ref, atol=0, rtol=0)
    assert (row_map % t).tolist() == src
    # unpermute with the probs: sum over each token's experts of prob * row (fp32 sum)
    y = moe.moe_unpermute(out * 2.0, row_map, (t, h), probs)
    g = torch.randn(t, h)
    (y.float() * g).sum().backward()
    tr, pr = tokens.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    yr = torch.einsum("te,th->th", pr * routing_map, tr * 2.0)
    (yr * g.double()).sum().backward()
    tol = TOL[dtype] * 4
    torch.testing.assert_close(y.double(), yr, atol=tol, rtol=tol)
    assert y.dtype == dtype
    torch.testing.assert_close(tokens.grad.double(), tr.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(probs.grad.double() * routing_map, pr.grad * routing_map, atol=tol, rtol=tol)


def test_unpermute_without_probs_sums_each_tokens_rows():
    t, e, h = 9, 5, 8
    routing_map, _ = routing(t, e, 3, empty=(0,))
    x = torch.randn(t, h)
    permuted, _, row_map = moe.moe_permute(x, routing_map, None, t * 3)
    torch.testing.assert_close(moe.moe_unpermute(permuted, row_map, (t, h)), x * 3, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("split_sizes", [[3, 0, 2, 5, 0, 1], [0, 4, 0, 0]])
def test_sort_chunks_fwd_bwd(split_sizes):
    c = len(split_sizes)
    order = torch.randperm(c)
    x = torch.randn(sum(split_sizes), 6, requires_grad=True)
    p = torch.rand(sum(split_sizes), requires_grad=True)
    y, py = moe.moe_sort_chunks(x, torch.tensor(split_sizes), order, p)
    chunks, pchunks = torch.split(x, split_sizes), torch.split(p, split_sizes)
    yr = torch.cat([chunks[i] for i in order.tolist()])
    torch.testing.assert_close(y, yr, atol=0, rtol=0)
    torch.testing.assert_close(py, torch.cat([pchunks[i] for i in order.tolist()]), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    inv = torch.empty_like(x)
    starts = torch.tensor([0] + split_sizes).cumsum(0)
    o = 0
    for i in order.tolist():
        inv[starts[i]:starts[i] + split_sizes[i]] = g[o:o + split_sizes[i]]
        o += split_sizes[i]
    torch.testing.assert_close(x.grad, inv, atol=0, rtol=0)


def ref_router(logits, topk, pre, score, bias, groups, group_topk, scale, dtype):
    """Megatron's formula, written out per token in fp64 (scores rounded to the logits' dtype
    before the top-k, as Megatron's and the op's are)."""
    lg = logits.double()
    t, e = lg.shape
    probs = torch.zeros_like(lg)
    for i in range(t):
        if score == "softmax":
            s = torch.softmax(lg[i], -1).to(dtype).double() if pre else lg[i]
        else:
            s = torch.sigmoid(lg[i]).to(dtype).double()
        choose = s + (bias.double() if bias is not None else 0)
        if groups:
            gs = choose.view(groups, -1).topk(topk // group_topk, -1).values.sum(-1)
            keep = gs.topk(group_topk).indices
            mask = torch.zeros(groups, dtype=torch.bool)
            mask[keep] = True
            choose = choose.masked_fill(~mask.repeat_interleave(e // groups), float("-inf"))
        idx = choose.topk(topk).indices
        top = s[idx]
        if score == "softmax":
            val = top if pre else torch.softmax(top, -1)
        else:
            val = top / (top.sum() + 1e-20) if topk > 1 else top
        probs[i, idx] = val * (scale or 1.0)
    return probs


@pytest.mark.parametrize("score,pre,use_bias,groups", [
    ("softmax", False, False, None), ("softmax", True, False, None), ("sigmoid", False, False, None),
    ("sigmoid", False, True, None), ("sigmoid", False, True, 4), ("softmax", True, False, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_router_fwd_bwd(score, pre, use_bias, groups, dtype):
    t, e, k = 11, 8, 2
    logits = torch.randn(t, e).to(dtype).requires_grad_()
    bias = torch.randn(e) * 0.1 if use_bias else None
    scale = 2.5 if groups else None
    probs, routing_map = moe.moe_topk_router(logits, k, pre, groups, 2 if groups else None, scale, score, bias)
    lr = logits.detach().double().requires_grad_()
    pr = ref_router(lr, k, pre, score, bias, groups, 2 if groups else None, scale, dtype)
    assert routing_map.dtype == torch.bool and (routing_map.sum(-1) == k).all()
    assert torch.equal(routing_map, pr != 0)
    tol = TOL[dtype] * 4
    torch.testing.assert_close(probs.double(), pr, atol=tol, rtol=tol)
    g = torch.randn(t, e)
    (probs.float() * g).sum().backward()
    (pr * g.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), lr.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_scores(score):
    logits = torch.randn(10, 6, requires_grad=True)
    routing_map, scores = moe.moe_router_scores(logits, 2, score)
    ref = torch.softmax(logits.double(), -1) if score == "softmax" else torch.sigmoid(logits.double())
    if score == "sigmoid":
        ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(scores.double(), ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(routing_map, torch.zeros(10, 6, dtype=torch.bool).scatter(1, ref.topk(2).indices, True))
    scores.sum().backward()  # differentiable (the aux loss flows through it)
    assert logits.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_gemm_wgrad_is_the_grouped_gemm_weight_gradient(dtype, sizes):
    """grouped_gemm_wgrad(dy, x) [E, n, k] (--delay-wgrad-compute's backward_dw) against the fp64
    weight gradient of y_e = x_e @ w_e^T (trans_b), experts without rows zero."""
    e, k, n = len(sizes), 24, 40
    x = torch.randn(sum(sizes), k).to(dtype)
    w = torch.randn(e, n, k, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(sizes), n).to(dtype)
    ref_grouped(x.double(), w, sizes, trans_b=True).backward(g.double())
    dw = moe.grouped_gemm_wgrad(g, x, torch.tensor(sizes))
    assert dw.shape == (e, n, k) and dw.dtype == dtype
    tol = TOL[dtype] * 16
    torch.testing.assert_close(dw.double(), w.grad, atol=tol, rtol=tol)
    for ex, cnt in enumerate(sizes):
        if cnt == 0:
            assert (dw[ex] == 0).all()
    with pytest.raises(ValueError, match="does not split"):
        moe.grouped_gemm_wgrad(g, x, torch.tensor([*sizes[:-1], sizes[-1] + 1]))

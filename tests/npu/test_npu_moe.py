"""The npu backend's MoE ops through the torch_npu EMULATION (no Ascend NPU exists here) against
fp64 references, forward and backward: uneven tokens per expert, experts with no tokens; which
kernel ran and the reported fallbacks. Also the emulation's own contract checks for these ops."""
import pytest
import torch

from megatron_adapt.backends import npu as npu_backend
from megatron_adapt.backends import reference as ref


def op(name):
    return npu_backend.BACKEND.op(name)


def ran(report, name):
    return set(report.op_counts().get(name, {}))


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("sizes", [[5, 0, 3, 9, 0, 1], [0, 4]])
def test_grouped_gemm_npu_grouped_matmul(torch_npu, report, dtype, sizes):
    torch.manual_seed(0)
    e, k, n = len(sizes), 16, 24
    x = torch.randn(sum(sizes), k).to(dtype).requires_grad_()
    w = (torch.randn(e, k, n) * 0.2).to(dtype).requires_grad_()
    y = op("grouped_gemm")(x, w, torch.tensor(sizes))
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rows, r0 = [], 0
    for ex, cnt in enumerate(sizes):
        rows.append(xr[r0:r0 + cnt] @ wr[ex])
        r0 += cnt
    yr = torch.cat(rows)
    yr.backward(g.double())
    tol = TOL[dtype] * 4
    torch.testing.assert_close(y.double(), yr, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=tol * 4, rtol=tol)
    for ex, cnt in enumerate(sizes):
        if cnt == 0:
            assert (w.grad[ex] == 0).all()
    from megatron_adapt.backends.npu import _lib, moe

    forms, done = _lib.api(), ran(report, "grouped_gemm")
    if not forms.gmm_tensor_group_list and (dtype == torch.float32 or len(sizes) == 1):
        assert done == {"npu.loop(matmul per expert)"}          # 6.0.0's int[] form: fp16/bf16 only
        return
    assert moe.GMM in done
    if forms.gmm_k_axis:   # 7.2.0+: dW through group_type=2 on the transposed view
        assert done == {moe.GMM, moe.GMM_WGRAD}
    else:                  # earlier: dW one matmul per expert, reported with the reason
        assert done == {moe.GMM, moe.WGRAD_LOOP}
        assert "group_type=2" in {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"]
                                  if o["op"] == "grouped_gemm"}[moe.WGRAD_LOOP]


def test_grouped_gemm_calls_the_release_form(torch_npu, report, monkeypatch):
    """What reaches npu_grouped_matmul: 6.0.0 a list of ints and a list of 2-D weights, no
    group_type; 7.x an int64 Tensor, group_type=0 forward / dx, group_type=2 on x.t() (a
    transposed view, not a copy) for dW from 7.2.0."""
    from megatron_adapt.backends.npu import _lib

    calls, real = [], torch_npu.npu_grouped_matmul

    def spy(x, weight, **kw):
        calls.append((x[0].shape, x[0].stride(), [tuple(w.shape) for w in weight], kw))
        return real(x, weight, **kw)
    monkeypatch.setattr(torch_npu, "npu_grouped_matmul", spy)
    x = torch.randn(7, 4, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.bfloat16, requires_grad=True)
    op("grouped_gemm")(x, w, torch.tensor([2, 0, 5])).sum().backward()
    forms = _lib.api()
    if not forms.gmm_tensor_group_list:
        assert [c[3] for c in calls] == [dict(group_list=[2, 2, 7], split_item=2)] * 2
        assert [c[2] for c in calls] == [[(4, 5)] * 3, [(5, 4)] * 3]
        return
    assert [c[3]["group_type"] for c in calls] == [0, 0] + ([2] if forms.gmm_k_axis else [])
    assert all(c[3]["group_list"].tolist() == [2, 2, 7] and c[3]["group_list_type"] == 0 for c in calls)
    if forms.gmm_k_axis:
        shape, stride, weights, kw = calls[2]
        assert shape == (4, 7) and stride == (1, 4) and weights == [(7, 5)] and kw["split_item"] == 3


def test_grouped_gemm_k_axis_refusals(torch_npu):
    """The documented K-axis layout (aclnnGroupedMatmulV4 groupType 2): x transposed, weight not.
    A contiguous copy of x.t() is refused where the release has K-axis grouping at all."""
    from torch_npu import EmulatedNPUError

    x, dy, groups = torch.randn(7, 4), torch.randn(7, 5), torch.tensor([2, 2, 7])
    if torch_npu.PROFILE == "6.0.0":
        with pytest.raises(TypeError, match="group_type"):
            torch_npu.npu_grouped_matmul([x.t()], [dy], group_list=[2, 2, 7], split_item=3, group_type=2)
        return
    call = dict(bias=None, group_list=groups, split_item=3, group_type=2, group_list_type=0)
    if torch_npu.PROFILE in ("7.0.0", "7.1.0"):
        with pytest.raises(EmulatedNPUError, match="group_type|K-axis"):
            torch_npu.npu_grouped_matmul([x.t()], [dy], **call)
        return
    out = torch_npu.npu_grouped_matmul([x.t()], [dy], **call)[0]
    assert out.shape == (3, 4, 5) and (out[1] == 0).all()
    torch.testing.assert_close(out[2], x[2:].t() @ dy[2:])
    with pytest.raises(EmulatedNPUError, match="x must be transposed"):
        torch_npu.npu_grouped_matmul([x.t().contiguous()], [dy], **call)
    with pytest.raises(EmulatedNPUError, match="weight must not be transposed"):
        torch_npu.npu_grouped_matmul([x.t()], [dy.t().contiguous().t()], **call)


def routed(t, e, k, empty=(1,)):
    logits = torch.randn(t, e)
    logits[:, list(empty)] = -1e9
    probs, routing_map = ref.moe_topk_router(logits, k)
    return routing_map, probs


def test_permute_unpermute_npu_kernels(torch_npu, report):
    torch.manual_seed(1)
    t, e, k, h = 11, 6, 2, 8
    routing_map, probs = routed(t, e, k, empty=(1, 4))
    x = torch.randn(t, h).bfloat16().requires_grad_()
    probs = probs.requires_grad_()
    out, pprobs, row_map = op("moe_permute")(x, routing_map, probs, t * k)
    r_out, r_probs, _ = ref.moe_permute(x.detach(), routing_map, probs.detach(), t * k)
    assert torch.equal(out, r_out) and torch.equal(pprobs.detach(), r_probs)  # Megatron's row order
    y = op("moe_unpermute")(out, row_map, (t, h), probs)
    expect = x.detach().double() * probs.detach().sum(-1, keepdim=True).double()
    torch.testing.assert_close(y.double(), expect, atol=3e-2, rtol=3e-2)
    g = torch.randn(t, h)
    (y.float() * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), g.double() * probs.detach().sum(-1, keepdim=True).double(),
                               atol=3e-2, rtol=3e-2)
    expect_dp = (g.double() * x.detach().double()).sum(-1, keepdim=True).expand(t, e) * routing_map
    torch.testing.assert_close(probs.grad.double(), expect_dp, atol=5e-2, rtol=3e-2)
    y2 = op("moe_unpermute")(out.detach(), row_map, (t, h))  # no probs: each token's rows summed
    torch.testing.assert_close(y2.double(), x.detach().double() * k, atol=3e-2, rtol=3e-2)
    from megatron_adapt.backends.npu import _lib

    if _lib.api().moe_token_permute:
        assert ran(report, "moe_permute") == {"npu.torch_npu.npu_moe_token_permute"}
        assert ran(report, "moe_unpermute") == {"npu.torch_npu.npu_moe_token_unpermute"}
    else:                  # before 7.1.0: no such ops, the reported PyTorch path
        assert ran(report, "moe_permute") == {"npu.torch(moe_permute)"}
        assert not hasattr(torch_npu, "npu_moe_token_permute")


def test_permute_dropped_tokens_and_fp32_fall_back_reported(torch_npu, report):
    t, e, h = 6, 4, 4
    routing_map, probs = routed(t, e, 2, empty=())
    routing_map[0, routing_map[0].nonzero()[0]] = False  # token 0 lost an expert (capacity drop)
    x = torch.randn(t, h).bfloat16()
    n = int(routing_map.sum())
    out, _, row_map = op("moe_permute")(x, routing_map, None, n)
    assert torch.equal(out, ref.moe_permute(x, routing_map, None, n)[0])
    reasons = {o["fallback_reason"] for o in report.as_dict()["ops"] if o["op"] == "moe_permute"}
    assert any(("different numbers of experts" if hasattr(torch_npu, "npu_moe_token_permute")
                else "has no npu_moe_token_permute") in r for r in reasons), reasons
    y = op("moe_unpermute")(out, row_map, (t, h))  # dropped tokens: unpermute falls back too
    torch.testing.assert_close(y.float(), ref.moe_unpermute(out, row_map, (t, h)).float())
    report.reset_op_counts()
    op("moe_permute")(torch.randn(t, h), routing_map, None, n)
    reasons = {o["fallback_reason"] for o in report.as_dict()["ops"] if o["op"] == "moe_permute"}
    assert any(("bf16" if hasattr(torch_npu, "npu_moe_token_permute") else "no npu_moe_token_permute") in r
               for r in reasons), reasons


def test_kernel_and_fallback_row_maps_pair(torch_npu, report):
    """The row map is the reference's on both paths: a kernel permute unpermuted by the reference
    and a reference permute unpermuted by the kernel give the same tokens."""
    t, e, k, h = 7, 5, 2, 4
    routing_map, probs = routed(t, e, k)
    x = torch.randn(t, h).bfloat16()
    out, _, row_map = op("moe_permute")(x, routing_map, None, t * k)
    r_out, _, r_row_map = ref.moe_permute(x, routing_map, None, t * k)
    assert torch.equal(row_map, r_row_map) and torch.equal(out, r_out)
    y = op("moe_unpermute")(r_out, r_row_map, (t, h), probs)
    torch.testing.assert_close(y.float(), ref.moe_unpermute(out, row_map, (t, h), probs).float(),
                               atol=2e-2, rtol=2e-2)


def test_sort_chunks_and_router_on_npu(torch_npu, report):
    x = torch.randn(10, 3)
    out, _ = op("moe_sort_chunks")(x, torch.tensor([4, 0, 6]), torch.tensor([2, 0, 1]))
    assert torch.equal(out, torch.cat([x[4:], x[:4]]))
    probs, routing_map = op("moe_topk_router")(torch.randn(5, 8), 2, False, None, None, None, "sigmoid", None)
    assert (routing_map.sum(-1) == 2).all() and torch.allclose(probs.sum(-1), torch.ones(5))


def test_emulated_contract_rejections(torch_npu):
    from torch_npu import EmulatedNPUError
    if torch_npu.PROFILE == "6.0.0":
        pytest.skip("6.0.0 has no npu_moe_token_permute; its grouped_matmul refusals: test_npu_api_table.py")
    x, w = torch.randn(4, 8), torch.randn(2, 8, 3)
    with pytest.raises(EmulatedNPUError, match="covers"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]), split_item=2, group_type=0)
    with pytest.raises(EmulatedNPUError, match="single-tensor"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 4]), split_item=0, group_type=0)
    if not hasattr(torch_npu, "npu_moe_token_permute"):
        return
    with pytest.raises(EmulatedNPUError, match="bf16|bfloat16"):
        torch_npu.npu_moe_token_permute(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(EmulatedNPUError, match="int32"):
        torch_npu.npu_moe_token_unpermute(torch.randn(4, 3).bfloat16(), torch.arange(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes", [[5, 0, 3, 9, 0, 1], [0, 4]])
def test_grouped_gemm_wgrad_npu(torch_npu, report, dtype, sizes):
    """--delay-wgrad-compute's grouped weight gradient: dw[e] = a_e^T @ b_e against fp64, through
    npu_grouped_matmul's K-axis groups where the release has them, else the reported loop."""
    from megatron_adapt.backends.npu import _lib, moe

    torch.manual_seed(0)
    a, b = torch.randn(sum(sizes), 16).to(dtype), torch.randn(sum(sizes), 24).to(dtype)
    dw = op("grouped_gemm_wgrad")(a, b, torch.tensor(sizes))
    expected = ref.grouped_gemm_wgrad(a.double(), b.double(), sizes)
    torch.testing.assert_close(dw.double(), expected, atol=TOL[dtype] * 16, rtol=TOL[dtype] * 4)
    done, forms = ran(report, "grouped_gemm_wgrad"), _lib.api()
    if not forms.gmm_tensor_group_list and (dtype == torch.float32 or len(sizes) == 1):
        assert done == {"npu.loop(matmul per expert)"}
    else:
        assert done == ({moe.GMM_WGRAD} if forms.gmm_k_axis else {moe.WGRAD_LOOP})

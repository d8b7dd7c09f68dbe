"""Mixture-of-experts ops on Ascend NPUs through torch_npu.

grouped_gemm: `torch_npu.npu_grouped_matmul(x: list, weight: list, *, bias, group_list, split_item,
group_type, group_list_type, ...) -> list` in its single-tensor mode (split_item 2/3), groups along
the rows (group_type=0) with group_list the cumulative row counts (group_list_type=0), in a
custom autograd function as MindSpeed's GMM does: dx = the same op with the weights transposed,
dw = the op grouped along the contraction (group_type=2) -> [E, k, n].

moe_permute / moe_unpermute: `torch_npu.npu_moe_token_permute(tokens, indices, num_out_tokens=None,
padded_mode=False) -> (permuted, sorted_indices int32)` and `npu_moe_token_unpermute(permuted,
sorted_indices, probs=None, padded_mode=False, restore_shape=None)`; both take a [T, topk] table
of expert ids, so they serve dropless routing (every token the same number of experts, which
this op checks on the host once per call) in bf16, the kernels' documented dtype. The row map
is the reference's (e * T + t), so a kernel unpermute pairs with a fallback permute and back;
unpermute rebuilds the kernel's sorted_indices from it. Anything else (dropped tokens, other
dtypes) takes the PyTorch ops, reported as a fallback.

moe_sort_chunks, moe_topk_router, moe_router_scores: PyTorch ops, which torch_npu dispatches to
NPU kernels (reported as npu.torch).
"""
from __future__ import annotations

import torch

from megatron_adapt import report
from megatron_adapt.backends import reference

from ._lib import torch_npu


def _gmm(x, w, group_list, group_type, split_item):
    return torch_npu().npu_grouped_matmul([x], [w], bias=None, group_list=group_list,
                                          split_item=split_item, group_type=group_type,
                                          group_list_type=0)[0]


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_list):
        ctx.save_for_backward(x, w, group_list)
        return _gmm(x, w, group_list, 0, 2)

    @staticmethod
    def backward(ctx, dy):
        x, w, group_list = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _gmm(dy, w.transpose(-2, -1).contiguous(), group_list, 0, 2) if ctx.needs_input_grad[0] else None
        dw = _gmm(x.t().contiguous(), dy, group_list, 2, 3) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_gemm(x, w, tokens_per_expert, trans_b: bool = False):
    npu = torch_npu()
    if not hasattr(npu, "npu_grouped_matmul"):
        why = "torch_npu has no npu_grouped_matmul"
    elif x.shape[0] == 0:
        why = "no rows"
    elif x.dtype != w.dtype:
        why = f"x {x.dtype} and w {w.dtype} differ"
    else:
        why = None
    if why is not None:
        report.fell_back("grouped_gemm", "npu.loop(matmul per expert)", why)
        return reference.grouped_gemm(x, w, tokens_per_expert, trans_b)
    report.ran("grouped_gemm", "npu.torch_npu.npu_grouped_matmul")
    counts = tokens_per_expert if isinstance(tokens_per_expert, torch.Tensor) else torch.tensor(tokens_per_expert)
    group_list = torch.cumsum(counts.to(device=x.device, dtype=torch.int64), 0)
    wk = w.transpose(-2, -1).contiguous() if trans_b else w
    return _GroupedMatmul.apply(x.contiguous(), wk, group_list)


def _topk_table(routing_map, num_out_tokens):
    """[T, k] expert ids (ascending) when every token has the same k experts and nothing is
    dropped, else (None, why)."""
    t = routing_map.shape[0]
    counts = routing_map.sum(dim=1)
    k = int(counts[0]) if t else 0
    if t == 0 or k == 0 or not bool((counts == k).all()):
        return None, "tokens have different numbers of experts (dropped or padded routing)"
    if num_out_tokens is not None and int(num_out_tokens) != t * k:
        return None, f"num_out_tokens {int(num_out_tokens)} != tokens x topk {t * k} (dropped tokens)"
    return torch.topk(routing_map.to(torch.int32), k, dim=1).indices.sort(dim=1).values.to(torch.int64), None


def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None):
    npu = torch_npu()
    table, why = (None, "torch_npu has no npu_moe_token_permute") if not hasattr(npu, "npu_moe_token_permute") \
        else (None, f"dtype {tokens.dtype} (the kernel takes bf16)") if tokens.dtype != torch.bfloat16 \
        else _topk_table(routing_map.bool(), num_out_tokens)
    if table is None:
        report.fell_back("moe_permute", "npu.torch(moe_permute)", why)
        return reference.moe_permute(tokens, routing_map, probs, num_out_tokens)
    report.ran("moe_permute", "npu.torch_npu.npu_moe_token_permute")
    t, k = table.shape
    n = t * k
    permuted, inverse = npu.npu_moe_token_permute(tokens, table, num_out_tokens=n)
    # inverse[p] = the row of flat position p = t * k + j; each row's position:
    pos = torch.empty(n, dtype=torch.int64, device=tokens.device).scatter_(
        0, inverse.to(torch.int64), torch.arange(n, device=tokens.device))
    row_map = table.reshape(-1).index_select(0, pos) * t + pos // k   # e * T + t, as the reference's
    permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, row_map)
    return permuted, permuted_probs, row_map


def _flat_positions(row_map, num_tokens):
    """Each row's flat position t * k + j (j: its rank among its token's experts), when every
    token has the same number k of rows; else None. Rows sorted token-major, experts ascending,
    are exactly the flat order."""
    n = row_map.numel()
    token = row_map % num_tokens
    counts = torch.bincount(token, minlength=num_tokens)
    if n == 0 or n % num_tokens or not bool((counts == n // num_tokens).all()):
        return None
    order = torch.argsort(token * (1 << 31) + row_map // num_tokens)
    return torch.empty_like(order).scatter_(0, order, torch.arange(n, device=row_map.device))


def moe_unpermute(permuted, row_map, restore_shape, merging_probs=None):
    npu = torch_npu()
    t = int(restore_shape[0])
    pos = None
    if not hasattr(npu, "npu_moe_token_unpermute"):
        why = "torch_npu has no npu_moe_token_unpermute"
    elif permuted.dtype != torch.bfloat16:
        why = f"dtype {permuted.dtype} (the kernel takes bf16)"
    else:
        pos = _flat_positions(row_map, t)
        why = "tokens have different numbers of rows (dropped tokens)" if pos is None else None
    if pos is None:
        report.fell_back("moe_unpermute", "npu.torch(moe_unpermute)", why)
        return reference.moe_unpermute(permuted, row_map, restore_shape, merging_probs)
    report.ran("moe_unpermute", "npu.torch_npu.npu_moe_token_unpermute")
    n = permuted.shape[0]
    k = n // t
    inverse = torch.empty(n, dtype=torch.int64, device=permuted.device).scatter_(
        0, pos, torch.arange(n, device=permuted.device)).to(torch.int32)
    if merging_probs is None:
        probs = torch.ones(t, k, dtype=permuted.dtype, device=permuted.device)
    else:  # the kernel takes bf16 probs [T, k] in flat order
        picked = merging_probs.t().reshape(-1).index_select(0, row_map)
        probs = torch.zeros(n, dtype=picked.dtype, device=permuted.device).scatter(0, pos, picked)
        probs = probs.view(t, k).to(permuted.dtype)
    return npu.npu_moe_token_unpermute(permuted, inverse, probs=probs)


def moe_sort_chunks(input, split_sizes, sorted_idxs, probs=None):  # noqa: A002
    report.ran("moe_sort_chunks", "npu.torch.searchsorted+index_select")
    return reference.moe_sort_chunks(input, split_sizes, sorted_idxs, probs)


def moe_topk_router(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                    scaling_factor=None, score_function="softmax", expert_bias=None):
    report.ran("moe_topk_router", f"npu.torch.{score_function}_topk")
    return reference.moe_topk_router(logits, topk, use_pre_softmax, num_groups, group_topk,
                                     scaling_factor, score_function, expert_bias)


def moe_router_scores(logits, topk, score_function="softmax"):
    report.ran("moe_router_scores", f"npu.torch.{score_function}")
    return reference.moe_router_scores(logits, topk, score_function)

"""Mixture-of-experts ops on Ascend NPUs through torch_npu.

grouped_gemm: `torch_npu.npu_grouped_matmul` with x one tensor and y one tensor (split_item 2/3),
in a custom autograd function as MindSpeed-MM's GmmFunction does. Its call form depends on the
release (chosen once from torch_npu.__version__, _lib.api()):

* 7.0.0 and later: `npu_grouped_matmul([x], [w], bias=None, group_list=<int64 Tensor>,
  split_item=2, group_type=0, group_list_type=0)` -- w one [E, k, n] tensor, group_list the
  cumulative row counts. dx = the same with w transposed (a contiguous copy: the safe layout on
  every release). dW = `npu_grouped_matmul([x.t()], [dy], group_list=..., split_item=3,
  group_type=2, group_list_type=0)[0]` -> [E, k, n], the K-axis grouping, whose documented layout
  (aclnnGroupedMatmulV4, groupType 2) is x *transposed* (a [k, M] view of the contiguous [M, k]
  input: stride [1, k]), weight not transposed, y 3-D. Only 7.2.0 and later take group_type=2
  (op-plugin "GMM k axis support", 2025-08; 7.1.0 refuses anything but -1/0, 7.0.0 has no 3-D
  output for it); earlier releases compute dW with one matmul per expert, reported.
* 6.0.0: `npu_grouped_matmul([x], [w[0], ..., w[E-1]], group_list=[cumulative ints],
  split_item=2)` -- no group_type / group_list_type keywords, group_list a list of ints, weight
  a list of 2-D tensors, fp16/bf16 only; dW by the per-expert loop, reported.

moe_permute / moe_unpermute: `torch_npu.npu_moe_token_permute(tokens, indices, num_out_tokens=None,
padded_mode=False) -> (permuted, sorted_indices int32)` and `npu_moe_token_unpermute(permuted,
sorted_indices, probs=None, padded_mode=False, restore_shape=None)` (7.1.0 and later); both take a
[T, topk] table of expert ids, so they serve dropless routing (every token the same number of
experts, which this op checks on the host once per call) in bf16, the kernels' documented dtype.
The row map is the reference's (e * T + t), so a kernel unpermute pairs with a fallback permute
and back; unpermute rebuilds the kernel's sorted_indices from it. Anything else (dropped tokens,
other dtypes, older releases) takes the PyTorch ops, reported as a fallback.

moe_sort_chunks, moe_topk_router, moe_router_scores: PyTorch ops, which torch_npu dispatches to
NPU kernels (reported as npu.torch).
"""
from __future__ import annotations

import torch

from megatron_adapt import report
from megatron_adapt.backends import reference

from ._lib import api, torch_npu

GMM = "npu.torch_npu.npu_grouped_matmul"
GMM_WGRAD = GMM + ".k_axis(wgrad)"
WGRAD_LOOP = "npu.loop(wgrad matmul per expert)"
MAX_GROUPS = {True: 1024, False: 128}   # tensor group_list (group_type 0, one weight tensor) / list form


def _gmm_rows(x, w, groups):
    """y = x grouped by rows (group_type 0), w [E, k, n] contiguous."""
    npu = torch_npu()
    if api().gmm_tensor_group_list:
        return npu.npu_grouped_matmul([x], [w], bias=None, group_list=groups, split_item=2,
                                      group_type=0, group_list_type=0)[0]
    return npu.npu_grouped_matmul([x], list(w.unbind(0)), group_list=groups, split_item=2)[0]


def _wgrad(x, dy, groups, counts, op="grouped_gemm"):
    """dW [E, k, n] = x_e^T @ dy_e for each expert e (reported under `op`)."""
    forms = api()
    if forms.gmm_k_axis:
        report.ran(op, GMM_WGRAD)
        return torch_npu().npu_grouped_matmul([x.t()], [dy], bias=None, group_list=groups, split_item=3,
                                              group_type=2, group_list_type=0)[0]
    report.fell_back(op, WGRAD_LOOP,
                     f"{forms.describe()}: npu_grouped_matmul takes group_type=2 (K-axis groups, the "
                     "weight gradient) from Ascend Extension 7.2.0 on")
    if counts is None:  # the tensor group_list form: read the counts on the host only on this path
        counts = torch.diff(groups, prepend=groups.new_zeros(1)).tolist()
    return torch.stack([xe.t() @ de for xe, de in zip(torch.split(x, counts), torch.split(dy, counts))])


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, groups, counts):
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.counts = groups, counts
        return _gmm_rows(x, w, groups)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _gmm_rows(dy, w.transpose(-2, -1).contiguous(), ctx.groups) if ctx.needs_input_grad[0] else None
        dw = _wgrad(x, dy, ctx.groups, ctx.counts) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def _unsupported(x, w, groups: int):
    forms = api()
    if not hasattr(torch_npu(), "npu_grouped_matmul"):
        return "torch_npu has no npu_grouped_matmul"
    if x.shape[0] == 0:
        return "no rows"
    if x.dtype != w.dtype:
        return f"x {x.dtype} and w {w.dtype} differ"
    if groups > MAX_GROUPS[forms.gmm_tensor_group_list]:
        return f"{groups} experts (at most {MAX_GROUPS[forms.gmm_tensor_group_list]} groups in this call form)"
    if not forms.gmm_tensor_group_list:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return f"{forms.describe()}: the int[] group_list form takes fp16/bf16, not {x.dtype}"
        if groups == 1:
            return f"{forms.describe()}: one expert (a list group_list may not have length 1)"
    return None


def grouped_gemm(x, w, tokens_per_expert, trans_b: bool = False):
    is_tensor = isinstance(tokens_per_expert, torch.Tensor)
    why = _unsupported(x, w, tokens_per_expert.numel() if is_tensor else len(tokens_per_expert))
    if why is not None:
        report.fell_back("grouped_gemm", "npu.loop(matmul per expert)", why)
        return reference.grouped_gemm(x, w, tokens_per_expert, trans_b)
    report.ran("grouped_gemm", GMM)
    groups, counts = _group_list(tokens_per_expert, x.device)
    wk = w.transpose(-2, -1).contiguous() if trans_b else w.contiguous()
    return _GroupedMatmul.apply(x.contiguous(), wk, groups, counts)


def _group_list(tokens_per_expert, device):
    """(group_list, host counts | None) in this release's call form."""
    is_tensor = isinstance(tokens_per_expert, torch.Tensor)
    if api().gmm_tensor_group_list:  # cumulative counts stay on the device: no host sync per call
        per_expert = tokens_per_expert if is_tensor else torch.tensor(tokens_per_expert)
        return torch.cumsum(per_expert.to(device=device, dtype=torch.int64), 0), None
    # 6.0.0: group_list is a list of ints
    counts = [int(c) for c in (tokens_per_expert.tolist() if is_tensor else tokens_per_expert)]
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist(), counts


def grouped_gemm_wgrad(a, b, tokens_per_expert):
    """dw[e] = a_e^T @ b_e: npu_grouped_matmul with K-axis groups (group_type=2, 7.2.0 on), else
    one matmul per expert, reported with the reason."""
    is_tensor = isinstance(tokens_per_expert, torch.Tensor)
    why = _unsupported(a, b, tokens_per_expert.numel() if is_tensor else len(tokens_per_expert))
    if why is not None:
        report.fell_back("grouped_gemm_wgrad", "npu.loop(matmul per expert)", why)
        return reference.grouped_gemm_wgrad(a, b, tokens_per_expert)
    groups, counts = _group_list(tokens_per_expert, a.device)
    return _wgrad(a.contiguous(), b.contiguous(), groups, counts, op="grouped_gemm_wgrad")


def _no_permute(name):
    forms = api()
    if not forms.moe_token_permute:
        return f"{forms.describe()} has no {name} (Ascend Extension 7.1.0 and later)"
    return None if hasattr(torch_npu(), name) else f"torch_npu has no {name}"


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
    table, why = (None, _no_permute("npu_moe_token_permute")) if _no_permute("npu_moe_token_permute") \
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
    if _no_permute("npu_moe_token_unpermute"):
        why = _no_permute("npu_moe_token_unpermute")
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

"""Mixture-of-experts ops: grouped GEMM, token permute / unpermute / chunk sort, router top-k.

Plain PyTorch and device-agnostic (no host synchronisation where the output size is known), so
they are also the reference the other backends are tested against and the fallback they report.
Layout conventions (Megatron's): a routing map is bool [tokens, experts]; permuted rows are
expert-major, tokens in ascending order within an expert; `row_map[r] = e * T + t` names the
expert e and source token t of permuted row r (what the matching unpermute needs, as TE's
row_id_map does).
"""
from __future__ import annotations

import torch

from megatron_adapt import report


# ----------------------------------------------------------------------------- grouped GEMM
def _split_sizes(tokens_per_expert) -> list[int]:
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(n) for n in tokens_per_expert.tolist()]
    return [int(n) for n in tokens_per_expert]


def grouped_gemm_loop(x, w, tokens_per_expert, trans_b: bool = False):
    """y[rows of expert e] = x[rows of e] @ w[e] (w[e]^T with trans_b): one matmul per expert.

    Experts with no rows still take part in the graph, so their weights get a zero gradient.
    """
    sizes = _split_sizes(tokens_per_expert)
    if len(sizes) != w.shape[0] or sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped_gemm: tokens_per_expert {sizes} does not split x {tuple(x.shape)} "
                         f"over {w.shape[0]} experts")
    chunks = torch.split(x, sizes, dim=0)
    outs = [c @ (w[e].t() if trans_b else w[e]) for e, c in enumerate(chunks)]
    return torch.cat(outs, dim=0)


def grouped_gemm(x, w, tokens_per_expert, trans_b: bool = False):
    """(x [T, k], w [E, k, n] ([E, n, k] with trans_b), tokens_per_expert [E]) -> y [T, n]."""
    report.ran("grouped_gemm", "cpu.loop(matmul per expert)")
    return grouped_gemm_loop(x, w, tokens_per_expert, trans_b)


# ----------------------------------------------------------------------------- permutation
def _selected_positions(routing_map, num_out_tokens):
    """Flat positions e * T + t of the True entries of routing_map^T, expert-major, ascending.

    With num_out_tokens given the output size is known and nothing waits for the device: a
    stable sort puts the selected positions first, in order.
    """
    flat = routing_map.t().reshape(-1)
    if num_out_tokens is None:
        return torch.nonzero(flat, as_tuple=False).squeeze(1)
    order = torch.argsort((~flat).to(torch.int8), stable=True)
    return order[:int(num_out_tokens)]


def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None):
    """(tokens [T, h], routing_map bool [T, E], probs [T, E] | None, num_out_tokens | None)
    -> (permuted [N, h], permuted_probs [N] | None, row_map [N] int64 = e * T + t)."""
    report.ran("moe_permute", "cpu.torch.index_select")
    return permute_reference(tokens, routing_map, probs, num_out_tokens)


def permute_reference(tokens, routing_map, probs=None, num_out_tokens=None):
    row_map = _selected_positions(routing_map.bool(), num_out_tokens)
    permuted = tokens.index_select(0, row_map % tokens.shape[0])
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.t().reshape(-1).index_select(0, row_map)
    return permuted, permuted_probs, row_map


def moe_unpermute(permuted, row_map, restore_shape, merging_probs=None):
    """(permuted [N, h], row_map [N] from moe_permute, restore_shape (T, h), merging_probs [T, E]
    | None) -> [T, h] in permuted's dtype: each token's rows (times their prob) summed in fp32."""
    report.ran("moe_unpermute", "cpu.torch.index_add")
    return unpermute_reference(permuted, row_map, restore_shape, merging_probs)


def unpermute_reference(permuted, row_map, restore_shape, merging_probs=None):
    num_tokens = int(restore_shape[0])
    rows = permuted.float()
    if merging_probs is not None:
        rows = rows * merging_probs.t().reshape(-1).index_select(0, row_map).float().unsqueeze(-1)
    out = torch.zeros(tuple(restore_shape), dtype=torch.float32, device=permuted.device)
    out = out.index_add(0, row_map % num_tokens, rows)
    return out.to(permuted.dtype)


def chunk_source_rows(split_sizes, sorted_idxs, num_rows: int, device):
    """Source row of each output row when chunks (sizes split_sizes) are reordered as sorted_idxs."""
    sizes = split_sizes.to(device=device, dtype=torch.int64)
    order = sorted_idxs.to(device=device, dtype=torch.int64)
    in_starts = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes.index_select(0, order)
    out_ends = torch.cumsum(out_sizes, 0)
    rows = torch.arange(num_rows, device=device)
    chunk = torch.searchsorted(out_ends, rows, right=True)
    return in_starts.index_select(0, order).index_select(0, chunk) + rows - (out_ends - out_sizes).index_select(0, chunk)


def moe_sort_chunks(input, split_sizes, sorted_idxs, probs=None):  # noqa: A002 (Megatron's name)
    """(input [N, ...], split_sizes [C] int, sorted_idxs [C] int, probs [N] | None) -> (output, probs):
    the C consecutive chunks of input, in the order sorted_idxs. Split sizes may stay on the device."""
    report.ran("moe_sort_chunks", "cpu.torch.index_select")
    return sort_chunks_reference(input, split_sizes, sorted_idxs, probs)


def sort_chunks_reference(input, split_sizes, sorted_idxs, probs=None):  # noqa: A002
    src = chunk_source_rows(split_sizes, sorted_idxs, input.shape[0], input.device)
    return input.index_select(0, src), (None if probs is None else probs.index_select(0, src))


# ----------------------------------------------------------------------------- router
def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        t, e = scores.shape
        group_scores = scores.view(t, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, -1)
        scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(scores, k=topk, dim=-1)


def moe_topk_router(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                    scaling_factor=None, score_function="softmax", expert_bias=None):
    """(logits [T, E], topk, ...) -> (routing_probs [T, E] logits dtype, routing_map bool [T, E]).

    softmax: top-k of the logits then softmax over the k (use_pre_softmax: softmax over all E,
    then top-k). sigmoid: top-k of sigmoid(logits) (+ expert_bias for the choice only), the k
    scores normalised to sum 1 when topk > 1. num_groups / group_topk: the k are taken from the
    group_topk groups whose best topk/group_topk scores sum highest. scaling_factor multiplies.
    """
    report.ran("moe_topk_router", f"cpu.torch.{score_function}_topk")
    return topk_router_reference(logits, topk, use_pre_softmax, num_groups, group_topk,
                                 scaling_factor, score_function, expert_bias)


def topk_router_reference(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                          scaling_factor=None, score_function="softmax", expert_bias=None):
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, idx = _topk(scores, topk, num_groups, group_topk)
        else:
            top, idx = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = _topk(scores + expert_bias, topk, num_groups, group_topk)
            top = torch.gather(scores, 1, idx).type_as(logits)
        else:
            top, idx = _topk(scores, topk, num_groups, group_topk)
        probs = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs.type_as(logits))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return routing_probs, routing_map


def moe_router_scores(logits, topk, score_function="softmax"):
    """(logits [T, E], topk, score_function) -> (routing_map bool [T, E], scores [T, E] fp32):
    the scores the load-balancing loss uses (softmax, or sigmoid normalised over E) and their top-k."""
    report.ran("moe_router_scores", f"cpu.torch.{score_function}")
    return router_scores_reference(logits, topk, score_function)


def router_scores_reference(logits, topk, score_function="softmax"):
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    idx = torch.topk(scores, k=topk, dim=1)[1]
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True), scores

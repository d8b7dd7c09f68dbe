"""Mixture-of-experts ops: the references (grouped GEMM as one matmul per expert; permutation,
chunk sort and router in PyTorch index / sort / top-k ops)."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def grouped_gemm(x, w, tokens_per_expert, trans_b: bool = False):
    report.ran("grouped_gemm", "cpu.loop(matmul per expert)")
    return reference.grouped_gemm(x, w, tokens_per_expert, trans_b)


def grouped_gemm_wgrad(a, b, tokens_per_expert):
    report.ran("grouped_gemm_wgrad", "cpu.loop(matmul per expert)")
    return reference.grouped_gemm_wgrad(a, b, tokens_per_expert)


def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None):
    report.ran("moe_permute", "cpu.torch.index_select")
    return reference.moe_permute(tokens, routing_map, probs, num_out_tokens)


def moe_unpermute(permuted, row_map, restore_shape, merging_probs=None):
    report.ran("moe_unpermute", "cpu.torch.index_add")
    return reference.moe_unpermute(permuted, row_map, restore_shape, merging_probs)


def moe_sort_chunks(input, split_sizes, sorted_idxs, probs=None):  # noqa: A002 (Megatron's name)
    report.ran("moe_sort_chunks", "cpu.torch.index_select")
    return reference.moe_sort_chunks(input, split_sizes, sorted_idxs, probs)


def moe_topk_router(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                    scaling_factor=None, score_function="softmax", expert_bias=None):
    report.ran("moe_topk_router", f"cpu.torch.{score_function}_topk")
    return reference.moe_topk_router(logits, topk, use_pre_softmax, num_groups, group_topk,
                                     scaling_factor, score_function, expert_bias)


def moe_router_scores(logits, topk, score_function="softmax"):
    report.ran("moe_router_scores", f"cpu.torch.{score_function}")
    return reference.moe_router_scores(logits, topk, score_function)

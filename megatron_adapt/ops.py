"""The backend-neutral op contract. Patches call these names; every backend implements them.

Tensors are on the backend's device; every op that takes part in training supports autograd.
Each implementation reports itself with `report.ran(op, impl)` (or `report.fell_back`).
`OPS` below is the one list of ops: each op's contract, and the module and attribute that serve
it inside a backend package (one module per op family); the table that follows is built from it.
"""
from __future__ import annotations

import textwrap
from typing import NamedTuple


class Op(NamedTuple):
    home: str       # "module:attr" inside a backend package, e.g. ".norms:rms_norm"
    contract: str   # (arguments) -> result


OPS: dict[str, Op] = {
    "vocab_parallel_cross_entropy": Op(
        ".cross_entropy:vocab_parallel_cross_entropy",
        "(logits[..., V/tp], target[...] int64 global ids, label_smoothing: float, tp_group | "
        "None) -> loss[...] fp32. Max and sum-exp reduced over tp_group."),
    "rms_norm": Op(".norms:rms_norm", "(x[..., h], weight[h], eps: float) -> y (x.dtype)"),
    "layer_norm": Op(
        ".norms:layer_norm",
        "(x[..., h], weight[h], bias[h] | None, eps: float) -> y (x.dtype)"),
    "scaled_masked_softmax": Op(
        ".softmax:scaled_masked_softmax",
        "(scores[b, np, sq, sk], mask bool [b|1, 1|np, sq, sk] True=masked | None, scale: float"
        " | None, causal: bool, window_size: (left, right) | None, softmax_in_fp32: bool) -> "
        "probs (scores.dtype)"),
    "attention": Op(
        ".attention:attention",
        "(q[b, hq, sq, d], k[b, hkv, sk, d], v[b, hkv, sk, d], attn_mask bool True=masked "
        "broadcastable to [b, hq, sq, sk] | None, causal: bool, scale: float | None, dropout_p:"
        " float, window_size | None) -> out[b, hq, sq, d]"),
    "attention_bias": Op(
        ".attention:attention_bias",
        "(q[b, hq, sq, d], k[b, hkv, sk, d], v[b, hkv, sk, d], bias float broadcastable to "
        "[b, hq, sq, sk], attn_mask bool True=masked | None, causal: bool, scale: float | None, "
        "dropout_p: float, window_size | None) -> out[b, hq, sq, d]: softmax(q k^T * scale + bias, "
        "masked) v, the bias added after the scale (TE's post_scale_bias: T5's relative position "
        "embedding); differentiable in the bias"),
    "attention_thd": Op(
        ".attention:attention_thd",
        "(q[T, hq, d], k[T, hkv, d], v[T, hkv, dv], cu_seqlens_q [n+1] int, cu_seqlens_kv [n+1] int, "
        "cu_seqlens_q_padded [n+1] | None, cu_seqlens_kv_padded [n+1] | None, causal: bool, scale: "
        "float | None, dropout_p: float, window_size | None) -> out[T, hq, dv]: packed (thd) "
        "sequences, each attending only within itself (Megatron's PackedSeqParams); sequence i's "
        "tokens start at cu_seqlens_*_padded[i] (cu_seqlens_*[i] without padding), padding rows "
        "give zeros. Malformed offsets raise ValueError"),
    "attention_cp": Op(
        ".attention:attention_cp",
        "(q[b, hq, s, d], k[b, hkv, s, d], v[b, hkv, s, dv]: this rank's tokens, pos [b, s] int "
        "(position in its document), doc [b, s] int (document, -1 = padding), causal: bool, "
        "scale: float, window_size | None, groups: process group | [a2a group, p2p group], "
        "comm_type 'p2p'|'allgather'|'a2a'|'a2a+p2p', dropout_p: float = 0) -> out[b, hq, s, dv]: "
        "attention over the "
        "tokens of every rank of the group(s) (backends/context_parallel.py)"),
    "rope": Op(
        ".rope:rope",
        "(t[s, b, h, d], freqs[s, 1, 1, r] angles (r <= d), interleaved: bool) -> t with its "
        "first r channels rotated"),
    "rope_cos_sin": Op(
        ".rope:rope_cos_sin",
        "(t[..., r], cos[..., r], sin[..., r] broadcastable to t) -> t * cos + rotate_half(t) * "
        "sin, pairs (i, i + r/2); cos and sin carry any scale (YaRN's mscale). Multi-latent "
        "attention's fused YaRN RoPE; cuda leaves it to Megatron's own Triton kernel"),
    "swiglu": Op(".activations:swiglu", "(x[..., 2f]) -> silu(x[..., :f]) * x[..., f:]"),
    "bias_swiglu": Op(".activations:bias_swiglu", "(x, bias) -> swiglu(x + bias)"),
    "bias_gelu": Op(".activations:bias_gelu", "(bias, y) -> gelu_tanh(y + bias)"),
    "bias_dropout_add": Op(
        ".dropout:bias_dropout_add",
        "(x, bias[h] | None, residual (x's shape and dtype), prob: float) -> residual + "
        "dropout(x + bias, prob), training mode; masks from the default generator"),
    "adam": Op(
        ".optimizers:Adam",
        "optimizer class, apex FusedAdam signature (params, lr, betas, eps, weight_decay, "
        "adam_w_mode=True, ...)"),
    "sgd": Op(".optimizers:SGD", "optimizer class, torch.optim.SGD signature"),
    "multi_tensor_l2norm": Op(
        ".multi_tensor:l2norm",
        "(tensors: list) -> fp32 scalar tensor, the l2 norm of all of them"),
    "multi_tensor_scale": Op(
        ".multi_tensor:scale",
        "(srcs: list, dsts: list, scale: float) -> None; dst = src * scale"),
    "wgrad_accumulate": Op(
        ".matmul:wgrad_accumulate",
        "(input [t, in], grad_output [t, out], main_grad [out, in]) -> None; main_grad += "
        "grad_output^T @ input in place (gradient-accumulation fusion; main_grad fp32 with "
        "bf16/fp16 operands, or all one dtype)"),
    "grouped_gemm": Op(
        ".moe:grouped_gemm",
        "(x [T, k], w [E, k, n] ([E, n, k] with trans_b), tokens_per_expert [E] int (any "
        "device), trans_b: bool) -> y [T, n]; the rows of expert e (consecutive, experts in "
        "order) times w[e]. Experts with no rows get zero weight grads"),
    "grouped_gemm_wgrad": Op(
        ".moe:grouped_gemm_wgrad",
        "(a [T, m], b [T, n], tokens_per_expert [E] int (any device)) -> dw [E, m, n]; dw[e] = "
        "a_e^T @ b_e over the rows of expert e (zeros for an expert with no rows): the grouped "
        "GEMM's weight gradient on its own, for --delay-wgrad-compute's backward_dw"),
    "moe_permute": Op(
        ".moe:moe_permute",
        "(tokens [T, h], routing_map bool [T, E], probs [T, E] | None, num_out_tokens | None) "
        "-> (permuted [N, h], permuted_probs [N] | None, row_map [N] int64): rows expert-major,"
        " tokens ascending within an expert (Megatron's permute order); row_map[r] = e * T + t,"
        " row r's expert e and token t"),
    "moe_unpermute": Op(
        ".moe:moe_unpermute",
        "(permuted [N, h], row_map [N] from moe_permute, restore_shape (T, h), merging_probs "
        "[T, E] | None) -> [T, h] permuted.dtype: each token's rows (times their prob) summed "
        "in fp32"),
    "moe_sort_chunks": Op(
        ".moe:moe_sort_chunks",
        "(input [N, ...], split_sizes [C] int, sorted_idxs [C] int, probs [N] | None) -> "
        "(output, probs | None): the C consecutive chunks reordered as sorted_idxs"),
    "moe_topk_router": Op(
        ".moe:moe_topk_router",
        "(logits [T, E], topk, use_pre_softmax, num_groups, group_topk, scaling_factor, "
        "score_function 'softmax'|'sigmoid', expert_bias | None) -> (routing_probs [T, E] "
        "logits.dtype, routing_map bool [T, E]) (Megatron's topk_routing_with_score_function)"),
    "moe_router_scores": Op(
        ".moe:moe_router_scores",
        "(logits [T, E], topk, score_function) -> (routing_map bool [T, E], scores [T, E] fp32)"
        " for the load-balancing loss"),
    "fp8_unavailable": Op(
        ".fp8:fp8_unavailable",
        "() -> None when this backend and device run fp8 GEMMs, else the reason (str)"),
    "fp8_linear": Op(
        ".fp8:fp8_linear",
        "(x [..., in], weight [out, in], bias [out] | None, scaling: backends.fp8_scaling."
        "Fp8Scaling, wgrad_sink: callable | None) -> y [..., out] x.dtype: forward, dgrad and "
        "wgrad GEMMs in fp8 with scaling's format and recipe; wgrad_sink(dW fp32) returns the "
        "weight's gradient (gradient-accumulation fusion), without it dW in weight.dtype. "
        "Served only where fp8_unavailable() is None (cuda)"),
    "fp8_grouped_gemm": Op(
        ".fp8:fp8_grouped_gemm",
        "(x [T, in], w [E, out, in], tokens_per_expert [E] host ints, recipe: backends.fp8_scaling."
        "Fp8Recipe, weight_cache: backends.fp8_scaling.Fp8WeightCache | None = None, main_grads: "
        "E fp32 [out, in] | None = None, static_sizes: bool = False) -> y [T, out] "
        "x.dtype: each expert's consecutive rows times w[e]^T, forward, dgrad and wgrad GEMMs in fp8 "
        "(the MoE experts' grouped linears under fp8); weight_cache keeps w's fp8 operands across a "
        "step's micro-batches; with main_grads the weight gradient is added into them and w's "
        "gradient is a placeholder (the caller marks grad_added_to_main_grad); static_sizes: the "
        "row counts are the same at every call. "
        "Served only where fp8_unavailable() is None (cuda)"),
    "fp8_swiglu": Op(
        ".fp8_swiglu:fp8_swiglu",
        "(x [..., 2F] fc1's output, no bias) -> [..., F] x.dtype, SwiGLU for an fp8 linear under "
        "delayed scaling: the output and the gradient it sends back to x are computed inside that "
        "linear's casts (fp8_linear), any other use computes them in x.dtype (reported). "
        "Served only where fp8_unavailable() is None (cuda)"),
    "ssd_scan": Op(
        ".ssm:ssd_scan",
        "(x [b, l, h, p], dt [b, l, h], A [h] fp32, B [b, l, g, n], C [b, l, g, n], chunk_size, "
        "D [h] | [h, p] | None, z [b, l, h, p] | None, dt_bias [h] | None, dt_softplus: bool, "
        "dt_limit (lo, hi), initial_states [b, h, p, n] | None, seq_idx [b, l] int | None, "
        "return_final_states: bool) -> out [b, l, h, p] x.dtype (, final_states [b, h, p, n] "
        "fp32): Mamba-2's selective state-space scan (mamba_chunk_scan_combined's semantics)"),
    "causal_conv1d": Op(
        ".ssm:causal_conv1d",
        "(x [b, l, d] any strides, weight [d, w], bias [d] | None, activation None|'silu'|'swish',"
        " seq_idx [b, l] | None) -> [b, l, d] x.dtype: depthwise causal conv over l"),
    "rms_norm_gated": Op(
        ".ssm:rms_norm_gated",
        "(x [..., d], weight [d], z like x | None, eps, group_size | None, norm_before_gate: bool)"
        " -> y x.dtype: RMSNorm per group of channels, gated by silu(z) before or after"),
    "ssm_conv_update": Op(
        ".ssm:ssm_conv_update",
        "(x [b, (s,) d], conv_state [slots, d, L] updated in place, weight [d, w], bias [d] | None,"
        " silu: bool, conv_state_indices [b] | None (negative: padding), intermediate_conv_states "
        "[slots, s, d, L] | None) -> y like x: the causal conv's decode step over a conv-state "
        "cache (Megatron's causal_conv1d_update)"),
    "ssm_state_update": Op(
        ".ssm:ssm_state_update",
        "(state [slots, h, p, n] updated in place, x [b, (s,) h, p], dt like x, A [h, p, n], "
        "B / C [b, (s,) g, n], D [h, p] | None, z like x | None, dt_bias [h, p] | None, "
        "dt_softplus, state_batch_indices [b] | None, intermediate_ssm_states | None) -> y like x:"
        " Mamba-2's recurrence for decode (Megatron's selective_state_update)"),
    "rng_get_state": Op(
        ".rng:get_state",
        '() -> state tensor of the generator Megatron calls "cuda"'),
    "rng_set_state": Op(".rng:set_state", "(state) -> None"),
}

if __doc__:   # (python -OO drops docstrings)
    __doc__ += "\n" + "\n".join(
        textwrap.fill(op.contract, 100, initial_indent=f"{name:<29}", subsequent_indent=" " * 29)
        for name, op in OPS.items()) + "\n"


# Ranks whose replicated values must stay bit-identical (Megatron's tensor-parallel group): a
# backend that chooses a kernel at run time must make the same choice on each of them. Patches
# (which know Megatron) set the getter; backends read it.
_replica_group_getter = None


def set_replica_group(getter) -> None:
    """`getter()` returns the process group (or None while there is none)."""
    global _replica_group_getter
    _replica_group_getter = getter


def replica_group():
    return _replica_group_getter() if _replica_group_getter is not None else None

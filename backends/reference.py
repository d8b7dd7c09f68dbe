"""The reference math of the ops (`megatron_adapt.ops`): plain PyTorch and device-agnostic.

One copy for every backend: the cpu backend serves its ops from these, the cuda and npu backends
run them where their kernels cannot take a call, and the tests check every kernel against them.
`reference.<op>` is op <op>'s math; it reports nothing (the backend that calls it reports what
ran), except `make_adam`, which reports the optimizer it builds under the caller's name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_adapt import report


# ----------------------------------------------------------------------------- cross entropy
def _group_info(tp_group):
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross entropy over a vocabulary split along the last dim across `tp_group`: fp32
    math, one all-reduce of the max and one of the sums, the gradient written in place.

    Label smoothing follows Megatron's formula with K the *global* vocabulary size (Megatron's own
    unfused path uses the per-partition size, which only agrees at TP=1).
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, tp_group):
        world, rank = _group_info(tp_group)
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # fp32 input: never write into the caller's logits
        logits_max = x.amax(dim=-1)
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        x.sub_(logits_max.unsqueeze(-1))

        part = x.size(-1)
        start = rank * part
        in_part = (target >= start) & (target < start + part)
        local_target = torch.where(in_part, target - start, torch.zeros_like(target))
        predicted = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_part
        sum_x = x.sum(dim=-1) if label_smoothing > 0 else None
        exp = x.exp_()
        sums = [predicted, exp.sum(dim=-1)] + ([sum_x] if sum_x is not None else [])
        stacked = torch.stack(sums)
        if world > 1:
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        predicted, sum_exp = stacked[0], stacked[1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted

        vocab = part * world
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab / (vocab - 1)
            mean_log_probs = stacked[2] / vocab - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_part, local_target)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, in_part, local_target = ctx.saved_tensors
        grad = softmax  # reuse the saved buffer, as Megatron does
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          -(1.0 - ctx.smoothing) * in_part.unsqueeze(-1).to(grad.dtype))
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / ctx.vocab)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, tp_group=None):
    return VocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), tp_group)


# ----------------------------------------------------------------------------- norms
def rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.size(-1),), weight, eps)


def layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


# ----------------------------------------------------------------------------- softmax, attention
MASK_VALUE = -10000.0  # Megatron's attention_mask_func fill: a fully masked row stays finite


def build_mask(sq, sk, causal, window_size, mask, device):
    """Combined boolean mask (True = masked) or None, with Megatron's alignment (bottom-right)."""
    m = None
    if window_size is not None:
        ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
        m = ~torch.tril(torch.triu(ones, diagonal=sk - sq - window_size[0]), diagonal=sk - sq + window_size[1])
    elif causal and sq > 1:
        m = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1 + sk - sq)
    if mask is not None:
        m = mask if m is None else (m | mask)
    return m


def scaled_masked_softmax(scores, mask, scale, causal, window_size=None, softmax_in_fp32=True):
    x = scores.float() if softmax_in_fp32 else scores
    if scale is not None and scale != 1.0:
        x = x * scale
    m = build_mask(x.size(-2), x.size(-1), causal, window_size, mask, x.device)
    if m is not None:
        x = x.masked_fill(m, MASK_VALUE)
    return torch.softmax(x, dim=-1).to(scores.dtype)


def attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    """torch's scaled_dot_product_attention (is_causal where no mask is needed, GQA without repeats)."""
    sq, sk = q.size(-2), k.size(-2)
    use_causal = causal and attn_mask is None and window_size is None and sq == sk
    mask = None if use_causal else build_mask(sq, sk, causal, window_size, attn_mask, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=dropout_p,
        is_causal=use_causal, scale=scale, enable_gqa=k.size(1) != q.size(1))


# ----------------------------------------------------------------------------- rope
def _rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).view(x.shape)


def rope(t, freqs, interleaved=False, mscale=1.0):
    """Megatron's bshd formula: rotate-half or interleaved pairs, the first r channels only."""
    rot = freqs.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    out = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((out, t_pass), dim=-1) if t_pass.numel() else out


def rope_cos_sin(t, cos, sin):
    """Rotate-half RoPE from precomputed cos / sin (any scale folded in)."""
    return t * cos.to(t.dtype) + _rotate_half(t, False) * sin.to(t.dtype)


# ----------------------------------------------------------------------------- activations, dropout
def swiglu(x):
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


def bias_swiglu(x, bias):
    return swiglu(x + bias)


def bias_gelu(bias, y):
    """The tanh approximation, as Megatron's fused bias_gelu."""
    return F.gelu(y + bias, approximate="tanh")


def bias_dropout_add(x, bias, residual, prob):
    """Megatron's own arithmetic (x + bias rounded to x's dtype, then torch's dropout, then the
    residual added), so the masks are those of the default generator."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=True)


# ----------------------------------------------------------------------------- multi-tensor, matmul
def multi_tensor_l2norm(tensors):
    """apex's multi_tensor_l2norm through torch._foreach_norm, accumulated in fp32."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def multi_tensor_scale(srcs, dsts, factor):
    if srcs:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, factor))


def wgrad_accumulate(input, grad_output, main_grad):  # noqa: A002 (apex's argument order)
    """main_grad += grad_output^T @ input: one addmm_ in main_grad's dtype (Megatron's
    gradient-accumulation fusion, which apex's fused_weight_gradient_mlp_cuda did)."""
    dtype = main_grad.dtype
    main_grad.addmm_(grad_output.t().to(dtype), input.to(dtype))


# ----------------------------------------------------------------------------- optimizers
def make_adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
              weight_decay=0.0, amsgrad=False, *, impl_flags, impl_name, capturable=False, **unsupported):
    """apex.optimizers.FusedAdam's constructor, returning the torch optimizer with the same math;
    each backend passes its torch.optim flags (foreach / fused) and the name it reports.

    capturable: Megatron >= 0.17 passes `--optimizer-cuda-graph` here (apex / TE take it too);
    torch.optim's own `capturable` keeps the step count on the device for CUDA-graph capture.
    """
    if unsupported:
        raise TypeError(f"{impl_name} Adam does not support {sorted(unsupported)} "
                        "(precision-aware optimizer options need Transformer Engine's FusedAdam)")
    if not bias_correction:
        raise ValueError("bias_correction=False is not supported by torch.optim Adam/AdamW")
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    report.ran("adam", f"{impl_name}.{cls.__name__}")
    if lr is not None:
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                   capturable=capturable, **impl_flags)
    # lr=None: Megatron's OptimizerConfig default, which apex / TE FusedAdam take (the learning
    # rate comes per param group or from Megatron's scheduler before the first step). torch.optim
    # validates lr at construction: build with a placeholder, then leave None where none was given.
    params = list(params)
    groups_given = bool(params) and isinstance(params[0], dict)
    given = [g.get("lr") for g in params] if groups_given else [None]   # per param group
    opt = cls(params, lr=0.0, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
              capturable=capturable, **impl_flags)
    opt.defaults["lr"] = None
    for group, group_lr in zip(opt.param_groups, given):
        if group_lr is None:
            group["lr"] = None
    return opt


# ----------------------------------------------------------------------------- mixture of experts
# Megatron's layout: a routing map is bool [tokens, experts]; permuted rows are expert-major,
# tokens ascending within an expert; `row_map[r] = e * T + t` names the expert e and source token
# t of permuted row r (what the matching unpermute needs, as TE's row_id_map does). Nothing here
# waits for the device where the output size is known.
def _split_sizes(tokens_per_expert) -> list[int]:
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(n) for n in tokens_per_expert.tolist()]
    return [int(n) for n in tokens_per_expert]


def grouped_gemm(x, w, tokens_per_expert, trans_b: bool = False):
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
    row_map = _selected_positions(routing_map.bool(), num_out_tokens)
    permuted = tokens.index_select(0, row_map % tokens.shape[0])
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.t().reshape(-1).index_select(0, row_map)
    return permuted, permuted_probs, row_map


def moe_unpermute(permuted, row_map, restore_shape, merging_probs=None):
    num_tokens = int(restore_shape[0])
    rows = permuted.float()
    if merging_probs is not None:
        rows = rows * merging_probs.t().reshape(-1).index_select(0, row_map).float().unsqueeze(-1)
    out = torch.zeros(tuple(restore_shape), dtype=torch.float32, device=permuted.device)
    out = out.index_add(0, row_map % num_tokens, rows)
    return out.to(permuted.dtype)


def _chunk_source_rows(split_sizes, sorted_idxs, num_rows: int, device):
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
    src = _chunk_source_rows(split_sizes, sorted_idxs, input.shape[0], input.device)
    return input.index_select(0, src), (None if probs is None else probs.index_select(0, src))


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
    """softmax: top-k of the logits then softmax over the k (use_pre_softmax: softmax over all E,
    then top-k). sigmoid: top-k of sigmoid(logits) (+ expert_bias for the choice only), the k
    scores normalised to sum 1 when topk > 1. num_groups / group_topk: the k are taken from the
    group_topk groups whose best topk/group_topk scores sum highest. scaling_factor multiplies.
    """
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
    """The scores the load-balancing loss uses (softmax, or sigmoid normalised over E), top-k'd."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    idx = torch.topk(scores, k=topk, dim=1)[1]
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True), scores

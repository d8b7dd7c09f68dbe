"""The reference math of the ops (`megatron_adapt.ops`): plain PyTorch and device-agnostic.

One copy for every backend: the cpu backend serves its ops from these, the cuda and npu backends
run them where their kernels cannot take a call, and the tests check every kernel against them.
`reference.<op>` is op <op>'s math; it reports nothing (the backend that calls it reports what
ran), except `make_adam`, which reports the optimizer it builds under the caller's name.
"""
from __future__ import annotations

import weakref

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


def bias_mask(q, k, bias, attn_mask, causal, window_size):
    """SDPA's additive float mask for attention_bias: the bias in q's dtype, masked positions at the
    dtype's lowest value (finite: a fully masked row, e.g. a padded query, stays finite). The bias
    gets its gradient through it."""
    mask = build_mask(q.size(-2), k.size(-2), causal, window_size, attn_mask, q.device)
    add = bias.to(q.dtype)
    return add if mask is None else add.masked_fill(mask, torch.finfo(q.dtype).min)


def attention_bias(q, k, v, bias, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    """SDPA with the bias as its additive mask (bias_mask)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias_mask(q, k, bias, attn_mask, causal, window_size),
                                          dropout_p=dropout_p, scale=scale, enable_gqa=k.size(1) != q.size(1))


# ----------------------------------------------------------------------------- packed (thd) attention
def thd_segments(cu_seqlens, cu_seqlens_padded, total: int, name: str = "cu_seqlens") -> list[tuple[int, int]]:
    """[(start, length)] of each packed sequence in a [T, ...] tensor, from Megatron's PackedSeqParams:
    sequence i holds the tokens [start_i, start_i + length_i), start_i = cu_seqlens_padded[i] (or
    cu_seqlens[i] without padding), length_i = cu_seqlens[i + 1] - cu_seqlens[i]; the rest of its
    padded slot is padding. Raises ValueError naming the argument on malformed offsets."""
    cu = _offsets(cu_seqlens, name)
    if cu_seqlens_padded is None:
        padded = cu
    else:
        padded = _offsets(cu_seqlens_padded, f"{name}_padded")
        if len(padded) != len(cu):
            raise ValueError(f"{name}_padded has {len(padded)} entries, {name} {len(cu)}")
    segments = []
    for i in range(len(cu) - 1):
        length, slot = cu[i + 1] - cu[i], padded[i + 1] - padded[i]
        if length > slot:
            raise ValueError(f"sequence {i}: length {length} ({name}) exceeds its padded slot {slot} "
                             f"({name}_padded)")
        segments.append((padded[i], length))
    if padded[-1] > total:
        raise ValueError(f"{name} ends at {padded[-1]}, past the {total} packed tokens")
    return segments


_OFFSETS: dict = {}   # id(cu) -> (weakref to cu, its version counter, its values)


def _offsets(cu, name) -> list[int]:
    """cu's values, checked. Megatron hands one cu_seqlens tensor to every layer of a step: its values
    are read (a device-to-host sync on a GPU) once, and again only if it is written in place."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D integer tensor of n + 1 cumulative offsets, got "
                         f"{getattr(cu, 'shape', type(cu).__name__)} {getattr(cu, 'dtype', '')}")
    try:
        version = cu._version
    except RuntimeError:     # an inference-mode tensor keeps no version counter: read it every time
        version = None
    hit = _OFFSETS.get(id(cu))
    if version is not None and hit is not None and hit[0]() is cu and hit[1] == version:
        return hit[2]
    vals = _checked_offsets(cu, name)
    if version is not None:
        if len(_OFFSETS) >= 32:
            _OFFSETS.clear()
        _OFFSETS[id(cu)] = (weakref.ref(cu), version, vals)
    return vals


def _checked_offsets(cu, name) -> list[int]:
    vals = [int(x) for x in cu.tolist()]
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    bad = [i for i in range(len(vals) - 1) if vals[i + 1] < vals[i]]
    if bad:
        i = bad[0]
        raise ValueError(f"{name} must be non-decreasing cumulative offsets: entry {i + 1} ({vals[i + 1]}) < "
                         f"entry {i} ({vals[i]})")
    return vals


def check_thd(q, k, v):
    """q [T, hq, d], k/v [T, hkv, d(v)] with hq a multiple of hkv, or ValueError."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"packed (thd) attention takes q/k/v as [T, heads, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.size(1) % k.size(1) or k.size(1) != v.size(1):
        raise ValueError(f"heads q={q.size(1)} k={k.size(1)} v={v.size(1)}: q heads must be a multiple of "
                         "k/v heads")


def _zero_rows(t, n):
    return t.new_zeros((n,) + tuple(t.shape[1:]))


def attention_thd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                  causal=True, scale=None, dropout_p=0.0, window_size=None):
    """Each packed sequence on its own through `attention` (bottom-right causal alignment where its
    q and kv lengths differ); padding and tokens after the last sequence get zero output."""
    check_thd(q, k, v)
    segs_q = thd_segments(cu_seqlens_q, cu_seqlens_q_padded, q.size(0), "cu_seqlens_q")
    segs_kv = thd_segments(cu_seqlens_kv, cu_seqlens_kv_padded, k.size(0), "cu_seqlens_kv")
    if len(segs_q) != len(segs_kv):
        raise ValueError(f"cu_seqlens_q has {len(segs_q)} sequences, cu_seqlens_kv {len(segs_kv)}")
    pieces, at = [], 0
    dv = v.size(-1)
    out_rows = lambda n: q.new_zeros(n, q.size(1), dv)
    for (qs, ql), (ks, kl) in zip(segs_q, segs_kv):
        if qs > at:
            pieces.append(out_rows(qs - at))
        if ql:
            if kl:
                o = attention(q[qs:qs + ql].transpose(0, 1).unsqueeze(0), k[ks:ks + kl].transpose(0, 1).unsqueeze(0),
                              v[ks:ks + kl].transpose(0, 1).unsqueeze(0), None, causal, scale, dropout_p,
                              window_size)
                pieces.append(o[0].transpose(0, 1))
            else:
                pieces.append(out_rows(ql))
        at = qs + ql
    if at < q.size(0):
        pieces.append(out_rows(q.size(0) - at))
    return torch.cat(pieces)


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
class _FusedAdamState:
    """torch.optim's Adam keeps a `step` in every parameter's state; apex's and TE's FusedAdam,
    whose place these optimizers take, keep it in the param group. Megatron writes states the
    FusedAdam way: its `init_state_fn` (sharded checkpoint loading) creates exp_avg / exp_avg_sq
    only, and its optimizers save the common step only when it is non-zero. torch's Adam then
    raised KeyError 'step' on load_state_dict and on the next step(). Here a state loads as it
    was saved (no `step` added: a loaded state equals the saved one), and step() gives a state
    without `step` its group's step (FusedAdam's), else 0: the count of a state never stepped."""

    def __setstate__(self, state):
        added = []
        for group in state.get("param_groups", ()):
            for p in group.get("params", ()):
                p_state = state.get("state", {}).get(p)
                if p_state and "step" not in p_state:
                    p_state["step"] = torch.zeros(())    # only for torch's check of every state
                    added.append(p_state)
        super().__setstate__(state)
        for p_state in added:
            del p_state["step"]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p_state = self.state.get(p)
                if p_state and "step" not in p_state:
                    on_device = group.get("capturable") or group.get("fused")
                    p_state["step"] = torch.tensor(
                        float(group.get("step", 0)), dtype=torch.float32,
                        device=p.device if on_device else "cpu")
        return super().step(closure)


_FUSED_STATE = {base: type(base.__name__, (_FusedAdamState, base), {"__module__": __name__,
                                                                     "__doc__": _FusedAdamState.__doc__})
                for base in (torch.optim.Adam, torch.optim.AdamW)}


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
    base = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    cls = _FUSED_STATE[base]
    report.ran("adam", f"{impl_name}.{base.__name__}")
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


def grouped_gemm_wgrad(a, b, tokens_per_expert):
    """dw[e] = a[rows of e]^T @ b[rows of e]: one matmul per expert (zeros where e has no rows)."""
    sizes = _split_sizes(tokens_per_expert)
    if sum(sizes) != a.shape[0] or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped_gemm_wgrad: tokens_per_expert {sizes} does not split a "
                         f"{tuple(a.shape)} / b {tuple(b.shape)}")
    return torch.stack([ae.t() @ be for ae, be in zip(torch.split(a, sizes), torch.split(b, sizes))])


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


# ----------------------------------------------------------------------------- Mamba-2 (SSD)
# Shapes: x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n] (h % g == 0: head i reads
# group i // (h / g)), D [h] or [h, p], z like x, states [b, h, p, n]. The recurrence, per head:
#   dt' = clamp(softplus(dt + dt_bias)), state_t = exp(dt'_t A) state_{t-1} + dt'_t x_t B_t^T,
#   y_t = state_t C_t + D x_t, out_t = y_t * silu(z_t)
# seq_idx [b, l] (int, non-decreasing): the state does not cross from one sequence to the next
# (initial_states feed the first sequence only).
def ssd_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """dt as the scan uses it (fp32): + dt_bias, softplus (threshold 20, as mamba-ssm), clamp."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _heads(t, h):
    """[b, l, g, n] -> [b, l, h, n] (each group repeated for its heads), fp32."""
    return t.float().repeat_interleave(h // t.size(2), dim=2)


def _d_skip(D, x):
    D = D.float()
    return x.float() * (D[:, None] if D.dim() == 1 else D)


def ssd_scan_sequential(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                        dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None,
                        return_final_states=False):
    """The recurrence one step at a time, fp32: the tests' ground truth (slow, no chunking)."""
    b, l, h, p = x.shape
    dt = ssd_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch, xf = _heads(B, h), _heads(C, h), x.float()
    state = (initial_states.float() if initial_states is not None
             else x.new_zeros(b, h, p, B.size(-1), dtype=torch.float32))
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A.float())                                  # [b, h]
        if seq_idx is not None and t > 0:
            decay = decay * (seq_idx[:, t] == seq_idx[:, t - 1]).float()[:, None]
        state = state * decay[..., None, None] + torch.einsum(
            "bh,bhp,bhn->bhpn", dt[:, t], xf[:, t], Bh[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + _d_skip(D, x)
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None,
             return_final_states=False):
    """The chunked SSD algorithm (Mamba-2) in PyTorch ops, fp32, differentiable by autograd.

    Within a chunk of Q steps the output is a masked Q x Q matrix product; across chunks the
    state is passed once per chunk. Memory O(b h l Q), compute O(b h l (Q (p + n) + p n))."""
    b, l, h, p = x.shape
    n = B.size(-1)
    Q = int(chunk_size)
    dt = ssd_dt(dt, dt_bias, dt_softplus, dt_limit)
    xf, Bh, Ch = x.float(), _heads(B, h), _heads(C, h)
    pad = (-l) % Q
    if pad:  # padded steps have dt = 0: no decay, no input; their outputs are dropped
        xf, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bh, Ch))
        dt = F.pad(dt, (0, 0, 0, pad))
    L = l + pad
    c = L // Q
    xc, Bc, Cc = (t.reshape(b, c, Q, h, -1) for t in (xf, Bh, Ch))
    dtc = dt.reshape(b, c, Q, h)
    a = torch.cumsum(dtc * A.float(), dim=2)                                       # [b, c, Q, h]
    same = None
    if seq_idx is not None:
        seq = F.pad(seq_idx, (0, pad), value=-1) if pad else seq_idx   # (pads: their own sequence)
        if pad:
            seq = torch.where(seq < 0, seq_idx[:, -1:], seq)
        seq = seq.reshape(b, c, Q)
    # within chunks: y_i += sum_{j<=i} (C_i . B_j) exp(a_i - a_j) dt_j x_j
    seg = a[:, :, :, None, :] - a[:, :, None, :, :]                                # [b, c, i, j, h]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    keep = causal[None, None, :, :, None]
    if seq_idx is not None:
        keep = keep & (seq[:, :, :, None] == seq[:, :, None, :])[..., None]
    decay = torch.exp(seg.masked_fill(~keep, float("-inf")))
    scores = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc) * decay * dtc[:, :, None, :, :]
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, xc)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(a[:, :, -1:, :] - a) * dtc                                 # [b, c, Q, h]
    if seq_idx is not None:
        to_end = to_end * (seq == seq[:, :, -1:]).float()[..., None]
    chunk_states = torch.einsum("bcjh,bcjhp,bcjhn->bchpn", to_end, xc, Bc)
    # across chunks: the state entering chunk k
    state = (initial_states.float() if initial_states is not None
             else xf.new_zeros(b, h, p, n))
    entering = []
    for k in range(c):
        entering.append(state)
        carry = torch.exp(a[:, k, -1, :])                                          # [b, h]
        if seq_idx is not None:
            prev_last = seq[:, k - 1, -1] if k else seq[:, 0, 0]
            carry = carry * (seq[:, k, -1] == prev_last).float()[:, None]
        state = state * carry[..., None, None] + chunk_states[:, k]
    entering = torch.stack(entering, dim=1)                                        # [b, c, h, p, n]
    from_state = torch.exp(a)
    if seq_idx is not None:
        prev_last = torch.cat([seq[:, :1, :1], seq[:, :-1, -1:]], dim=1)           # [b, c, 1]
        from_state = from_state * (seq == prev_last).float()[..., None]
    y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", Cc, entering, from_state)
    y = y.reshape(b, L, h, p)[:, :l]
    if D is not None:
        y = y + _d_skip(D, x)
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None):
    """Depthwise causal conv over the sequence: x [b, l, d] (any strides), weight [d, w],
    bias [d] | None, activation None | "silu" | "swish" -> [b, l, d] x.dtype (fp32 math).
    y[t] = act(bias + sum_k weight[:, k] x[t - (w - 1) + k]); with seq_idx [b, l] a window
    never reaches into the previous sequence."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r}: None, 'silu' or 'swish'")
    b, l, d = x.shape
    w = weight.size(-1)
    xt = x.float().transpose(1, 2)                                                 # [b, d, l]
    if seq_idx is None:
        y = F.conv1d(F.pad(xt, (w - 1, 0)), weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=d)
    else:
        win = F.pad(xt, (w - 1, 0)).unfold(-1, w, 1)                               # [b, d, l, w]
        pos = torch.arange(l, device=x.device)[:, None] - (w - 1) + torch.arange(w, device=x.device)
        src = seq_idx.gather(1, pos.clamp(min=0).reshape(1, -1).expand(b, -1)).reshape(b, l, w)
        ok = (src == seq_idx[:, :, None]) & (pos >= 0)
        y = (win * ok[:, None].float() * weight.float()[None, :, None, :]).sum(-1)
        if bias is not None:
            y = y + bias.float()[None, :, None]
    if activation is not None:
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype)


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba-ssm's gated RMSNorm: x [..., d], weight [d], z like x | None; per group of
    group_size channels (None: all d): norm_before_gate  y = rmsnorm(x) w * silu(z);
    otherwise y = rmsnorm(x * silu(z)) w. fp32 math, x.dtype out."""
    d = x.size(-1)
    gs = d if group_size is None else int(group_size)
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    xg = xf.reshape(*x.shape[:-1], d // gs, gs)
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape) * weight.float()
    if z is not None and norm_before_gate:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def _cache_slots(batch, indices, device):
    """(valid rows mask [batch], their cache slots): row i uses slot indices[i] (row i without
    indices); a negative slot marks a padding row."""
    idx = (torch.arange(batch, device=device) if indices is None
           else indices.reshape(-1).to(device=device, dtype=torch.long))
    valid = idx >= 0
    return valid, idx[valid]


def ssm_conv_update(x, conv_state, weight, bias, silu, conv_state_indices=None,
                    intermediate_conv_states=None):
    """One decode step (or a few: speculative tokens) of the causal conv over a conv-state cache.
    x [b, d] or [b, s, d]; conv_state [slots, d, L] (L >= w), updated in place; weight [d, w];
    conv_state_indices [b] int (row i uses slot indices[i]; a negative slot gives zeros and
    touches nothing) | None (row i is slot i); intermediate_conv_states [slots, s, d, L] | None
    gets the state after each token. Per token: y = act(bias + sum_k weight[:, k] window[k]) over
    the state's last w - 1 columns and the token, then the state shifts left by one and takes
    the token. Megatron's causal_conv1d_update (megatron/core/ssm/ops) semantics; fp32 math."""
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(1)
    b, s, _ = x.shape
    w, length = weight.size(-1), conv_state.size(-1)
    valid, rows = _cache_slots(b, conv_state_indices, x.device)
    out = torch.zeros_like(x)
    wf = weight.float()
    for t in range(s):
        tok = x[valid, t]                                                          # [n, d]
        state = conv_state[rows]
        window = torch.cat([state[..., length - w + 1:].float(), tok.float()[..., None]], dim=-1)
        y = (window * wf).sum(-1)
        if bias is not None:
            y = y + bias.float()
        if silu:
            y = F.silu(y)
        state = torch.cat([state[..., 1:], tok.to(conv_state.dtype)[..., None]], dim=-1)
        conv_state[rows] = state
        if intermediate_conv_states is not None:
            intermediate_conv_states[rows, t] = state.to(intermediate_conv_states.dtype)
        out[valid, t] = y.to(out.dtype)
    return out.squeeze(1) if squeeze else out


def ssm_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, intermediate_ssm_states=None):
    """Mamba-2's recurrence for a decode step (or a few tokens) over an SSM-state cache, as
    Megatron's selective_state_update (megatron/core/ssm/ops/mamba_ssm.py): state [slots, h, p, n]
    (or [slots, p, n]), updated in place; x / dt / z [b, (s,) h, p]; A [h, p, n]; B / C
    [b, (s,) g, n]; D / dt_bias [h, p]; a negative slot in state_batch_indices gives zeros.
    Per token: dt' = softplus(dt + dt_bias) (dt' = dt above 20), h = h exp(A dt') + dt' B x,
    y = (h C) + D x, times silu(z). fp32 math, x.dtype out."""
    has_heads = state.dim() > 3
    if not has_heads:
        state = state.unsqueeze(1)
    seq_unsq = False
    if has_heads and x.dim() == 3:
        x, dt, B, C = (t.unsqueeze(1) for t in (x, dt, B, C))
        z = z.unsqueeze(1) if z is not None else None
        seq_unsq = True
    elif not has_heads and x.dim() == 2:
        x, dt, B, C = (t[:, None, None] for t in (x, dt, B, C))
        z = z[:, None, None] if z is not None else None
        seq_unsq = True
    elif not has_heads and x.dim() == 3:
        x, dt, B, C = (t.unsqueeze(2) for t in (x, dt, B, C))
        z = z.unsqueeze(2) if z is not None else None
    A = A.unsqueeze(0) if A.dim() == 2 else A
    D = D.unsqueeze(0) if D is not None and D.dim() == 1 else D
    dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None and dt_bias.dim() == 1 else dt_bias
    inter = intermediate_ssm_states
    if inter is not None and not has_heads and inter.dim() == 4:
        inter = inter.unsqueeze(2)
    b, s, h, _ = x.shape
    ratio = h // B.size(-2)
    valid, rows = _cache_slots(b, state_batch_indices, x.device)
    out = torch.zeros_like(x)
    hstate = state[rows].float()                                                   # [n, h, p, N]
    for t in range(s):
        d = dt[valid, t].float()
        if dt_bias is not None:
            d = d + dt_bias.float()
        if dt_softplus:
            d = torch.where(d <= 20.0, F.softplus(d), d)
        Bt = B[valid, t].float().repeat_interleave(ratio, dim=1)                   # [n, h, N]
        Ct = C[valid, t].float().repeat_interleave(ratio, dim=1)
        xt = x[valid, t].float()                                                   # [n, h, p]
        hstate = hstate * torch.exp(A.float() * d[..., None]) + (d * xt)[..., None] * Bt[:, :, None, :]
        if inter is not None:
            inter[rows, t] = hstate.to(inter.dtype)
        y = (hstate * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            y = y + xt * D.float()
        if z is not None:
            y = y * F.silu(z[valid, t].float())
        out[valid, t] = y.to(out.dtype)
    state[rows] = hstate.to(state.dtype)
    if not has_heads:
        out = out.squeeze(2)
    return out.squeeze(1) if seq_unsq else out

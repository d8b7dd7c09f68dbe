"""Vocab-parallel cross entropy: a fused, chunked online-softmax Triton kernel pair, TP-aware.

Forward: ONE read of the logits. Each row's program walks the local vocabulary slice in chunks
keeping a running max and rescaled sum of exponentials (online softmax), and also picks the
target logit (when the target falls in this rank's slice) and sum(x) for label smoothing.
Collectives are exactly the reference's (backends/cpu/cross_entropy.py): the row max is
all-reduced (MAX) first, each rank rescales its partial sums to that max, then one SUM
all-reduce of [predicted, sum_exp(, sum_x)]. Label smoothing uses the *global* vocabulary K.
Backward: one read + one write: grad = (softmax - (1-s)*onehot - s/K) * grad_out, computed from
the saved logits and row log-sum-exp and written IN PLACE into the saved logits buffer (like
Megatron's saved softmax buffer, and Liger): no [tokens, vocab] fp32 buffer is ever allocated.
The logits are therefore consumed by the backward; a second backward through the same graph
raises instead of returning garbage.
"""
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megatron_adapt import report

from ._common import fallback, kernel_reason, next_pow2

IMPL = "cuda.triton.online_softmax"
CHUNK = 4096


@triton.jit
def _ce_fwd(X, T, STATS, M, V, start, BLOCK: tl.constexpr, SMOOTH: tl.constexpr):
    row = tl.program_id(0)
    base = X + tl.cast(row, tl.int64) * V
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    se = tl.zeros([BLOCK], dtype=tl.float32)
    sx = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < V
        x = tl.load(base + cols, mask=m, other=float("-inf")).to(tl.float32)
        new = tl.maximum(mx, x)
        safe = tl.where(new == float("-inf"), 0.0, new)
        se = se * tl.exp(mx - safe) + tl.exp(x - safe)
        mx = new
        if SMOOTH:
            sx += tl.where(m, x, 0.0)
    rmax = tl.max(mx, axis=0)
    sum_exp = tl.sum(tl.where(mx == float("-inf"), 0.0, se * tl.exp(mx - rmax)), axis=0)
    t = tl.load(T + row) - start
    inside = (t >= 0) & (t < V)
    pred = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
    pred = tl.where(inside, pred, 0.0)
    tl.store(STATS + row, rmax)
    tl.store(STATS + M + row, sum_exp)
    tl.store(STATS + 2 * M + row, pred)
    if SMOOTH:
        tl.store(STATS + 3 * M + row, tl.sum(sx, axis=0))


@triton.jit
def _ce_bwd(X, DX, T, LSE, GO, V, start, on_target, uniform, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = X + tl.cast(row, tl.int64) * V
    out = DX + tl.cast(row, tl.int64) * V
    lse = tl.load(LSE + row)
    go = tl.load(GO + row).to(tl.float32)
    t = tl.load(T + row) - start
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < V
        x = tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - uniform - tl.where(cols == t, on_target, 0.0)
        tl.store(out + cols, (g * go).to(X.dtype.element_ty), mask=m)


def _group_info(tp_group):
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


class FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, tp_group):
        world, rank = _group_info(tp_group)
        part = logits.size(-1)
        x = logits.reshape(-1, part)
        if not x.is_contiguous():
            x = x.contiguous()
        t = target.reshape(-1).contiguous()
        rows = x.size(0)
        start = rank * part
        smooth = label_smoothing > 0
        stats = torch.empty((4 if smooth else 3, rows), dtype=torch.float32, device=x.device)
        block = min(CHUNK, next_pow2(part))
        if rows:
            _ce_fwd[(rows,)](x, t, stats, rows, part, start, BLOCK=block, SMOOTH=smooth,
                             num_warps=8 if block >= 2048 else 4)
        local_max = stats[0]
        gmax = local_max.clone()
        if world > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)
        # Rescale this rank's partial sums to the global max, then one all-reduce of all of them.
        in_part = (t >= start) & (t < start + part)
        sums = [(stats[2] - gmax) * in_part, stats[1] * torch.exp(local_max - gmax)]
        if smooth:
            sums.append(stats[3] - part * gmax)
        stacked = torch.stack(sums)
        if world > 1:
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        predicted, sum_exp = stacked[0], stacked[1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted
        vocab = part * world
        smoothing = 0.0
        if smooth:
            smoothing = label_smoothing * vocab / (vocab - 1)
            mean_log_probs = stacked[2] / vocab - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        lse = log_sum_exp + gmax  # absolute log-sum-exp of the raw logits
        ctx.save_for_backward(x, t, lse)
        ctx.cfg = (start, part, smoothing, vocab, block, logits.shape)
        ctx.consumed = False
        # A leaf the caller holds (rare: tests, not Megatron) keeps its values: write a new buffer.
        ctx.inplace = not (logits.is_leaf and x.data_ptr() == logits.data_ptr())
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.consumed and ctx.inplace:
            raise RuntimeError("vocab_parallel_cross_entropy (cuda): the backward writes the gradient "
                               "into the saved logits buffer, so it can run only once per forward")
        ctx.consumed = True
        x, t, lse = ctx.saved_tensors
        start, part, smoothing, vocab, block, shape = ctx.cfg
        go = grad_output.reshape(-1).float().contiguous()
        dx = x if ctx.inplace else torch.empty_like(x)
        if x.size(0):
            _ce_bwd[(x.size(0),)](x, dx, t, lse, go, part, start, 1.0 - smoothing, smoothing / vocab,
                                  BLOCK=block, num_warps=8 if block >= 2048 else 4)
        return dx.view(shape), None, None, None


def vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, tp_group=None):
    why = kernel_reason(logits)
    if why:
        return fallback("vocab_parallel_cross_entropy", why, logits, target, label_smoothing, tp_group)
    report.ran("vocab_parallel_cross_entropy", IMPL)
    return FusedVocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), tp_group)

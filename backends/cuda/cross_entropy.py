"""Vocab-parallel cross entropy: a fused, chunked online-softmax Triton kernel pair, TP-aware.

Forward: ONE read of the logits. A row's local vocabulary slice is cut into SPLIT pieces, one
program each (split-vocab: short token counts still fill the GPU); a program walks its piece in
chunks, keeping a running max (one max reduction per chunk, so ONE exp per element) and a
rescaled vector of exponentials, plus sum(x) for label smoothing. With SPLIT = 1 and no tensor
parallelism the same program finishes the row (loss and log-sum-exp), so the forward is a
single launch; otherwise a tiny combine kernel merges the (max, sum_exp, sum_x) partials and
picks the target logit.
Collectives are exactly the reference's (backends/reference.py): the row max is
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

from ._common import cdiv, launch, fallback, kernel_reason, next_pow2
from . import providers

IMPL = "cuda.triton.online_softmax"
CHUNK = 4096          # forward chunk width
BWD_CHUNK = 4096      # backward chunk width
FWD_WARPS = 8
BWD_WARPS = 8
BWD_EVICT = False     # evict_first hint on the backward's logits loads
SPLIT = None          # pieces per row; None: chosen by _split
SPLIT_TARGET = 4      # aim for >= SPLIT_TARGET programs per SM-slot wave when splitting rows
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _ce_fwd(X, T, PART, LOSS, LSE, M, V, start, piece, smoothing,
            BLOCK: tl.constexpr, SMOOTH: tl.constexpr, FINAL: tl.constexpr):
    """Program (row, s) reduces X[row, s*piece : (s+1)*piece]. FINAL (SPLIT = 1, no TP): write the
    loss and absolute log-sum-exp. Else write partials PART[k, s, row], k = max, sum_exp, sum_x."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    base = X + tl.cast(row, tl.int64) * V
    lo = s * piece
    hi = tl.minimum(lo + piece, V)
    mx = float("-inf")
    se = tl.zeros([BLOCK], dtype=tl.float32)
    sx = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(lo, hi, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < hi
        x = tl.load(base + cols, mask=m, other=float("-inf"), eviction_policy="evict_first")
        x = x.to(tl.float32) * LOG2E          # base-2 logits: exp(x - c) = exp2(x*log2e - c*log2e)
        new = tl.maximum(mx, tl.max(x, axis=0))
        safe = tl.where(new == float("-inf"), 0.0, new)
        se = se * tl.math.exp2(mx - safe) + tl.math.exp2(x - safe)
        mx = new
        if SMOOTH:
            sx += tl.where(m, x, 0.0)
    sum_exp = tl.sum(se, axis=0)
    mx = mx / LOG2E
    sum_x = tl.sum(sx, axis=0) / LOG2E
    if FINAL:
        t = tl.load(T + row) - start
        inside = (t >= 0) & (t < V)
        pred = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
        pred = tl.where(inside, pred, 0.0)
        lse_rel = tl.log(sum_exp)
        loss = lse_rel - (pred - mx)
        if SMOOTH:
            mean_log_probs = (sum_x - V * mx) / V - lse_rel
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        tl.store(LOSS + row, loss)
        tl.store(LSE + row, lse_rel + mx)
    else:
        S = tl.num_programs(1)
        tl.store(PART + s * M + row, mx)
        tl.store(PART + (S + s) * M + row, sum_exp)
        if SMOOTH:
            tl.store(PART + (2 * S + s) * M + row, sum_x)


@triton.jit
def _ce_combine(X, T, PART, STATS, LOSS, LSE, M, V, start, S, smoothing, SMOOTH: tl.constexpr,
                FINAL: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr):
    """Merge the S partials of BR rows. FINAL (no TP): write loss and log-sum-exp. Else write
    STATS[k, row], k = max, sum_exp (to that max), target logit (0 outside this rank's slice), sum_x."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < M
    ss = tl.arange(0, BS)
    m2 = rm[:, None] & (ss < S)[None, :]
    pm = tl.load(PART + ss[None, :] * M + rows[:, None], mask=m2, other=float("-inf"))
    ps = tl.load(PART + (S + ss[None, :]) * M + rows[:, None], mask=m2, other=0.0)
    gmax = tl.max(pm, axis=1)
    safe = tl.where(gmax == float("-inf"), 0.0, gmax)
    sum_exp = tl.sum(tl.where(m2, ps * tl.exp(pm - safe[:, None]), 0.0), axis=1)
    t = tl.load(T + rows, mask=rm, other=0) - start
    inside = (t >= 0) & (t < V) & rm
    pred = tl.load(X + rows.to(tl.int64) * V + tl.where(inside, t, 0), mask=inside, other=0.0)
    pred = pred.to(tl.float32)
    sum_x = 0.0
    if SMOOTH:
        px = tl.load(PART + (2 * S + ss[None, :]) * M + rows[:, None], mask=m2, other=0.0)
        sum_x = tl.sum(px, axis=1)
    if FINAL:
        lse_rel = tl.log(sum_exp)
        loss = lse_rel - (pred - gmax)
        if SMOOTH:
            loss = (1.0 - smoothing) * loss - smoothing * ((sum_x - V * gmax) / V - lse_rel)
        tl.store(LOSS + rows, loss, mask=rm)
        tl.store(LSE + rows, lse_rel + gmax, mask=rm)
    else:
        tl.store(STATS + rows, gmax, mask=rm)
        tl.store(STATS + M + rows, sum_exp, mask=rm)
        tl.store(STATS + 2 * M + rows, pred, mask=rm)
        if SMOOTH:
            tl.store(STATS + 3 * M + rows, sum_x, mask=rm)


@triton.jit
def _ce_bwd(X, DX, T, LSE, GO, V, start, piece, on_target, uniform, BLOCK: tl.constexpr,
            EVICT: tl.constexpr):
    """Program (row, s): grad of X[row, s*piece : (s+1)*piece], one read and one write."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    base = X + tl.cast(row, tl.int64) * V
    out = DX + tl.cast(row, tl.int64) * V
    c = tl.load(LSE + row) * LOG2E
    go = tl.load(GO + row).to(tl.float32)
    t = tl.load(T + row) - start
    gu = uniform * go
    gt = on_target * go
    lo = s * piece
    hi = tl.minimum(lo + piece, V)
    for off in range(lo, hi, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < hi
        if EVICT:
            x = tl.load(base + cols, mask=m, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(base + cols, mask=m, other=0.0)
        x = x.to(tl.float32)
        g = tl.math.exp2(x * LOG2E - c) * go - gu - tl.where(cols == t, gt, 0.0)
        tl.store(out + cols, g.to(DX.dtype.element_ty), mask=m)


def _group_info(tp_group):
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _split(rows, part, block, device):
    """Pieces per row: 1 when the rows alone fill the GPU a few times over, else enough pieces
    (each at least one chunk) for about SPLIT_TARGET programs per SM."""
    chunks = cdiv(part, block)
    if SPLIT is not None:
        split = max(1, min(chunks, SPLIT))
        piece = cdiv(chunks, split) * block
        return cdiv(part, piece), piece
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = sms * 8 * SPLIT_TARGET
    else:
        want = 8  # interpreter: exercise the split path on small inputs
    split = max(1, min(chunks, cdiv(want, max(rows, 1))))
    piece = cdiv(chunks, split) * block
    return cdiv(part, piece), piece


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
        vocab = part * world
        smoothing = label_smoothing * vocab / (vocab - 1) if smooth else 0.0
        block = min(CHUNK, next_pow2(part))
        warps = FWD_WARPS if block >= 2048 else 4
        split, piece = _split(rows, part, block, x.device)
        final = world == 1
        # In the target's shape from the start: the output must not be a view made in here, since
        # Megatron's schedules scale the loss in place (`output_tensor *= cp_group_size`), which
        # autograd refuses on a custom Function's view output (and on views of it).
        loss = torch.empty(target.shape, dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        if final and split == 1:
            if rows:
                launch(_ce_fwd, (rows, 1), x, t, loss, loss, lse, rows, part, start, piece, smoothing,
                                   BLOCK=block, SMOOTH=smooth, FINAL=True, num_warps=warps)
        else:
            nk = 3 if smooth else 2
            partial = torch.empty((nk, split, rows), dtype=torch.float32, device=x.device)
            stats = torch.empty((4 if smooth else 3, rows), dtype=torch.float32, device=x.device)
            if rows:
                launch(_ce_fwd, (rows, split), x, t, partial, partial, partial, rows, part, start, piece,
                                       smoothing, BLOCK=block, SMOOTH=smooth, FINAL=False,
                                       num_warps=warps)
                br = 64
                launch(_ce_combine, (cdiv(rows, br),), x, t, partial, stats, loss, lse, rows, part,
                                                      start, split, smoothing, SMOOTH=smooth,
                                                      FINAL=final, BR=br, BS=next_pow2(split),
                                                      num_warps=4)
            if not final:
                loss, lse = _reduce_stats(stats.view(stats.size(0), *target.shape), t.view(target.shape),
                                          start, part, world, tp_group, smooth, smoothing, vocab)
        ctx.save_for_backward(x, t, lse)
        ctx.cfg = (start, part, smoothing, vocab, logits.shape)
        ctx.consumed = False
        # A leaf the caller holds (rare: tests, not Megatron) keeps its values: write a new buffer.
        ctx.inplace = not (logits.is_leaf and x.data_ptr() == logits.data_ptr())
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.consumed and ctx.inplace:
            raise RuntimeError("vocab_parallel_cross_entropy (cuda): the backward writes the gradient "
                               "into the saved logits buffer, so it can run only once per forward")
        ctx.consumed = True
        x, t, lse = ctx.saved_tensors
        start, part, smoothing, vocab, shape = ctx.cfg
        go = grad_output.reshape(-1).float().contiguous()
        dx = x if ctx.inplace else torch.empty_like(x)
        rows = x.size(0)
        if rows:
            block = min(BWD_CHUNK, next_pow2(part))
            split, piece = _split(rows, part, block, x.device)
            launch(_ce_bwd, (rows, split), x, dx, t, lse, go, part, start, piece, 1.0 - smoothing,
                                   smoothing / vocab, BLOCK=block, EVICT=BWD_EVICT,
                                   num_warps=BWD_WARPS if block >= 2048 else 4)
        return dx.view(shape), None, None, None


def _reduce_stats(stats, t, start, part, world, tp_group, smooth, smoothing, vocab):
    """The reference's collectives over this rank's (max, sum_exp, target logit, sum_x)."""
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
    if smooth:
        mean_log_probs = stacked[2] / vocab - log_sum_exp
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss, log_sum_exp + gmax  # loss, absolute log-sum-exp of the raw logits


@providers.selectable("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, tp_group=None):
    why = kernel_reason(logits)
    if why:
        return fallback("vocab_parallel_cross_entropy", why, logits, target, label_smoothing, tp_group)
    report.ran("vocab_parallel_cross_entropy", IMPL)
    return FusedVocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), tp_group)

"""Vocab-parallel cross entropy in PyTorch: fp32 math, one all-reduce for the sums, grad in place."""
import torch
import torch.distributed as dist

from megatron_adapt import report

IMPL = "cpu.torch"


def _group_info(tp_group):
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross entropy over a vocabulary split along the last dim across `tp_group`.

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
    report.ran("vocab_parallel_cross_entropy", IMPL)
    return VocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), tp_group)

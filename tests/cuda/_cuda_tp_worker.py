"""Worker for the TP=2 cross-entropy test: one process per rank. NCCL with one GPU per rank when
there are enough GPUs; otherwise gloo (ranks share one GPU, or interpreted kernels on CPU).

Kept apart from the test module so that a spawned child imports only torch before it sets
TRITON_INTERPRET (triton reads it at import). With a GPU the ranks share it and run the
compiled kernels (gloo all-reduces CUDA tensors); without one the kernels run interpreted.
"""
import os

import torch


def run(rank, world, init_file, logits, target, smoothing, grad_out, results):
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"   # CPU tensors + gloo: the kernel runs interpreted
    os.environ["MEGATRON_ADAPT_AUTO"] = "0"
    import torch.distributed as dist

    from megatron_adapt import report
    from megatron_adapt.backends.cuda.cross_entropy import vocab_parallel_cross_entropy

    nccl = torch.cuda.device_count() >= world
    if nccl:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    try:
        if gpu:
            logits, target, grad_out = logits.cuda(), target.cuda(), grad_out.cuda()
        part = logits.size(-1) // world
        local = logits[..., rank * part:(rank + 1) * part].clone().requires_grad_()
        inp = local * 1.0  # a non-leaf, as Megatron's logits: the gradient is written in place
        inp.retain_grad()
        loss = vocab_parallel_cross_entropy(inp, target, smoothing, dist.group.WORLD)
        loss *= 1.0   # Megatron's schedules scale the loss in place: the output must allow it
        loss.backward(grad_out)
        counts = report.op_counts()["vocab_parallel_cross_entropy"]
        results.put((rank, loss.detach().cpu().numpy(), local.grad.detach().cpu().numpy(), sorted(counts),
                     dist.get_backend()))
    finally:
        dist.destroy_process_group()

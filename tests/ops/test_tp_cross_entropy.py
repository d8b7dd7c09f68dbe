"""The TP-aware cross entropy under a real gloo process group (2 processes): the loss and the
gradient of each vocabulary shard match the full-vocabulary fp64 reference."""
import os

import torch
import torch.multiprocessing as mp

from test_cpu_ops import ce_reference


def _worker(rank, port, vocab, smoothing, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron_adapt.backends.cpu.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (6, 3), generator=g)
    part = vocab // 2
    shard = logits[..., rank * part:(rank + 1) * part].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, smoothing, dist.group.WORLD)
    gout = torch.randn(6, 3, generator=g)
    (loss * gout).sum().backward()
    full = logits.double().requires_grad_()
    ref = ce_reference(full, target, smoothing)
    (ref * gout.double()).sum().backward()
    ok_loss = torch.allclose(loss.double(), ref, atol=1e-5, rtol=1e-5)
    ok_grad = torch.allclose(shard.grad.double(), full.grad[..., rank * part:(rank + 1) * part], atol=1e-6, rtol=1e-5)
    q.put((rank, ok_loss, ok_grad))
    dist.destroy_process_group()


def _port():
    from megatron_adapt.apps.ports import free_port

    return free_port()


def test_tp2_cross_entropy_matches_full_vocab_reference():
    ctx = mp.get_context("spawn")
    for vocab, smoothing in ((128, 0.0), (50, 0.2)):
        q = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, _port.__call__() if False else port, vocab, smoothing, q))
                 for port in [_port()] for r in range(2)]
        [p.start() for p in procs]
        results = sorted(q.get() for _ in procs)
        [p.join(60) for p in procs]
        assert results == [(0, True, True), (1, True, True)], (vocab, smoothing, results)

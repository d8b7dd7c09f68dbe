"""Worker for the providers' agreement test: one gloo process per rank, CPU functions whose speed
depends on the rank (kept apart from the test module so that a spawned child imports little)."""
import os
import time


def run(rank, world, init_file, results):
    os.environ["MEGATRON_ADAPT_AUTO"] = "0"
    import torch
    import torch.distributed as dist

    from megatron_adapt.backends.cuda import providers
    from megatron_adapt.ops import set_replica_group

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    set_replica_group(lambda: dist.group.WORLD)
    try:
        def rms(x, w, eps):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

        def slow(ms):
            def run_(*args):
                time.sleep(ms / 1e3)
                return rms(*args)
            return run_

        args = (torch.randn(8, 32, requires_grad=True), torch.randn(32, requires_grad=True), 1e-5)
        out = []
        # the candidate is much faster on rank 0 only, then on both ranks
        for cand_ms in ((0 if rank == 0 else 40), 0):
            cand = providers.Candidate("lib", "cand", "torch", lambda *a: None, slow(cand_ms))
            won, notes = providers.measure(slow(20), [cand], args)
            out.append((won is not None, notes.get("agreed_over_ranks"), notes["cand"]))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()

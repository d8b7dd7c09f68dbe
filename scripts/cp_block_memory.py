#!/usr/bin/env python3
"""Peak host memory and time of one context-parallel ring block in torch math (forward + backward,
backends/context_parallel.py's _block_fwd / _block_bwd) at the shape of Megatron's custom-process-group
test at CP=2 (4 x 32 heads x 2048 queries x 2048 keys, d128, bf16 in): the module given as a file.

    python scripts/cp_block_memory.py backends/context_parallel.py
    git show <commit>:backends/context_parallel.py > /tmp/old.py && python scripts/cp_block_memory.py /tmp/old.py
"""
import importlib.util, resource, sys, time, torch
torch.set_num_threads(2)
spec = importlib.util.spec_from_file_location("cpmod", sys.argv[1]); cp = importlib.util.module_from_spec(spec); spec.loader.exec_module(cp)
b, h, s, d = 4, 32, 2048, 128
qpos, qdoc = cp.sbhd_meta(b, s, 2, 0); kpos, kdoc = cp.sbhd_meta(b, s, 2, 1)
ok = cp.visible(qpos, qdoc, kpos, kdoc, True, None)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(b, h, s, d, generator=g).bfloat16() for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
t = time.time()
out, lse = cp._block_fwd(q, k, v, ok, 0.088, None)
dout = torch.randn(out.shape, generator=g)
grads = cp._block_bwd(q, k, v, ok, 0.088, out, dout, lse, None)
print(f"{sys.argv[1]}: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (inputs and setup {base:.2f}), {time.time() - t:.1f} s, dq sum {grads[0].double().sum():.6e} out sum {out.double().sum():.6e}")

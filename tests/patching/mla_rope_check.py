"""Run in a fresh interpreter with TRITON_INTERPRET=1: megatron-adapt's fused MLA YaRN RoPE (the
cpu backend's rope_cos_sin) against Megatron's own Triton kernels run by Triton's interpreter,
forward and backward, sbhd and packed thd (with context-parallel chunking). Prints JSON."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import applier  # noqa: E402

megatron_adapt.apply("cpu", quiet=True)
from megatron.core import config as mcore_config  # noqa: E402

mcore_config.set_experimental_flag(True)   # core 0.15 gates its fused MLA rope as experimental
# (a user passes --enable-experimental there); later releases ignore the flag for it
from megatron.core.fusions import fused_mla_yarn_rope_apply as kernels  # noqa: E402
from megatron.core.transformer import multi_latent_attention as mla  # noqa: E402

for name in ("rotary_fwd_q_kernel", "rotary_bwd_q_kernel", "rotary_fwd_kv_kernel", "rotary_bwd_kv_kernel"):
    getattr(kernels, name).configs = getattr(kernels, name).configs[:1]   # no benchmarking without a GPU
installed = applier.installed()
ours = (mla.fused_apply_mla_rope_for_q, mla.fused_apply_mla_rope_for_kv)
megatron = (installed[f"{mla.__name__}:fused_apply_mla_rope_for_q"].original,
            installed[f"{mla.__name__}:fused_apply_mla_rope_for_kv"].original)
assert ours[0] is not megatron[0] and ours[1] is not megatron[1]

torch.manual_seed(0)
n, dq, dp, dk, dv = 3, 8, 8, 8, 4   # Megatron's kernel needs power-of-2 head dims
emb = torch.randn(32, 1, 1, dp)
cos, sin = (emb.cos() * 1.3).contiguous(), (emb.sin() * 1.3).contiguous()   # YaRN's mscale folded in
cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)


def run(fns, shape, cu_seqlens, rank, size, inputs):
    q, kv, kpe = inputs
    yq = fns[0](q.clone(), cos, sin, dq, dp, cu_seqlens, rank, size)
    k, v = fns[1](kv, kpe, cos, sin, dp, dk, dv, cu_seqlens, rank, size)
    g = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate((yq, k, v))]
    return (yq, k, v, *torch.autograd.grad((yq, k, v), (q, kv, kpe), g))


def err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


out = {}
for cu_seqlens, rank, size in ((None, 0, 1), (cu, 0, 1), (cu, 0, 2), (cu, 1, 2)):
    shape = (10, 2) if cu_seqlens is None else (int(cu[-1]) // size,)
    inputs = [torch.randn(*shape, n, d, requires_grad=True) for d in (dq + dp, dk + dv)]
    inputs.append(torch.randn(*shape, 1, dp, requires_grad=True))
    name = "sbhd" if cu_seqlens is None else f"thd cp_rank={rank}/{size}"
    out[name] = {"max_err": err(run(ours, shape, cu_seqlens, rank, size, inputs),
                                run(megatron, shape, cu_seqlens, rank, size, inputs))}
    if size == 2:   # the check can fail: the other rank's chunk positions differ
        out[name]["other_rank_err"] = err(run(ours, shape, cu_seqlens, 1 - rank, size, inputs)[:1],
                                          run(megatron, shape, cu_seqlens, rank, size, inputs)[:1])
print("MLA-ROPE-JSON:" + json.dumps(out))
sys.stdout.flush()

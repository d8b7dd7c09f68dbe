"""Tier 1, area collectives: Megatron-FSDP's premultiplied-sum gradient reduce on backends whose
process groups lack it (gloo refused it at the reduce: "Cannot use ReduceOp.PREMUL_SUM with Gloo").
Reached through Megatron's own gradient_reduce_preprocessing, and a gloo reduce-scatter with its
result (one process)."""
import json

from adapt_testutil import run_python

CODE = r"""
import json, os, torch, torch.distributed as dist, megatron_adapt
megatron_adapt.apply("cpu", quiet=True)
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buf
from megatron_adapt.apps.ports import free_port

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
fused = DistributedDataParallelConfig(gradient_reduce_div_fusion=True, average_in_collective=False)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    grad = torch.full((8,), 3.0, dtype=dtype)
    op = buf.gradient_reduce_preprocessing(grad, 0.5, fused)
    reduced = torch.empty(8, dtype=dtype)
    dist.reduce_scatter_tensor(reduced, grad, op=op)
    out[str(dtype)] = {"sum": op == dist.ReduceOp.SUM, "reduced": reduced.tolist()}
grad = torch.full((4,), 3.0)
op = buf.gradient_reduce_preprocessing(grad, None, fused)
out["unscaled"] = {"sum": op == dist.ReduceOp.SUM, "grad": grad.tolist()}
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_premultiplied_sum_becomes_scale_then_sum_on_gloo():
    res = json.loads(run_python(CODE, env={"MEGATRON_ADAPT_AUTO": "0"}).stdout.strip().splitlines()[-1])
    for dtype in ("torch.float32", "torch.bfloat16"):   # fp32: the fused branch; bf16: Megatron's own
        assert res[dtype] == {"sum": True, "reduced": [1.5] * 8}, res
    assert res["unscaled"] == {"sum": True, "grad": [3.0] * 4}, res

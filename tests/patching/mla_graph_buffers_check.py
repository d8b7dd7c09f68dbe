"""Run in a fresh interpreter with TRITON_INTERPRET=1 (core 0.18+): multi-latent attention's fused
RoPE inside a CUDA-graph capture, as Megatron's CudaGraphRunner drives it, on the CPU.

The runner backs up the layer's buffers before its forward capture and copies them back in place
after it (core 0.18+'s create_fwd_graph); YaRN's cos / sin cache are such buffers, and Megatron's
kernels save them for the backward. Here: a YarnRotaryEmbedding's cached cos / sin, the kernels'
forward under a (simulated) capture, the restore `buf.copy_(backup)` over the module's buffers, then
the backward -- through Megatron's functions as they are, and through the cuda backend's wrapper of
them (patches/cuda_graphs.build_mla_rope_cache_copies). Prints MLA-GRAPH-JSON."""
import json
import os
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
import torch  # noqa: E402
import wrapt  # noqa: E402

import megatron_adapt  # noqa: E402

megatron_adapt.apply("cpu", quiet=True)   # the device layer: YaRN's tables ask for torch.cuda.current_device()
from megatron.core import config as mcore_config  # noqa: E402

mcore_config.set_experimental_flag(True)
from megatron.core.fusions import fused_mla_yarn_rope_apply as kernels  # noqa: E402
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding  # noqa: E402

from megatron_adapt.patches.cuda_graphs import build_mla_rope_cache_copies  # noqa: E402

for name in ("rotary_fwd_q_kernel", "rotary_bwd_q_kernel", "rotary_fwd_kv_kernel", "rotary_bwd_kv_kernel"):
    getattr(kernels, name).configs = getattr(kernels, name).configs[:1]   # no benchmarking without a GPU

n, dq, dp, dk, dv, s, b = 2, 8, 8, 8, 4, 16, 2
megatron = (kernels.fused_apply_mla_rope_for_q, kernels.fused_apply_mla_rope_for_kv)
wrapped = tuple(wrapt.FunctionWrapper(f, build_mla_rope_cache_copies(None, f)) for f in megatron)


def yarn_inputs():
    """A YaRN rotary embedding, its cached cos / sin, and the same q, kv and k_pe every call."""
    rope = YarnRotaryEmbedding(dp, rotary_base=10000, scaling_factor=4.0, original_max_position_embeddings=8,
                               use_cpu_initialization=True)
    cos, sin = rope.get_cached_cos_sin(s, dtype=torch.float32)
    torch.manual_seed(0)
    q = torch.randn(s, b, n, dq + dp, requires_grad=True)
    kv = torch.randn(s, b, n, dk + dv, requires_grad=True)
    kpe = torch.randn(s, b, 1, dp, requires_grad=True)
    return rope, cos, sin, q, kv, kpe


def capture_then_backward(fns):
    """The forward 'captured', the layer's buffers restored in place as the runner does, the backward."""
    rope, cos, sin, q, kv, kpe = yarn_inputs()
    backup = [buf.clone() for buf in rope.buffers()]
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        yq = fns[0](q.clone(), cos, sin, dq, dp)
        k, v = fns[1](kv, kpe, cos, sin, dp, dk, dv)
    for saved, buf in zip(backup, rope.buffers()):   # CudaGraphRunner.create_fwd_graph's restore
        buf.copy_(saved)
    try:
        grads = torch.autograd.grad((yq, k, v), (q, kv, kpe), [torch.ones_like(t) for t in (yq, k, v)])
    except RuntimeError as exc:
        return {"error": str(exc)[:160]}
    return {"outputs": [t.detach() for t in (yq, k, v)], "grads": grads, "buffers": len(backup)}


plain, ours = capture_then_backward(megatron), capture_then_backward(wrapped)
out = {"megatron_error": plain.get("error"), "ours_error": ours.get("error"), "buffers": ours.get("buffers")}
if "error" not in ours:
    # the same values as Megatron's functions outside a capture (where they need no copy)
    _, cos, sin, q, kv, kpe = yarn_inputs()
    yq = megatron[0](q.clone(), cos, sin, dq, dp)
    k, v = megatron[1](kv, kpe, cos, sin, dp, dk, dv)
    grads = torch.autograd.grad((yq, k, v), (q, kv, kpe), [torch.ones_like(t) for t in (yq, k, v)])
    out["max_err"] = max(float((x - y).abs().max()) for x, y in zip((*ours["outputs"], *ours["grads"]),
                                                                    (yq, k, v, *grads)))
print("MLA-GRAPH-JSON:" + json.dumps(out))

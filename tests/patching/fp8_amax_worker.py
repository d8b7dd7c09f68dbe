"""Delayed scaling's amax reduction through Megatron's fp8 context, at 2 ranks (torch.distributed.run,
gloo); rank 0 prints PROBE-JSON.

    FP8_AMAX_LAYOUT=dp2|tp2 python -m torch.distributed.run --nproc-per-node 2 fp8_amax_worker.py

GPTModel from Megatron's TE layer spec with --fp8-recipe delayed, two steps, each rank on its
data-parallel rank's tokens (dp2: data parallel 2, so the activations' amaxes differ between ranks;
tp2: tensor parallel 2 with sequence parallelism, so the weight shards' amaxes differ). Three models from the same
weights: `reduced` (Megatron's amax reduction group, as get_fp8_context names it), `tp_only`
(`tp_only_amax_red=True`, Megatron's switch for reducing over tensor (and context) parallel ranks only)
and `unreduced` (the group taken away, what ran before the reduction existed: the control that
shows the ranks' states differ without it). Per model and rank: every fp8 linear's amax history and
scales. The cpu backend borrows the cuda fp8 op, as fp8_worker.py explains."""
import json
import os
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import report  # noqa: E402
from megatron_adapt.backends import cpu as cpu_backend  # noqa: E402

cpu_backend.BACKEND.ops["fp8_linear"] = "megatron_adapt.backends.cuda.fp8:fp8_linear"
cpu_backend.BACKEND._loaded["fp8_unavailable"] = lambda recipe=None: None
megatron_adapt.apply("cpu", quiet=True)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_adapt.patches import fp8 as fp8_patch  # noqa: E402

LAYOUT = os.environ.get("FP8_AMAX_LAYOUT", "dp2")
TP = 2 if LAYOUT == "tp2" else 1
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
RANK = dist.get_rank()
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
            tensor_model_parallel_size=TP, sequence_parallel=TP > 1,
            fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")


def model(**kw):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return GPTModel(TransformerConfig(**BASE, **kw), get_gpt_layer_with_transformer_engine_spec(),
                    vocab_size=128, max_sequence_length=32)


def train(m, steps=2):
    # each data-parallel rank its own tokens (tensor-parallel ranks share theirs, as Megatron's
    # data loader gives them)
    g = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    tokens, labels = torch.randint(0, 128, (2, 32), generator=g), torch.randint(0, 128, (2, 32), generator=g)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    losses = []
    for _ in range(steps):
        for p in m.parameters():
            p.grad = None
        loss = m(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    return losses


def state(m):
    return {name: {"history_fwd": mod.fp8_scaling.amax_history["fwd"].tolist(),
                   "history_bwd": mod.fp8_scaling.amax_history["bwd"].tolist(),
                   "scale_fwd": mod.fp8_scaling.scale["fwd"].tolist(),
                   "scale_bwd": mod.fp8_scaling.scale["bwd"].tolist(),
                   "group_size": (dist.get_world_size(mod.fp8_scaling.amax_group)
                                  if mod.fp8_scaling.amax_group is not None else 0)}
            for name, mod in m.named_modules() if hasattr(mod, "fp8_scaling")}


mine = {}
for case in ("reduced", "tp_only", "unreduced"):
    original = fp8_patch.amax_reduction_group
    if case == "unreduced":
        fp8_patch.amax_reduction_group = lambda config: None
    try:
        m = model(tp_only_amax_red=case == "tp_only")
        before = report.op_counts().get("fp8_amax_reduction", {})
        mine[case] = {"losses": train(m), "state": state(m),
                      "reductions": {k: v - before.get(k, 0)
                                     for k, v in report.op_counts().get("fp8_amax_reduction", {}).items()
                                     if v > before.get(k, 0)}}
    finally:
        fp8_patch.amax_reduction_group = original

both = [None, None]
dist.all_gather_object(both, mine)
if RANK == 0:
    print("PROBE-JSON:" + json.dumps({"layout": LAYOUT, "ranks": both}))
dist.barrier()
dist.destroy_process_group()

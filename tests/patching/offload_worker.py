"""Megatron's layer-wise activation offloading (config.cpu_offloading, --cpu-offloading-num-layers)
through GPTModel from the TE spec under megatron-adapt, in a fresh interpreter. Prints PROBE-JSON:
loss and gradients with offloading against the same model without it (same weights, same batch),
which layers' saved tensors went to host memory, and a control whose host copies are zeroed after
the forward (its gradients must differ: the backward really reads the offloaded copies)."""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import one_rank_env  # noqa: E402

one_rank_env()
import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import report  # noqa: E402

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "cpu"
megatron_adapt.apply(BACKEND, quiet=True)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer import transformer_block  # noqa: E402

from megatron_adapt.backends import activation_offload  # noqa: E402

LAYERS, OFFLOADED, VOCAB, SEQ, BATCH = 4, 2, 128, 16, 2
DEVICE = "cuda" if BACKEND == "cuda" else "cpu"


def build(offload: bool):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                               add_bias_linear=False, cpu_offloading=offload,
                               cpu_offloading_num_layers=OFFLOADED if offload else 0)
    m = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=VOCAB,
                 max_sequence_length=SEQ, position_embedding_type="rope")
    return m.to(DEVICE)


def step(m, steps=2):
    g = torch.Generator().manual_seed(3)
    losses = []
    m.zero_grad()
    for _ in range(steps):       # two micro-batches: gradients accumulate, layers counted again
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(DEVICE)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(DEVICE)
        loss = m(tokens, torch.arange(SEQ, device=DEVICE)[None], None, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def max_rel(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


dist.init_process_group("nccl" if BACKEND == "cuda" else "gloo")
parallel_state.initialize_model_parallel(1, 1)
activation_offload.MIN_BYTES = 1024        # the toy model's activations are small
layers_seen, pinned = [], set()
pack = activation_offload.ActivationOffload._pack


def recording_pack(self, t):
    out = pack(self, t)
    if isinstance(out, activation_offload._Offloaded):
        layers_seen.append(out.layer)
        pinned.add(out.host.is_pinned())
    return out


activation_offload.ActivationOffload._pack = recording_pack
ref_losses, ref_grads = step(build(False))
report.reset_op_counts()
m = build(True)
block = m.decoder
res = {"context": type(block.offload_context).__name__,
       "inside_context_flag": hasattr(block.offload_context, "inside_context")}
losses, grads = step(m)
res.update(loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)), grad_rel_diff=max_rel(grads, ref_grads),
           grads=len(grads), layers_offloaded=sorted(set(layers_seen)), tensors=block.offload_context.tensors,
           bytes=block.offload_context.bytes, pinned=sorted(pinned),
           impls=sorted(i for (op, i) in report._op_counts if op == "activation_offload"))


def zeroing_pack(self, t):          # the control: every host copy is wiped once it is taken
    out = recording_pack(self, t)
    if isinstance(out, activation_offload._Offloaded):
        out.host.zero_()
    return out


activation_offload.ActivationOffload._pack = zeroing_pack
_, control_grads = step(build(True))
res["control_grad_rel_diff"] = max_rel(control_grads, ref_grads)
off = build(False)
res["disabled_pair"] = [type(off.decoder.offload_context).__name__, off.decoder.group_prefetch_offload_commit_async]
print("PROBE-JSON:" + json.dumps(res, default=str))
dist.destroy_process_group() if dist.is_initialized() else None

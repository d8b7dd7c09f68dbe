"""Packed sequences (thd) through Megatron's GPTModel under megatron-adapt, in a fresh interpreter
(core 0.16.1 has no stock script that packs: pretrain_gpt's --dataloader-inter-document-masking is
core 0.19's). Prints PROBE-JSON: for each layer spec (the TE spec megatron-adapt serves, and the
local spec) and RoPE fusion on / off, the largest per-token loss difference and the largest
relative gradient difference between the documents packed into one thd sequence (with and
without padding between them, cu_seqlens_padded) and the same documents run one per sequence.
"""
import json
import os
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import probe_port  # noqa: E402  (a free port: two test runs may share the machine)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=probe_port(),
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import report  # noqa: E402

megatron_adapt.apply("cpu", quiet=True)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

LENGTHS = [5, 1, 9, 7]
SLOTS = [8, 4, 12, 8]
VOCAB = 128


def model(spec, rope_fusion):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                               add_bias_linear=False, apply_rope_fusion=rope_fusion)
    layer = get_gpt_layer_with_transformer_engine_spec() if spec == "te" else get_gpt_layer_local_spec()
    return GPTModel(config, layer, vocab_size=VOCAB, max_sequence_length=32, position_embedding_type="rope")


def run(m, tokens, labels, packed=None):
    m.zero_grad()
    pos = torch.arange(tokens.size(1)).unsqueeze(0)
    loss = m(tokens, pos, None, labels=labels, packed_seq_params=packed)
    return loss


def grads(m):
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def cu(sizes):
    return torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)


def compare(spec, rope_fusion, padded, one_document=False):
    m = model(spec, rope_fusion)
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    labels = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    # one document per sequence: per-token losses, and the gradient of their sum
    ref_losses, ref_grads = [], None
    m.zero_grad()
    for d, lab in zip(docs, labels):
        loss = m(d[None], torch.arange(d.numel())[None], None, labels=lab[None])
        loss.sum().backward()
        ref_losses.append(loss[0].detach())
    ref_grads = grads(m)
    # packed: one thd sequence
    slots = SLOTS if padded else LENGTHS
    total = sum(slots)
    tokens = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    real = torch.zeros(total, dtype=torch.bool)
    at = 0
    for d, lab, slot in zip(docs, labels, slots):
        tokens[at:at + d.numel()], targets[at:at + d.numel()] = d, lab
        real[at:at + d.numel()] = True
        at += slot
    if one_document:   # the control: the boundaries ignored must show in the losses
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu([total]), cu_seqlens_kv=cu([total]),
                                 max_seqlen_q=total, max_seqlen_kv=total)
        return {"max_abs_loss_diff": (run(m, tokens[None], targets[None], params)[0].detach()
                                      - torch.cat(ref_losses)).abs().max().item()}
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(LENGTHS), cu_seqlens_kv=cu(LENGTHS),
                             cu_seqlens_q_padded=cu(slots) if padded else None,
                             cu_seqlens_kv_padded=cu(slots) if padded else None,
                             max_seqlen_q=max(slots), max_seqlen_kv=max(slots))
    loss = run(m, tokens[None], targets[None], params)
    (loss[0] * real).sum().backward()
    got = loss[0].detach()[real]
    diff = (got - torch.cat(ref_losses)).abs().max().item()
    packed_grads = grads(m)
    grad_rel = max(((packed_grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)).item()
                   for n in ref_grads)
    return {"max_abs_loss_diff": diff, "max_grad_rel_diff": grad_rel, "tokens": int(real.sum()),
            "core_attention": type(m.decoder.layers[0].self_attention.core_attention).__name__}


dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
out = {}
for spec in ("te", "local"):
    for rope_fusion in (True, False):
        for padded in (False, True):
            out[f"{spec}/fusion={rope_fusion}/padded={padded}"] = compare(spec, rope_fusion, padded)
out["control_one_document"] = compare("te", True, False, one_document=True)
out["impls"] = {op: sorted(report.op_counts().get(op, {})) for op in ("attention", "attention_thd", "rope")}
print("PROBE-JSON:" + json.dumps(out))

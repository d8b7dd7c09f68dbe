"""BERT, T5 and heterogeneous GPT from their transformer_engine specs, served without TE, against
Megatron's local specs.

Run as `python te_spec_families_worker.py <backend>`; prints one JSON line. For each family the same
weights go into the model built from the TE spec (served by patches/layer_specs: the provider's
fused norm + linear, attention and norm bound to the spec module's TE names) and into the model
built from Megatron's local spec (its own modules, the reference path). Parameter names differ only
as Megatron's own `sharded_state_dict_keys_map` says (the local spec's separate norms are the TE
spec's fused `layer_norm_*`). Each model gets the masks its stock script gives it: BERT the same
[b, 1, s, s] padding mask for both; T5 the local spec [b, 1, sq, sk] masks, the TE spec TE's
[b, 1, 1, s] padding masks, a causal decoder and a (query, key) padding pair for cross attention.
Reported: the largest difference of the per-token losses on real (unpadded) tokens and of every
parameter's gradient, fp32.
"""
import json
import os
import re
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from single_rank import one_rank_env  # noqa: E402

one_rank_env()
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import report  # noqa: E402

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "cpu"
megatron_adapt.apply(BACKEND, quiet=True)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
DEVICE = torch.device("cuda", 0) if BACKEND == "cuda" else "cpu"  # the npu emulation runs on CPU tensors
# Megatron's sharded_state_dict_keys_map: the local spec's separate norms are the TE spec's fused
# norm + linear (for a heterogeneous block replaced by a linear, that linear is the whole block).
FUSED_NORM = [{"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
              {"input_layernorm.": "self_attention.layer_norm_", "pre_mlp_layernorm.": "mlp.layer_norm_"}]
results = {}


def config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, kv_channels=8,
                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                bias_activation_fusion=False, masked_softmax_fusion=True, persist_layer_norm=True)
    base.update(kw)
    return TransformerConfig(**base)


def te_name(local_name: str, te_names) -> str:
    for fused in FUSED_NORM:
        name = local_name
        for old, new in fused.items():
            name = name.replace(old, new)
        if name in te_names:
            return name
    return local_name


def copy_weights(local, te):
    te_params = dict(te.named_parameters())
    local_params = dict(local.named_parameters())
    mapped = {te_name(n, te_params): n for n in local_params}
    missing = sorted(set(te_params) ^ set(mapped))
    if missing:
        raise AssertionError(f"parameter names differ beyond the fused norms: {missing}")
    with torch.no_grad():
        for name, p in te_params.items():
            p.copy_(local_params[mapped[name]])
    return mapped


def grad_diff(local, te, mapped):
    te_params, local_params = dict(te.named_parameters()), dict(local.named_parameters())
    worst, where = 0.0, None
    for te_n, local_n in mapped.items():
        a, b = te_params[te_n].grad, local_params[local_n].grad
        if (a is None) != (b is None):
            raise AssertionError(f"{te_n}: a gradient on one side only")
        if a is None:
            continue
        d = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)
        if d > worst:
            worst, where = d, te_n
    return worst, where


def megatron_attention(model):
    """The local model's core attention on Megatron's own DotProductAttention.forward (baddbmm,
    its masked softmax, bmm), not on the attention patch: the reference path."""
    import types

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron_adapt import applier
    original = applier.installed()["megatron.core.transformer.dot_product_attention:"
                                   "DotProductAttention.forward"].original
    n = 0
    for m in model.modules():
        if type(m) is DotProductAttention:
            m.forward = types.MethodType(original, m)
            n += 1
    assert n, "no DotProductAttention in the local model"
    return model


def modules_of(model):
    return sorted({type(m).__name__ for m in model.modules()})


def check(name):
    def deco(fn):
        try:
            results[name] = fn()
        except Exception as exc:  # reported with its message; the test fails on it
            import traceback
            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        return fn
    return deco


@check("bert")
def _():
    from megatron.core.models.bert import bert_layer_specs
    from megatron.core.models.bert.bert_model import BertModel

    cfg = config()
    vocab, s, b = 96, 16, 3

    def build(spec):
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        return BertModel(config=cfg, num_tokentypes=2, transformer_layer_spec=spec, vocab_size=vocab,
                         max_sequence_length=s, add_binary_head=True, parallel_output=True).to(DEVICE)

    te = build(bert_layer_specs.get_bert_layer_with_transformer_engine_spec())
    local = megatron_attention(build(bert_layer_specs.bert_layer_local_spec))
    mapped = copy_weights(local, te)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(5, vocab, (b, s), generator=g).to(DEVICE)
    lengths = [s, s - 5, s - 9]
    pad = torch.stack([torch.arange(s) < n for n in lengths]).long().to(DEVICE)   # 1 = real token
    types = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous().to(DEVICE)
    labels = torch.randint(5, vocab, (b, s), generator=g).to(DEVICE)
    out = {}
    for side, model in (("te", te), ("local", local)):
        lm_loss, binary = model(tokens, pad, tokentype_ids=types, lm_labels=labels)
        real = pad.bool()
        (lm_loss[real].mean() + binary.float().square().mean()).backward()
        out[side] = (lm_loss.detach(), binary.detach())
    real = pad.bool()
    loss_diff = (out["te"][0][real] - out["local"][0][real]).abs().max().item()
    worst, where = grad_diff(local, te, mapped)
    return {"loss_diff": loss_diff, "binary_diff": (out["te"][1] - out["local"][1]).abs().max().item(),
            "grad_rel_diff": worst, "grad_worst": where, "loss": out["local"][0][real].mean().item(),
            "te_modules": modules_of(te), "attn_mask_dimensions": te.attn_mask_dimensions}


@check("t5")
def _():
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model

    cfg = config()
    vocab, s_enc, s_dec, b = 96, 16, 8, 3

    def build(enc_spec, dec_spec):
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        return T5Model(config=cfg, encoder_config=cfg, transformer_encoder_layer_spec=enc_spec,
                       transformer_decoder_layer_spec=dec_spec, vocab_size=vocab, max_sequence_length=s_enc,
                       parallel_output=True, share_embeddings_and_output_weights=True).to(DEVICE)

    te = build(t5_spec.get_t5_encoder_with_transformer_engine_block_spec(2),
               t5_spec.get_t5_decoder_with_transformer_engine_block_spec(2))
    local = megatron_attention(build(t5_spec.get_t5_encoder_with_local_block_spec(2),
                                     t5_spec.get_t5_decoder_with_local_block_spec(2)))
    mapped = copy_weights(local, te)
    g = torch.Generator().manual_seed(3)
    enc = torch.randint(5, vocab, (b, s_enc), generator=g)
    dec = torch.randint(5, vocab, (b, s_dec), generator=g)
    enc_len, dec_len = [s_enc, s_enc - 6, s_enc - 3], [s_dec, s_dec - 3, s_dec - 1]
    enc[1, enc_len[1]:] = 0
    enc[2, enc_len[2]:] = 0
    dec[1, dec_len[1]:] = 0
    dec[2, dec_len[2]:] = 0
    enc_pad = torch.stack([torch.arange(s_enc) >= n for n in enc_len])   # True = padding, as get_batch
    dec_pad = torch.stack([torch.arange(s_dec) >= n for n in dec_len])
    labels = torch.randint(5, vocab, (b, s_dec), generator=g).to(DEVICE)
    real = ~dec_pad.to(DEVICE)
    out, layouts = {}, {}
    for side, model, use_local in (("te", te, False), ("local", local, True)):
        masks = T5MaskedWordPieceDataset.config_attention_mask(enc, dec, enc_pad, dec_pad, use_local)
        layouts[side] = [None if m is None else ("pair" if isinstance(m, tuple) else list(m.shape)) for m in masks]
        masks = [None if m is None else (tuple(x.to(DEVICE) for x in m) if isinstance(m, tuple) else m.to(DEVICE))
                 for m in masks]
        loss = model(enc.to(DEVICE), dec.to(DEVICE), *masks, lm_labels=labels)
        loss[real].mean().backward()
        out[side] = loss.detach()
    worst, where = grad_diff(local, te, mapped)
    names = [n for n, _ in te.named_parameters()]
    return {"loss_diff": (out["te"][real] - out["local"][real]).abs().max().item(), "grad_rel_diff": worst,
            "grad_worst": where, "loss": out["local"][real].mean().item(), "te_modules": modules_of(te),
            "mask_layouts": layouts,
            "final_norms": sorted({re.sub(r"^.*?(encoder|decoder)\.", r"\1.", n) for n in names
                                   if "final_layernorm" in n})}


@check("heterogeneous")
def _():
    """--heterogeneous-layers-config-path: per-layer attention (GQA), a no-op attention, attention
    and MLP replaced by a linear (TE's gathered norm + linear), per-layer FFN sizes."""
    import tempfile

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    def block(attention, mlp):
        a = {"no_op": attention == "no_op", "replace_with_linear": attention == "linear",
             "num_query_groups": 2 if attention == "gqa" else None}
        m = {"no_op": False, "replace_with_linear": mlp == "linear", "ffn_hidden_size": None if mlp == "linear" else mlp}
        return {"attention": a, "mlp": m}

    layers = [block("gqa", 96), block("no_op", 160), block("linear", "linear"), block("gqa", 64)]
    vocab, s, b = 96, 16, 2
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hetero.json")
        with open(path, "w") as f:
            json.dump({"block_configs": layers}, f)
        cfg = HeterogeneousTransformerConfig(
            num_layers=4, hidden_size=32, num_attention_heads=4, add_bias_linear=False, normalization="RMSNorm",
            gated_linear_unit=True, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, heterogeneous_layers_config_path=path)

        def build(use_te):
            torch.manual_seed(1)
            model_parallel_cuda_manual_seed(1)
            return GPTModel(cfg, get_gpt_heterogeneous_layer_spec(cfg, use_te=use_te), vocab_size=vocab,
                            max_sequence_length=s, position_embedding_type="rope").to(DEVICE)

        te, local = build(True), megatron_attention(build(False))
    mapped = copy_weights(local, te)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (b, s), generator=g).to(DEVICE)
    pos = torch.arange(s, device=DEVICE).expand(b, s)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=DEVICE).triu(1)
    out = {}
    for side, model in (("te", te), ("local", local)):
        loss = model(tokens, pos, mask, labels=tokens)
        loss.float().mean().backward()
        out[side] = loss.detach()
    worst, where = grad_diff(local, te, mapped)
    return {"loss_diff": (out["te"] - out["local"]).abs().max().item(), "grad_rel_diff": worst, "grad_worst": where,
            "loss": out["local"].float().mean().item(), "te_modules": modules_of(te),
            "layer_kinds": [type(layer.self_attention).__name__ + "/" + type(layer.mlp).__name__
                            for layer in te.decoder.layers]}


def explicit_attention(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                       packed_seq_params=None):
    """softmax(q k^T * scale + bias, masked) v written out in fp32: the reference for T5's relative
    position bias (Megatron's own DotProductAttention asserts a bias away)."""
    from megatron.core.transformer.enums import AttnMaskType
    q, k, v = (t.float().permute(1, 2, 0, 3) for t in (query, key, value))    # [b, h, s, d]
    s = q @ k.transpose(-1, -2) * self.softmax_scale
    if attention_bias is not None:
        s = s + attention_bias.float()
    sq, sk = s.shape[-2:]
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    masked = torch.zeros(sq, sk, dtype=torch.bool, device=s.device)
    if mask_type == AttnMaskType.causal:
        masked = torch.triu(torch.ones_like(masked), diagonal=1)
    elif attention_mask is not None:
        if isinstance(attention_mask, tuple):
            qm, km = attention_mask
            attention_mask = qm.reshape(qm.size(0), 1, sq, 1) | km.reshape(km.size(0), 1, 1, sk)
        masked = masked | attention_mask
    p = torch.softmax(s.masked_fill(masked, -1e30), -1)
    out = (p @ v.float()).to(query.dtype)                      # [b, h, sq, d]
    return out.permute(2, 0, 1, 3).reshape(sq, out.size(0), -1)


@check("t5_relative")
def _():
    """T5 with --position-embedding-type relative from the TE spec: the bias through the backend's
    attention_bias op against the same model on explicit_attention."""
    import types

    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model

    cfg = config()
    vocab, s_enc, s_dec, b = 96, 16, 8, 3

    def build():
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        return T5Model(config=cfg, encoder_config=cfg,
                       transformer_encoder_layer_spec=t5_spec.get_t5_encoder_with_transformer_engine_block_spec(2),
                       transformer_decoder_layer_spec=t5_spec.get_t5_decoder_with_transformer_engine_block_spec(2),
                       vocab_size=vocab, max_sequence_length=s_enc, parallel_output=True,
                       share_embeddings_and_output_weights=True, position_embedding_type="relative").to(DEVICE)

    served, ref = build(), build()
    with torch.no_grad():
        for (_, a), (_, r) in zip(served.named_parameters(), ref.named_parameters()):
            r.copy_(a)
    n = 0
    for m in ref.modules():
        if type(m).__name__ == "AdaptDotProductAttention":
            m.forward = types.MethodType(explicit_attention, m)
            n += 1
    g = torch.Generator().manual_seed(4)
    enc = torch.randint(5, vocab, (b, s_enc), generator=g)
    dec = torch.randint(5, vocab, (b, s_dec), generator=g)
    enc_pad = torch.stack([torch.arange(s_enc) >= n_ for n_ in (s_enc, s_enc - 6, s_enc - 3)])
    dec_pad = torch.stack([torch.arange(s_dec) >= n_ for n_ in (s_dec, s_dec - 3, s_dec - 1)])
    labels = torch.randint(5, vocab, (b, s_dec), generator=g).to(DEVICE)
    real = ~dec_pad.to(DEVICE)
    masks = T5MaskedWordPieceDataset.config_attention_mask(enc, dec, enc_pad, dec_pad, False)
    masks = [None if m is None else (tuple(x.to(DEVICE) for x in m) if isinstance(m, tuple) else m.to(DEVICE))
             for m in masks]
    out = {}
    results["op_counts"] = {op: dict(c) for op, c in report.op_counts().items()}   # BERT's and T5's
    report.reset_op_counts()
    for side, model in (("served", served), ("ref", ref)):
        loss = model(enc.to(DEVICE), dec.to(DEVICE), *masks, lm_labels=labels)
        loss[real].mean().backward()
        out[side] = loss.detach()
    counts = {op: dict(c) for op, c in report.op_counts().items()}
    grads = {name: (p.grad, r.grad) for (name, p), (_, r) in zip(served.named_parameters(), ref.named_parameters())}
    bias_grads = {k: v[0].abs().max().item() for k, v in grads.items() if "relative_pos_emb" in k}
    worst = max(((a - r).abs().max().item() / max(r.abs().max().item(), 1e-6), k) for k, (a, r) in grads.items()
                if a is not None)
    return {"loss_diff": (out["served"][real] - out["ref"][real]).abs().max().item(), "grad_rel_diff": worst[0],
            "grad_worst": worst[1], "reference_modules": n, "bias_grad_max": bias_grads,
            "attention_bias_calls": counts.get("attention_bias", {})}



@check("modelopt")
def _():
    """NVIDIA ModelOpt's GPT spec (get_gpt_modelopt_spec: Megatron's local linears with TE's norms and
    attention, what ModelOpt quantizes and distils), against the local spec: the same parameter names,
    so the weights load strictly; MLA's down projections on ModelOpt's own Linear in a second model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = config(normalization="RMSNorm", qk_layernorm=True)
    vocab, s, b = 96, 16, 2

    def build(spec, c=cfg):
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        return GPTModel(config=c, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=s).to(DEVICE)

    mo = build(get_gpt_modelopt_spec(cfg))
    local = megatron_attention(build(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")))
    missing = mo.load_state_dict(local.state_dict(), strict=True)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (b, s), generator=g).to(DEVICE)
    labels = torch.randint(0, vocab, (b, s), generator=g).to(DEVICE)
    pos = torch.arange(s, device=DEVICE).expand(b, s)
    losses = {}
    for side, model in (("modelopt", mo), ("local", local)):
        loss = model(tokens, pos, None, labels=labels)
        loss.float().mean().backward()
        losses[side] = loss.detach()
    worst, where = grad_diff(local, mo, {n: n for n, _ in local.named_parameters()})
    mla_cfg = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                                   v_head_dim=8, normalization="RMSNorm", qk_layernorm=True,
                                   hidden_dropout=0.0, attention_dropout=0.0)
    mla = build(get_gpt_modelopt_spec(mla_cfg), mla_cfg)
    layer = mla.decoder.layers[0].self_attention
    loss = mla(tokens, pos, None, labels=labels)
    loss.float().mean().backward()
    return {"load": str(missing), "loss_diff": (losses["modelopt"] - losses["local"]).abs().max().item(),
            "loss": losses["local"].float().mean().item(), "grad_rel_diff": worst, "grad_worst": where,
            "modelopt_modules": modules_of(mo),
            "mla_down_proj": type(layer.linear_q_down_proj).__module__ + "." + type(layer.linear_q_down_proj).__name__,
            "mla_loss_finite": bool(torch.isfinite(loss).all()),
            "mla_down_grad": layer.linear_q_down_proj.weight.grad is not None}


print(json.dumps(results))

"""The local DotProductAttention core on the backend's attention op (SDPA-style, fused).

Megatron's local core materialises [b, np, sq, sk] scores through baddbmm + softmax + bmm. The op
takes q/k/v as [b, h, s, d] views of Megatron's [s, b, h, d] tensors (or, with
MEGATRON_ADAPT_ATTENTION_LAYOUT=bshd / tests_gpt's --shape_order BSH, of batch-first copies:
the kernel then reads [b, s, h, d] memory, the layout flash kernels are written for), GQA without repeating k/v,
causal / padding / arbitrary masks, sliding windows and dropout (under the model-parallel RNG
tracker, as Megatron's dropout is). An attention bias (T5's relative position embedding, added
after the scale as TE's post_scale_bias) goes to the backend's `attention_bias` op. Softmax offsets
and additive float masks keep Megatron's own path, reported as a fallback. TE's (query, key)
padding-mask pair (T5's cross attention) becomes one bool mask.

`--attention-backend unfused` (`config.attention_backend`) keeps Megatron's own unfused math
(baddbmm + softmax + bmm), the counterpart of TE's UnfusedDotProductAttention that Megatron asks
TE for with that backend: explicit scores, a deterministic backward, and the tensors an unfused
attention saves (Megatron's fine-grained offloading test counts them). Reported as
`attention megatron.unfused`.

Packed sequences (`packed_seq_params.qkv_format == "thd"`: q/k/v [T, heads, d], Megatron's
Attention squeezed the batch of 1) go to the backend's `attention_thd` op with the PackedSeqParams'
cu_seqlens (and cu_seqlens_*_padded), causal within each sequence for the causal mask types, the
layer's sliding window and dropout; [T, heads * dv] comes back. Megatron's own path cannot take
them (it asserts and names TE), so what the op cannot serve with them is refused here, naming it.
"""
import contextlib

from megatron_adapt import report
from megatron_adapt.spec import PatchSpec


def dropout_rng(module, dropout_p):
    """The RNG context of attention dropout: Megatron's model-parallel RNG tracker's fork, as
    DotProductAttention does (not under sequence parallelism). A TE-named attention built while that
    tracker had no states (`adapt_dropout_fork` False) uses the default generator, as
    TEDotProductAttention does: it hands TE the tracker only if it was initialized at build."""
    if dropout_p > 0 and not module.config.sequence_parallel and getattr(module, "adapt_dropout_fork", True):
        from megatron.core import tensor_parallel   # only when dropout runs: this is every layer's call

        return tensor_parallel.get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()


def padding_pair_mask(masks, sq, sk):
    """TE's cross-attention padding masks, a pair (query padding [b, 1, 1, sq], key padding
    [b, 1, 1, sk], True = padding; T5 passes them with the transformer_engine spec), as one bool
    [b, 1, sq, sk] mask. A padded query's row is all masked: torch's math and memory-efficient SDPA
    give 0 there (as TE), cuDNN a finite value; no real token's output reads it."""
    q_pad, kv_pad = masks
    b = q_pad.size(0)
    return q_pad.reshape(b, 1, sq, 1) | kv_pad.reshape(b, 1, 1, sk)


def build(backend, original):
    attention = backend.op("attention")
    from megatron_adapt.core import active_config
    batch_first = active_config().attention_layout == "bshd"
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    def unsupported(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params):
        if getattr(self, "softmax_offset", None) is not None:
            return "softmax offset"
        if attention_mask is not None and attention_mask.dtype.is_floating_point:
            return "additive float mask"
        return None

    attention_thd = backend.op("attention_thd")
    attention_bias_op = backend.op("attention_bias")

    def forward_thd(self, query, key, value, attn_mask_type, attention_bias, p):
        if p.qkv_format != "thd":
            raise NotImplementedError(
                f"PackedSeqParams(qkv_format={p.qkv_format!r}) (--hybrid-context-parallel builds these) "
                f"is not served by megatron-adapt's attention on the {backend.name} backend: packed "
                "sequences are served as qkv_format='thd'")
        if attention_bias is not None or getattr(self, "softmax_offset", None) is not None:
            raise NotImplementedError(
                "packed sequences (thd) with " + ("attention_bias" if attention_bias is not None else
                                                  "a softmax offset (--softmax-type)") +
                f": megatron-adapt's attention_thd op on the {backend.name} backend takes neither")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal,
                               AttnMaskType.causal_bottom_right)
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        rng = dropout_rng(self, dropout_p)
        with rng:
            out = attention_thd(query, key, value, p.cu_seqlens_q, p.cu_seqlens_kv, p.cu_seqlens_q_padded,
                                p.cu_seqlens_kv_padded, causal, scale, dropout_p,
                                self.scale_mask_softmax.window_size)
        return out.reshape(out.size(0), -1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if isinstance(attention_mask, tuple):
            attention_mask = padding_pair_mask(attention_mask, query.size(0), key.size(0))
        if packed_seq_params is not None:
            return forward_thd(self, query, key, value, attn_mask_type, attention_bias, packed_seq_params)
        if getattr(self.config, "attention_backend", None) == AttnBackend.unfused:
            report.ran("attention", "megatron.unfused")
            return original(self, query, key, value, attention_mask, attn_mask_type,
                            attention_bias, packed_seq_params)
        why = unsupported(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if why:
            report.fell_back("attention", "megatron.DotProductAttention", why)
            return original(self, query, key, value, attention_mask, attn_mask_type,
                            attention_bias, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        window = self.scale_mask_softmax.window_size
        if mask_type in (AttnMaskType.causal, AttnMaskType.causal_bottom_right):
            # The causal kernel, ignoring the dataloader's [b, 1, s, s] causal mask: what TE and
            # Megatron's fused upper-triangular softmax do for this mask type. Passing the mask
            # would run full (not causal) attention under an explicit mask: half the speed.
            mask, causal = None, True
        else:
            mask = None if mask_type == AttnMaskType.no_mask else attention_mask
            causal = mask_type == AttnMaskType.padding_causal and mask is None
        # Megatron divides the score scale by layer_number under query-key layer scaling and
        # multiplies it back inside the softmax: the net scale is softmax_scale * coeff.
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        rng = dropout_rng(self, dropout_p)
        sq, b = query.size(0), query.size(1)
        if batch_first:  # [s, b, h, d] -> contiguous [b, s, h, d], seen as [b, h, s, d]
            q, k, v = (t.transpose(0, 1).contiguous().transpose(1, 2) for t in (query, key, value))
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with rng:
            if attention_bias is not None:   # T5's relative position embedding: added after the scale
                out = attention_bias_op(q, k, v, attention_bias, mask, causal, scale, dropout_p, window)
            else:
                # positional: the op contract's order (keyword binding costs host time per call)
                out = attention(q, k, v, mask, causal, scale, dropout_p, window)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
    return forward


SPECS = [
    PatchSpec("megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
              area="attention", build=build),
]

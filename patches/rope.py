"""Rotary embeddings: the unfused bshd path, and `--rope-fusion` (on by default) without TE.

`rope_utils.fused_apply_rotary_pos_emb` is TE's kernel or None; `TransformerConfig` refuses
`apply_rope_fusion` while it is None. Installing the backend's rope op there makes the default
work. Multi-latent attention's layout keeps Megatron's own code.

core_v0.19 renamed `_apply_rotary_pos_emb_bshd`'s fourth parameter (`multi_latent_attention` ->
`mla_rotary_interleaved`, the old name kept as a deprecated keyword after `mscale`): one spec per range.
"""
from megatron_adapt import report
from megatron_adapt.spec import PatchSpec

MODULE = "megatron.core.models.common.embeddings.rope_utils"


def build_bshd(backend, original):
    rope = backend.op("rope")

    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False,
                                   mscale=1.0):
        if multi_latent_attention:
            report.fell_back("rope", "megatron._apply_rotary_pos_emb_bshd", "multi-latent attention layout")
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        return rope(t, freqs, rotary_interleaved, mscale)
    return _apply_rotary_pos_emb_bshd


def build_bshd_mla_interleaved(backend, original):
    rope = backend.op("rope")

    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False,
                                   mscale=1.0, multi_latent_attention=None):
        if mla_rotary_interleaved or multi_latent_attention:
            report.fell_back("rope", "megatron._apply_rotary_pos_emb_bshd", "multi-latent attention layout")
            return original(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale,
                            multi_latent_attention)
        return rope(t, freqs, rotary_interleaved, mscale)
    return _apply_rotary_pos_emb_bshd


def build_fused(backend, original):
    rope = backend.op("rope")

    def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
        return rope(t, freqs, interleaved)
    return fused_apply_rotary_pos_emb


SPECS = [
    PatchSpec(f"{MODULE}:_apply_rotary_pos_emb_bshd", area="rope", build=build_bshd,
              versions=">=0.15.0,<0.19.0"),
    PatchSpec(f"{MODULE}:_apply_rotary_pos_emb_bshd", area="rope", build=build_bshd_mla_interleaved,
              versions=">=0.19.0,<0.20.0"),
    PatchSpec(f"{MODULE}:fused_apply_rotary_pos_emb", area="rope", build=build_fused,
              check_signature=False),
]

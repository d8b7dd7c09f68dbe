"""Rotary embeddings: the unfused bshd path, and `--rope-fusion` (on by default) without TE.

`rope_utils.fused_apply_rotary_pos_emb` is TE's kernel or None; `TransformerConfig` refuses
`apply_rope_fusion` while it is None. Installing the backend's rope op there makes the default
work. Multi-latent attention's layout (the rotary channels' even / odd elements gathered into
halves, then rotate-half) is that gather followed by the backend's rope op.

Multi-latent attention with `--rope-fusion` (on by default with `--position-embedding-type rope`)
calls Megatron's Triton kernels `fused_apply_mla_rope_for_q` / `_for_kv` (YaRN cos / sin tables,
sbhd or packed thd with context-parallel chunking); they need a GPU. On cpu and npu they are
served by the backend's `rope_cos_sin` op, with the same token positions (thd: the position within
each sequence; under context parallelism, the two chunks each rank holds). On cuda Megatron's
kernels stay.

core_v0.19 renamed `_apply_rotary_pos_emb_bshd`'s fourth parameter (`multi_latent_attention` ->
`mla_rotary_interleaved`, the old name kept as a deprecated keyword after `mscale`): one spec per range.
"""
import torch

from megatron_adapt.spec import PatchSpec

MODULE = "megatron.core.models.common.embeddings.rope_utils"
MLA = "megatron.core.transformer.multi_latent_attention"


def build_bshd(backend, original):
    rope = backend.op("rope")

    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False,
                                   mscale=1.0):
        if multi_latent_attention:
            t = _mla_gather(t, freqs.size(-1))
        return rope(t, freqs, rotary_interleaved, mscale)
    return _apply_rotary_pos_emb_bshd


def build_bshd_mla_interleaved(backend, original):
    rope = backend.op("rope")

    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False,
                                   mscale=1.0, multi_latent_attention=None):
        if multi_latent_attention is not None:   # Megatron's deprecated name for the flag
            mla_rotary_interleaved = multi_latent_attention
        if mla_rotary_interleaved:
            t = _mla_gather(t, freqs.size(-1))
        return rope(t, freqs, rotary_interleaved, mscale)
    return _apply_rotary_pos_emb_bshd


def _mla_gather(t, rot):
    """MLA's layout: the first `rot` channels' even elements, then their odd ones."""
    return torch.cat((t[..., 0:rot:2], t[..., 1:rot:2], t[..., rot:]), dim=-1)


def _positions(cu_seqlens, total, cp_rank, cp_size):
    """Each packed (thd) token's position in its sequence, as Megatron's _get_thd_token_idx:
    lengths are cu_seqlens // cp_size on this rank; under context parallelism a rank holds the
    chunks cp_rank and 2 * cp_size - cp_rank - 1 of each sequence. Where Megatron split the whole
    packed row instead (core_v0.19's --dataloader-inter-document-masking: patches/context_parallel's
    per_sequence_thd_split), the rank holds those chunks of the row, and a token's position is its
    offset in the document holding it."""
    if cp_size > 1:
        from megatron_adapt.backends import context_parallel as cp
        from megatron_adapt.patches.context_parallel import per_sequence_thd_split

        if per_sequence_thd_split():
            return cp.thd_sequence_meta(cu_seqlens, None, total * cp_size, cp_size, cp_rank)[0][0].to(cu_seqlens.device)
    cu = torch.div(cu_seqlens.long(), cp_size, rounding_mode="floor")
    if cu.device.type == "cpu" and int(cu[-1]) != total:   # on a device this would sync every layer
        raise ValueError(_thd_size_message(int(cu_seqlens[-1]), total, cp_size))
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths,
                                  output_size=total)
    local = torch.arange(total, device=cu.device) - cu[seq]
    if cp_size == 1:
        return local
    length = lengths[seq]
    half = torch.div(length, 2, rounding_mode="floor")
    return torch.where(local < half,
                       local + torch.div(cp_rank * length, 2, rounding_mode="floor"),
                       local - half + torch.div((2 * cp_size - cp_rank - 1) * length, 2,
                                                rounding_mode="floor"))


def _thd_size_message(packed, total, cp_size):
    if cp_size == 1:
        return (f"packed (thd) RoPE: cu_seqlens ends at {packed} tokens but the tensor holds {total}")
    return (f"packed (thd) RoPE under context parallelism {cp_size}: cu_seqlens covers the whole packed row "
            f"({packed} tokens), so this rank should hold {packed // cp_size} of them, but the tensor holds "
            f"{total}. Split the packed batch per CP rank first (Megatron's get_thd_batch_on_this_cp_rank / "
            "get_batch_on_this_cp_rank), as TE's thd RoPE and attention also expect")


def _cos_sin(cos, sin, t, cu_seqlens, cp_rank, cp_size):
    """cos / sin [max_s, 1, 1, r] -> broadcastable to t's rotary part: [s, 1, 1, r] (sbhd) or
    [total, 1, r] (thd)."""
    if cu_seqlens is None:
        return cos[: t.size(0)], sin[: t.size(0)]
    pos = _positions(cu_seqlens, t.size(0), cp_rank, cp_size)
    r = cos.size(-1)
    return cos.reshape(-1, r)[pos].unsqueeze(1), sin.reshape(-1, r)[pos].unsqueeze(1)


def build_mla_rope_q(backend, original):
    rope_cos_sin = backend.op("rope_cos_sin")

    def fused_apply_mla_rope_for_q(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q=None,
                                   cp_rank=0, cp_size=1, rotary_interleaved=False):
        if rotary_interleaved:   # as Megatron's kernel
            raise NotImplementedError("fused MLA RoPE supports rotary_interleaved=False only")
        c, s = _cos_sin(cos, sin, t, cu_seqlens_q, cp_rank, cp_size)
        nope, pe = torch.split(t, [qk_head_dim, emb_dim], dim=-1)
        return torch.cat((nope, rope_cos_sin(_mla_gather(pe, emb_dim), c, s)), dim=-1)
    return fused_apply_mla_rope_for_q


def build_mla_rope_kv(backend, original):
    rope_cos_sin = backend.op("rope_cos_sin")

    def fused_apply_mla_rope_for_kv(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim,
                                    cu_seqlens_kv=None, cp_rank=0, cp_size=1,
                                    rotary_interleaved=False):
        if rotary_interleaved:
            raise NotImplementedError("fused MLA RoPE supports rotary_interleaved=False only")
        c, s = _cos_sin(cos, sin, kv, cu_seqlens_kv, cp_rank, cp_size)
        k_nope, value = torch.split(kv, [k_dim, v_dim], dim=-1)
        k_pe = rope_cos_sin(_mla_gather(k_pos_emb, emb_dim), c, s)   # [.., 1, emb]: one for all heads
        key = torch.cat((k_nope, k_pe.expand(*k_nope.shape[:-1], emb_dim)), dim=-1)
        return key, value.contiguous()
    return fused_apply_mla_rope_for_kv


def build_fused_thd(backend, original):
    """TE's fused RoPE for packed (thd) tensors: t [T, h, d], freqs [max_s, 1, 1, r], each token
    rotated by its position in its sequence (cu_seqlens: Megatron passes the padded offsets where
    it has them); under context parallelism this rank holds chunks cp_rank and 2 * cp_size -
    cp_rank - 1 of each sequence (TE's and Megatron's thd split), or of the whole packed row (core
    0.19's --dataloader-inter-document-masking: see _positions)."""
    rope = backend.op("rope")

    def fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
        # (`interleaved`: core_v0.17+ passes config.rotary_interleaved)
        pos = _positions(cu_seqlens, t.size(0), cp_rank, cp_size)
        return rope(t.unsqueeze(1), freqs[pos], interleaved).squeeze(1)
    return fused_apply_rotary_pos_emb_thd


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
    PatchSpec(f"{MODULE}:fused_apply_rotary_pos_emb_thd", area="rope", build=build_fused_thd,
              check_signature=False),
    PatchSpec(f"{MLA}:fused_apply_mla_rope_for_q", area="rope", build=build_mla_rope_q,
              backends=("cpu", "npu")),
    PatchSpec(f"{MLA}:fused_apply_mla_rope_for_kv", area="rope", build=build_mla_rope_kv,
              backends=("cpu", "npu")),
]

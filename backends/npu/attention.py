"""Core attention through torch_npu.npu_fusion_attention (Ascend's flash attention).

Signature relied on (Ascend Extension for PyTorch >= 6.0.0):

    npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
        atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647,
        inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
        gen_mask_parallel=True, sync=False)
      -> (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)

The op contract hands us q/k/v as [b, h, s, d] views of Megatron's [s, b, h, d] tensors; we give
the kernel layout "SBH" (Megatron's memory order, as MindSpeed does), so no copy is made for
contiguous inputs. Views of batch-first memory ([b, s, h, d], MEGATRON_ADAPT_ATTENTION_LAYOUT=bshd)
go as layout "BSH" instead, also without a copy. GQA: key/value carry hkv = hq / g heads in their H; head_num is hq.

Masks (atten_mask: bool, True = masked; the kernel ignores sparse_mode and pre/next_tockens when
atten_mask is None, so every sparse mode passes its mask):

    causal, sq == sk     sparse_mode=2 (leftUpCausal) + the compressed 2048x2048 triu mask
    causal, sq != sk     sparse_mode=3 (rightDownCausal: Megatron's bottom-right alignment)
    window (l, r)        sparse_mode=4 (band from the bottom-right), pre_tockens=l, next_tockens=r
    explicit mask        sparse_mode=0 with the full mask (combined with causal / window) as
                         SS, 11SS, B1SS or BNSS -- the shapes the kernel accepts (not 1NSS)
    none                 atten_mask=None

keep_prob = 1 - dropout_p (the kernel draws its own dropout mask). scale defaults to 1/sqrt(d).
Context parallelism (attention_cp, NpuBlocks): the ring's blocks cut into all-visible and causal
pieces, npu_fusion_attention per piece in layout "BNSD" (causal: sparse_mode 3 + the compressed
mask; all-visible: no mask), lse = softmax_max[..., 0] + log(softmax_sum[..., 0]); the backward
per piece through

    npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
        padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
        attention_in=None, scale_value=1., keep_prob=1., ..., sparse_mode=0, ...)
      -> (dq, dk, dv, dpse)   (7.3.0: + dsink)

with the ring's final output as attention_in and its log-sum-exp as softmax_max (softmax_sum = 1).

Outside the kernel's documented limits (dtype fp16/bf16/fp32, Dq = Dk = Dv <= 768, Nq <= 256 and a
multiple of Nkv, windows with an unbounded side) the reference runs, reported as a fallback.
"""
import math

import torch

from megatron_adapt import report
from megatron_adapt.backends import context_parallel, reference

from ._lib import torch_npu

IMPL = "npu.torch_npu.npu_fusion_attention"
FALLBACK = "npu.torch.sdpa (reference)"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 768
MAX_HEADS = 256
COMPRESSED = 2048
_compressed: dict[str, torch.Tensor] = {}


def compressed_causal_mask(device) -> torch.Tensor:
    """The 2048x2048 upper-triangular bool mask sparse modes 2, 3 and 4 take (one per device)."""
    key = str(device)
    mask = _compressed.get(key)
    if mask is None:
        mask = _compressed[key] = torch.triu(
            torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device), diagonal=1)
    return mask


def unsupported(q, k, v, attn_mask, window_size) -> str | None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q/k/v must be 4-D [b, h, s, d]"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype} k={k.dtype} v={v.dtype} (kernel: one of fp16/bf16/fp32)"
    d = q.size(-1)
    if k.size(-1) != d or v.size(-1) != d:
        return "q/k/v head dims differ"
    if not 1 <= d <= MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    hq, hkv = q.size(1), k.size(1)
    if hq > MAX_HEADS or hq % hkv or v.size(1) != hkv:
        return f"heads q={hq} kv={hkv} (kernel: Nq <= {MAX_HEADS}, a multiple of Nkv)"
    if window_size is not None and (window_size[0] < 0 or window_size[1] < 0):
        return f"window {tuple(window_size)} with an unbounded side"
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return f"mask dtype {attn_mask.dtype} (must be bool)"
    return None


def _kernel_mask(mask, b, n, sq, sk):
    """A bool mask broadcastable to [b, n, sq, sk] in a shape the kernel takes: SS/11SS/B1SS/BNSS."""
    if mask.dim() < 4:
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mb, mn = mask.size(0), mask.size(1)
    if mn == 1:
        shape = (mb, 1, sq, sk)           # 11SS or B1SS
    else:
        shape = (b, n, sq, sk)            # BNSS (1NSS is not accepted)
    return mask.expand(shape).contiguous()


def _sbh(t):
    """[b, h, s, d] view -> [s, b, h*d] (free when t is a view of a contiguous [s, b, h, d])."""
    return t.permute(2, 0, 1, 3).reshape(t.size(2), t.size(0), t.size(1) * t.size(3))


def _bsh(t):
    """[b, h, s, d] view -> [b, s, h*d] (free when t is a view of a contiguous [b, s, h, d])."""
    return t.transpose(1, 2).reshape(t.size(0), t.size(2), t.size(1) * t.size(3))


def attention_bias(q, k, v, bias, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    """Reported reference: npu_fusion_attention's `pse` adds a bias, but whether its backward
    returns the bias's gradient for every layout has not been checked on an Ascend NPU here."""
    report.fell_back("attention_bias", FALLBACK, "a learned attention bias (pse) is served by the "
                     "reference: npu_fusion_attention's pse gradient is unverified here")
    return reference.attention_bias(q, k, v, bias, attn_mask, causal, scale, dropout_p, window_size)


def _batch_first(t) -> bool:
    """A view of contiguous [b, s, h, d] memory that is not also one of [s, b, h, d] (b == 1)."""
    return t.transpose(1, 2).is_contiguous() and not t.permute(2, 0, 1, 3).is_contiguous()


def attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    why = unsupported(q, k, v, attn_mask, window_size)
    if why:
        report.fell_back("attention", FALLBACK, why)
        return reference.attention(q, k, v, attn_mask, causal, scale, dropout_p, window_size)
    b, hq, sq, d = q.shape
    sk = k.size(2)
    pre = nxt = 2147483647
    if attn_mask is not None:
        full = reference.build_mask(sq, sk, causal, window_size, attn_mask, q.device)
        mask = _kernel_mask(full, b, hq, sq, sk)
        sparse_mode = 0
    elif window_size is not None:
        mask, sparse_mode = compressed_causal_mask(q.device), 4
        pre, nxt = int(window_size[0]), int(window_size[1])
    elif causal:
        mask, sparse_mode = compressed_causal_mask(q.device), (2 if sq == sk else 3)
    else:
        mask, sparse_mode = None, 0
    report.ran("attention", IMPL)
    batch_first = all(_batch_first(t) for t in (q, k, v))
    to_layout = _bsh if batch_first else _sbh
    out = torch_npu().npu_fusion_attention(
        to_layout(q), to_layout(k), to_layout(v), hq, "BSH" if batch_first else "SBH", atten_mask=mask,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale), keep_prob=1.0 - float(dropout_p),
        pre_tockens=pre, next_tockens=nxt, sparse_mode=sparse_mode)[0]
    if batch_first:
        return out.view(b, sq, hq, d).transpose(1, 2)
    return out.view(sq, b, hq, d).permute(1, 2, 0, 3)


def _thd_unsupported(q, k, v, window_size) -> str | None:
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype} k={k.dtype} v={v.dtype} (kernel: one of fp16/bf16/fp32)"
    d = q.size(-1)
    if k.size(-1) != d or v.size(-1) != d or not 1 <= d <= MAX_HEAD_DIM:
        return f"head dims q={d} k={k.size(-1)} v={v.size(-1)} (kernel: equal, <= {MAX_HEAD_DIM})"
    if q.size(1) > MAX_HEADS:
        return f"{q.size(1)} heads > {MAX_HEADS}"
    if window_size is not None and (window_size[0] < 0 or window_size[1] < 0):
        return f"window {tuple(window_size)} with an unbounded side"
    return None


def _ends(segments, slots):
    """Cumulative end offsets (actual_seq_*len) of the non-empty sequences or padded slots."""
    return [start + length for start, length in (slots if slots is not None else segments) if length]


def attention_thd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                  causal=True, scale=None, dropout_p=0.0, window_size=None):
    """Layout "TND" with actual_seq_qlen / actual_seq_kvlen the cumulative end offsets (a list of
    ints). Padding between sequences (cu_seqlens_*_padded) goes into the kernel as part of each
    padded slot: under a causal mask (or a window with no right side) a sequence's trailing
    padding comes after all its queries and is never attended; its rows are zeroed afterwards.
    Padding with a mask that would see it, or q and kv slots that differ, take the reference."""
    reference.check_thd(q, k, v)
    segs_q = reference.thd_segments(cu_seqlens_q, cu_seqlens_q_padded, q.size(0), "cu_seqlens_q")
    segs_kv = reference.thd_segments(cu_seqlens_kv, cu_seqlens_kv_padded, k.size(0), "cu_seqlens_kv")
    if len(segs_q) != len(segs_kv):
        raise ValueError(f"cu_seqlens_q has {len(segs_q)} sequences, cu_seqlens_kv {len(segs_kv)}")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, causal, scale,
            dropout_p, window_size)
    padded = cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None
    slots = None
    if padded:
        pad_q = reference.thd_segments(cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q,
                                       None, q.size(0), "cu_seqlens_q_padded")
        pad_kv = reference.thd_segments(cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None
                                        else cu_seqlens_kv, None, k.size(0), "cu_seqlens_kv_padded")
        hides_padding = (window_size[1] == 0) if window_size is not None else causal
        why = None
        if not hides_padding:
            why = "padding between sequences with a mask that attends to later tokens"
        elif segs_q != segs_kv or pad_q != pad_kv:
            why = "padding between sequences with q and kv offsets that differ"
        if why:
            report.fell_back("attention_thd", FALLBACK, why)
            return reference.attention_thd(*args)
        slots = pad_q
    why = _thd_unsupported(q, k, v, window_size)
    if why:
        report.fell_back("attention_thd", FALLBACK, why)
        return reference.attention_thd(*args)
    ends_q, ends_kv = _ends(segs_q, slots), _ends(segs_kv, slots)
    out = q.new_zeros(q.size(0), q.size(1), v.size(-1))
    if not ends_q:
        report.ran("attention_thd", IMPL + "(TND)")
        return out + 0 * q.sum()
    pre = nxt = 2147483647
    if window_size is not None:
        mask, sparse_mode = compressed_causal_mask(q.device), 4
        pre, nxt = int(window_size[0]), int(window_size[1])
    elif causal:
        mask, sparse_mode = compressed_causal_mask(q.device), 3
    else:
        mask, sparse_mode = None, 0
    report.ran("attention_thd", IMPL + "(TND)")
    tq, tk = ends_q[-1], ends_kv[-1]
    res = torch_npu().npu_fusion_attention(
        q[:tq], k[:tk], v[:tk], q.size(1), "TND", atten_mask=mask,
        scale=1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale), keep_prob=1.0 - float(dropout_p),
        pre_tockens=pre, next_tockens=nxt, sparse_mode=sparse_mode, actual_seq_qlen=ends_q,
        actual_seq_kvlen=ends_kv)[0]
    if padded:
        rows = torch.cat([torch.arange(s, s + n) for s, n in segs_q if n]).to(q.device)
        return out.index_copy(0, rows, res[rows])
    return torch.cat([res, out[tq:]]) if tq < q.size(0) else res


# ---- context parallelism: the ring's blocks through npu_fusion_attention(_grad) -----------------------
CP_IMPL = "npu.fusion_attention_blocks"
BLOCK_FALLBACK = "npu.torch.block"
BLOCK_WHY = ("this block's visibility has no cover by all-visible and causal pieces (a sliding window, or "
             "documents that end inside a chunk): it runs in torch math with its scores materialised")


def _piece_mask(causal, device):
    """(atten_mask, sparse_mode) of one piece: a causal piece (square, lower-triangular) takes
    rightDownCausal with the compressed mask, as MindSpeed's ring attention does; an all-visible
    one no mask."""
    return (compressed_causal_mask(device), 3) if causal else (None, 0)


def _fa_block_fwd(q, k, v, causal, scale):
    """(out fp32 [b, h, sq, d], lse fp32 [b, h, sq]) of one piece, layout BNSD; lse from the
    kernel's row statistics: softmax_max + log(softmax_sum) (both [b, h, sq, 8], equal over 8)."""
    mask, mode = _piece_mask(causal, q.device)
    out, smax, ssum = torch_npu().npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.size(1), "BNSD", atten_mask=mask, scale=scale,
        keep_prob=1.0, sparse_mode=mode)[:3]
    return out.float(), smax[..., 0] + torch.log(ssum[..., 0])


def _fa_block_bwd(dout, q, k, v, out, lse, causal, scale):
    """dq, dk, dv (fp32; dk/dv with k/v's heads) of one piece from the ring's FINAL out and lse:
    softmax_max = lse and softmax_sum = 1 make the kernel's exp(s - max) / sum the final
    probabilities (MindSpeed passes the ring's merged max / sum pair; the same numbers)."""
    mask, mode = _piece_mask(causal, q.device)
    stat = lse.unsqueeze(-1).expand(*lse.shape, 8).contiguous()
    dq, dk, dv = torch_npu().npu_fusion_attention_grad(
        q.contiguous(), k.contiguous(), v.contiguous(), dout.to(q.dtype).contiguous(), q.size(1), "BNSD",
        atten_mask=mask, softmax_max=stat, softmax_sum=torch.ones_like(stat),
        attention_in=out.to(q.dtype).contiguous(), scale_value=scale, keep_prob=1.0, sparse_mode=mode)[:3]
    return dq.float(), dk.float(), dv.float()


NpuBlocks = context_parallel.PieceBlocks(
    _fa_block_fwd, _fa_block_bwd, BLOCK_FALLBACK, BLOCK_WHY)
"""The context-parallel ring's blocks (and allgather / a2a's one block) through Ascend's fused
    attention: each block cut into all-visible and causal pieces (context_parallel.block_pieces), one
    npu_fusion_attention call per piece, merged by log-sum-exp; the backward runs
    npu_fusion_attention_grad per piece from the ring's final output and log-sum-exp. A block with
    no such cover, or dropout, takes the math, reported."""


def attention_cp(q, k, v, pos, doc, causal, scale, window_size, groups, comm_type, dropout_p=0.0):
    return context_parallel.served_attention_cp(NpuBlocks, unsupported(q, k, v, None, None), CP_IMPL, "npu.torch",
                                                q, k, v, pos, doc, causal, scale, window_size, groups, comm_type,
                                                dropout_p)

"""Core attention through torch's fused scaled_dot_product_attention, cuDNN first.

SDPA is asked for cuDNN, then flash, then memory-efficient, then math (sdpa_kernel with
set_priority): on Hopper cuDNN's fused attention is the fastest fwd+bwd kernel PyTorch ships.
Causal without a mask goes as is_causal (no mask tensor). Sliding windows and padding /
arbitrary masks become one bool mask (flash cannot take a mask: cuDNN or memory-efficient serve
it). GQA goes as enable_gqa: k/v are never repeated. Where flash-attn-4 is installed, calls it
can serve (no dropout, no mask tensor, Hopper or newer) take it for a signature only where it
measures faster and agrees (providers.py). Which backend will serve a call is probed
once per signature with torch.backends.cuda.can_use_* and reported; the math path (it
materialises the scores) is reported as a fallback.
"""
import itertools

import torch
import torch.nn.functional as F

from megatron_adapt import report
from megatron_adapt.backends import context_parallel, reference
from megatron_adapt.backends.reference import build_mask
from megatron_adapt.backends.cuda import cudnn_thd, providers

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # torch < 2.3
    sdpa_kernel = None

_paths: dict = {}


def _flag_fns():
    """[(getter, setter)] of torch's SDPA backend switches and the wanted value of each, as
    sdpa_kernel(PRIORITY) sets them (None where this torch lacks the private functions)."""
    try:
        from torch.nn.attention import _backend_names
        out = []
        for name, val in _backend_names.items():
            out.append((getattr(torch._C, f"_get_{name}_sdp_enabled"),
                        getattr(torch._C, f"_set_sdp_use_{name}"), getattr(SDPBackend, val) in PRIORITY))
        torch._C._get_sdp_priority_order, torch._C._set_sdp_priority_order  # noqa: B018 (present?)
        return out
    except Exception:
        return None


_FLAGS = _flag_fns() if sdpa_kernel is not None else None
_ORDER = [int(b) for b in PRIORITY] if sdpa_kernel is not None else []


def _sdpa(q, k, v, **kw):
    """F.scaled_dot_product_attention under our backend priority, as `with _context():` but with
    the switches set and restored through torch's C functions directly (the context manager
    costs tens of microseconds of Python a call), and only when they differ from ours."""
    if _FLAGS is None:
        with _context():
            return F.scaled_dot_product_attention(q, k, v, **kw)
    prev = [get() for get, _, _ in _FLAGS]
    order = torch._C._get_sdp_priority_order()
    want = _ORDER + [b for b in order if b not in _ORDER]
    same = order == want and all(p == w for p, (_, _, w) in zip(prev, _FLAGS))
    if same:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    for _, put, w in _FLAGS:
        put(w)
    torch._C._set_sdp_priority_order(want)
    try:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    finally:
        for (_, put, _), p in zip(_FLAGS, prev):
            put(p)
        torch._C._set_sdp_priority_order(order)


def _context():
    if sdpa_kernel is None:
        import contextlib
        return contextlib.nullcontext()
    try:
        return sdpa_kernel(PRIORITY, set_priority=True)
    except TypeError:  # torch without set_priority: default order
        return sdpa_kernel(PRIORITY)


def expected_path(q, k, v, mask, dropout_p, causal, gqa):
    """Which SDPA backend should serve this call (probed once per signature)."""
    if q.device.type != "cuda":
        return "math"
    key = (q.shape, k.shape, q.dtype, None if mask is None else tuple(mask.shape), dropout_p > 0,
           causal, gqa, q.stride(), k.stride(), q.requires_grad)
    path = _paths.get(key)
    if path is None:
        path = "unknown"
        try:
            args = [q, k, v, mask, dropout_p, causal]
            try:
                params = torch.backends.cuda.SDPAParams(*args, gqa)
            except TypeError:
                params = torch.backends.cuda.SDPAParams(*args)
            checks = [("cudnn", getattr(torch.backends.cuda, "can_use_cudnn_attention", None)),
                      ("flash", torch.backends.cuda.can_use_flash_attention),
                      ("efficient", torch.backends.cuda.can_use_efficient_attention)]
            path = "math"
            for name, fn in checks:
                if fn is not None and fn(params, False):
                    path = name
                    break
        except Exception:  # probing API differs across torch versions: SDPA still decides
            pass
        _paths[key] = path
    return path


@providers.selectable("attention")   # FlashAttention-4 where installed and measured faster
def attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    sq, sk = q.size(-2), k.size(-2)
    use_causal = causal and attn_mask is None and window_size is None and sq == sk
    mask = None if use_causal else build_mask(sq, sk, causal, window_size, attn_mask, q.device)
    keep = None if mask is None else ~mask
    gqa = k.size(1) != q.size(1)
    path = expected_path(q, k, v, keep, dropout_p, use_causal, gqa)
    impl = f"cuda.sdpa.{path}"
    if path == "math" and q.device.type == "cuda":
        report.fell_back("attention", impl, "no fused SDPA backend takes these inputs "
                         f"(dtype {q.dtype}, head dim {q.size(-1)}, mask {mask is not None})")
    else:
        report.ran("attention", impl)
    return _sdpa(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=use_causal, scale=scale,
                 enable_gqa=gqa)


def attention_bias(q, k, v, bias, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    """The bias as SDPA's additive mask, on the memory-efficient kernel (it returns the mask's
    gradient; flash takes no mask), math where that kernel cannot take the inputs (reported)."""
    add = reference.bias_mask(q, k, bias, attn_mask, causal, window_size)
    gqa = k.size(1) != q.size(1)
    path = "math"
    if q.device.type == "cuda" and sdpa_kernel is not None:
        try:
            params = torch.backends.cuda.SDPAParams(q, k, v, add, dropout_p, False, gqa)
            path = "efficient" if torch.backends.cuda.can_use_efficient_attention(params, False) else "math"
        except (TypeError, AttributeError, RuntimeError):
            path = "math"
    impl = f"cuda.sdpa.{path}"
    if path == "math" and q.device.type == "cuda":
        report.fell_back("attention_bias", impl, f"the memory-efficient SDPA kernel does not take these "
                         f"inputs (dtype {q.dtype}, head dim {q.size(-1)})")
    else:
        report.ran("attention_bias", impl)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) if sdpa_kernel is not None else _context():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=add, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)


def _padded_index(segs, device):
    """[n, L] source rows of each sequence, padded by repeating its last row, and the valid mask."""
    n, longest = len(segs), max(length for _, length in segs)
    pos = torch.arange(longest)
    starts = torch.tensor([s for s, _ in segs]).unsqueeze(1)
    lengths = torch.tensor([length for _, length in segs]).unsqueeze(1)
    valid = pos.unsqueeze(0) < lengths
    idx = starts + torch.minimum(pos.unsqueeze(0), lengths - 1)
    return idx.to(device), valid.to(device), n, longest


def attention_thd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                  causal=True, scale=None, dropout_p=0.0, window_size=None):
    """Packed sequences on Hopper, with nvidia-cudnn-frontend installed, go through cuDNN's fused
    attention with ragged offsets (cudnn_thd.py: bf16 / fp16, head dim <= 128, no dropout or window,
    the same sequences for q and kv); measured faster than the varlen flash kernel (docs/long-context.md).
    Otherwise they go through torch's variable-length flash kernel in one call
    (cu_seqlens in, only the within-document work done, GQA and windows native), chosen by
    measurement against the other layouts: per-document cuDNN SDPA, a padded batch, a dense
    block-diagonal mask, cuDNN's ragged layout (scripts/bench_kernels.py --ops attention_thd;
    docs/long-context.md). Where flash
    cannot serve (fp32, a head dim it does not take, before sm80, q/v head dims that differ), the
    sequences go as one padded batch [n, h, L, d] through SDPA: causal self-attention as
    is_causal (a sequence's trailing padding lies after all its queries, so it is never seen);
    windows and non-causal calls add a key-padding mask. Sequences whose q and kv lengths differ
    go one by one through `attention` on that path."""
    reference.check_thd(q, k, v)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return _varlen_on_device(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                                 causal, scale, dropout_p, window_size)
    segs_q = reference.thd_segments(cu_seqlens_q, cu_seqlens_q_padded, q.size(0), "cu_seqlens_q")
    segs_kv = reference.thd_segments(cu_seqlens_kv, cu_seqlens_kv_padded, k.size(0), "cu_seqlens_kv")
    if len(segs_q) != len(segs_kv):
        raise ValueError(f"cu_seqlens_q has {len(segs_q)} sequences, cu_seqlens_kv {len(segs_kv)}")
    live = [seg for seg in segs_q if seg[1]]
    if live and cudnn_thd.why_not(q, k, v, segs_q, segs_kv, causal, dropout_p, window_size) is None:
        report.ran("attention_thd", "cuda.cudnn.ragged")
        return cudnn_thd.attention(q, k, v, live, causal, scale)
    why_not = _varlen_why_not(q, k, v)
    if why_not is None:
        return _varlen(q, k, v, segs_q, segs_kv, causal, scale, dropout_p, window_size)
    return _padded_batch(q, k, v, segs_q, segs_kv, causal, scale, dropout_p, window_size)


def _padded_batch(q, k, v, segs_q, segs_kv, causal, scale, dropout_p, window_size):
    keep = [i for i, (_, length) in enumerate(segs_q) if length]
    if any(segs_q[i][1] != segs_kv[i][1] for i in range(len(segs_q))):
        report.ran("attention_thd", "cuda.sdpa.per_sequence")
        return _per_sequence(q, k, v, segs_q, segs_kv, causal, scale, dropout_p, window_size)
    out = q.new_zeros(q.size(0), q.size(1), v.size(-1))
    if not keep:
        report.ran("attention_thd", "cuda.sdpa.padded_batch")
        return out + 0 * q.sum()   # keeps the graph: zero gradients for every input
    iq, valid, n, longest = _padded_index([segs_q[i] for i in keep], q.device)
    ik, _, _, _ = _padded_index([segs_kv[i] for i in keep], q.device)
    qb, kb, vb = q[iq].transpose(1, 2), k[ik].transpose(1, 2), v[ik].transpose(1, 2)   # [n, h, L, d]
    use_causal = causal and window_size is None
    keep_mask = None
    if not use_causal:
        masked = build_mask(longest, longest, causal, window_size, ~valid.view(n, 1, 1, longest), q.device)
        keep_mask = ~masked
    gqa = k.size(1) != q.size(1)
    path = expected_path(qb, kb, vb, keep_mask, dropout_p, use_causal, gqa)
    report.ran("attention_thd", f"cuda.sdpa.padded_batch.{path}")
    ob = _sdpa(qb, kb, vb, attn_mask=keep_mask, dropout_p=dropout_p, is_causal=use_causal, scale=scale,
               enable_gqa=gqa).transpose(1, 2)          # [n, L, h, dv]
    return out.index_copy(0, iq[valid], ob[valid])


_FLASH_VARLEN = getattr(torch.ops.aten, "_flash_attention_forward", None)


def _varlen_why_not(q, k, v):
    """None where torch's varlen flash kernel takes these inputs, else why not."""
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if _FLASH_VARLEN is None:
        return "this torch has no aten._flash_attention_forward"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: flash takes fp16 / bf16"
    d = q.size(-1)
    if k.size(-1) != d or v.size(-1) != d or d % 8 or d > 256:
        return f"head dims q {d}, k {k.size(-1)}, v {v.size(-1)}: flash takes one head dim, a multiple of 8, <= 256"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "flash needs sm80 or newer"
    return None


class _FlashVarlen(torch.autograd.Function):
    """aten's variable-length flash attention forward and backward (q/k/v [T, heads, d], int32
    cumulative offsets, GQA by head counts, bottom-right causal alignment, windows)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, left, right):
        out, lse, rng, unused, _ = _FLASH_VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, False,
                                                 scale=scale, window_size_left=left, window_size_right=right)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.args = (max_q, max_k, dropout_p, causal, scale, left, right)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, dropout_p, causal, scale, left, right = ctx.args
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, unused,
            scale=scale, window_size_left=left, window_size_right=right)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _compact(t, segs, lengths):
    """The rows of the sequences, back to back: a leading slice of t where they already lie so,
    else gathered; with the gather's row index (None for a slice)."""
    starts = [s for s, _ in segs]
    n = sum(lengths)
    if starts[0] == 0 and all(starts[i + 1] == starts[i] + lengths[i] for i in range(len(starts) - 1)):
        return (t if n == t.size(0) else t[:n]), None
    rows = torch.cat([torch.arange(s, s + length) for s, length in zip(starts, lengths)]).to(t.device)
    return t.index_select(0, rows), rows


def _varlen(q, k, v, segs_q, segs_kv, causal, scale, dropout_p, window_size):
    """One varlen flash call over the live sequences (gathered where they do not lie back to back
    from row 0), the output scattered back to their rows; padding rows and empty sequences get 0."""
    live = [i for i in range(len(segs_q)) if segs_q[i][1] and segs_kv[i][1]]
    if not live:
        return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    report.ran("attention_thd", "cuda.flash.varlen")
    sq, skv = [segs_q[i] for i in live], [segs_kv[i] for i in live]
    len_q, len_k = [n for _, n in sq], [n for _, n in skv]
    qc, rows_q = _compact(q, sq, len_q)
    kc, rows_k = _compact(k, skv, len_k)
    vc = v[:kc.size(0)] if rows_k is None else v.index_select(0, rows_k)
    cu_q = torch.tensor([0] + list(itertools.accumulate(len_q)), dtype=torch.int32).to(q.device)
    cu_k = torch.tensor([0] + list(itertools.accumulate(len_k)), dtype=torch.int32).to(q.device)
    left, right = (None, None) if window_size is None else (int(window_size[0]), int(window_size[1]))
    out = _FlashVarlen.apply(qc, kc, vc, cu_q, cu_k, max(len_q), max(len_k), causal, scale, dropout_p, left, right)
    if rows_q is not None:
        return q.new_zeros(q.shape).index_copy(0, rows_q, out)
    n = out.size(0)
    return out if n == q.size(0) else torch.cat([out, out.new_zeros((q.size(0) - n,) + tuple(out.shape[1:]))])


def _rows_in_sequences(cu_slots, cu_seqlens, total):
    """[total] bool on the device: row r holds a token of some sequence (not a slot's padding, not
    past the last slot). No host reads: capture-safe."""
    rows = torch.arange(total, device=cu_slots.device, dtype=cu_slots.dtype)
    seg = (torch.searchsorted(cu_slots, rows, right=True) - 1).clamp_(0, cu_slots.numel() - 2)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return ((rows - cu_slots[seg]) < lengths[seg]) & (rows < cu_slots[-1])


def _varlen_on_device(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_q_padded, cu_kv_padded, causal, scale, dropout_p,
                      window_size):
    """Packed attention inside a CUDA-graph capture (Megatron's --cuda-graph-impl local, e.g. RL's
    get_logprobs with sequence packing): the offsets stay on the device, since a capture cannot read
    them on the host and a replay may bring others. One varlen flash call over the sequences' slots,
    with the token counts as the bound on a sequence's length; rows outside every sequence (a slot's
    padding, rows past the last slot) go in as 0 and come out as 0, so their gradients are 0 too."""
    why = _varlen_why_not(q, k, v)
    if why is not None:
        raise RuntimeError(f"packed (thd) attention inside a CUDA-graph capture needs torch's varlen flash "
                           f"kernel on the cuda backend: {why}")
    if (cu_q_padded is None) != (cu_kv_padded is None):
        raise RuntimeError("packed (thd) attention inside a CUDA-graph capture: padded slots for q but not "
                           "kv (or the reverse) are not served")
    if cu_q_padded is not None and not causal:
        raise RuntimeError("packed (thd) attention inside a CUDA-graph capture: padded sequence slots "
                           "(cu_seqlens_*_padded) are served for causal attention only")
    cu_sq, cu_sk = cu_seqlens_q.to(torch.int32), cu_seqlens_kv.to(torch.int32)
    cu_q = cu_sq if cu_q_padded is None else cu_q_padded.to(torch.int32)
    cu_k = cu_sk if cu_kv_padded is None else cu_kv_padded.to(torch.int32)
    in_q = _rows_in_sequences(cu_q, cu_sq, q.size(0))[:, None, None]
    in_k = _rows_in_sequences(cu_k, cu_sk, k.size(0))[:, None, None]
    zero = q.new_zeros(())
    q, k, v = torch.where(in_q, q, zero), torch.where(in_k, k, zero), torch.where(in_k, v, zero)
    left, right = (None, None) if window_size is None else (int(window_size[0]), int(window_size[1]))
    report.ran("attention_thd", "cuda.flash.varlen(device offsets, captured)")
    out = _FlashVarlen.apply(q, k, v, cu_q, cu_k, q.size(0), k.size(0), causal, scale, dropout_p, left, right)
    return torch.where(in_q, out, zero)


def _per_sequence(q, k, v, segs_q, segs_kv, causal, scale, dropout_p, window_size):
    out = q.new_zeros(q.size(0), q.size(1), v.size(-1))
    rows, pieces = [], []
    for (qs, ql), (ks, kl) in zip(segs_q, segs_kv):
        if ql and kl:
            o = attention(q[qs:qs + ql].transpose(0, 1).unsqueeze(0), k[ks:ks + kl].transpose(0, 1).unsqueeze(0),
                          v[ks:ks + kl].transpose(0, 1).unsqueeze(0), None, causal, scale, dropout_p, window_size)
            pieces.append(o[0].transpose(0, 1))
            rows.append(torch.arange(qs, qs + ql))
    if not pieces:
        return out + 0 * q.sum()
    return out.index_copy(0, torch.cat(rows).to(q.device), torch.cat(pieces))


# ---- context parallelism: the ring's blocks through the flash kernels ---------------------------------
_FLASH_BWD = getattr(torch.ops.aten, "_flash_attention_backward", None)
_NO_DROPOUT_RNG: dict = {}    # device -> (rng_state, unused) of a forward without dropout, for backwards
_LSE_LAYOUT: list = []        # "hT" ([heads, total]) or "bhs" ([batch, heads, seq]): what this torch's kernel gives


block_pieces = context_parallel.block_pieces    # (moved there: the npu backend cuts its blocks the same way)


def _to_tokens(x):
    """[b, h, s, d] -> [b·s, h, d] (the varlen kernel's layout; a copy)."""
    b, h, s_, d = x.shape
    return x.transpose(1, 2).reshape(b * s_, h, d)


def _from_tokens(x, b):
    n, h, d = x.shape
    return x.view(b, n // b, h, d).transpose(1, 2)


def _lse_bhs(lse, b, h, sq):
    if lse.dim() == 2:             # [h, b·sq]
        _LSE_LAYOUT[:] = ["hT"]
        return lse.view(h, b, sq).transpose(0, 1)
    _LSE_LAYOUT[:] = ["bhs"]
    return lse[:, :, :sq]


def _lse_kernel(lse, b, h, sq):
    if _LSE_LAYOUT == ["hT"]:
        return lse.transpose(0, 1).reshape(h, b * sq).contiguous()
    return lse.contiguous()


def _flash_block_fwd(q, k, v, causal, scale):
    """(out fp32 [b, h, sq, d], lse fp32 [b, h, sq]) of one piece: the batch rows as equal-length
    sequences of one varlen call."""
    b, h, sq, _ = q.shape
    sk = k.size(2)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    out, lse, rng, unused, _ = _FLASH_VARLEN(_to_tokens(q), _to_tokens(k), _to_tokens(v), cu_q, cu_k, sq, sk, 0.0,
                                             causal, False, scale=scale)
    _NO_DROPOUT_RNG[q.device] = (rng, unused)
    return _from_tokens(out, b).float(), _lse_bhs(lse, b, h, sq).float()


def _flash_block_bwd(dout, q, k, v, out, lse, causal, scale):
    """dq, dk, dv (fp32, k/v with their own heads) of one piece from the ring's final out / lse."""
    b, h, sq, _ = q.shape
    sk = k.size(2)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    rng, unused = _NO_DROPOUT_RNG[q.device]
    dq, dk, dv = _FLASH_BWD(_to_tokens(dout.to(q.dtype)), _to_tokens(q), _to_tokens(k), _to_tokens(v),
                            _to_tokens(out.to(q.dtype)), _lse_kernel(lse, b, h, sq), cu_q, cu_k, sq, sk, 0.0,
                            causal, rng, unused, scale=scale)
    return _from_tokens(dq, b).float(), _from_tokens(dk, b).float(), _from_tokens(dv, b).float()


BLOCK_WHY = ("this block's visibility has no cover by all-visible and causal pieces (a sliding window, or "
             "documents that end inside a chunk): it runs in torch math with its scores materialised")


FlashBlocks = context_parallel.PieceBlocks(
    _flash_block_fwd, _flash_block_bwd, "cuda.torch.block", BLOCK_WHY)
"""The context-parallel ring's blocks (and allgather / a2a's one block) through the varlen flash
    kernel: each block cut into all-visible and causal pieces (block_pieces), one flash call per
    piece, the pieces merged by log-sum-exp; the backward runs flash's backward per piece from the
    ring's final output and log-sum-exp. A block with no such cover, or dropout, takes the math."""


def attention_cp(q, k, v, pos, doc, causal, scale, window_size, groups, comm_type, dropout_p=0.0):
    why = _varlen_why_not(q, k, v) or (_FLASH_BWD is None and "this torch has no aten._flash_attention_backward")
    return context_parallel.served_attention_cp(FlashBlocks, why, "cuda.flash_blocks", "cuda.torch", q, k, v, pos,
                                                doc, causal, scale, window_size, groups, comm_type, dropout_p)

"""Packed-sequence (THD) attention through cuDNN's fused flash attention with ragged offsets, the
layout Transformer Engine feeds cuDNN on Hopper. torch's varlen kernel is FlashAttention-2, about half
of cuDNN's dense rate on an H100 (docs/long-context.md); cuDNN's ragged graphs run the same fused
kernel as its dense causal attention, doing only the within-document work.

Built with the cuDNN frontend's Python graphs (`pip install nvidia-cudnn-frontend`, which loads the
libcudnn that torch ships); MEGATRON_ADAPT_EXTERNAL=off keeps to torch's varlen flash kernel. A graph
depends on the number of sequences, the longest one and the total rows, not on where documents start or how long each is (those are runtime tensors: ragged offsets and
sequence lengths), so a graph is built once per bucket (sequences and the longest rounded up to
powers of two, empty sequences padding the count) and reused; building one costs ~0.1-0.5 s.

q, k, v: [T, heads, d], any rows between or after sequences (cu_seqlens_padded) are left alone by
the kernel and come back as zeros in the output and gradients."""
from __future__ import annotations

import functools

import torch

_INT32_MAX = 2 ** 31 - 1


@functools.lru_cache(maxsize=1)
def _cudnn():
    import cudnn            # nvidia-cudnn-frontend
    return cudnn


def available() -> bool:
    try:
        _cudnn()
        return True
    except Exception:       # not installed, or its compiled module does not load
        return False


def why_not(q, k, v, segs_q, segs_kv, causal, dropout_p, window_size) -> str | None:
    """None where this path serves the call, else why not (the caller takes the varlen flash path)."""
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    from megatron_adapt.backends.cuda import providers
    if providers._mode() == "off":
        return "MEGATRON_ADAPT_EXTERNAL=off: no other library's kernels"
    if not available():
        return "nvidia-cudnn-frontend is not installed"
    if torch.cuda.get_device_capability(q.device) < (9, 0):
        return "measured on Hopper only (sm90+)"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: cuDNN's fused attention takes fp16 / bf16"
    d = q.size(-1)
    if k.size(-1) != d or v.size(-1) != d or d % 8 or d > 128:
        return f"head dims q {d}, k {k.size(-1)}, v {v.size(-1)}: one head dim, a multiple of 8, <= 128"
    if q.size(1) % k.size(1):
        return f"{q.size(1)} query heads over {k.size(1)} key heads"
    if dropout_p:
        return "attention dropout"
    if window_size is not None:
        return "sliding window"
    if list(segs_q) != list(segs_kv):
        return "q and kv sequences differ"
    if q.numel() > _INT32_MAX or k.numel() > _INT32_MAX:
        return "more than 2^31 elements: int32 ragged offsets"
    return stats_too_padded(segs_q, q.size(0))


def stats_too_padded(segs, rows: int) -> str | None:
    """Why the padded softmax statistics of these sequences would be too large, or None."""
    live = [length for _, length in segs if length]
    if live and _pow2(len(live)) * bucket_len(max(live)) > STATS_ROWS_LIMIT * max(rows, 4096):
        return (f"{len(live)} sequences up to {max(live)} tokens in {rows} rows: the softmax statistics "
                f"kept for the backward would be padded to more than {STATS_ROWS_LIMIT}x the rows")
    return None


# The backward's softmax statistics are a padded [sequences, heads, longest, 1] fp32 tensor (cuDNN
# before 9.26 takes no ragged statistics there); flash keeps [heads, rows]. Past this many times the
# rows (one long document among very many short ones) the varlen flash kernel serves instead. At 32x,
# 16384 rows and 32 heads they are 67 MB a layer, against ~1 GB of the layer's activations; below
# 4096 rows they are small whatever their padding.
STATS_ROWS_LIMIT = 32


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_len(longest: int) -> int:
    """The graph's sequence length for a longest sequence: the next power of two, at least 64."""
    return max(64, _pow2(longest))


class _Graphs:
    """cuDNN graphs (forward, backward) per bucket, with the handle they were built on, per device."""

    def __init__(self):
        self.handles, self.fwd, self.bwd = {}, {}, {}

    def handle(self, device):
        cudnn = _cudnn()
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self.handles:
            with torch.cuda.device(idx):
                self.handles[idx] = cudnn.create_handle()
        h = self.handles[idx]
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(idx).cuda_stream)
        return h

    def build(self, backward, key, handle):
        cudnn = _cudnn()
        dtype, b, hq, hkv, s, d, total, causal, scale = key
        io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def index(name, rows):
            return g.tensor(name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)

        def packed(name, heads, offsets):
            t = g.tensor(name=name, dim=[b, heads, s, d], stride=[s * heads * d, d, heads * d, 1], data_type=io)
            t.set_ragged_offset(offsets)
            return t

        def output(t, heads, offsets):
            t.set_output(True).set_dim([b, heads, s, d]).set_stride([s * heads * d, d, heads * d, 1])
            t.set_ragged_offset(offsets)

        off_q, off_kv = index("off_q", b + 1), index("off_kv", b + 1)
        seq_len = index("seq_len", b)
        q, k, v = packed("q", hq, off_q), packed("k", hkv, off_kv), packed("v", hkv, off_kv)
        t = {"q": q, "k": k, "v": v, "off_q": off_q, "off_kv": off_kv, "seq_len": seq_len}
        common = dict(attn_scale=scale, use_causal_mask=causal, use_padding_mask=True, seq_len_q=seq_len,
                      seq_len_kv=seq_len)
        if not backward:
            o, stats = g.sdpa(name="fwd", q=q, k=k, v=v, generate_stats=True, **common)
            output(o, hq, off_q)
            stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([b, hq, s, 1]) \
                .set_stride([hq * s, s, 1, 1])
            t.update(o=o, stats=stats)
        else:
            o, do = packed("o", hq, off_q), packed("do", hq, off_q)
            stats = g.tensor(name="stats", dim=[b, hq, s, 1], stride=[hq * s, s, 1, 1],
                             data_type=cudnn.data_type.FLOAT)
            dq, dk, dv = g.sdpa_backward(name="bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                         max_total_seq_len_q=total, max_total_seq_len_kv=total, **common)
            output(dq, hq, off_q)
            output(dk, hkv, off_kv)
            output(dv, hkv, off_kv)
            t.update(o=o, do=do, stats=stats, dq=dq, dk=dk, dv=dv)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g, t

    def run(self, backward, key, device, tensors):
        handle = self.handle(device)
        table = self.bwd if backward else self.fwd
        if key not in table:
            table[key] = self.build(backward, key, handle)
        g, t = table[key]
        ws = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=device)
        g.execute({t[name]: x for name, x in tensors.items()}, ws, handle=handle)


GRAPHS = _Graphs()


def graph_count() -> int:
    return len(GRAPHS.fwd) + len(GRAPHS.bwd)


def _layout(segs, total, heads_q, heads_kv, d, device):
    """Bucketed sequence count b and longest s; int32 ragged offsets (in elements) and lengths,
    empty sequences appended up to b."""
    n = len(segs)
    b, s = _pow2(n), bucket_len(max(length for _, length in segs))
    starts = [st for st, _ in segs] + [total] * (b - n)
    lengths = [length for _, length in segs] + [0] * (b - n)
    rows = torch.tensor(starts + [total], dtype=torch.int64)
    host = torch.cat([rows * heads_q * d, rows * heads_kv * d, torch.tensor(lengths)]).to(torch.int32)
    dev = host.to(device, non_blocking=True).view(-1, 1, 1, 1)
    off_q, off_kv, seq_len = dev[:b + 1], dev[b + 1:2 * (b + 1)], dev[2 * (b + 1):]
    return b, s, off_q, off_kv, seq_len


class _CudnnThd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, off_q, off_kv, seq_len, key, dense):
        o = torch.empty_like(q) if dense else torch.zeros_like(q)
        dtype, b, hq, hkv, s, d, total, causal, scale = key
        stats = torch.empty(b, hq, s, 1, dtype=torch.float32, device=q.device)
        GRAPHS.run(False, key, q.device, dict(q=q, k=k, v=v, off_q=off_q, off_kv=off_kv, seq_len=seq_len,
                                              o=o, stats=stats))
        ctx.save_for_backward(q, k, v, o, stats, off_q, off_kv, seq_len)
        ctx.key, ctx.dense = key, dense
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, stats, off_q, off_kv, seq_len = ctx.saved_tensors
        make = torch.empty_like if ctx.dense else torch.zeros_like
        dq, dk, dv = make(q), make(k), make(v)
        GRAPHS.run(True, ctx.key, q.device, dict(q=q, k=k, v=v, o=o, do=do.contiguous(), stats=stats, off_q=off_q,
                                                 off_kv=off_kv, seq_len=seq_len, dq=dq, dk=dk, dv=dv))
        return dq, dk, dv, None, None, None, None, None


def attention(q, k, v, segs, causal, scale):
    """Causal (or full) attention within each of `segs` ((start row, length) per sequence, the same for
    q and kv) of packed q, k, v [T, heads, d]; rows outside every sequence come back as zeros."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    total, hq, d = q.shape
    hkv = k.size(1)
    b, s, off_q, off_kv, seq_len = _layout(segs, total, hq, hkv, d, q.device)
    covered = sum(length for _, length in segs)
    dense = covered == total
    key = (q.dtype, b, hq, hkv, s, d, total, bool(causal), float(scale if scale is not None else d ** -0.5))
    return _CudnnThd.apply(q, k, v, off_q, off_kv, seq_len, key, dense)

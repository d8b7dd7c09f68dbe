#!/usr/bin/env python3
"""Benchmark the cuda backend's ops (forward + backward) against Megatron's stock fallback math,
PyTorch eager, torch.compile and Liger-Kernel (when importable). Writes DIR/kernels.csv and
DIR/kernels.png (matplotlib, if installed).

    python scripts/bench_kernels.py --backend cuda --out out/bench

Timing: triton.testing.do_bench (CUDA events, L2 flushed before each call), median and p20/p80
of fwd+bwd; the backward goes through torch.autograd.grad (no .grad accumulation counted).
Bandwidth: bytes of a minimal fwd+bwd model per op (stated in the `bytes_model` column: every
input read once and every output written once per pass), over the median time, and as a fraction
of a large device-to-device copy measured in the same run (bytes read + written).
Mamba-2 (`--ops ssm`): the SSD scan, causal conv1d and gated RMSNorm against the PyTorch
reference, its torch.compile and mamba-ssm / causal-conv1d where those import.
Attention: TFLOP/s with flash-attention's convention (fwd 4*b*h*s^2*d, halved when causal;
fwd+bwd = 3.5x fwd). "megatron_stock" is Megatron-core's plain-torch path when apex / TE /
its CUDA extensions are absent, re-implemented here (megatron-core need not be installed).
"""
import argparse
import csv
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

# our Triton kernels are timed: not PyTorch's native op, which eager calls take by default
os.environ.setdefault("MEGATRON_ADAPT_EAGER_OPS", "triton")
ROWS = []
COPY_GBPS = None
SELECT = []   # (op, args) at the benchmark's shapes, for the providers' tournament


def ours(be, name):
    """Our kernel itself: the op without the providers' choice among installed libraries."""
    op = be.op(name)
    return getattr(op, "ours", op)


def run_selections(be, path):
    """What the providers would choose at the benchmark's shapes (when a library is installed)."""
    import json
    from megatron_adapt import report
    from megatron_adapt.backends.cuda import providers
    report.reset_op_counts()
    for name, op_args in SELECT:
        providers.choose(name, ours(be, name), op_args, "auto")
    sel = report.as_dict()["selections"]
    for s in sel:
        print(f"  {s['op']} [{s['inputs']}]: {s['chosen']} ({s['how']}; {s['candidates']})", flush=True)
    with open(path, "w") as f:
        json.dump(sel, f, indent=1)


def bench(fn, warmup=25, rep=100):
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])


def fwd_bwd(forward, inputs, grad_out=None):
    """A closure running forward and backward with respect to `inputs`."""
    def run():
        out = forward()
        g = grad_out if grad_out is not None else torch.ones_like(out)
        torch.autograd.grad(out, inputs, g)
    return run


def split_fns(forward, inputs, grad_out=None):
    """(forward only, backward only) closures: the backward re-runs on one retained graph."""
    state = {}

    def fwd():
        return forward()

    def bwd():
        if "out" not in state:
            state["out"] = forward()
        out = state["out"]
        g = grad_out if grad_out is not None else torch.ones_like(out)
        torch.autograd.grad(out, inputs, g, retain_graph=True)
    return fwd, bwd


FIELDS = ["op", "shape", "impl", "ms", "p20", "p80", "bytes_model", "GBps", "frac_copy", "TFLOPs",
          "fwd_ms", "fwd_frac_copy", "bwd_ms", "bwd_frac_copy", "note"]


def record(op, shape, impl, fn, nbytes=None, model="", flops=None, note="", split=None):
    """Time fn (fwd+bwd). split = (fwd_fn, fwd_bytes, bwd_fn, bwd_bytes) also times the passes
    one by one (the backward on one retained graph)."""
    try:
        ms, p20, p80 = bench(fn)
    except Exception as e:  # one failing comparator must not lose the run
        print(f"  {op:<24} {impl:<18} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
        ROWS.append(dict(op=op, shape=shape, impl=impl, ms="", p20="", p80="", bytes_model=model,
                         GBps="", frac_copy="", TFLOPs="", note=f"failed: {type(e).__name__}"))
        return
    gbps = nbytes / ms / 1e6 if nbytes else None
    tfl = flops / ms / 1e9 if flops else None
    row = dict(op=op, shape=shape, impl=impl, ms=f"{ms:.4f}", p20=f"{p20:.4f}", p80=f"{p80:.4f}",
               bytes_model=model, GBps=f"{gbps:.0f}" if gbps else "",
               frac_copy=f"{gbps / COPY_GBPS:.3f}" if gbps and COPY_GBPS else "",
               TFLOPs=f"{tfl:.0f}" if tfl else "", note=note)
    extra = ""
    if split is not None:
        try:
            for tag, pass_fn, pass_bytes in (("fwd", split[0], split[1]), ("bwd", split[2], split[3])):
                pms = bench(pass_fn)[0]
                frac = pass_bytes / pms / 1e6 / COPY_GBPS
                row[f"{tag}_ms"], row[f"{tag}_frac_copy"] = f"{pms:.4f}", f"{frac:.3f}"
                extra += f"  {tag} {pms:.3f} ms {frac:6.1%}"
        except Exception as e:
            extra += f"  split FAILED: {type(e).__name__}: {str(e)[:120]}"
    ROWS.append(row)
    print(f"  {op:<24} {impl:<18} {ms:8.3f} ms  " + (f"{gbps:7.0f} GB/s {gbps / COPY_GBPS:6.1%} of copy"
          if gbps else "") + (f"  {tfl:6.0f} TFLOP/s" if tfl else "") + extra, flush=True)


def maybe_compile(fn, args):
    if not args.compile or time.time() - args.t0 > args.compile_budget:
        return None
    return torch.compile(fn, dynamic=False)


def liger():
    try:
        import liger_kernel  # noqa: F401
        return True
    except ImportError:
        return False


# ---------------------------------------------------------------- Megatron stock re-implementations
def megatron_softmax(x, scale, causal):
    """FusedScaleMaskSoftmax.forward_torch_softmax (softmax_in_fp32, causal default mask)."""
    x = x.float() * scale
    sq, sk = x.shape[-2:]
    mask = torch.triu(torch.ones(sq, sk, device=x.device, dtype=torch.bool), diagonal=1)
    x = x.masked_fill(mask, -10000.0)
    return torch.softmax(x, -1).to(torch.bfloat16)


def megatron_swiglu_fns():
    """Megatron's SwiGLUFunction: jit_fuser (torch.compile) forward and hand-written backward."""
    @torch.compile
    def swiglu(y):
        a, b = torch.chunk(y, 2, -1)
        return F.silu(a) * b

    @torch.compile
    def swiglu_back(g, y):
        a, b = torch.chunk(y, 2, -1)
        return torch.cat((g * torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a))) * b,
                          g * F.silu(a)), -1)

    class SwiGLUFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return swiglu(x)

        @staticmethod
        def backward(ctx, g):
            return swiglu_back(g, ctx.saved_tensors[0])
    return SwiGLUFunction.apply


def megatron_attention(q, k, v, scale):
    """Megatron's local DotProductAttention: baddbmm scores, fp32 masked softmax, bmm."""
    b, h, s, d = q.shape
    rep = h // k.size(1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.baddbmm(torch.empty(b * h, s, s, dtype=q.dtype, device=q.device),
                           q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2),
                           beta=0.0, alpha=scale).view(b, h, s, s)
    probs = megatron_softmax(scores, 1.0, True).to(q.dtype)
    return torch.bmm(probs.view(b * h, s, s), v.reshape(b * h, s, d)).view(b, h, s, d)


# ---------------------------------------------------------------- per-op benchmarks
def bench_norms(be, args, dev):
    t, h = args.tokens, args.hidden
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(h, device=dev, dtype=torch.bfloat16, requires_grad=True) + 0.5
    w = w.detach().requires_grad_()
    bias = torch.randn(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    nb = 5 * t * h * 2
    model = "fwd r x + w y; bwd r x,dy + w dx = 5*T*H*2B"
    shape = f"{t}x{h} bf16"

    def eager_rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w

    rms = ours(be, "rms_norm")
    fb = (2 * t * h * 2, 3 * t * h * 2)  # fwd r x w y; bwd r x,dy w dx
    f, b = split_fns(lambda: rms(x, w, 1e-5), [x, w], dy)
    record("rms_norm", shape, "ours", fwd_bwd(lambda: rms(x, w, 1e-5), [x, w], dy), nb, model,
           split=(f, fb[0], b, fb[1]))
    record("rms_norm", shape, "megatron_stock", fwd_bwd(lambda: F.rms_norm(x, (h,), w, 1e-5), [x, w], dy),
           nb, model, note="WrappedTorchNorm -> torch.nn.RMSNorm")
    record("rms_norm", shape, "torch_eager", fwd_bwd(lambda: eager_rms(x, w), [x, w], dy), nb, model)
    c = maybe_compile(eager_rms, args)
    if c:
        record("rms_norm", shape, "torch_compile", fwd_bwd(lambda: c(x, w), [x, w], dy), nb, model)
    if liger():
        from liger_kernel.transformers.functional import liger_rms_norm
        record("rms_norm", shape, "liger", fwd_bwd(lambda: liger_rms_norm(x, w, 1e-5), [x, w], dy), nb, model)
    ln = ours(be, "layer_norm")
    f, b = split_fns(lambda: ln(x, w, bias, 1e-5), [x, w, bias], dy)
    record("layer_norm", shape, "ours", fwd_bwd(lambda: ln(x, w, bias, 1e-5), [x, w, bias], dy), nb, model,
           split=(f, fb[0], b, fb[1]))
    record("layer_norm", shape, "megatron_stock",
           fwd_bwd(lambda: F.layer_norm(x, (h,), w, bias, 1e-5), [x, w, bias], dy), nb, model,
           note="WrappedTorchNorm -> torch.nn.LayerNorm (= eager)")
    c = maybe_compile(lambda x, w, b: F.layer_norm(x, (h,), w, b, 1e-5), args)
    if c:
        record("layer_norm", shape, "torch_compile", fwd_bwd(lambda: c(x, w, bias), [x, w, bias], dy), nb, model)
    if liger():
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        record("layer_norm", shape, "liger",
               fwd_bwd(lambda: LigerLayerNormFunction.apply(x, w, bias, 1e-5), [x, w, bias], dy), nb, model)
    SELECT.append(("rms_norm", (x, w, 1e-5)))
    SELECT.append(("layer_norm", (x, w, bias, 1e-5)))


def bench_softmax(be, args, dev):
    b, hh, s = 4, 16, 2048
    x = torch.randn(b, hh, s, s, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    nb = 5 * x.numel() * 2
    model = "fwd r x w y; bwd r y,dy w dx = 5*E*2B (causal mask computed, not read)"
    shape = f"b{b} h{hh} {s}x{s} bf16 causal"
    sm = be.op("scaled_masked_softmax")
    scale = 1 / math.sqrt(128)
    record("scaled_masked_softmax", shape, "ours",
           fwd_bwd(lambda: sm(x, None, scale, True, None, True), [x], dy), nb, model)
    record("scaled_masked_softmax", shape, "megatron_stock",
           fwd_bwd(lambda: megatron_softmax(x, scale, True), [x], dy), nb, model,
           note="forward_torch_softmax (no CUDA extension)")
    c = maybe_compile(lambda x: megatron_softmax(x, scale, True), args)
    if c:
        record("scaled_masked_softmax", shape, "torch_compile", fwd_bwd(lambda: c(x), [x], dy), nb, model)


def bench_swiglu(be, args, dev):
    t, f = args.tokens, args.hidden
    x = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, f, device=dev, dtype=torch.bfloat16)
    nb = 8 * t * f * 2
    model = "fwd r 2F w F; bwd r 2F,F w 2F = 8*T*F*2B"
    shape = f"{t}x(2*{f}) bf16"
    op = ours(be, "swiglu")
    record("swiglu", shape, "ours", fwd_bwd(lambda: op(x), [x], dy), nb, model)
    SELECT.append(("swiglu", (x,)))
    if args.compile:
        mswiglu = megatron_swiglu_fns()
        record("swiglu", shape, "megatron_stock", fwd_bwd(lambda: mswiglu(x), [x], dy), nb, model,
               note="SwiGLUFunction with jit_fuser=torch.compile")

    def eager(x):
        a, b = torch.chunk(x, 2, -1)
        return F.silu(a) * b
    record("swiglu", shape, "torch_eager", fwd_bwd(lambda: eager(x), [x], dy), nb, model)
    c = maybe_compile(eager, args)
    if c:
        record("swiglu", shape, "torch_compile", fwd_bwd(lambda: c(x), [x], dy), nb, model)
    if liger():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        a, b = x.detach()[:, :f].contiguous().requires_grad_(), x.detach()[:, f:].contiguous().requires_grad_()
        record("swiglu", shape, "liger", fwd_bwd(lambda: LigerSiLUMulFunction.apply(a, b), [a, b], dy), nb, model)


def bench_dropout(be, args, dev):
    """Bias-dropout-add in training, p = 0.1 (Megatron's default hidden dropout)."""
    t, h, p = args.tokens, args.hidden, 0.1
    x, r = [torch.randn(t, h, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    b = torch.randn(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    nb = 5 * t * h * 2
    model = "fwd r x,res w out; bwd r dout w dx = 5*T*H*2B (a stored mask adds T*H*1B twice)"
    shape = f"{t}x{h} bf16 p={p}"
    op = ours(be, "bias_dropout_add")
    record("bias_dropout_add", shape, "ours", fwd_bwd(lambda: op(x, b, r, p), [x, b, r], dy), nb, model)
    record("bias_dropout_add", shape + " no bias", "ours", fwd_bwd(lambda: op(x, None, r, p), [x, r], dy), nb, model)

    from megatron_adapt.backends.reference import bias_dropout_add  # Megatron's arithmetic
    eager = lambda x, b, r: bias_dropout_add(x, b, r, p)
    record("bias_dropout_add", shape, "torch_eager", fwd_bwd(lambda: eager(x, b, r), [x, b, r], dy), nb, model)
    c = maybe_compile(eager, args)
    if c:
        record("bias_dropout_add", shape, "megatron_stock", fwd_bwd(lambda: c(x, b, r), [x, b, r], dy), nb,
               model, note="Megatron's bias_dropout_add_fused_train: torch.compile of the eager function")


def bench_rope(be, args, dev):
    from megatron_adapt.backends.reference import rope as megatron_rope  # Megatron's bshd formula
    b, h, d = 4, args.hidden // 128, 128
    s = args.tokens // b
    t = torch.randn(s, b, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.randn(s, 1, 1, d, device=dev)
    dy = torch.randn_like(t)
    nb = 4 * t.numel() * 2
    model = "fwd r t w out; bwd r dy w dt = 4*E*2B (angles negligible)"
    shape = f"s{s} b{b} h{h} d{d} bf16"
    op = be.op("rope")
    record("rope", shape, "ours", fwd_bwd(lambda: op(t, freqs, False), [t], dy), nb, model)
    record("rope", shape, "megatron_stock", fwd_bwd(lambda: megatron_rope(t, freqs, False), [t], dy), nb,
           model, note="_apply_rotary_pos_emb_bshd unfused (= eager)")
    c = maybe_compile(lambda t, f: megatron_rope(t, f, False), args)
    if c:
        record("rope", shape, "torch_compile", fwd_bwd(lambda: c(t, freqs), [t], dy), nb, model)


def bench_ce(be, args, dev):
    from megatron_adapt.backends.reference import vocab_parallel_cross_entropy as megatron_ce
    op = ours(be, "vocab_parallel_cross_entropy")
    for v in (32000, 128256):
        t = args.ce_tokens
        x = torch.randn(t, v, device=dev, dtype=torch.bfloat16, requires_grad=True)
        tg = torch.randint(0, v, (t,), device=dev)
        g = torch.rand(t, device=dev)
        nb = 3 * t * v * 2
        model = "fwd r logits; bwd r logits w grad = 3*T*V*2B"
        shape = f"{t}x{v} bf16"
        # x is a leaf: the backward writes a new buffer, so it can be re-run for the bwd-only time.
        f, b = split_fns(lambda: op(x, tg, 0.0, None), [x], g)
        record("cross_entropy", shape, "ours", fwd_bwd(lambda: op(x, tg, 0.0, None), [x], g), nb, model,
               split=(f, t * v * 2, b, 2 * t * v * 2))
        SELECT.append(("vocab_parallel_cross_entropy", (x, tg, 0.0, None)))
        record("cross_entropy", shape, "megatron_stock", fwd_bwd(lambda: megatron_ce(x, tg, 0.0, None), [x], g),
               nb, model, note="VocabParallelCrossEntropy math (fp32 copy, saved softmax)")
        record("cross_entropy", shape, "torch_eager",
               fwd_bwd(lambda: F.cross_entropy(x.float(), tg, reduction="none"), [x], g), nb, model)
        c = maybe_compile(lambda x, tg: F.cross_entropy(x.float(), tg, reduction="none"), args)
        if c:
            record("cross_entropy", shape, "torch_compile", fwd_bwd(lambda: c(x, tg), [x], g), nb, model)
        if liger():
            from liger_kernel.transformers.functional import liger_cross_entropy
            record("cross_entropy", shape, "liger",
                   fwd_bwd(lambda: liger_cross_entropy(x, tg, reduction="none"), [x], g), nb, model)
        del x


def bench_attention(be, args, dev):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    op = be.op("attention")
    b, h, s, d = 4, 16, 2048, 128
    for hkv, label in ((16, "causal"), (4, "causal GQA 16q/4kv")):
        q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(q)
        flops = 3.5 * 4 * b * s * s * h * d / 2
        shape = f"b{b} h{h}/{hkv} s{s} d{d} bf16 {label}"
        from megatron_adapt import report
        report.reset_op_counts()
        op(q, k, v, causal=True)
        path = ",".join(report.op_counts().get("attention", {}))
        record("attention", shape, "ours", fwd_bwd(lambda: op(q, k, v, causal=True), [q, k, v], dy),
               flops=flops, note=path)
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
                torch.autograd.grad(out, [q, k, v], dy)
            record("attention", shape, name, run, flops=flops)
        from megatron_adapt.backends.cuda import providers
        if providers.installed("flash_attn.cute"):
            record("attention", shape, "flash_attn_4",
                   fwd_bwd(lambda: providers._fa4_attention(q, k, v, None, True), [q, k, v], dy),
                   flops=flops, note="flash-attn-4 (CuTe DSL)")
        record("attention", shape, "megatron_stock",
               fwd_bwd(lambda: megatron_attention(q, k, v, d ** -0.5), [q, k, v], dy), flops=flops,
               note="local DotProductAttention: baddbmm + torch softmax + bmm")


def thd_lengths(n_docs, total, seed=0):
    """n_docs random document lengths (each >= 1) summing to total."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: n_docs - 1].add(1).sort().values.tolist()
    edges = [0] + cuts + [total]
    return [b - a for a, b in zip(edges, edges[1:])]


def bench_attention_thd(be, args, dev, h=16, d=128, n_docs=8):
    """Packed (thd) attention, issue 22: 8 documents of random lengths summing to --thd-tokens, 16
    heads, d128, bf16, causal within each document. TFLOP/s count only the within-document work
    (sum of L_i^2 / 2), so every row is comparable with the dense causal row at the same total
    length (which counts T^2 / 2). Rows: ours (the op: torch's varlen flash kernel), the same
    op's padded-batch path (one [n, h, L, d] SDPA call), cuDNN's ragged attention through aten
    (forward and backward where this torch has its derivative), one SDPA call per document, dense
    SDPA under the block-diagonal causal mask, and our dense causal attention at the same T.
    Each row's output is checked against ours (max |diff| in the note)."""
    from megatron_adapt import report
    from megatron_adapt.backends.cuda import attention as cuda_attention
    total = args.thd_tokens
    lengths = thd_lengths(n_docs, total)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn_like(q)
    doc_flops = 3.5 * 4 * h * d * sum(n * n for n in lengths) / 2
    dense_flops = 3.5 * 4 * h * d * total * total / 2
    shape = f"T{total} docs {lengths} h{h} d{d} bf16"
    op = be.op("attention_thd")
    report.reset_op_counts()
    with torch.no_grad():
        ref = op(q, k, v, cu, cu, causal=True).float()
    path = ",".join(report.op_counts().get("attention_thd", {}))

    def diff(fn):
        try:
            with torch.no_grad():
                return f"max|diff| vs ours {(fn().float() - ref).abs().max().item():.2e}"
        except Exception as e:
            return f"forward failed: {type(e).__name__}"
    record("attention_thd", shape, "ours", fwd_bwd(lambda: op(q, k, v, cu, cu, causal=True), [q, k, v], dy),
           flops=doc_flops, note=path)
    segs = [(int(a), n) for a, n in zip(cu[:-1].tolist(), lengths)]
    varlen = lambda: cuda_attention._varlen(q, k, v, segs, segs, True, None, 0.0, None)
    record("attention_thd", shape, "flash_varlen", fwd_bwd(varlen, [q, k, v], dy), flops=doc_flops,
           note="torch's varlen flash kernel (aten._flash_attention_forward with cu_seqlens); " + diff(varlen))
    from megatron_adapt.backends.cuda import cudnn_thd
    if cudnn_thd.why_not(q, k, v, segs, segs, True, 0.0, None) is None:
        # Training sees new document lengths every step: 16 layouts of 8 documents summing to T, one
        # per call, all in the graph bucket the first call built (after its build, timed alone).
        layouts = [torch.tensor([0] + torch.tensor(thd_lengths(n_docs, total, seed=s)).cumsum(0).tolist(),
                                dtype=torch.int32, device=dev) for s in range(1, 17)]
        built = cudnn_thd.graph_count()
        t0 = time.perf_counter()
        torch.autograd.grad(op(q, k, v, layouts[0], layouts[0], causal=True), [q, k, v], dy)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        turn = iter(range(10 ** 9))
        flops16 = sum(3.5 * 4 * h * d * sum(n * n for n in thd_lengths(n_docs, total, seed=s)) / 2
                      for s in range(1, 17)) / 16
        record("attention_thd", shape, "ours_new_layout_each_call",
               fwd_bwd(lambda: op(q, k, v, *(2 * [layouts[next(turn) % 16]]), causal=True), [q, k, v], dy),
               flops=flops16, note=f"16 layouts of {n_docs} documents in turn (mean within-document FLOPs); "
                                   f"graphs built: {cudnn_thd.graph_count() - built} (first call {first_ms:.0f} ms)")
    padded = lambda: cuda_attention._padded_batch(q, k, v, segs, segs, True, None, 0.0, None)
    record("attention_thd", shape, "ours_padded_batch", fwd_bwd(padded, [q, k, v], dy), flops=doc_flops,
           note=diff(padded))
    cudnn = getattr(torch.ops.aten, "_cudnn_attention_forward", None)
    if cudnn is not None:
        ragged = lambda: cudnn(q, k, v, None, cu, cu, max(lengths), max(lengths), True, 0.0, True, False)[0]
        note = diff(ragged)
        record("attention_thd", shape, "cudnn_ragged_aten", fwd_bwd(ragged, [q, k, v], dy), flops=doc_flops,
               note=note)

    def per_document():
        outs, at = [], 0
        for n in lengths:
            sl = slice(at, at + n)
            outs.append(F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                                                       v[sl].transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1))
            at += n
        return torch.cat(outs)
    record("attention_thd", shape, "sdpa_per_document", fwd_bwd(per_document, [q, k, v], dy), flops=doc_flops,
           note=diff(per_document))
    doc = torch.repeat_interleave(torch.arange(n_docs, device=dev), torch.tensor(lengths, device=dev))
    keep = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool, device=dev).tril()
    dense = (lambda **kw: F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), **kw)
             [0].transpose(0, 1))
    record("attention_thd", shape, "sdpa_block_diagonal_mask",
           fwd_bwd(lambda: dense(attn_mask=keep), [q, k, v], dy),
           flops=doc_flops, note="dense scores under the document mask; " + diff(lambda: dense(attn_mask=keep)))
    attention = be.op("attention")
    ours_dense = lambda: attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), None, True)[0].transpose(0, 1)
    report.reset_op_counts()
    with torch.no_grad():
        ours_dense()
    dense_path = ",".join(report.op_counts().get("attention", {}))
    record("attention_thd", shape, "dense_causal_same_T", fwd_bwd(ours_dense, [q, k, v], dy),
           flops=dense_flops, note=f"our attention op ({dense_path}), causal over all T: the target is "
                                  "THD >= 80% of this TFLOP/s")


def bench_adam(be, args, dev):
    n, chunks = args.adam_params, 64
    size = n // chunks
    params = [torch.randn(size, device=dev, requires_grad=True) for _ in range(chunks)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    nb = 28 * size * chunks
    model = "r p,g,m,v w p,m,v fp32 = 28 B/param"
    shape = f"{size * chunks / 1e9:.2f}e9 fp32 params in {chunks} tensors"
    opt = be.op("adam")(params, lr=1e-4, weight_decay=0.1)
    record("adamw", shape, "ours", opt.step, nb, model, note=type(opt).__name__ + " fused=True")
    del opt
    torch.cuda.empty_cache()
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)
    record("adamw", shape, "megatron_stock", opt.step, nb, model, note="torch AdamW foreach (no apex/TE)")
    del opt
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    record("adamw", shape, "torch_fused", opt.step, nb, model)
    del opt, params
    torch.cuda.empty_cache()


def bench_multi_tensor(be, args, dev):
    ts = [torch.randn(4 * 1024 * 1024, device=dev) for _ in range(256)]  # 1 Gi fp32 elements
    nb = sum(t.numel() for t in ts) * 4
    l2 = be.op("multi_tensor_l2norm")
    record("multi_tensor_l2norm", "256 x 4M fp32", "ours", lambda: l2(ts), nb, "r all = 4B/elem")

    def megatron_l2():  # Megatron's local_multi_tensor_l2_norm: one norm per tensor, then stack
        return torch.norm(torch.stack([torch.norm(t, 2.0) for t in ts]), 2.0)
    record("multi_tensor_l2norm", "256 x 4M fp32", "megatron_stock", megatron_l2, nb, "r all = 4B/elem")


def mamba_ssm_fns():
    """mamba-ssm's own kernels, where installed: (chunk scan, causal conv1d, gated RMSNorm)."""
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:
        return None
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception:
        causal_conv1d_fn = None
    return mamba_chunk_scan_combined, causal_conv1d_fn, rmsnorm_fn


def bench_ssm(be, args, dev):
    """Mamba-2 layer ops at a Mamba-2 / Nemotron-H-like shape: d_inner = 2 * hidden, head dim 64,
    8 groups, state 128, chunk 128 (Megatron's defaults), bf16."""
    from megatron_adapt.backends import reference
    P, G, N, Q = 64, 8, 128, 128
    H = 2 * args.hidden // P
    b = 4
    L = args.tokens // b
    T = b * L
    bf = dict(device=dev, dtype=torch.bfloat16)
    x = torch.randn(b, L, H, P, **bf).requires_grad_()
    z = torch.randn(b, L, H, P, **bf).requires_grad_()
    dt = (torch.randn(b, L, H, **bf) * 0.5).requires_grad_()
    Bm = (torch.randn(b, L, G, N, **bf) * 0.5).requires_grad_()
    Cm = (torch.randn(b, L, G, N, **bf) * 0.5).requires_grad_()
    A = (-torch.rand(H, device=dev) - 0.5).requires_grad_()
    D = torch.randn(H, device=dev).requires_grad_()
    dt_bias = torch.randn(H, device=dev).requires_grad_()
    dy = torch.randn(b, L, H, P, **bf)
    leaves = [x, dt, A, Bm, Cm, D, z, dt_bias]
    xs, bcs, dts = T * H * P * 2, T * G * N * 2, T * H * 2
    fwd_b = 2 * xs + 2 * bcs + dts + xs                  # r x, z, B, C, dt; w out
    bwd_b = 3 * xs + 2 * bcs + dts + 2 * xs + 2 * bcs + dts   # r x, z, dout, B, C, dt; w dx, dz, dB, dC, ddt
    model = "fwd r x,z,B,C,dt w y; bwd r x,z,dy,B,C,dt w dx,dz,dB,dC,ddt (bf16; states not counted)"
    shape = f"b{b} l{L} h{H} p{P} g{G} n{N} Q{Q} bf16"
    scan = ours(be, "ssd_scan")
    call = lambda f: (lambda: f(x, dt, A, Bm, Cm, Q, D=D, z=z, dt_bias=dt_bias, dt_softplus=True))
    f, bw = split_fns(call(scan), leaves, dy)
    record("ssd_scan", shape, "ours", fwd_bwd(call(scan), leaves, dy), fwd_b + bwd_b, model,
           split=(f, fwd_b, bw, bwd_b))
    record("ssd_scan", shape, "torch_eager", fwd_bwd(call(reference.ssd_scan), leaves, dy), fwd_b + bwd_b,
           model, note="the chunked reference (the cpu backend's op)")
    c = maybe_compile(lambda *a, **k: reference.ssd_scan(*a, **k), args)
    if c:
        record("ssd_scan", shape, "torch_compile", fwd_bwd(call(c), leaves, dy), fwd_b + bwd_b, model)
    mssm = mamba_ssm_fns()
    if mssm:
        record("ssd_scan", shape, "mamba_ssm", fwd_bwd(call(mssm[0]), leaves, dy), fwd_b + bwd_b, model)
    # the causal conv1d over xBC [b, l, d_inner + 2 G N] (channel-last), width 4, SiLU
    d = H * P + 2 * G * N
    xc = torch.randn(b, L, d, **bf).requires_grad_()
    wc = (torch.randn(d, 4, device=dev) * 0.3).to(torch.bfloat16).requires_grad_()
    bc = torch.randn(d, **bf).requires_grad_()
    gy = torch.randn(b, L, d, **bf)
    nb = 5 * T * d * 2
    conv = ours(be, "causal_conv1d")
    cshape = f"{b}x{L}x{d} w4 bf16 silu"
    record("causal_conv1d", cshape, "ours", fwd_bwd(lambda: conv(xc, wc, bc, "silu"), [xc, wc, bc], gy), nb,
           "fwd r x w y; bwd r x,dy w dx = 5*T*D*2B")
    record("causal_conv1d", cshape, "torch_eager",
           fwd_bwd(lambda: reference.causal_conv1d(xc, wc, bc, "silu"), [xc, wc, bc], gy), nb,
           "fwd r x w y; bwd r x,dy w dx = 5*T*D*2B", note="F.conv1d, the reference")
    if mssm and mssm[1]:
        record("causal_conv1d", cshape, "causal_conv1d",
               fwd_bwd(lambda: mssm[1](xc.transpose(1, 2), wc, bc, activation="silu").transpose(1, 2),
                       [xc, wc, bc], gy), nb, "fwd r x w y; bwd r x,dy w dx = 5*T*D*2B")
    # the gated RMSNorm after the scan: [T, d_inner], groups of d_inner / G, gate before the norm
    xn = torch.randn(T, H * P, **bf).requires_grad_()
    zn = torch.randn(T, H * P, **bf).requires_grad_()
    wn = torch.ones(H * P, **bf).requires_grad_()
    gn = torch.randn(T, H * P, **bf)
    nb = 7 * T * H * P * 2
    norm = ours(be, "rms_norm_gated")
    nshape = f"{T}x{H * P} groups {H * P // G} bf16"
    nmodel = "fwd r x,z w y; bwd r x,z,dy w dx,dz = 7*T*D*2B"
    record("rms_norm_gated", nshape, "ours",
           fwd_bwd(lambda: norm(xn, wn, zn, 1e-5, H * P // G, False), [xn, wn, zn], gn), nb, nmodel)
    record("rms_norm_gated", nshape, "torch_eager",
           fwd_bwd(lambda: reference.rms_norm_gated(xn, wn, zn, 1e-5, H * P // G, False), [xn, wn, zn], gn),
           nb, nmodel)
    if mssm:
        record("rms_norm_gated", nshape, "mamba_ssm",
               fwd_bwd(lambda: mssm[2](xn, wn, None, z=zn, eps=1e-5, group_size=H * P // G,
                                       norm_before_gate=False), [xn, wn, zn], gn), nb, nmodel)


def measure_copy(dev):
    global COPY_GBPS
    src = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms, _, _ = bench(lambda: dst.copy_(src))
    COPY_GBPS = 2 * src.numel() * 2 / ms / 1e6
    ROWS.append(dict(op="d2d_copy", shape="2 GiB bf16", impl="torch copy_", ms=f"{ms:.4f}", p20="", p80="",
                     bytes_model="r+w = 2*N*2B", GBps=f"{COPY_GBPS:.0f}", frac_copy="1.000", TFLOPs="", note=""))
    print(f"device-to-device copy: {COPY_GBPS:.0f} GB/s (bytes read + written)", flush=True)
    del src, dst


def plot(path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG chart")
        return
    mem = [r for r in ROWS if r["frac_copy"] and r["op"] != "d2d_copy"]
    att = [r for r in ROWS if r["TFLOPs"]]
    fig, axes = plt.subplots(1, 2, figsize=(16, 0.32 * max(len(mem), len(att)) + 2),
                             gridspec_kw={"width_ratios": [2, 1]})
    labels = [f"{r['op']} {r['shape'].split(' bf16')[0]} [{r['impl']}]" for r in mem]
    cols = ["tab:green" if r["impl"] == "ours" else "tab:gray" for r in mem]
    axes[0].barh(range(len(mem)), [float(r["frac_copy"]) for r in mem], color=cols)
    axes[0].set_yticks(range(len(mem)), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].axvline(1.0, color="k", lw=0.5)
    axes[0].set_xlabel("fwd+bwd model bandwidth / measured D2D copy bandwidth")
    labels = [f"{r['shape'].split(' bf16')[0]} {r['shape'].split('bf16 ')[-1]} [{r['impl']}]" for r in att]
    cols = ["tab:green" if r["impl"] == "ours" else "tab:gray" for r in att]
    axes[1].barh(range(len(att)), [float(r["TFLOPs"]) for r in att], color=cols)
    axes[1].set_yticks(range(len(att)), labels, fontsize=7)
    axes[1].invert_yaxis()
    axes[1].set_xlabel("attention fwd+bwd TFLOP/s")
    fig.suptitle(f"megatron-adapt cuda backend, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda", choices=["cuda"])
    p.add_argument("--out", required=True)
    p.add_argument("--ops", default="norms,softmax,swiglu,dropout,rope,ce,attention,attention_thd,adam,multi_tensor,ssm",
                   help="comma-separated subset of the default list")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--thd-tokens", type=int, default=16384, help="attention_thd: packed tokens (8 documents)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ce-tokens", type=int, default=8192)
    p.add_argument("--adam-params", type=int, default=10 ** 9)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile baselines")
    p.add_argument("--compile-budget", type=float, default=300,
                   help="seconds after which further torch.compile baselines are skipped")
    args = p.parse_args(argv)
    args.t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    from megatron_adapt.backends import load
    be = load(args.backend)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, liger: {liger()}", flush=True)
    measure_copy(dev)
    table = dict(norms=bench_norms, softmax=bench_softmax, swiglu=bench_swiglu, dropout=bench_dropout, rope=bench_rope,
                 ce=bench_ce, attention=bench_attention, adam=bench_adam, multi_tensor=bench_multi_tensor,
                 ssm=bench_ssm, attention_thd=bench_attention_thd)
    for name in args.ops.split(","):
        print(f"[{name}]", flush=True)
        try:
            table[name](be, args, dev)
        except Exception as e:
            print(f"  {name} FAILED: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()
    path = os.path.join(args.out, "kernels.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        w.writeheader()
        w.writerows(ROWS)
    print(f"wrote {path}")
    plot(os.path.join(args.out, "kernels.png"))
    if liger():
        print("[providers: ours or an installed library, per op at these shapes]", flush=True)
        run_selections(be, os.path.join(args.out, "selections.json"))


if __name__ == "__main__":
    sys.exit(main())

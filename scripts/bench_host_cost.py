"""Host cost per call of every cuda-backend op, next to PyTorch's op and Liger's where one exists.

Tiny tensors (the GPU time is ~0), so what is timed is the Python / launch cost the host pays
per call: N calls are timed with time.perf_counter() before the final synchronize (the enqueue
time, printed as host us/call) and after it (wall us/call). Every variant of one op (ours, PyTorch's,
Liger's) is timed in turns, --reps turns of N calls each, so that all of them see the same state of
the host; the best turn is printed (noise on a busy host only adds time), the median is in the JSON. Forward alone runs under no_grad;
forward+backward calls torch.autograd.grad on precomputed output gradients (no .grad
accumulation). `launches` is the number of GPU kernels one call queued (torch.profiler; '-' where
the profiler is unavailable).

Run through the backend's op table (the function Megatron's patches call, providers wrapper
included), with megatron-adapt's configuration fixed once as in a patched run.

Usage: python scripts/bench_host_cost.py [--calls 300] [--reps 7] [--json out.json] [--ops rms_norm,swiglu]
       MEGATRON_ADAPT_TRITON_DIRECT=0 gives the ordinary Triton launcher (the "before" column).
On CPU it runs under TRITON_INTERPRET=1 as a smoke test only (the figures mean nothing there).
--stub-launch replaces every Triton launch of the cuda backend with a no-op (outputs are garbage):
what is left is the Python around the kernels, measurable on any machine, CPU tensors included.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

os.environ.setdefault("MEGATRON_ADAPT_AUTO", "0")   # the cuda backend's ops are timed, nothing applied
os.environ.setdefault("MEGATRON_ADAPT_EAGER_OPS", "triton")   # ours, not PyTorch's op they are compared with
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before Triton is imported

def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def host_us_interleaved(fns, calls, dev, reps):
    """{name: (host us/call best, host us/call median, wall us/call best)} for every fn in `fns`,
    timed in turns: rep 1 of every fn, then rep 2 of every fn, ... so that the variants of one op
    see the same state of a noisy host, and their ratio is a like-for-like comparison. The best
    (smallest) rep is the figure: host noise only ever adds time."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    sync(dev)
    host = {k: [] for k in fns}
    wall = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            sync(dev)
            t2 = time.perf_counter()
            host[k].append((t1 - t0) / calls * 1e6)
            wall[k].append((t2 - t0) / calls * 1e6)
    return {k: (min(host[k]), statistics.median(host[k]), min(wall[k])) for k in fns}


def kernels_per_call(fn, dev):
    if dev.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(dev)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "Memcpy" not in e.name and "Memset" not in e.name)
    except Exception:  # profiler unavailable (CUPTI missing): the column stays empty
        return None


def fwd_bwd(f, inputs):
    """(forward-only call, forward+backward call) of f over `inputs`."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def fwd():
        with torch.no_grad():
            f(*inputs)
    if not leaves:
        return fwd, None
    with torch.no_grad():
        out = f(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs if o.is_floating_point()]

    def both():
        o = f(*inputs)
        o = o if isinstance(o, tuple) else (o,)
        torch.autograd.grad([x for x in o if x.is_floating_point()], leaves, grads)
    return fwd, both


def cases(dev, dt, ours):
    """op -> list of (variant, callable fwd-only, callable fwd+bwd or None)."""
    F = torch.nn.functional
    r = lambda *s, grad=True, dtype=dt: torch.randn(*s, device=dev, dtype=dtype).requires_grad_(grad)
    T, H = 8, 256
    out = {}

    def add(op, variant, f, inputs, backward=True):
        fw, fb = fwd_bwd(f, inputs)
        out.setdefault(op, []).append((variant, fw, fb if backward else None))

    try:   # (GPU only: Liger's kernels do not run under the Triton interpreter)
        import liger_kernel  # noqa: F401
        liger = dev.type == "cuda"
    except Exception:
        liger = False

    x, w, b = r(T, H), r(H), r(H)
    add("rms_norm", "ours", lambda x, w: ours("rms_norm")(x, w, 1e-5), [x, w])
    add("rms_norm", "torch F.rms_norm", lambda x, w: F.rms_norm(x, (H,), w, 1e-5), [x, w])
    add("layer_norm", "ours", lambda x, w, b: ours("layer_norm")(x, w, b, 1e-5), [x, w, b])
    add("layer_norm", "torch F.layer_norm", lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5), [x, w, b])
    if liger:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        add("rms_norm", "liger", lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "gemma", False), [x, w])
        add("layer_norm", "liger", lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5), [x, w, b])

    xs, bs = r(T, 2 * H), r(2 * H)

    def torch_swiglu(x):
        a, g = torch.chunk(x, 2, -1)
        return F.silu(a) * g
    add("swiglu", "ours", lambda x: ours("swiglu")(x), [xs])
    add("swiglu", "torch silu*mul", torch_swiglu, [xs])
    if liger:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        add("swiglu", "liger", lambda x: LigerSiLUMulFunction.apply(*torch.chunk(x, 2, -1)), [xs])
    add("bias_swiglu", "ours", lambda x, b: ours("bias_swiglu")(x, b), [xs, bs])
    add("bias_swiglu", "torch add+silu*mul", lambda x, b: torch_swiglu(x + b), [xs, bs])
    add("bias_gelu", "ours", lambda b, y: ours("bias_gelu")(b, y), [b, x])
    add("bias_gelu", "torch add+gelu", lambda b, y: F.gelu(y + b, approximate="tanh"), [b, x])

    xd, rd = r(T, H), r(T, H)
    add("bias_dropout_add", "ours", lambda x, b, res: ours("bias_dropout_add")(x, b, res, 0.1), [xd, b, rd])

    from megatron_adapt.backends.reference import bias_dropout_add  # Megatron's arithmetic
    torch_bda = lambda x, b, res: bias_dropout_add(x, b, res, 0.1)
    add("bias_dropout_add", "torch add+dropout+add", torch_bda, [xd, b, rd])
    if dev.type == "cuda":
        add("bias_dropout_add", "torch.compile (Megatron's)", torch.compile(torch_bda), [xd, b, rd])

    s_, bb, hh, d = 4, 2, 4, 32
    q = r(s_, bb, hh, d)
    freqs = torch.randn(s_, 1, 1, d, device=dev)

    def torch_rope(t, f):  # Megatron's _apply_rotary_pos_emb_bshd, non-interleaved
        cos, sin = torch.cos(f).to(t.dtype), torch.sin(f).to(t.dtype)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-x2, x1), dim=-1) * sin
    add("rope", "ours", lambda t: ours("rope")(t, freqs, False, 1.0), [q])
    add("rope", "torch (Megatron unfused)", lambda t: torch_rope(t, freqs), [q])

    sc = r(2, 2, 16, 16)
    causal = torch.triu(torch.ones(16, 16, device=dev, dtype=torch.bool), 1)
    add("scaled_masked_softmax", "ours", lambda s: ours("scaled_masked_softmax")(s, None, 0.125, True), [sc])
    add("scaled_masked_softmax", "torch scale+mask+softmax",
        lambda s: torch.softmax((s * 0.125).masked_fill(causal, -10000.0), -1), [sc])

    logits, tgt = r(T, 512), torch.randint(0, 512, (T,), device=dev)
    add("vocab_parallel_cross_entropy", "ours",
        lambda z: ours("vocab_parallel_cross_entropy")(z, tgt, 0.0, None), [logits])
    add("vocab_parallel_cross_entropy", "torch F.cross_entropy",
        lambda z: F.cross_entropy(z.float(), tgt, reduction="none"), [logits])
    if liger:
        from liger_kernel.transformers.functional import liger_cross_entropy
        add("vocab_parallel_cross_entropy", "liger",
            lambda z: liger_cross_entropy(z, tgt, reduction="none"), [logits])

    qa, ka, va = r(2, 2, 16, 32), r(2, 2, 16, 32), r(2, 2, 16, 32)   # [b, h, s, d]
    add("attention", "ours", lambda q, k, v: ours("attention")(q, k, v, None, True), [qa, ka, va])
    add("attention", "torch SDPA", lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True), [qa, ka, va])

    ts = [torch.randn(64, device=dev) for _ in range(8)]
    dst = [torch.empty_like(t) for t in ts]
    add("multi_tensor_l2norm", "ours", lambda: ours("multi_tensor_l2norm")(ts), [], backward=False)
    add("multi_tensor_l2norm", "torch _foreach_norm+stack",
        lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))), [], backward=False)
    add("multi_tensor_scale", "ours", lambda: ours("multi_tensor_scale")(ts, dst, 0.5), [], backward=False)
    add("multi_tensor_scale", "torch _foreach_mul",
        lambda: torch._foreach_copy_(dst, torch._foreach_mul(ts, 0.5)), [], backward=False)
    gpu_ = dev.type == "cuda"
    inp, go, mg = r(T, H, grad=False), r(T, H, grad=False), torch.zeros(H, H, device=dev)
    add("wgrad_accumulate", "ours", lambda: ours("wgrad_accumulate")(inp, go, mg), [], backward=False)
    add("wgrad_accumulate", "torch addmm(out_dtype=fp32)" if gpu_ else "torch addmm_",
        (lambda: torch.addmm(mg, go.t(), inp, out_dtype=torch.float32, out=mg)) if gpu_ else
        (lambda: mg.addmm_(go.t(), inp)), [], backward=False)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7, help="turns per variant; the best is reported")
    ap.add_argument("--stub-launch", action="store_true",
                    help="Triton launches do nothing: time only the Python around the kernels")
    ap.add_argument("--json")
    ap.add_argument("--ops", default="")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not a.stub_launch:
            a.calls, a.reps = min(a.calls, 5), min(a.reps, 2)
    dev = torch.device("cuda" if gpu else "cpu")
    dt = torch.bfloat16 if gpu else torch.float32

    from megatron_adapt import core
    from megatron_adapt.backends.cuda import BACKEND
    from megatron_adapt.config import Config
    core._state.setdefault("config", Config.resolve())   # as in a patched run: read once
    backend = BACKEND   # (its check() wants a GPU: the CPU smoke run skips it)
    from megatron_adapt.backends.cuda import _common
    if a.stub_launch:   # every module of the backend that launches through _common.launch
        import importlib
        import pkgutil
        from megatron_adapt.backends import cuda as cuda_pkg
        for info in pkgutil.iter_modules(cuda_pkg.__path__):
            m = importlib.import_module(f"{cuda_pkg.__name__}.{info.name}")
            if getattr(m, "launch", None) is _common.launch and m is not _common:
                m.launch = lambda *args, **kw: None
    ours = backend.op
    direct = getattr(_common, "direct_launch_enabled", lambda: False)()   # (absent before it)

    head = {"cpu": cpu_model(), "gpu": torch.cuda.get_device_name() if gpu else None,
            "torch": torch.__version__, "direct_launch": direct, "stub_launch": a.stub_launch,
            "triton": __import__("triton").__version__}
    print(f"# host: {head['cpu']} | GPU: {head['gpu']} | torch {head['torch']} | triton "
          f"{head['triton']} | direct launch {'on' if direct else 'off'}", flush=True)
    rows = []
    only = set(filter(None, a.ops.split(",")))
    for op, variants in cases(dev, dt, ours).items():
        if only and op not in only:
            continue
        fns = {(variant, kind): fn for variant, fw, fb in variants
               for kind, fn in (("fwd", fw), ("fwd_bwd", fb)) if fn is not None}
        timed = host_us_interleaved(fns, a.calls, dev, a.reps)
        for variant, fw, fb in variants:
            row = {"op": op, "variant": variant}
            for kind, fn in (("fwd", fw), ("fwd_bwd", fb)):
                if fn is None:
                    continue
                best, med, wall = timed[(variant, kind)]
                row[f"{kind}_host_us"], row[f"{kind}_host_us_median"] = round(best, 1), round(med, 1)
                row[f"{kind}_wall_us"] = round(wall, 1)
                row[f"{kind}_launches"] = kernels_per_call(fn, dev)
            rows.append(row)
    f = lambda v: "-" if v is None else str(v)
    print(f"{'op':28} {'variant':28} {'fwd host us':>11} {'(launches)':>10} {'fwd+bwd host us':>15} {'(launches)':>10}")
    for r_ in rows:
        print(f"{r_['op']:28} {r_['variant']:28} {f(r_.get('fwd_host_us')):>11} {f(r_.get('fwd_launches')):>10} "
              f"{f(r_.get('fwd_bwd_host_us')):>15} {f(r_.get('fwd_bwd_launches')):>10}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({**head, "calls": a.calls, "reps": a.reps, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())

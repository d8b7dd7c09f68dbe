"""How well layer-wise activation offloading (backends/activation_offload.py, Megatron's
`--cpu-offloading-num-layers`) hides its copies, without Megatron: a stack of llama-like layers
(RMSNorm, QKV, SDPA, proj, SwiGLU MLP; bf16) at the 0.95B bench model's shapes, forward and
backward over micro-batches, with the first K layers offloaded through the same context and
layer-output function Megatron's transformer block uses.

Per K: ms per step (CUDA events, median), the compute stream's busy time, the bytes moved, and
from one profiled step how long the copies ran and how much of that time the compute stream was
busy too ("hidden"). `--sweep` runs each setting in a fresh process (CUDA_DEVICE_MAX_CONNECTIONS
must be set before CUDA starts) and writes one JSON.

  python scripts/offload_overlap_probe.py --sweep --out OUT/offload_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F


class Layer(torch.nn.Module):
    def __init__(self, hidden, ffn, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):                      # x: [s, b, h], Megatron's layout
        s, b, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        g, u = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(g) * u)


def one_setting(args) -> dict:
    from megatron_adapt.backends.activation_offload import offload_context
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = torch.nn.ModuleList(Layer(args.hidden, args.ffn, args.heads)
                                 for _ in range(args.layers)).to(dev, torch.bfloat16)
    ctx, boundary = (offload_context(args.offload, args.layers, streams=True)
                     if args.offload else (None, None))
    xs = [torch.randn(args.seq, args.mbs, args.hidden, device=dev, dtype=torch.bfloat16,
                      requires_grad=True) for _ in range(args.micro_batches)]

    def step():
        for x in xs:
            h = x
            for layer in layers:
                if ctx is None:
                    h = layer(h)
                else:
                    with ctx:
                        h = layer(h)
                    h = boundary(h)
            h.float().square().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    out = {"offloaded_layers": args.offload, "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "ms_per_step": statistics.median(times), "ms_all": times,
           "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
           "gb_each_way_per_step": (ctx.forward_bytes * args.micro_batches / 1e9) if ctx else 0.0}
    out.update(profile_step(step))
    return out


def profile_step(step) -> dict:
    """One step under torch.profiler: busy time per stream, copy time, copy time hidden under compute."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels, d2h, h2d = [], [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        span = (e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream"))
        if cat == "kernel":
            kernels.append(span)
        elif cat == "gpu_memcpy" and "DtoH" in name:
            d2h.append(span)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            h2d.append(span)
    if not kernels:
        return {"profile": "no kernels recorded"}
    compute_stream = statistics.mode(k[2] for k in kernels)
    compute = union([k[:2] for k in kernels if k[2] == compute_stream])
    t0 = min(s for s, _ in compute)
    t1 = max(e for _, e in compute)
    def hidden(copies):
        cu = union([c[:2] for c in copies])
        return length(cu), length(intersect(cu, compute))
    d2h_t, d2h_h = hidden(d2h)
    h2d_t, h2d_h = hidden(h2d)
    gaps = sorted(((b[0] - a[1], a[1] - t0) for a, b in zip(compute, compute[1:])), reverse=True)[:8]
    return {"profiled_step_ms": (t1 - t0) / 1e3, "compute_busy_ms": length(compute) / 1e3,
            "d2h_ms": d2h_t / 1e3, "d2h_hidden_ms": d2h_h / 1e3,
            "h2d_ms": h2d_t / 1e3, "h2d_hidden_ms": h2d_h / 1e3,
            "other_streams_kernels": sum(1 for k in kernels if k[2] != compute_stream),
            "largest_compute_gaps_ms_at_ms": [(g / 1e3, at / 1e3) for g, at in gaps]}


def union(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(spans):
    return sum(e - s for s, e in spans)


SHAPE = ("layers", "hidden", "ffn", "heads", "seq", "mbs", "micro_batches", "iters")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--offload", type=int, default=0, help="layers offloaded (the first K)")
    p.add_argument("--sweep", action="store_true", help="K = 0, 2, 4, 8 with max connections 1 and 8")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not args.sweep:
        print(json.dumps(one_setting(args)), flush=True)
        return
    results = []
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    for conns in ("1", "8"):
        for k in (0, 2, 4, 8):
            env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=conns)
            cmd = [sys.executable, __file__, "--offload", str(k)] + [
                f"--{name.replace('_', '-')}={getattr(args, name)}" for name in SHAPE]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [l for l in r.stdout.splitlines() if l.startswith("{")]
            res = json.loads(line[-1]) if line else {"offloaded_layers": k, "error": r.stderr[-2000:]}
            res.pop("ms_all", None)
            print(json.dumps(res), flush=True)
            results.append(res)
    doc = {"gpu": torch.cuda.get_device_name(), "host_cpu": cpu, "torch": torch.__version__,
           "shape": vars(args), "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

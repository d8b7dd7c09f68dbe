"""Where a transformer layer's host time goes, per layer, on one GPU (issue 25, item 1).

Builds the GPT model `pretrain_gpt.py` builds for a bench preset (scripts/bench_e2e.sh's shapes:
megatron-core's GPTModel, Megatron's DDP and Float16Module, bf16, Megatron's default dropout) and
times one training forward + backward at two depths; the difference divided by the layer count
difference is the cost of one layer, free of the embedding, the loss and the optimizer.

- host: wall-clock of the forward and of the backward at micro-batch 1 and a short sequence,
  where the GPU finishes each kernel before the host queues the next one (the GPU time is printed
  next to it to show that), so the wall time is the host's.
- GPU: CUDA-event time of the same forward + backward at the preset's own micro-batch and
  sequence (the kernels' time per layer, which a host-bound step waits on).
- where the host time goes: one forward + backward under torch.profiler with its Python tracer;
  every event's self time (its duration minus its children's, per thread) is put into a category:
  Megatron's Python, megatron-adapt's Python, torch's Python (nn.Module call, autograd.Function
  apply), Triton's launcher, GEMM ops (cuBLAS launches), attention ops (cuDNN / flash launches),
  other aten ops, CUDA runtime calls (kernel launches, allocations), host syncs, and the autograd
  engine's own C++ (the backward thread's time that no event covers). The profiler slows Python
  down, so the categories are given as shares and scaled to the unprofiled host time.

Variants, each in its own process (one import state each), interleaved over --reps rounds:
  torch   megatron-adapt's default path (cuda backend, the TE spec it serves): eager calls of the
          norms, bias-GeLU, SwiGLU and bias-dropout-add take PyTorch's native ops
          (MEGATRON_ADAPT_EAGER_OPS=torch, the default)
  triton  the same with MEGATRON_ADAPT_EAGER_OPS=triton: those ops on our Triton kernels, each a
          Python autograd.Function (what they cost on the host against ops with no Python on their
          backward path)
  stock   no megatron-adapt: Megatron's local spec, unfused (pretrain_gpt.py's stock run)

Usage: python scripts/profile_layer_host.py --preset gpt2-350m --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict

PRESETS = {  # scripts/bench_e2e.sh's shapes (layers are chosen here)
    "llama-0.95b": dict(hidden=2048, ffn=5632, heads=16, seq=2048, mbs=4, vocab=32000, llama=True),
    "llama-350m": dict(hidden=1024, ffn=2816, heads=16, seq=1024, mbs=8, vocab=32000, llama=True),
    "llama-125m": dict(hidden=768, ffn=2048, heads=12, seq=1024, mbs=8, vocab=32000, llama=True),
    "gpt2-350m": dict(hidden=1024, ffn=4096, heads=16, seq=1024, mbs=8, vocab=50257, llama=False),
    "gpt2-125m": dict(hidden=768, ffn=3072, heads=12, seq=1024, mbs=8, vocab=50257, llama=False),
}
DEPTHS = (2, 6)
KERNELS = "GPU kernel time (not host; for comparison)"


def host_cpu():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        model = platform.processor()
    return f"{model}, {os.cpu_count()} vCPU"


# ---------------------------------------------------------------- one variant, in its own process
def build(variant, p, layers):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29577", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
    stock = variant == "stock"
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=p["hidden"], ffn_hidden_size=p["ffn"], num_attention_heads=p["heads"],
        normalization="RMSNorm" if p["llama"] else "LayerNorm", gated_linear_unit=p["llama"],
        activation_func=torch.nn.functional.silu if p["llama"] else torch.nn.functional.gelu,
        add_bias_linear=not p["llama"], bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
        bias_activation_fusion=not stock, bias_dropout_fusion=not stock,
        masked_softmax_fusion=not stock, persist_layer_norm=not stock, apply_rope_fusion=not stock,
        gradient_accumulation_fusion=not stock)
    if stock:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=cfg.normalization)
    else:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=p["vocab"],
                     max_sequence_length=p["seq"], position_embedding_type="rope" if p["llama"] else "learned_absolute",
                     share_embeddings_and_output_weights=not p["llama"]).cuda()
    model = Float16Module(cfg, model)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    return DistributedDataParallel(cfg, ddp, model)


def step_fn(model, mbs, seq, vocab):
    import torch
    tokens = torch.randint(0, vocab, (mbs, seq), device="cuda")
    labels = torch.randint(0, vocab, (mbs, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, -1)

    def forward():
        return model(tokens, pos, None, labels=labels).float().mean()

    return forward


def timed(model, mbs, seq, vocab, iters, warmup):
    """(host fwd ms, host bwd ms, GPU fwd+bwd ms) medians over `iters` after `warmup` steps."""
    import torch
    forward = step_fn(model, mbs, seq, vocab)
    fwd, bwd, gpu = [], [], []
    for i in range(warmup + iters):
        model.zero_grad_buffer()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
            gpu.append(e0.elapsed_time(e1))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return med(fwd), med(bwd), med(gpu)


def categorise(trace_path):
    """Self time (µs) per category from a chrome trace with Python events, per thread."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in
                  ("python_function", "cpu_op", "cuda_runtime", "user_annotation", "cuda_driver")]
        kernels = [e for e in json.load(open(trace_path))["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_tid = defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    totals = defaultdict(float)
    top = defaultdict(float)
    totals[KERNELS] = sum(e["dur"] for e in kernels)
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, self_t = [], {}
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_t[id(stack[-1])] -= min(e["dur"], stack[-1]["ts"] + stack[-1]["dur"] - e["ts"])
            self_t[id(e)] = e["dur"]
            stack.append(e)
        for e in evs:
            c = category(e)
            if c is None:
                continue
            totals[c] += max(self_t[id(e)], 0.0)
            top[e["name"][:110]] += max(self_t[id(e)], 0.0)
    return dict(totals), dict(sorted(top.items(), key=lambda kv: -kv[1])[:40])


def category(e):
    name, cat = e["name"], e["cat"]
    if cat == "python_function":
        n = name.replace("\\", "/")
        if "megatron_adapt/" in n or "/backends/" in n or "/patches/" in n:
            return "megatron-adapt Python"
        if "megatron/" in n:
            return "Megatron Python"
        if "triton/" in n:
            return "Triton launcher (Python)"
        if "torch/autograd" in n or "torch/nn/modules/module.py" in n:
            return "torch Python (Module call, autograd.Function)"
        if "torch/" in n:
            return "torch Python (other)"
        if "run_backward" in n or "_cuda_synchronize" in n:
            return None   # the main thread waiting for the backward thread / the GPU: not host work
        if n.startswith("<built-in") or "built-in" in n:
            return "Python -> C++ calls (bindings)"
        return "other Python"
    if cat in ("cuda_runtime", "cuda_driver"):
        low = name.lower()
        if "synchronize" in low or "memcpy" in low:
            return "host syncs and copies"
        if "launch" in low:
            return "CUDA kernel launches (runtime)"
        return "CUDA runtime (other: alloc, events)"
    if cat == "cpu_op":
        low = name.lower()
        if name.startswith("autograd::engine::evaluate_function"):
            return "autograd engine (C++)"
        if any(k in low for k in ("::mm", "addmm", "::bmm", "matmul", "::linear", "baddbmm")):
            return "GEMM ops (aten, cuBLAS)"
        if any(k in low for k in ("attention", "cudnn", "flash", "sdpa")):
            return "attention ops (aten, cuDNN/flash)"
        if any(k in low for k in ("item", "local_scalar", "nonzero", "synchronize")):
            return "host syncs and copies"
        if "backward" in low and not low.startswith("aten::"):
            return "autograd engine (C++)"
        return "other aten ops"
    return "other"


def profile(model, mbs, seq, vocab, path):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile
    forward = step_fn(model, mbs, seq, vocab)
    for _ in range(3):
        model.zero_grad_buffer()
        forward().backward()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        model.zero_grad_buffer()
        t0 = time.perf_counter()
        forward().backward()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    prof.export_chrome_trace(path)
    return wall


def kernel_time(model, mbs, seq, vocab, path):
    """GPU kernel time (ms) of one forward + backward at the preset's shape (CUDA activity only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile
    forward = step_fn(model, mbs, seq, vocab)
    model.zero_grad_buffer()
    forward().backward()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        model.zero_grad_buffer()
        forward().backward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    return sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") in
               ("kernel", "gpu_memcpy", "gpu_memset")) / 1e3


def run_variant(variant, preset, iters, warmup, workdir):
    if variant != "stock":
        os.environ["MEGATRON_ADAPT_AUTO"] = "0"
        os.environ["MEGATRON_ADAPT_BACKEND"] = "cuda"
        import megatron_adapt
        megatron_adapt.apply("cuda", eager_ops=variant)
    import torch
    p = PRESETS[preset]
    out = {"variant": variant, "depths": {}}
    for layers in DEPTHS:
        model = build(variant, p, layers)
        host = timed(model, 1, 128, p["vocab"], iters, warmup)
        real = timed(model, p["mbs"], p["seq"], p["vocab"], max(iters // 3, 3), 2)
        trace = os.path.join(workdir, f"trace_{variant}_{layers}.json")
        real_kernels_ms = kernel_time(model, p["mbs"], p["seq"], p["vocab"], trace)
        prof_wall = profile(model, 1, 128, p["vocab"], trace)
        out["depths"][layers] = dict(host_fwd_ms=host[0], host_bwd_ms=host[1], tiny_gpu_ms=host[2],
                                     real_host_fwd_ms=real[0], real_host_bwd_ms=real[1], real_gpu_ms=real[2],
                                     real_kernels_ms=real_kernels_ms,
                                     profiled_wall_ms=prof_wall)
        out["depths"][layers]["categories_us"], out["depths"][layers]["top_self_us"] = categorise(trace)
        os.remove(trace)
        del model
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- parent: the report
def per_layer(res):
    a, b = (res["depths"][str(d)] if str(d) in res["depths"] else res["depths"][d] for d in DEPTHS)
    n = DEPTHS[1] - DEPTHS[0]
    d = {k: (b[k] - a[k]) / n for k in ("host_fwd_ms", "host_bwd_ms", "tiny_gpu_ms", "real_gpu_ms", "real_kernels_ms",
                                         "profiled_wall_ms")}
    cats = {c: (b["categories_us"].get(c, 0.0) - a["categories_us"].get(c, 0.0)) / n
            for c in set(a["categories_us"]) | set(b["categories_us"])}
    return d, cats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-350m", choices=sorted(PRESETS))
    ap.add_argument("--variants", default="torch,triton,stock")
    ap.add_argument("--reps", type=int, default=2, help="rounds of the variants, interleaved")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._variant:
        res = run_variant(a._variant, a.preset, a.iters, a.warmup, os.path.dirname(a._out) or ".")
        with open(a._out, "w") as f:
            json.dump(res, f)
        return
    import torch
    info = dict(preset=a.preset, host=host_cpu(), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                depths=DEPTHS, host_shape="micro-batch 1, seq 128", runs=[])
    print(f"host: {info['host']}; GPU: {info['gpu']}; torch {info['torch']}; preset {a.preset}", flush=True)
    workdir = os.path.dirname(os.path.abspath(a.json)) if a.json else "."
    for rep in range(a.reps):
        for v in a.variants.split(","):
            out = os.path.join(workdir, f"_variant_{v}.json")
            t0 = time.time()
            r = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--iters", str(a.iters),
                                "--warmup", str(a.warmup), "--_variant", v, "--_out", out],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"variant {v} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}", flush=True)
                continue
            with open(out) as f:
                res = json.load(f)
            os.remove(out)
            res["round"] = rep
            d, cats = per_layer(res)
            res["per_layer"], res["per_layer_categories_us"] = d, cats
            info["runs"].append(res)
            kernel_us = cats.pop(KERNELS, 0.0)
            prof_total = sum(cats.values()) or 1.0
            host = d["host_fwd_ms"] + d["host_bwd_ms"]
            print(f"\n[{v}, round {rep}, {time.time() - t0:.0f} s] per layer: host fwd {d['host_fwd_ms'] * 1e3:.0f} µs"
                  f" + bwd {d['host_bwd_ms'] * 1e3:.0f} µs = {host * 1e3:.0f} µs; GPU at mb1/s128 "
                  f"{d['tiny_gpu_ms'] * 1e3:.0f} µs; at the preset's shape: GPU kernels {d['real_kernels_ms'] * 1e3:.0f} µs, "
                  f"elapsed {d['real_gpu_ms'] * 1e3:.0f} µs (host / GPU kernels {host / max(d['real_kernels_ms'], 1e-9):.2f}); "
                  f"profiled {d['profiled_wall_ms'] * 1e3:.0f} µs",
                  flush=True)
            for c, us in sorted(cats.items(), key=lambda kv: -kv[1]):
                print(f"    {c:48s} {100 * us / prof_total:5.1f} %  ~{us / prof_total * host * 1e3:6.0f} µs", flush=True)
            print(f"    (profiled host events {prof_total:.0f} µs; GPU kernels at mb1/s128 {kernel_us:.0f} µs per layer)")
            a_, b_ = (res["depths"][str(d)]["top_self_us"] for d in DEPTHS)
            tops = {k: (b_.get(k, 0.0) - a_.get(k, 0.0)) / (DEPTHS[1] - DEPTHS[0]) for k in b_}
            for k, us in sorted(tops.items(), key=lambda kv: -kv[1])[:12]:
                print(f"      top: {us:6.0f} µs  {k}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()

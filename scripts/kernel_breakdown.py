"""GPU kernel time of profiled training steps, by kind: where a step's GPU time goes.

Reads the Chrome trace(s) that torch.profiler writes (Megatron's `--profile --use-pytorch-profiler
--profile-step-start S --profile-step-end E --tensorboard-dir DIR` writes `DIR/*.pt.trace.json` on
core 0.16, `DIR/../torch_profile/rank-N.json.gz` on core 0.19: pass the folder above both) and
sums every GPU kernel's duration by category (kernel names; inside CUDA graphs the kernels keep their
names but not the op that launched them, so names are all there is), plus the top kernels by time and
the GPU-busy time (union of kernel intervals) against the traced wall span, and the idle time
between them by gap length: short gaps are launch latency between dependent kernels (inside CUDA
graphs too), long ones the GPU waiting on the host; the longest are listed with the host ops
(cpu_op / user_annotation / python_function events) that span them.

    python scripts/kernel_breakdown.py DIR_OR_TRACE [--steps N] [--json OUT.json] [--top 40]

`--steps` divides by the number of profiled steps, giving ms per step.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from collections import defaultdict

# first match wins; order matters (fp8 GEMMs before GEMMs, our Triton kernels before elementwise)
CATEGORIES = [
    # cuBLASLt's nvjet kernels name their operand types: nvjet_sm90_qq... (e4m3 x e4m3), _qr...
    # (e4m3 x e5m2), _tst / _tss (bf16)
    ("gemm fp8", r"(e4m3|e5m2|f8f8|fp8|nvjet_sm\d+_q|qgmma|Float8)"),
    ("attention", r"(flash|fmha|cudnn|sdpa|attn|attention)"),   # cuDNN's SDPA kernels say wgmma too
    ("gemm", r"(gemm|nvjet|cutlass|xmma|cublas|s16816|s1688|wgmma|splitK|splitk)"),
    ("fp8 casts (Triton)", r"(_cast|_amax|_quant|_rows_kernel|_group_columns|_scale)"),
    ("fp8 amax (torch reduce)", r"(AbsMaxOps)"),
    ("norms", r"(norm)"),
    ("optimizer", r"(multi_tensor|adam|Adam)"),
    ("nccl", r"(nccl)"),
    ("cross entropy / softmax", r"(cross_entropy|softmax|log_softmax|nll)"),
    ("rope", r"(rope|rotary)"),
    ("activations", r"(swiglu|silu|gelu|glu)"),
    ("other Triton", r"^(triton_|_)"),
    ("reductions", r"(reduce|Reduce|sum_|norm_kernel)"),
    ("elementwise / copies", r"(elementwise|vectorized|unrolled|copy|Copy|fill|Fill|cat_|index|gather|scatter)"),
]


# core 0.16 (tensorboard_trace_handler): DIR/*.pt.trace.json; core 0.19: DIR/../torch_profile/rank-N.json.gz
TRACE_PATTERNS = ("*.pt.trace.json*", "rank-*.json.gz")


def _category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


GAP_BUCKETS_US = (5, 20, 100, 1000)   # idle gaps: < 5 us, 5-20, 20-100, 100 us - 1 ms, >= 1 ms
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def _gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The idle stretches between the union of the busy intervals."""
    out, end = [], None
    for s, e in sorted(intervals):
        if end is not None and s > end:
            out.append((end, s))
        end = e if end is None else max(end, e)
    return out


def _gap_summary(gaps, host, steps, longest):
    labels = [f"< {GAP_BUCKETS_US[0]} us"] + [f"{a}-{b} us" for a, b in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:])] \
        + [f">= {GAP_BUCKETS_US[-1]} us"]
    sums, counts = [0.0] * len(labels), [0] * len(labels)
    for s, e in gaps:
        i = sum((e - s) >= b for b in GAP_BUCKETS_US)
        sums[i] += e - s
        counts[i] += 1
    listed = []
    for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:longest]:
        spanning = sorted((d, n) for ts, d, n in host if ts <= e and ts + d >= s)
        names = []
        for _, n in spanning:    # innermost (shortest) first
            if n not in names:
                names.append(n[:80])
        listed.append({"us": round(e - s, 1), "host_ops": names[:5]})
    return {"ms_per_step": {lab: round(v / 1000.0 / steps, 3) for lab, v in zip(labels, sums)},
            "count_per_step": {lab: c / steps for lab, c in zip(labels, counts)}, "longest": listed}


def breakdown(paths: list[str], steps: int, top: int) -> dict:
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    intervals, host = [], []
    for path in paths:
        for ev in _load(path).get("traceEvents", []):
            if ev.get("ph") == "X" and ev.get("cat") in HOST_CATS:
                host.append((float(ev.get("ts", 0)), float(ev.get("dur", 0)), ev.get("name", "")))
            if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            name, dur, ts = ev.get("name", ""), float(ev.get("dur", 0)), float(ev.get("ts", 0))
            cat = _category(name) if ev["cat"] == "kernel" else ev["cat"]
            by_cat[cat] += dur
            by_name[name][0] += dur
            by_name[name][1] += 1
            intervals.append((ts, ts + dur))
    if not intervals:
        raise SystemExit(f"no GPU kernels in {paths}")
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    kernel_total = sum(by_cat.values())
    ms = lambda us: round(us / 1000.0 / steps, 3)   # noqa: E731
    return {
        "traces": [os.path.basename(p) for p in paths],
        "steps": steps,
        "span_ms_per_step": ms(span),
        "gpu_busy_ms_per_step": ms(_busy(intervals)),
        "kernel_ms_per_step": ms(kernel_total),
        "idle_gaps": _gap_summary(_gaps(intervals), host, steps, 12),
        "categories_ms_per_step": {k: ms(v) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:160], "category": _category(n), "ms_per_step": ms(v[0]), "calls_per_step": v[1] / steps}
            for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", help="a trace file, or a directory holding *.pt.trace.json[.gz]")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    paths = [args.path] if os.path.isfile(args.path) else sorted(
        p for pattern in TRACE_PATTERNS for p in glob.glob(os.path.join(args.path, "**", pattern), recursive=True))
    if not paths:
        raise SystemExit(f"no {' or '.join(TRACE_PATTERNS)} under {args.path}")
    out = breakdown(paths, args.steps, args.top)
    print(f"{'category':28s} ms/step   share")
    for k, v in out["categories_ms_per_step"].items():
        print(f"{k:28s} {v:8.2f}  {100 * v / out['kernel_ms_per_step']:5.1f} %")
    print(f"kernels {out['kernel_ms_per_step']} ms/step, GPU busy {out['gpu_busy_ms_per_step']} of "
          f"{out['span_ms_per_step']} ms traced per step")
    gaps = out["idle_gaps"]
    print("idle between kernels, by gap: " + ", ".join(
        f"{lab} {v} ms ({gaps['count_per_step'][lab]:.0f})" for lab, v in gaps["ms_per_step"].items()))
    for g in gaps["longest"]:
        print(f"  gap {g['us']:9.1f} us  host: {' < '.join(g['host_ops'])}")
    for k in out["top_kernels"][:args.top]:
        print(f"  {k['ms_per_step']:8.2f} ms {k['calls_per_step']:7.0f}x  [{k['category']}] {k['name'][:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

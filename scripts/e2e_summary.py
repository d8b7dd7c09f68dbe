"""Summarise scripts/bench_e2e.sh logs: ms/iteration, TFLOP/s per GPU, MFU, peak memory, GPU busy
fraction (nvidia-smi dmon SM %), the host CPU model, loss curves."""
import argparse
import json
import re
import statistics
from pathlib import Path

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                  r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+))?.*?lm loss: ([0-9.E+-]+)")
MEM = re.compile(r"memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+) \| "
                 r"reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")


def gpu_busy(dmon: Path):
    """Median SM busy % over the steady part of a run: the samples between the first and the last
    one >= 30 % (start-up, compilation and exit excluded), their first quarter dropped (warm-up,
    graph capture). None without samples."""
    if not dmon.exists():
        return None
    sm = []
    for line in dmon.read_text(errors="replace").splitlines():
        parts = line.split()
        if parts and not line.startswith("#") and len(parts) > 1 and parts[1].isdigit():
            sm.append(int(parts[1]))
    busy = [i for i, v in enumerate(sm) if v >= 30]
    if len(busy) < 4:
        return None
    window = sm[busy[0]:busy[-1] + 1]
    return statistics.median(window[len(window) // 4:]) / 100.0


def parse(log: Path, warmup: int, peak: float) -> dict:
    text = log.read_text(errors="replace")
    rows = {int(i): (float(ms), float(tf) if tf else None, float(loss)) for i, ms, tf, loss in ITER.findall(text)}
    if not rows:
        raise SystemExit(f"{log}: no iterations logged; tail:\n{text[-3000:]}")
    steady = [rows[i] for i in sorted(rows) if i > warmup]
    ms = statistics.median(r[0] for r in steady)
    tflops = [r[1] for r in steady if r[1] is not None]
    tf = statistics.median(tflops) if tflops else None
    mem = MEM.findall(text)
    smi = Path(f"{log}.smi_peak_mib")
    return {
        "iterations": len(rows), "ms_per_iter": ms, "tflops_per_gpu": tf,
        "mfu": tf / peak if tf else None,
        "max_allocated_gb": max(float(m[1]) for m in mem) / 1024 if mem else None,
        "max_reserved_gb": max(float(m[3]) for m in mem) / 1024 if mem else None,
        "smi_peak_gb": int(smi.read_text()) / 1024 if smi.exists() else None,
        "gpu_busy": gpu_busy(Path(f"{log}.dmon")),
        "cuda_graphs": bool(re.search(r"built \d+ cuda graph|\d+ CUDA graphs built|CUDA graph capture done for training", text)),
        "losses": {i: rows[i][2] for i in sorted(rows)},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    out = Path(a.outdir)
    res = {r: parse(out / f"{r}.log", a.warmup, a.peak_tflops) for r in a.runs}
    host = (out / "host_cpu.txt").read_text().strip() if (out / "host_cpu.txt").exists() else "unknown"
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else "unknown"
    preset = (out / "preset.txt").read_text().strip() if (out / "preset.txt").exists() else "llama-0.95b"
    print(f"preset: {preset} | GPU: {gpu} | host CPU: {host}")
    base = res.get("stock", {}).get("ms_per_iter")
    print(f"{'run':13} {'ms/iter':>9} {'vs stock':>8} {'TFLOP/s/GPU':>12} {'MFU':>7} {'GPU busy':>9} {'graphs':>6} "
          f"{'max alloc GB':>13} {'max resv GB':>12} {'smi peak GB':>12}")
    for r, v in res.items():
        f = lambda x, fmt: format(x, fmt) if x is not None else "-"
        v["speedup_vs_stock"] = base / v["ms_per_iter"] if base else None
        v["host_cpu"], v["gpu"], v["preset"] = host, gpu, preset
        print(f"{r:13} {v['ms_per_iter']:9.1f} {f(v['speedup_vs_stock'], '7.2f')}x {f(v['tflops_per_gpu'], '12.1f')} "
              f"{f(v['mfu'] and 100 * v['mfu'], '6.1f')}% {f(v['gpu_busy'] and 100 * v['gpu_busy'], '8.0f')}% "
              f"{'yes' if v['cuda_graphs'] else 'no':>6} "
              f"{f(v['max_allocated_gb'], '13.2f')} {f(v['max_reserved_gb'], '12.2f')} {f(v['smi_peak_gb'], '12.2f')}")
    if {"adapt", "adapt_graphs"} <= set(res):  # how much of the default step waits on the host
        ratio = res["adapt"]["ms_per_iter"] / res["adapt_graphs"]["ms_per_iter"]
        print(f"adapt / adapt_graphs: {ratio:.2f}x (defaults' time over --cuda-graph-impl local's)")
    if {"adapt_eager", "adapt_graphs"} <= set(res):  # the eager step against graphs (MEGATRON_ADAPT_CUDA_GRAPHS=off)
        ratio = res["adapt_eager"]["ms_per_iter"] / res["adapt_graphs"]["ms_per_iter"]
        print(f"adapt_eager / adapt_graphs: {ratio:.2f}x (eager time over --cuda-graph-impl local's)")
    if {"adapt_eager", "adapt"} <= set(res):
        ratio = res["adapt"]["ms_per_iter"] / res["adapt_graphs" if "adapt_graphs" in res else "adapt_eager"]["ms_per_iter"]
        print(f"adapt (defaults, graphs={res['adapt'].get('cuda_graphs')}) / "
              f"{'adapt_graphs' if 'adapt_graphs' in res else 'adapt_eager'}: {ratio:.2f}x")
    if {"stock", "adapt"} <= set(res):
        s, b = res["stock"], res["adapt"]
        common = sorted(set(s["losses"]) & set(b["losses"]))
        diffs = [abs(s["losses"][i] - b["losses"][i]) for i in common]
        summary = {
            "speedup_ms": s["ms_per_iter"] / b["ms_per_iter"],
            "tflops_ratio": (b["tflops_per_gpu"] / s["tflops_per_gpu"]) if s["tflops_per_gpu"] and b["tflops_per_gpu"] else None,
            "max_allocated_ratio": (b["max_allocated_gb"] / s["max_allocated_gb"]) if s["max_allocated_gb"] and b["max_allocated_gb"] else None,
            "smi_peak_ratio": (b["smi_peak_gb"] / s["smi_peak_gb"]) if s["smi_peak_gb"] and b["smi_peak_gb"] else None,
            "loss_max_abs_diff": max(diffs), "loss_mean_abs_diff": sum(diffs) / len(diffs),
            "loss_first_last": {"stock": (s["losses"][common[0]], s["losses"][common[-1]]),
                                "adapt": (b["losses"][common[0]], b["losses"][common[-1]])},
        }
        res["comparison"] = summary
        print(json.dumps(summary, indent=1))
        print("iteration  stock_loss  adapt_loss")
        for i in common:
            print(f"{i:9d}  {s['losses'][i]:.5f}  {b['losses'][i]:.5f}")
    (out / "e2e_summary.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Plots for docs/benchmarks.md, made from the raw figures in docs/results/*.json and nothing else.

    python3 scripts/plot_benchmarks.py                 # writes docs/plots/*.png
    python3 scripts/plot_benchmarks.py --out DIR       # somewhere else
    python3 scripts/plot_benchmarks.py --results DIR   # other JSON files of the same layout

Runs on the CPU in a few seconds; needs matplotlib (`pip install matplotlib`, or `pip install -e ".[test]"`).
Every figure is a JSON file's own numbers: speed-up = the call's stock ms / iteration over the run's,
losses are the per-iteration `lm loss` each run printed. What the script adds is only the labels below
(date of the commit that added the file, GPU, host CPU, Megatron-LM tag), copied from
docs/benchmarks.md's index.
"""
import argparse
import decimal
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as exc:  # pragma: no cover - exercised by hand
    sys.exit(f"plot_benchmarks.py needs matplotlib ({exc}). Install it with `pip install matplotlib` "
             f"(or `pip install -e \".[test]\"`), then run it again.")

# The PNGs this script writes; tests/test_plot_benchmarks.py checks each one.
PLOTS = (
    "speedup_dense_095b.png",
    "speedup_moe.png",
    "speedup_small_presets.png",
    "speedup_core016_vs_core019.png",
    "loss_095b_headline.png",
    "loss_095b_dropout0.png",
    "loss_095b_core019_full_iteration.png",
    "loss_095b_50_iterations.png",
    "loss_moe.png",
    "host_cost_ratio.png",
    "megatron_unit_tests.png",
    "loss_095b_fp8_vs_bf16.png",
    "loss_095b_fp8_vs_bf16_graphs.png",
)

# Run names as the JSON files have them -> legend label and colour.
RUN_STYLE = {
    "stock": ("stock (local + flags)", "#7f7f7f"),
    "stock_full_graph": ("stock + full_iteration graph", "#bcbd22"),
    "adapt": ("megatron-adapt, defaults", "#1f77b4"),
    "adapt_off": ("megatron-adapt, defaults, EXTERNAL=off", "#17becf"),
    "adapt_graphs": ("megatron-adapt + --cuda-graph-impl local", "#ff7f0e"),
    "adapt_graphs_off": ("megatron-adapt + graphs, EXTERNAL=off", "#d62728"),
    "adapt_full_graph": ("megatron-adapt + full_iteration graph", "#2ca02c"),
}


def fmt(x, places=None):
    """A JSON figure as stored (medians of two samples end in .x5: 448.45 stays 448.45), or a
    derived ratio rounded half-up to `places` decimals."""
    if places is None:
        return f"{float(x):.2f}".rstrip("0").rstrip(".")
    q = decimal.Decimal(1).scaleb(-places)
    return str(decimal.Decimal(repr(float(x))).quantize(q, rounding=decimal.ROUND_HALF_UP))


def load(results, name):
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def is_run(v):
    return isinstance(v, dict) and "ms_per_iter" in v


def runs_of(results, name, part=None):
    """{run name: run dict} of one JSON file, whatever its layout."""
    d = load(results, name)
    if name == "e2e_h100_bias_dropout_add.json":
        d = d["headline_same_call"]["summary"]
    elif name == "e2e_h100_core019_bias_dropout_add.json":
        d = d["summary"]
    elif name == "e2e_h100_fa4_dropout0.json":
        runs = dict(d["external_auto_fa4"])
        runs["adapt_off"] = d["external_off"]["adapt"]
        runs["adapt_graphs_off"] = d["external_off"]["adapt_graphs"]
        d = runs
    elif part is not None:
        d = d[part]
    return {k: v for k, v in d.items() if is_run(v)}


def losses(run):
    items = sorted((int(k), float(v)) for k, v in run["losses"].items())
    return [i for i, _ in items], [x for _, x in items]


# ---- speed-up ----------------------------------------------------------------------------------

# (file, part of the file or None, label: date / commit, GPU, host, Megatron-LM, what)
DENSE_CALLS = (
    ("e2e_h100.json", None, "2026-11-21 957518a  H100, host not recorded\ncore_v0.16.1, 50 it."),
    ("e2e_h200.json", None, "2026-11-21 957518a  H200, host not recorded\ncore_v0.16.1, 50 it."),
    ("e2e_h100_core019.json", None, "2026-11-24 d46674c  H100, 16 vCPU\ncore_v0.19.0, 50 it."),
    ("e2e_h100_graphs.json", None, "2026-11-24 2438f54  H100, 16 vCPU\ncore_v0.16.1, 30 it."),
    ("e2e_h100_fa4_dropout0.json", None,
     "2026-11-24 8e18d15  H100, 16 vCPU\ncore_v0.16.1, dropout 0, FA4 installed"),
    ("e2e_h100_bias_dropout_add.json", None, "2026-11-24 0fd5507  H100, 4 vCPU\ncore_v0.16.1, 30 it."),
    ("e2e_h100_core019_bias_dropout_add.json", None, "2026-11-24 f14831a  H100, 4 vCPU\ncore_v0.19.0, 20 it."),
    ("e2e_h100_core019_full_iteration.json", None, "2026-11-24 8baab7e  H100, 4 vCPU\ncore_v0.19.0, 25 it."),
    ("e2e_h100_host_trim.json", None, "2026-11-24 b317278  H100, 4 vCPU\ncore_v0.16.1, 30 it. (README headline)"),
)
MOE_CALLS = (
    ("moe_h100.json", None, "2026-11-24 f50b6a1  H100, 16 vCPU\ncore_v0.16.1, 25 it."),
    ("moe_h100_core019.json", None, "2026-11-24 15c27ef  H100, 16 vCPU\ncore_v0.19.0, 20 it. (before the expert-grad fix)"),
    ("moe_h100_core016_core019_same_call.json", "core_v0.16.1", "2026-11-24 301bd87  H100, 4 vCPU\ncore_v0.16.1, 20 it. (same call)"),
    ("moe_h100_core016_core019_same_call.json", "core_v0.19.0", "2026-11-24 301bd87  H100, 4 vCPU\ncore_v0.19.0, 20 it. (same call)"),
)
SMALL_CALLS = (
    ("e2e_h100_gpt2_350m.json", None, "2026-11-25  H100, 16 vCPU\ngpt2-350m, default dropout"),
    ("e2e_h100_gpt2_125m_dropout0.json", None, "2026-11-25  H100, 16 vCPU\ngpt2-125m, dropout 0"),
    ("e2e_h100_llama_350m.json", None, "2026-11-25  H100, 16 vCPU\nllama-350m, default dropout"),
    ("e2e_h100_llama_125m.json", None, "2026-11-25  H100, 16 vCPU\nllama-125m, default dropout"),
)
ORDER = ("adapt", "adapt_off", "adapt_graphs", "adapt_graphs_off", "adapt_full_graph", "stock_full_graph")


def speedup_chart(results, calls, title, path):
    rows = []  # (call label or None, run, speed-up, ms)
    for name, part, label in calls:
        runs = runs_of(results, name, part)
        stock = runs["stock"]["ms_per_iter"]
        first = True
        for r in ORDER:
            if r in runs:
                ms = runs[r]["ms_per_iter"]
                rows.append((label if first else None, r, stock / ms, ms, stock))
                first = False
        rows.append(None)  # gap between calls
    rows = rows[:-1]
    fig_h = 1.6 + 0.32 * len(rows)
    fig, ax = plt.subplots(figsize=(11, fig_h))
    ys, ticks, ticklabels, seen = [], [], [], set()
    y = 0
    for row in rows:
        y -= 1
        if row is None:
            continue
        label, r, sp, ms, stock = row
        name, colour = RUN_STYLE[r]
        ax.barh(y, sp, color=colour, height=0.8, label=None if r in seen else name)
        seen.add(r)
        ax.text(sp + 0.02, y, f"{fmt(sp, 2)}×  ({fmt(ms)} vs {fmt(stock)} ms)", va="center", fontsize=8)
        if label is not None:
            ticks.append(y)
            ticklabels.append(label)
        ys.append(y)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.text(1.0, min(ys) - 0.75, " stock = 1×", fontsize=8, va="bottom")
    ax.set_yticks(ticks)
    ax.set_yticklabels(ticklabels, fontsize=8)
    ax.set_ylim(min(ys) - 0.8, 0.6)
    xmax = max(r[2] for r in rows if r) + 0.9
    ax.set_xlim(0, xmax)
    ax.set_xlabel("speed-up over stock Megatron-LM in the same call (stock ms / run ms, ×)")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.35 / fig_h, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def core_chart(results, path):
    """ms / iteration, megatron-core 0.16 against 0.19, where the files have both."""
    panels = (
        ("MoE GPT (16 layers, 8 experts top-2), one call\n2026-11-24 301bd87, H100, 4-vCPU host",
         [("core_v0.16.1", runs_of(results, "moe_h100_core016_core019_same_call.json", "core_v0.16.1")),
          ("core_v0.19.0", runs_of(results, "moe_h100_core016_core019_same_call.json", "core_v0.19.0"))]),
        ("0.95B dense GPT, two calls of one day (not the same call)\nH100, 4-vCPU host",
         [("core_v0.16.1\n(b317278)", runs_of(results, "e2e_h100_host_trim.json")),
          ("core_v0.19.0\n(f14831a)", runs_of(results, "e2e_h100_core019_bias_dropout_add.json"))]),
        ("0.95B dense GPT, two calls of one day (not the same call)\nH100, 16-vCPU host",
         [("core_v0.16.1\n(2438f54)", runs_of(results, "e2e_h100_graphs.json")),
          ("core_v0.19.0\n(d46674c)", runs_of(results, "e2e_h100_core019.json"))]),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 5.4))
    shown = {}
    for ax, (title, groups) in zip(axes, panels):
        names = [r for r in ("stock",) + ORDER if any(r in g for _, g in groups)]
        width = 0.8 / len(names)
        for j, r in enumerate(names):
            xs, hs, stocks = [], [], []
            for i, (_, g) in enumerate(groups):
                if r in g:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    hs.append(g[r]["ms_per_iter"])
                    stocks.append(g["stock"]["ms_per_iter"])
            label, colour = RUN_STYLE[r]
            shown[label] = ax.bar(xs, hs, width=width, color=colour, label=label)
            for x, h, st in zip(xs, hs, stocks):
                text = fmt(h) if r == "stock" else f"{fmt(h)}\n{fmt(st / h, 2)}×"
                ax.text(x, h, text, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([g for g, _ in groups], fontsize=9)
        ax.set_ylabel("ms / iteration (median of steady iterations)")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max(v["ms_per_iter"] for _, g in groups for v in g.values()) * 1.15)
    fig.suptitle("megatron-core 0.16 against 0.19: ms per iteration (lower is better) and speed-up over "
                 "stock in the same call", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.legend(list(shown.values()), list(shown), loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- loss curves -------------------------------------------------------------------------------

def loss_chart(results, name, title, path, part=None, note=None, labels=None, band=None):
    runs = runs_of(results, name, part)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    xs0, stock = losses(runs["stock"])
    for r in ("stock",) + ORDER:
        if r not in runs:
            continue
        label, colour = RUN_STYLE[r]
        label = (labels or {}).get(r, label)
        xs, ys = losses(runs[r])
        style = dict(color=colour, lw=2.2 if r == "stock" else 1.4,
                     ls="-" if r in ("stock", "adapt", "adapt_graphs") else "--")
        top.plot(xs, ys, label=label, marker="o", ms=2.5, **style)
        if r != "stock":
            n = min(len(xs), len(xs0))
            diff = [ys[i] - stock[i] for i in range(n)]
            mx = max(abs(v) for v in diff)
            bottom.plot(xs[:n], diff, label=f"{label}: max |Δ| {mx:.4f}", marker="o", ms=2.5, **style)
    top.set_yscale("log")
    top.set_ylabel("lm loss (log scale)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    top.grid(alpha=0.3, which="both")
    bottom.axhline(0, color="black", lw=0.8)
    if band:
        for b in (-band, band):
            bottom.axhline(b, color="red", lw=1, ls=":")
    bottom.set_ylabel("run − stock (lm loss)")
    bottom.set_xlabel("iteration")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    if note:
        bottom.set_title(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def moe_loss_chart(results, path):
    panels = (
        ("moe_h100.json", None, "2026-11-24 f50b6a1, H100, 16 vCPU, core_v0.16.1"),
        ("moe_h100_core016_core019_same_call.json", "core_v0.16.1", "2026-11-24 301bd87, H100, 4 vCPU, core_v0.16.1"),
        ("moe_h100_core016_core019_same_call.json", "core_v0.19.0", "2026-11-24 301bd87, H100, 4 vCPU, core_v0.19.0"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
    for ax, (name, part, label) in zip(axes, panels):
        runs = runs_of(results, name, part)
        for r in ("stock", "adapt"):
            xs, ys = losses(runs[r])
            lab, colour = RUN_STYLE[r]
            ax.plot(xs, ys, color=colour, marker="o", ms=2.5, lw=2.0 if r == "stock" else 1.4, label=lab)
        ax.set_title(f"{name}\n{label}", fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("lm loss")
    fig.suptitle("MoE GPT (16 layers, hidden 2048, 8 experts top-2), bf16, Megatron's default dropout: "
                 "stock against megatron-adapt", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- host cost and unit tests ------------------------------------------------------------------

def host_cost_chart(results, path):
    d = load(results, "host_cost_h100_interleaved.json")
    order = ("before_1", "before_2", "after_1", "after_2")
    colours = {"before_1": "#aec7e8", "before_2": "#6baed6", "after_1": "#fdae6b", "after_2": "#e6550d"}
    ratios = {}  # op -> {run: ours / PyTorch's op, forward + backward (forward only where no backward)}
    for run in order:
        rows = d["runs"][run]["rows"]
        by_op = {}
        for row in rows:
            by_op.setdefault(row["op"], []).append(row)
        for op, rs in by_op.items():
            ours = next(r for r in rs if r["variant"] == "ours")
            torch_rows = [r for r in rs if r["variant"].startswith("torch") and "compile" not in r["variant"]]
            if not torch_rows:
                continue
            ref = torch_rows[0]
            key = "fwd_bwd_host_us" if "fwd_bwd_host_us" in ours else "fwd_host_us"
            suffix = "" if key == "fwd_bwd_host_us" else " (fwd only)"
            ratios.setdefault(op + suffix, {})[run] = ours[key] / ref[key]
    ops = list(ratios)
    fig, ax = plt.subplots(figsize=(11, 6))
    width = 0.2
    for j, run in enumerate(order):
        xs = [i + (j - 1.5) * width for i in range(len(ops))]
        ax.bar(xs, [ratios[op].get(run, float("nan")) for op in ops], width=width, color=colours[run],
               label=run.replace("_", ", run "))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.5, color="red", lw=1, ls="--", label="1.5× target")
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("host time, ours ÷ PyTorch's op (×, best turn)")
    ax.set_title("Host cost per call, forward + backward, tiny shapes: H100 80GB HBM3, host Intel(R) Xeon(R) "
                 "Processor 4 vCPU\n(host_cost_h100_interleaved.json, 2026-11-24 36fc529; before = 8baab7e's "
                 "backends, after = 34bb20c's)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def unit_test_chart(results, path):
    cpu = load(results, "megatron_unit_tests_cpu_tags.json")["runs"]
    gpu = load(results, "megatron_unit_tests_h100_tags.json")["runs"]
    groups = [(f"{tag}\ncuda, H100", gpu[tag]["total"]) for tag in sorted(gpu)]
    groups += [(f"{tag}\ncpu, 2 proc.", cpu[tag]["total"]) for tag in sorted(cpu)]
    groups.sort(key=lambda g: g[0])
    fig, ax = plt.subplots(figsize=(11, 4.8))
    xs = range(len(groups))
    bottom = [0] * len(groups)
    for key, colour in (("passed", "#2ca02c"), ("failed", "#d62728"), ("error", "#9467bd"),
                        ("skipped", "#c7c7c7")):
        hs = [g[1][key] for g in groups]
        ax.bar(xs, hs, bottom=bottom, color=colour, label=key)
        for x, b, h in zip(xs, bottom, hs):
            if h:
                ax.text(x, b + h / 2, str(h), ha="center", va="center", fontsize=8)
        bottom = [b + h for b, h in zip(bottom, hs)]
    ax.set_xticks(list(xs))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.set_ylabel("tests (Megatron-LM's 16 unit-test files)")
    ax.set_title("Megatron-LM's own unit tests under megatron-adapt, no Transformer Engine "
                 "(stock without TE: 0 pass)\ncuda: megatron_unit_tests_h100_tags.json (H100, 4-vCPU host); "
                 "cpu: megatron_unit_tests_cpu_tags.json (2-core development machine)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fp8_loss_chart(results, name, title, path, key=None):
    """A parity JSON as scripts/fp8_loss_parity.py wrote it (under `key` where the file wraps it):
    bf16's losses and each fp8 recipe's."""
    d = load(results, name)
    d = d[key] if key else d
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = sorted(int(k) for k in d["bf16"])
    ax.plot(xs, [float(d["bf16"][str(i)]) for i in xs], label="bf16", lw=1.5, color="#1f77b4")
    for (label, run), color in zip(sorted(d["fp8"].items()), ("#d62728", "#2ca02c", "#ff7f0e")):
        xs = sorted(int(k) for k in run["losses"])
        ax.plot(xs, [float(run["losses"][str(i)]) for i in xs], lw=1, color=color,
                label=f"fp8 {label}: mean |Δ| over the last {d['last']} = {run['mean_abs_diff_last']:.4f} "
                      f"(bound {d['tol']})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(REPO, "docs", "results"), help="folder of the JSON files")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "plots"), help="folder for the PNG files")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    res, out = args.results, (lambda n: os.path.join(args.out, n))

    speedup_chart(res, DENSE_CALLS, "0.95B llama-like GPT, one GPU, bf16: speed-up over stock Megatron-LM\n"
                  "(each call against its own stock run; label: commit date and hash, GPU, host CPU, Megatron-LM tag)", out("speedup_dense_095b.png"))
    speedup_chart(res, MOE_CALLS, "MoE GPT (16 layers, hidden 2048, 8 experts top-2), one H100, bf16:\n"
                  "speed-up over stock (local, no grouped GEMM) in the same call", out("speedup_moe.png"))
    speedup_chart(res, SMALL_CALLS, "Small presets (scripts/bench_e2e.sh PRESET=...), one H100, bf16, core_v0.16.1:\n"
                  "speed-up over stock; the defaults are host-bound, Megatron's CUDA graphs are not", out("speedup_small_presets.png"))
    core_chart(res, out("speedup_core016_vs_core019.png"))
    loss_chart(res, "e2e_h100_host_trim.json",
               "0.95B GPT, README headline call: e2e_h100_host_trim.json (2026-11-24 b317278), H100 80GB HBM3, "
               "4-vCPU host,\ncore_v0.16.1, Megatron's default dropout (each run draws its own dropout masks)",
               out("loss_095b_headline.png"))
    loss_chart(res, "e2e_h100_fa4_dropout0.json",
               "0.95B GPT, dropout 0 (--attention-dropout 0 --hidden-dropout 0): e2e_h100_fa4_dropout0.json "
               "(2026-11-24 8e18d15),\nH100 80GB HBM3, 16-vCPU host, core_v0.16.1; FA4 installed, then "
               "MEGATRON_ADAPT_EXTERNAL=off", out("loss_095b_dropout0.png"),
               note="without dropout the curves agree: red dotted lines = ±0.02, the tolerance stated for bf16",
               band=0.02, labels={"adapt": "megatron-adapt, defaults (FA4 chosen for attention)",
                                  "adapt_graphs": "megatron-adapt + graphs (FA4 chosen)"})
    loss_chart(res, "e2e_h100_core019_full_iteration.json",
               "0.95B GPT, CUDA graph scopes: e2e_h100_core019_full_iteration.json (2026-11-24 8baab7e), "
               "H100 80GB HBM3, 4-vCPU host,\ncore_v0.19.0, Megatron's default dropout",
               out("loss_095b_core019_full_iteration.png"))
    loss_chart(res, "e2e_h100.json",
               "0.95B GPT, 50 iterations: e2e_h100.json (2026-11-21 957518a), H100 80GB HBM3 (host not "
               "recorded), core_v0.16.1,\nMegatron's default dropout", out("loss_095b_50_iterations.png"))
    moe_loss_chart(res, out("loss_moe.png"))
    host_cost_chart(res, out("host_cost_ratio.png"))
    unit_test_chart(res, out("megatron_unit_tests.png"))
    fp8_loss_chart(res, "fp8_parity_h100.json",
                   "0.95B GPT, fp8 vs bf16, same data and initial weights: fp8_parity_h100.json\n"
                   "(2026-11-25, H100 80GB HBM3, 32-vCPU host, core_v0.16.1; scripts/fp8_loss_parity.py)",
                   out("loss_095b_fp8_vs_bf16.png"))
    fp8_loss_chart(res, "fp8_graphs_parity_h200.json",
                   "0.95B GPT, fp8 vs bf16, both inside Megatron's CUDA graphs: fp8_graphs_parity_h200.json\n"
                   "(2026-11-26, H200, 16-vCPU host, core_v0.16.1; scripts/fp8_loss_parity.py)",
                   out("loss_095b_fp8_vs_bf16_graphs.png"), key="parity")
    for name in PLOTS:
        print(out(name))


if __name__ == "__main__":
    main()

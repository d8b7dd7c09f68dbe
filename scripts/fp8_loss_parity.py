"""fp8 against bf16 loss curves of the same model, data and initial weights (issue 23, item 3):
the mean |Δ loss| over the last N iterations (default 20) of each fp8 run against the bf16 run,
PASS at <= --tol (0.05), and one plot of the curves.

Usage (logs written by scripts/bench_e2e.sh: adapt.log for bf16, adapt_fp8.log for fp8):
  python3 scripts/fp8_loss_parity.py --bf16 OUT_A/adapt.log \
      --fp8 tensorwise=OUT_A/adapt_fp8.log --fp8 delayed=OUT_B/adapt_fp8.log --out OUT/fp8_parity
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_summary import parse  # noqa: E402


def losses(log):
    return {int(i): v for i, v in parse(Path(log), 0, 989.0)["losses"].items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", required=True)
    ap.add_argument("--fp8", action="append", required=True, help="LABEL=path/to/adapt_fp8.log")
    ap.add_argument("--last", type=int, default=20)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.png")
    ap.add_argument("--model", default="0.95B model", help="the plot title's model name")
    ap.add_argument("--bf16-rerun", help="a second bf16 log of the same command: its mean |Δ| against "
                                         "--bf16 is the run-to-run spread the fp8 figures compare with")
    a = ap.parse_args(argv)
    base = losses(a.bf16)
    result, ok = {"bf16": base, "last": a.last, "tol": a.tol, "fp8": {}}, True
    if a.bf16_rerun:
        again = losses(a.bf16_rerun)
        tail = sorted(set(base) & set(again))[-a.last:]
        spread = sum(abs(again[i] - base[i]) for i in tail) / len(tail)
        result["bf16_rerun"] = {"losses": again, "mean_abs_diff_last": spread}
        print(f"bf16 run to run: mean |dloss| over the last {len(tail)} = {spread:.4f}")
    for spec in a.fp8:
        label, path = spec.split("=", 1)
        cur = losses(path)
        common = sorted(set(base) & set(cur))
        tail = common[-a.last:]
        if len(common) < a.last:
            raise SystemExit(f"{label}: only {len(common)} common iterations")
        mean = sum(abs(cur[i] - base[i]) for i in tail) / len(tail)
        passed = mean <= a.tol
        ok &= passed
        result["fp8"][label] = {"losses": cur, "iterations": len(common), "mean_abs_diff_last": mean,
                                "final": (base[common[-1]], cur[common[-1]]), "pass": passed}
        print(f"fp8 {label}: {len(common)} iterations, mean |dloss| over the last {len(tail)} = {mean:.4f} "
              f"({'PASS' if passed else 'FAIL'} at {a.tol}); final loss bf16 {base[common[-1]]:.4f}, "
              f"fp8 {cur[common[-1]]:.4f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(sorted(base), [base[i] for i in sorted(base)], label="bf16", lw=1.5)
        if "bf16_rerun" in result:
            r = result["bf16_rerun"]
            xs = sorted(r["losses"])
            ax.plot(xs, [r["losses"][i] for i in xs], label=f"bf16 again (mean |Δ| last {a.last}: "
                                                            f"{r['mean_abs_diff_last']:.3f})", lw=1, ls="--")
        for label, r in result["fp8"].items():
            xs = sorted(r["losses"])
            ax.plot(xs, [r["losses"][i] for i in xs], label=f"fp8 {label} (mean |Δ| last {a.last}: "
                                                            f"{r['mean_abs_diff_last']:.3f})", lw=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{a.model}:\nfp8 vs bf16, same data and initial weights", fontsize=10)
        fig.tight_layout()
        fig.savefig(a.out + ".png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""scripts/fp8_loss_parity.py (issue 23's loss-curve check) on Megatron-style logs: the mean |Δ| over
the last N iterations, the verdict at --tol, and the bf16 run-to-run spread of --bf16-rerun (CPU only)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "fp8_loss_parity.py")


def log(path, losses):
    path.write_text("".join(
        f" [2026-11-29 00:00:00] iteration {i:8d}/{len(losses):8d} | consumed samples: {8 * i:10d} | "
        f"elapsed time per iteration (ms): 100.0 | throughput per GPU (TFLOP/s/GPU): 1.0 | learning rate: "
        f"1.000000E-04 | global batch size:     8 | lm loss: {v:.6E} | loss scale: 1.0 | grad norm: 1.000 | "
        f"number of skipped iterations:   0 | number of nan iterations:   0 |\n"
        for i, v in enumerate(losses, 1)))
    return str(path)


def run(tmp_path, *args):
    env = dict(os.environ, MPLBACKEND="Agg", MPLCONFIGDIR=str(tmp_path / "mpl"))
    return subprocess.run([sys.executable, SCRIPT, *args, "--out", str(tmp_path / "parity")], env=env,
                          capture_output=True, text=True, timeout=120)


def test_verdict_and_run_to_run_spread(tmp_path):
    bf16 = [10.0 - 0.1 * i for i in range(30)]
    near = log(tmp_path / "near.log", [v + 0.02 for v in bf16])
    far = log(tmp_path / "far.log", [v + (0.2 if i >= 10 else 0.0) for i, v in enumerate(bf16)])
    rerun = log(tmp_path / "rerun.log", [v - 0.03 for v in bf16])
    proc = run(tmp_path, "--bf16", log(tmp_path / "bf16.log", bf16), "--fp8", f"near={near}",
               "--bf16-rerun", rerun, "--model", "test model")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "parity.json").read_text())
    assert abs(res["fp8"]["near"]["mean_abs_diff_last"] - 0.02) < 1e-5 and res["fp8"]["near"]["pass"]
    assert abs(res["bf16_rerun"]["mean_abs_diff_last"] - 0.03) < 1e-5
    assert "bf16 run to run: mean |dloss| over the last 20 = 0.0300" in proc.stdout
    proc = run(tmp_path, "--bf16", str(tmp_path / "bf16.log"), "--fp8", f"far={far}")
    assert proc.returncode == 1 and "FAIL at 0.05" in proc.stdout, proc.stdout   # 0.2 over the last 20

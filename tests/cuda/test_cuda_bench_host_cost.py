"""scripts/bench_host_cost.py keeps working: --stub-launch times the Python around the cuda
backend's kernels on any machine, every variant of an op in turns, best turn and median in the JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_host_cost.py"


def test_stub_launch_rows(tmp_path):
    out = tmp_path / "host.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_ADAPT_")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--stub-launch", "--calls", "20", "--reps", "2",
                           "--ops", "rms_norm,swiglu", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["stub_launch"] is True and data["reps"] == 2
    rows = {(r["op"], r["variant"]): r for r in data["rows"]}
    for op in ("rms_norm", "swiglu"):
        ours = rows[(op, "ours")]
        assert ours["fwd_host_us"] > 0 and ours["fwd_bwd_host_us"] > ours["fwd_host_us"], ours
        assert ours["fwd_host_us"] <= ours["fwd_host_us_median"], ours
    assert any(op == "rms_norm" and v.startswith("torch") for op, v in rows), rows

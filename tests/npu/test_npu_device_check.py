"""scripts/npu_device_check.py: one line and exit 2 without torch_npu; under the emulation (the
only torch_npu here) every op row passes and names the implementation taken."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "npu_device_check.py")
EMULATION_DIR = os.path.join(ROOT, "tests", "npu", "emulation")


def run(*args, emulation=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_NPU_EMULATION_PROFILE")}
    if emulation:
        env.update(PYTHONPATH=EMULATION_DIR, TORCH_NPU_EMULATION_PROFILE=emulation)
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)


def test_without_torch_npu_fails_in_one_line():
    out = run()
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "cannot import torch_npu" in out.stderr


def test_refuses_the_emulation_unless_asked():
    out = run(emulation="7.3.0")
    assert out.returncode == 2 and "EMULATION" in out.stderr


@pytest.mark.parametrize("profile", ["6.0.0", "7.3.0"])
def test_every_op_passes_under_the_emulation(profile):
    out = run("--allow-emulation", emulation=profile)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert f"Ascend Extension for PyTorch {profile} call forms" in lines[0]
    rows = [l for l in lines[2:-1]]
    assert len(rows) == 14 and all(l.endswith("PASS") for l in rows)
    assert "npu.fusion_attention_blocks" in rows[-1] and "FELL BACK" not in rows[-1]
    kernel = "npu.torch_npu.npu_grouped_matmul.k_axis(wgrad)" if profile == "7.3.0" else "FELL BACK"
    assert kernel in [l for l in rows if l.startswith("grouped_gemm")][0]

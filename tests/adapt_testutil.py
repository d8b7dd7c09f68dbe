"""Subprocess helper shared by the tests (a uniquely named module: several conftest.py exist)."""
import os
import subprocess
import sys


def run_python(code_or_args, env=None, timeout=300, check=True):
    """Run python in a fresh interpreter; returns CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    args = [sys.executable, "-c", code_or_args] if isinstance(code_or_args, str) else [sys.executable, *code_or_args]
    proc = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc

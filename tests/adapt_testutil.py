"""Subprocess helper shared by the tests (a uniquely named module: several conftest.py exist)."""
import os
import subprocess
import sys


def free_port() -> str:
    """A free local port: fixed ports collide when two test runs share the machine (CI runs the two
    Pythons' suites side by side)."""
    from megatron_adapt.apps.ports import free_port as pick

    return str(pick())


def run_python(code_or_args, env=None, timeout=300, check=True, unset=()):
    """Run python in a fresh interpreter (without the variables in `unset`); returns CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    for name in unset:
        full_env.pop(name, None)
    args = [sys.executable, "-c", code_or_args] if isinstance(code_or_args, str) else [sys.executable, *code_or_args]
    proc = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def spawn_ranks(worker, nprocs=2, timeout=600):
    """Run worker(rank, port, queue) in `nprocs` spawned processes on one free port; each puts
    (rank, result) on the queue. Returns {rank: result}."""
    import torch.multiprocessing as mp

    port = int(free_port())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, q)) for r in range(nprocs)]
    [p.start() for p in procs]
    results = dict(q.get(timeout=timeout) for _ in procs)
    [p.join(60) for p in procs]
    return results

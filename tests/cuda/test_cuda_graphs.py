"""Megatron's own CUDA graphs (--cuda-graph-impl local) with the cuda backend's ops inside them.

- A capture that fails inside a backend op is re-raised naming the op (the interpreter on CPU
  exercises the naming; on a GPU the failure is a real CUDA capture error).
- GPU + MEGATRON_LM_PATH: pretrain_gpt.py on a small llama-like model, with and without
  --cuda-graph-impl local (dropout 0, MEGATRON_ADAPT_EXTERNAL=off so both runs use the same
  kernels): the loss curves match, and the report says the graphs were built with backend ops
  captured in them. TP=2 over NCCL too where two GPUs are visible.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _cuda_helpers import DEVICE, GPU

cg = pytest.importorskip("megatron.core.transformer.cuda_graphs")


def _fail_in_norm(monkeypatch):
    """Make the norm kernel's host code raise the error CUDA gives a forbidden call in a capture."""
    from megatron_adapt.backends.cuda import norms
    real = norms.next_pow2

    def next_pow2(n):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    monkeypatch.setattr(norms, "next_pow2", next_pow2)
    return real


def test_capture_failure_names_the_op(monkeypatch):
    from megatron_adapt.backends.cuda import BACKEND
    from megatron_adapt.patches.cuda_graphs import GraphCaptureError, build

    x = torch.randn(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    rms_norm = BACKEND.op("rms_norm")
    _fail_in_norm(monkeypatch)
    monkeypatch.setattr(cg._CudagraphGlobalRecord, "cudagraph_record", [("runner", "fwd")])
    monkeypatch.setattr(cg._CudagraphGlobalRecord, "cudagraph_created", False)
    wrapper = build(BACKEND, None)             # stands in for Megatron's create_cudagraphs:
    with pytest.raises(GraphCaptureError) as info:
        wrapper(lambda: rms_norm(x, w, 1e-5), None, (), {})
    msg = str(info.value)
    assert "rms_norm" in msg and "backends/cuda/norms.py (_Norm.forward)" in msg, msg
    assert "cannot run inside a CUDA graph" in msg, msg


REAL_CAPTURE = """
import torch, pytest
from megatron.core.transformer import cuda_graphs as cg
from megatron_adapt.backends.cuda import BACKEND, norms
from megatron_adapt.patches.cuda_graphs import GraphCaptureError, build
x, w = torch.randn(4, 64, device="cuda"), torch.ones(64, device="cuda")
rms_norm = BACKEND.op("rms_norm")
rms_norm(x, w, 1e-5)
real = norms.next_pow2
def next_pow2(n):
    torch.cuda.synchronize()          # forbidden while the stream is capturing
    return real(n)
norms.next_pow2 = next_pow2
def capture():
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rms_norm(x, w, 1e-5)
cg._CudagraphGlobalRecord.cudagraph_record = [("runner", "fwd")]
try:
    build(BACKEND, None)(capture, None, (), {})
except GraphCaptureError as e:
    print("NAMED:", e)
"""


@pytest.mark.skipif(not GPU, reason="needs a GPU (a real CUDA graph capture)")
def test_real_capture_failure_names_the_op():
    """A real capture broken by a synchronise inside the op (in a subprocess: a failed capture
    leaves the process's CUDA RNG unusable)."""
    env = {**os.environ, "MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_EXTERNAL": "off"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", REAL_CAPTURE], env=env, capture_output=True,
                          text=True, timeout=300)
    named = [l for l in proc.stdout.splitlines() if l.startswith("NAMED:")]
    assert named, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rms_norm" in named[0] and "norms.py" in named[0], named[0]


# ---- end to end: Megatron-LM's pretrain_gpt.py, graphed against eager ---------------------------

LM = os.environ.get("MEGATRON_LM_PATH")
e2e = pytest.mark.skipif(
    not (GPU and LM and os.path.isfile(os.path.join(LM or "", "pretrain_gpt.py"))),
    reason="needs a GPU and MEGATRON_LM_PATH (a Megatron-LM checkout with pretrain_gpt.py)")
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.]+E[+-]\d+)")
MODEL = [
    "--num-layers", "4", "--hidden-size", "512", "--ffn-hidden-size", "1408",
    "--num-attention-heads", "8", "--seq-length", "512", "--max-position-embeddings", "512",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "8192", "--mock-data", "--split", "949,50,1", "--bf16",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--clip-grad", "1.0", "--seed", "1234", "--init-method-std", "0.02",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000", "--train-iters", "12",
]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pretrain(tmp: Path, name: str, tp: int, extra: list) -> tuple[dict, dict]:
    report = tmp / f"{name}.json"
    launcher = ([shutil.which("megatron-adapt-run")] if shutil.which("megatron-adapt-run")
                else [sys.executable, "-m", "megatron_adapt.launcher"])
    cmd = [*launcher, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
           "--master-port", str(_port()), os.path.join(LM, "pretrain_gpt.py"), *MODEL,
           "--tensor-model-parallel-size", str(tp), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_ADAPT_")}
    env = {**env, "MEGATRON_ADAPT_BACKEND": "cuda", "MEGATRON_ADAPT_EXTERNAL": "off",
           "MEGATRON_ADAPT_REPORT": str(report), "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=400)
    (tmp / f"{name}.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    losses = {int(i): float(v) for i, v in ITER_RE.findall(proc.stdout)}
    assert len(losses) == 12, proc.stdout[-3000:]
    return losses, json.loads(report.read_text())


@e2e
@pytest.mark.parametrize("tp", [1, 2])
def test_graphed_and_eager_loss_curves_match(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    no_dropout = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    eager, _ = _pretrain(tmp_path, f"eager_tp{tp}", tp, no_dropout)
    graphed, rep = _pretrain(tmp_path, f"graphed_tp{tp}", tp, no_dropout + ["--cuda-graph-impl", "local"])
    diffs = [abs(eager[i] - graphed[i]) for i in sorted(eager)]
    assert max(diffs) < 0.02 and sum(diffs) / len(diffs) < 0.01, (eager, graphed)
    graphs = rep["cuda_graphs"]
    assert graphs and graphs[0]["graphs"] == 2 * 4, graphs        # 4 layers x fwd/bwd
    captured = " ".join(graphs[0]["captured_ops"])
    for op in ("rms_norm", "swiglu", "rope", "attention"):
        assert op in captured, graphs                             # backend ops inside the graphs
    assert not [o for o in rep["ops"] if o["fallback_reason"]], rep["ops"]


@e2e
def test_graphs_with_default_dropout_run(tmp_path):
    """Megatron's default dropout inside the graphs (its graph-safe RNG tracker): runs, loss falls."""
    losses, rep = _pretrain(tmp_path, "graphed_dropout", 1, ["--cuda-graph-impl", "local"])
    assert rep["cuda_graphs"] and losses[12] < losses[1], (losses, rep["cuda_graphs"])

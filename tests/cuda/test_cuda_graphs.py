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


FULL_ITERATION_IMPL = "Megatron (--cuda-graph-impl local --cuda-graph-scope full_iteration, training)"


def _full_iteration_wrapper(monkeypatch, stage_iteration):
    """Megatron's FullCudaGraphWrapper at training iteration `stage_iteration` (capture at 1)."""
    fcg = pytest.importorskip("megatron.core.full_cuda_graph")
    cls = fcg.FullCudaGraphWrapper
    monkeypatch.setattr(cls, "curr_iteration", {"training": stage_iteration, "validation": 0})
    monkeypatch.setattr(cls, "cuda_graph", {"training": None, "validation": None})
    inst = cls.__new__(cls)                   # no CUDA stream: the wrapper only reads its state
    inst.cuda_graph_warmup_steps = 1
    return inst


def test_full_iteration_capture_is_reported(monkeypatch):
    """--cuda-graph-scope full_iteration: the iteration that captures is counted and reported;
    the others pass straight through."""
    from megatron_adapt import report
    from megatron_adapt.backends.cuda import BACKEND
    from megatron_adapt.patches.cuda_graphs import build_full_iteration

    x = torch.randn(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    rms_norm = BACKEND.op("rms_norm")
    hook = build_full_iteration(BACKEND, None)
    graph = torch.cuda.CUDAGraph() if GPU else None

    def step(capture=False, **kw):
        out = rms_norm(rms_norm(x, w, 1e-5), w, 1e-5)       # eager (Megatron's warm-up runs are)
        if capture and GPU:
            with torch.cuda.graph(graph):
                out = rms_norm(rms_norm(x, w, 1e-5), w, 1e-5)
            graph.replay()
        return out

    monkeypatch.setattr(report, "_graphs", [])
    hook(step, _full_iteration_wrapper(monkeypatch, 0), (), dict(forward_only=False))   # eager warm-up step
    assert report._graphs == []
    hook(step, _full_iteration_wrapper(monkeypatch, 1), (), dict(forward_only=False, capture=True))  # the capture
    (built,) = report._graphs
    assert built["impl"] == FULL_ITERATION_IMPL and built["graphs"] == 1, built
    rms = lambda ops: sum(n for k, n in ops.items() if k.startswith("rms_norm ["))
    if GPU:   # inside the graph, and eager
        assert rms(built["captured_ops"]) == 2 and rms(built["warmup_ops"]) == 2, built
    else:     # no CUDA, nothing captures: the build's calls are counted as before
        assert rms(built["captured_ops"]) == 2 and built["warmup_ops"] == {}, built


def test_full_iteration_capture_failure_names_the_op(monkeypatch):
    from megatron_adapt.backends.cuda import BACKEND
    from megatron_adapt.patches.cuda_graphs import GraphCaptureError, build_full_iteration

    x = torch.randn(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    rms_norm = BACKEND.op("rms_norm")
    _fail_in_norm(monkeypatch)
    inst = _full_iteration_wrapper(monkeypatch, 1)
    with pytest.raises(GraphCaptureError) as info:
        build_full_iteration(BACKEND, None)(lambda **kw: rms_norm(x, w, 1e-5), inst, (),
                                            dict(forward_only=False))
    msg = str(info.value)
    assert "full_iteration" in msg and "rms_norm" in msg and "norms.py (_Norm.forward)" in msg, msg


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
    from megatron_adapt.apps.ports import free_port

    return free_port()


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


EAGER = ["--cuda-graph-impl", "none"]    # typed, so MEGATRON_ADAPT_CUDA_GRAPHS' default keeps out


def _assert_same_curve(eager, graphed):
    diffs = [abs(eager[i] - graphed[i]) for i in sorted(eager)]
    assert max(diffs) < 0.02 and sum(diffs) / len(diffs) < 0.01, (eager, graphed)


@e2e
@pytest.mark.parametrize("tp", [1, 2])
def test_graphed_and_eager_loss_curves_match(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    no_dropout = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    eager, eager_rep = _pretrain(tmp_path, f"eager_tp{tp}", tp, no_dropout + EAGER)
    # Megatron's default arguments: graphs from MEGATRON_ADAPT_CUDA_GRAPHS' default (auto)
    graphed, rep = _pretrain(tmp_path, f"graphed_tp{tp}", tp, no_dropout)
    _assert_same_curve(eager, graphed)
    assert not eager_rep["cuda_graphs"], eager_rep["cuda_graphs"]
    switch = [o["implementation"] for o in rep["ops"] if o["op"] == "cuda_graphs.switch"]
    assert switch == ["--cuda-graph-impl local (MEGATRON_ADAPT_CUDA_GRAPHS=auto (default)): whole layers"], switch
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


FULL_ITERATION = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
                  "--no-check-for-nan-in-loss-and-grad"]     # Megatron requires the last one


def _checkout_version():
    """The checkout's megatron-core release (its own megatron/core, else the installed package that
    its training code runs with, as where only the training code was copied)."""
    info = Path(LM, "megatron", "core", "package_info.py")
    if not info.is_file():
        import megatron.core.package_info as installed
        info = Path(installed.__file__)
    text = info.read_text()
    return tuple(int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR"))


def _full_iteration_capturable():
    """Megatron-LM before 0.18: pretrain_gpt's get_batch_on_this_tp_rank makes a tensor from a host
    int on the GPU in every micro-batch (torch.tensor in _broadcast_cu_seqlens), which a
    full-iteration capture refuses; stock Megatron's own limit, the broadcast is conditional
    from 0.18 on."""
    if _checkout_version() < (0, 18):
        pytest.skip(f"Megatron-LM {'.'.join(map(str, _checkout_version()))} at MEGATRON_LM_PATH: its "
                    "get_batch copies a host int to the GPU in every micro-batch (stock Megatron "
                    "cannot capture full_iteration before 0.18)")


@e2e
def test_full_iteration_graph_and_eager_loss_curves_match(tmp_path):
    """--cuda-graph-scope full_iteration: the whole forward-backward (all micro-batches) in one
    graph, captured at iteration --cuda-graph-warmup-steps; same loss curve as eager (dropout 0)."""
    _full_iteration_capturable()
    no_dropout = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    eager, _ = _pretrain(tmp_path, "eager_full", 1, no_dropout + EAGER)
    graphed, rep = _pretrain(tmp_path, "graphed_full", 1, no_dropout + FULL_ITERATION)
    _assert_same_curve(eager, graphed)
    (built,) = rep["cuda_graphs"]
    assert built["impl"] == FULL_ITERATION_IMPL and built["graphs"] == 1, built
    captured = " ".join(built["captured_ops"])
    for op in ("rms_norm", "swiglu", "rope", "attention", "vocab_parallel_cross_entropy"):
        assert op in captured, built
    assert not [o for o in rep["ops"] if o["fallback_reason"]], rep["ops"]


@e2e
def test_full_iteration_graph_with_default_dropout_runs(tmp_path):
    _full_iteration_capturable()
    losses, rep = _pretrain(tmp_path, "graphed_full_dropout", 1, FULL_ITERATION)
    assert rep["cuda_graphs"] and losses[12] < losses[1], (losses, rep["cuda_graphs"])


def _fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()}: fp8 GEMMs need sm89+")


@e2e
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_graphed_and_eager_loss_curves_match(tmp_path, recipe):
    """fp8 linears inside Megatron's layer graphs (no TE): the casts, amaxes, scales and the delayed
    update are replayed with the GEMMs; same curve as fp8 eager."""
    _fp8_gpu()
    fp8 = ["--attention-dropout", "0", "--hidden-dropout", "0", "--fp8-format", "hybrid", "--fp8-recipe", recipe]
    eager, _ = _pretrain(tmp_path, f"fp8_{recipe}_eager", 1, fp8 + EAGER)
    graphed, rep = _pretrain(tmp_path, f"fp8_{recipe}_graphed", 1, fp8 + ["--cuda-graph-impl", "local"])
    _assert_same_curve(eager, graphed)
    graphs = rep["cuda_graphs"]
    assert graphs and graphs[0]["graphs"] == 2 * 4, graphs
    assert "fp8_linear" in " ".join(graphs[0]["captured_ops"]), graphs
    assert not [o for o in rep["ops"] if o["fallback_reason"]], rep["ops"]
    # 4 micro-batches a step: the captured weight casts follow Megatron's skip flag (the same curve
    # as eager, whose later micro-batches reuse the cache on the host)
    casts = {o["implementation"] for o in rep["ops"] if o["op"] == "fp8_weight_cast"}
    assert {"cast, or cached by the graph's flag", "cached (later micro-batch)"} <= casts, casts


MLA = ["--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "64",
       "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--qk-layernorm", "--rotary-scaling-factor", "40",
       "--mscale", "1.0", "--mscale-all-dim", "1.0"]


@e2e
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mla_graphed_and_eager_loss_curves_match(tmp_path, fp8):
    """Multi-latent attention (Megatron's fused YaRN RoPE) inside the layer graphs that auto turns
    on: core 0.18+'s runner copies a layer's buffers back after its forward capture, which broke
    the backward capture of MLA's RoPE (patches/cuda_graphs gives it copies of cos / sin); under
    fp8 the down projections' fp8 GEMMs are captured too. Same curve as eager."""
    args = ["--attention-dropout", "0", "--hidden-dropout", "0", *MLA]
    if fp8:
        _fp8_gpu()
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    eager, _ = _pretrain(tmp_path, "mla_eager", 1, args + EAGER)
    graphed, rep = _pretrain(tmp_path, "mla_graphed", 1, args)
    _assert_same_curve(eager, graphed)
    graphs = rep["cuda_graphs"]
    assert graphs and graphs[0]["graphs"] == 2 * 4, graphs
    assert not [o for o in rep["ops"] if o["fallback_reason"]], rep["ops"]
    copies = sum(o["calls"] for o in rep["ops"] if o["op"] == "mla_rope_capture")
    assert copies == (2 * 4 if _checkout_version() >= (0, 18) else 0), rep["ops"]   # q and kv, 4 layers
    if fp8:
        assert "fp8_linear" in " ".join(graphs[0]["captured_ops"]), graphs


@e2e
def test_fp8_full_iteration_graph_and_eager_loss_curves_match(tmp_path):
    _fp8_gpu()
    _full_iteration_capturable()
    fp8 = ["--attention-dropout", "0", "--hidden-dropout", "0", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    eager, _ = _pretrain(tmp_path, "fp8_full_eager", 1, fp8 + EAGER)
    graphed, rep = _pretrain(tmp_path, "fp8_full_graphed", 1, fp8 + FULL_ITERATION)
    _assert_same_curve(eager, graphed)
    (built,) = rep["cuda_graphs"]
    assert built["graphs"] == 1 and "fp8_linear" in " ".join(built["captured_ops"]), built


# ---- evaluation under layer graphs runs eager ------------------------------------------------------

EVAL_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
import megatron_adapt
megatron_adapt.apply("cuda", quiet=True)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("nccl", rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.cuda_graphs import create_cudagraphs, _CudagraphGlobalRecord
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
ps.initialize_model_parallel()
initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)
model_parallel_cuda_manual_seed(123)
config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.5,
                           attention_dropout=0.5, cuda_graph_impl="local", use_cpu_initialization=True)
block = TransformerBlock(config, get_gpt_layer_with_transformer_engine_spec()).cuda()
x = torch.randn(32, 2, 64, device="cuda", requires_grad=True)
for step in range(3):            # step 0 records, create_cudagraphs captures, steps 1-2 replay
    block(hidden_states=x, attention_mask=None).sum().backward()
    create_cudagraphs()
assert _CudagraphGlobalRecord.cudagraph_created
runners = sum(len(l.cudagraph_manager.cudagraph_runners) for l in block.layers)
block.eval()
with torch.no_grad():
    y1 = block(hidden_states=x.detach(), attention_mask=None)
    y2 = block(hidden_states=x.detach(), attention_mask=None)
    ref = x.detach()
    for layer in block.layers:   # each layer's own forward: eager, no manager
        ref = layer.forward(hidden_states=ref, attention_mask=None)[0]
    ref = block.final_layernorm(ref) if getattr(block, "final_layernorm", None) is not None else ref
block.train()                    # training replays again after evaluation
out = block(hidden_states=x, attention_mask=None)
out.sum().backward()
print("RESULT", runners, torch.equal(y1, y2), (y1 - ref).abs().max().item(), torch.isfinite(out).all().item())
'''


@pytest.mark.skipif(not GPU, reason="needs a GPU (CUDA graphs)")
def test_evaluation_under_layer_graphs_runs_eager(tmp_path):
    """Megatron's CudaGraphManager would replay the training-mode graph (dropout 0.5 here) for a
    layer in eval mode; under megatron-adapt the eval forward runs eager: two eval passes agree
    with each other and with the layers' own forward, and training replays its graphs after."""
    script = tmp_path / "eval_graphs.py"
    script.write_text(EVAL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), str(_port())], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stdout[-4000:]
    _, runners, same, diff, finite = line[0].split()
    assert int(runners) == 2 and same == "True" and float(diff) < 1e-5 and finite == "True", line[0]

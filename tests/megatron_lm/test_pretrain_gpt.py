"""Stock Megatron-LM scripts, unmodified, on the cpu backend over gloo.

Each test launches `megatron-adapt-run torchrun --nproc-per-node 2 <script> ...` in a subprocess
(the way a user would) and checks the exit code, that the loss is printed and falls, that
checkpoints are written and a second run resumes from the saved iteration, and that the start-up
report shows the patches applied. Every fused-kernel flag is left at Megatron's default
(gradient-accumulation fusion included) and so is --transformer-impl (transformer_engine, served
by megatron-adapt's backend-native layer spec since TE is not installed).

Needs MEGATRON_LM_PATH: a Megatron-LM checkout matching the installed megatron-core (tag
core_v<version>). Each launch costs ~15-25 s on two CPU cores; the file takes ~4-5 minutes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LM = os.environ.get("MEGATRON_LM_PATH")
NEEDS_CHECKOUT = True  # conftest.py: skipped when the checkout's version is not the installed one
REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(not LM, reason="MEGATRON_LM_PATH is not set: these tests run Megatron-LM's "
                       "pretrain_gpt.py and examples from a checkout (tag core_v<megatron-core version>)"),
    pytest.mark.skipif(bool(LM) and not os.path.isfile(os.path.join(LM or "", "pretrain_gpt.py")),
                       reason=f"MEGATRON_LM_PATH={LM} has no pretrain_gpt.py"),
    pytest.mark.skipif(shutil.which("megatron-adapt-run") is None or shutil.which("torchrun") is None,
                       reason="megatron-adapt-run / torchrun not on PATH (pip install -e .)"),
]

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--split", "949,50,1",
    "--attention-backend", "auto",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", "20",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
]
LLAMA = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--untie-embeddings-and-output-weights"]

# Rows of the start-up table that must say "applied" on the pretrain_gpt path.
REQUIRED_PATCHES = (
    "megatron.training.initialize:initialize_megatron",
    "megatron.core.jit:jit_fuser",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    "megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
    "megatron.core.transformer.torch_norm:WrappedTorchNorm",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward",
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
    "megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb",
    "megatron.core.models.gpt.gpt_layer_specs:TESpecProvider",
    "megatron.core.models.gpt.gpt_layer_specs:TENorm",
    "megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda",
    "megatron.core.tensor_parallel.layers:_grad_accum_fusion_available",
)
# The stock local path with the flags users needed before: --transformer-impl local and no wgrad fusion.
LOCAL_UNFUSED = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion"]

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.]+E[+-]\d+)")
ROW_RE = re.compile(r"^(\w+)\s+(\S+:\S+)\s+(applied|skipped|failed|pending|disabled|reverted)\b", re.M)


def _free_port() -> int:
    from megatron_adapt.apps.ports import free_port

    return free_port()


def _env() -> dict:
    env = dict(os.environ)
    env.update(MEGATRON_LM_PATH=LM, OMP_NUM_THREADS="1", MEGATRON_ADAPT_BACKEND="cpu",
               PYTHONUNBUFFERED="1")
    for var in ("MEGATRON_ADAPT_AUTO", "MEGATRON_ADAPT_QUIET", "MEGATRON_ADAPT_DISABLE",
                "MEGATRON_ADAPT_ATTENTION_LAYOUT", "MEGATRON_ADAPT_REPORT"):
        env.pop(var, None)
    return env


SKIP_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.E+-]+).*?number of skipped iterations:\s+(\d+)")


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, log: Path):
        self.rc, self.out, self.log = proc.returncode, proc.stdout, log
        self.losses = {int(i): float(loss) for i, _, loss in ITER_RE.findall(self.out)}
        # iteration -> (loss scale, skipped iterations in that logging interval)
        self.scaler = {int(i): (float(scale), int(n)) for i, scale, n in SKIP_RE.findall(self.out)}

    def check(self):
        assert self.rc == 0, f"exit code {self.rc}; log {self.log}:\n{self.out[-6000:]}"
        assert self.losses, f"no 'lm loss' printed; log {self.log}:\n{self.out[-3000:]}"
        return self


def launch(script: str, args: list[str], tmp: Path, name: str, cwd: Path | None = None,
           timeout: int = 300, env: dict | None = None, umask: int | None = None, nproc: int = 2) -> Run:
    cmd = ["megatron-adapt-run", "torchrun", "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), os.path.join(LM, script), *args]
    proc = subprocess.run(cmd, env={**_env(), **(env or {})}, cwd=cwd or tmp, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))
    log = tmp / f"{name}.log"
    log.write_text(" ".join(cmd) + "\n" + proc.stdout)
    return Run(proc, log)


def pretrain(args: list[str], tmp: Path, name: str, iters: int = 10, env: dict | None = None,
             umask: int | None = None) -> Run:
    return launch("pretrain_gpt.py", [*TINY_GPT, "--train-iters", str(iters), *args], tmp, name, env=env,
                  umask=umask)


def launch_reported(script: str, args: list[str], tmp: Path, name: str, env: dict | None = None) -> Run:
    """launch() with megatron-adapt's JSON report written; run.ops maps each op to its row. Checked."""
    report = tmp / f"{name}.report.json"
    run = launch(script, args, tmp, name, env={"MEGATRON_ADAPT_REPORT": str(report), **(env or {})})
    run.ops = {o["op"]: o for o in json.loads(report.read_text())["ops"]} if report.exists() else {}
    return run.check()


# Megatron's own path for a family: its local spec, with megatron-adapt's attention patch off
# (Megatron's DotProductAttention and masks); with dropout 0 and the same seed the losses agree.
LOCAL_PATH = (["--transformer-impl", "local"], {"MEGATRON_ADAPT_DISABLE": "attention"})


def assert_matches_local(te: Run, local: Run, iters: int, tol: float = 2e-3):
    assert "attention" not in local.ops, local.ops   # Megatron's DotProductAttention served it
    assert sorted(te.losses) == sorted(local.losses) == list(range(1, iters + 1))
    assert max(abs(te.losses[i] - local.losses[i]) for i in te.losses) < tol, (te.losses, local.losses)


def assert_loss_falls(run: Run, first: int = 1, by: float = 0.3):
    losses = run.losses
    last = max(losses)
    assert losses[last] < losses[first] - by, f"loss did not fall: {losses}"


def ranks_printed(run: Run, t: str, p: str) -> bool:
    """Megatron's checkpoint log names the loading rank as `[ t 1/2, p 1/1 ]`; core_v0.18 and later
    put other groups between (`[ t 1/2, gtp_remat 1/1, p 1/1 ]`)."""
    return re.search(rf"\[ t {t}, (?:\w+ \d+/\d+, )*p {p} \]", run.out) is not None


# Modules pretrain_gpt.py never imports: their patches stay pending (CLIP-ViT, LLaVA: multimodal
# models; the T5 and BERT specs and T5's dataset; core_v0.16.1's pretrain_gpt.py imports no Mamba module).
NOT_IMPORTED_BY_GPT = ("megatron.core.models.vision.", "megatron.core.models.multimodal.", "megatron.core.models.T5.",
                       "megatron.core.models.bert.", "megatron.core.datasets.t5_dataset",
                       "megatron.core.ssm.", "megatron.core.models.mamba.",
                       "megatron.core.models.mimo.", "megatron.elastification.", "megatron.core.post_training.",
                       "megatron.core.inference.communication_utils")   # imported by training only on some paths


def assert_patched(run: Run, required=REQUIRED_PATCHES, may_wait=NOT_IMPORTED_BY_GPT):
    """No patch failed; none is pending but those whose module (prefix in `may_wait`) the script
    never imports; every `required` one applied."""
    assert "megatron-adapt: backend=cpu" in run.out, "no start-up report on rank 0"
    rows = {target: status for _, target, status in ROW_RE.findall(run.out)}
    failed = {t: s for t, s in rows.items()
              if s == "failed" or (s == "pending" and not t.startswith(tuple(may_wait)))}
    assert not failed, f"patches not applied: {failed}"
    missing = [t for t in required if rows.get(t) != "applied"]
    assert not missing, f"not applied: {missing}; table: {rows}"


def save_and_resume(extra: list[str], tmp: Path, name: str) -> tuple[Run, Run]:
    """10 iterations saving at 5 and 10, then a second run that loads iteration 10 and goes to 15.

    Raising --train-iters on resume needs --override-opt_param-scheduler: Megatron asserts that the
    checkpointed scheduler matches the new one, and its weight-decay horizon is
    train_iters * global_batch_size (this is Megatron's behaviour on any hardware).
    """
    ckpt = tmp / f"ckpt_{name}"
    save = ["--save", str(ckpt), "--save-interval", "5"]
    first = pretrain([*extra, *save], tmp, f"{name}_save").check()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    for it in ("iter_0000005", "iter_0000010"):
        assert (ckpt / it / "metadata.json").is_file(), f"no torch_dist checkpoint {ckpt / it}"
        assert list((ckpt / it).glob("*.distcp")), f"no shards in {ckpt / it}"
    second = pretrain([*extra, *save, "--load", str(ckpt), "--override-opt_param-scheduler"],
                      tmp, f"{name}_resume", iters=15).check()
    assert f"loading distributed checkpoint from {ckpt} at iteration 10" in second.out
    assert "successfully loaded checkpoint" in second.out
    assert min(second.losses) == 11 and max(second.losses) == 15, second.losses
    # The resumed run continues the first run's curve instead of starting over.
    assert abs(second.losses[11] - first.losses[10]) < 0.25, (first.losses, second.losses)
    assert second.losses[11] < first.losses[1] - 0.3, (first.losses, second.losses)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "15"
    return first, second


def test_tp2_bf16_save_and_resume(tmp_path):
    first, second = save_and_resume(["--tensor-model-parallel-size", "2", "--bf16"], tmp_path, "tp2")
    assert_patched(first)
    assert_loss_falls(first)
    assert ranks_printed(second, t="1/2", p="1/1")


def test_tp2_sequence_parallel_bf16(tmp_path):
    run = pretrain(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"],
                   tmp_path, "tp2_sp").check()
    assert_patched(run)
    assert_loss_falls(run)


def test_pp2_bf16_save_and_resume(tmp_path):
    first, second = save_and_resume(["--pipeline-model-parallel-size", "2", "--bf16"], tmp_path, "pp2")
    assert_patched(first)
    assert_loss_falls(first)
    assert ranks_printed(second, t="1/1", p="1/2")


def test_vpp_pp2_bf16_save_and_resume(tmp_path):
    """Interleaved schedule (2 virtual stages per rank), whose p2p overlaps and waits for sends late:
    without the device layer keeping gloo send buffers alive this hits NaN at iteration ~4."""
    first, second = save_and_resume(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                     "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"],
                                    tmp_path, "vpp")
    assert_loss_falls(first)
    assert "number of nan iterations:   0" in first.out and "nan iterations:   1" not in first.out


def test_dp2_distributed_optimizer_bf16_save_and_resume(tmp_path):
    first, second = save_and_resume(["--use-distributed-optimizer", "--bf16"], tmp_path, "dp2_distopt")
    # Stock Megatron without TE/apex asserts in DistributedOptimizer.state_dict on --load.
    assert_patched(second, required=REQUIRED_PATCHES + (
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict",))
    assert_loss_falls(first)


@pytest.mark.parametrize("impl", ["default", "local"])
def test_llama_like_tp2_sp_bf16(tmp_path, impl):
    """swiglu + rope (with Megatron's default --rope-fusion) + RMSNorm, untied output layer; on the
    default (TE) layer spec and on --transformer-impl local."""
    extra = LOCAL_UNFUSED if impl == "local" else []
    run = pretrain(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16", *LLAMA, *extra],
                   tmp_path, f"llama_tp2_sp_{impl}").check()
    assert_patched(run)
    assert_loss_falls(run)


def _scaler_trains_on(run: Run):
    """Megatron's dynamic loss scaler from 2^32: overflowing steps are skipped (no loss printed) and
    halve the scale; then steps go through and the loss falls."""
    first = min(run.scaler)
    assert run.scaler[first] == (2.0 ** 32, 1), run.scaler          # step 1 overflows, is skipped
    skipped = [i for i, (_, n) in run.scaler.items() if n]
    trained = sorted(run.losses)
    assert len(skipped) >= 3 and trained and trained[0] > skipped[0], (run.scaler, run.losses)
    scales = [run.scaler[i][0] for i in sorted(run.scaler)]
    assert scales[-1] < scales[0] and all(b <= a for a, b in zip(scales, scales[1:])), scales
    assert len(trained) >= 8, run.losses                             # ... then it trains on
    assert run.losses[trained[-1]] < run.losses[trained[0]] - 0.3, run.losses


def launch_script(script: str, args: list[str], tmp: Path, name: str, env: dict, timeout: int = 300) -> Run:
    """A tests_gpt launch script, the way a user runs it; a fresh master port each time."""
    proc = subprocess.run([str(REPO / "tests_gpt" / script), *args],
                          env={**_env(), "MASTER_PORT": str(_free_port()), **env}, cwd=tmp,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    log = tmp / f"{name}.log"
    log.write_text(proc.stdout)
    return Run(proc, log)


def test_launch_script_fp16_loss_scaler_bsh_llama_sliding_window(tmp_path):
    """tests_gpt/pretrain_gpt_fp16.sh at its defaults (Megatron's 2^32 initial loss scale, 30
    iterations): PP=2, llama-like, --pre/--next window, --shape_order BSH (attention on batch-first
    copies)."""
    run = launch_script("pretrain_gpt_fp16.sh", ["--shape_order", "BSH", "--pre=16", "--next=0"],
                        tmp_path, "script", env=dict(PP="2", LLAMA="1",
                                                     MEGATRON_ADAPT_REPORT=str(tmp_path / "report.json")))
    assert run.rc == 0, run.out[-6000:]
    assert "--window-size 16,0" in run.out and "--fp16" in run.out and "--initial-loss-scale" not in run.out
    assert_patched(run)
    _scaler_trains_on(run)
    report = json.loads((tmp_path / "report.json").read_text())   # rank 0: the first stage
    assert report["attention_layout"] == "bshd"
    assert [o["implementation"] for o in report["ops"] if o["op"] == "attention"] == ["cpu.torch.sdpa"], report["ops"]


def test_launch_script_rejects_an_unknown_shape_order(tmp_path):
    proc = subprocess.run([str(REPO / "tests_gpt" / "pretrain_gpt_distributed.sh"), "--shape_order", "HBS"],
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 2 and "must be SBH or BSH" in proc.stdout


def test_gpt3_example_arguments_scaled_down(tmp_path):
    """examples/gpt3/train_gpt3_175b_distributed.sh's own model and training arguments (read from
    the checkout): default --transformer-impl, --attention-backend auto, fp16 from a 2^32 loss
    scale, batch-size ramp-up, every fusion at its default; tiny sizes, TP=2, mock data, with
    --save/--load into one directory as the example has."""
    run = launch_script("pretrain_gpt3_example.sh", [], tmp_path, "gpt3",
                        env=dict(CKPT=str(tmp_path / "ckpt")), timeout=400)
    assert run.rc == 0, run.out[-6000:]
    for flag in ("--attention-backend auto", "--fp16", "--init-method-std 0.006"):
        assert flag in run.out, flag                                  # the example's own flags ...
    # ... and its ramp-up: --rampup-batch-size up to core_v0.17, a step schedule from 0.18 (scaled)
    assert "--rampup-batch-size 16 16 5859375" in run.out or "--step-batch-size-schedule 0:4 1280:8" in run.out
    assert "--transformer-impl" not in run.out and "--no-" not in run.out.split("\n", 1)[0]
    assert re.search(r"global batch size:\s+4 \|", run.out) and re.search(r"global batch size:\s+8 \|", run.out)
    assert_patched(run)
    _scaler_trains_on(run)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").is_file()


def test_simple_mcore_train_loop_example(tmp_path):
    """examples/run_simple_mcore_train_loop.py hard-codes nccl, torch.cuda.set_device, .to("cuda")
    and TP=2. It trains 5 iterations, saves a torch_dist checkpoint into ./ckpt and loads it.

    Its loss stays at ~ln(100) on any device (it steps torch.optim.Adam on .grad while Megatron's DDP
    accumulates into .main_grad), so only completion is asserted, not a falling loss.
    """
    run = launch("examples/run_simple_mcore_train_loop.py", [], tmp_path, "simple_loop")
    assert run.rc == 0, f"exit code {run.rc}; log {run.log}:\n{run.out[-6000:]}"
    assert re.search(r"Iteration 4: Losses reduced: \[\{'lm loss': tensor\(4\.\d+", run.out), run.out[-3000:]
    assert "Successfully loaded the model" in run.out
    assert (tmp_path / "ckpt" / "metadata.json").is_file()
    # From core_v0.19 the example never imports megatron.training, nor the experimental attention
    # or heterogeneous layer specs: those patches stay pending (waiting for an import that does not come).
    assert_patched(run, required=(), may_wait=("megatron.training.", "megatron.core.models.gpt.experimental_",
                                               "megatron.core.models.gpt.heterogeneous.", *NOT_IMPORTED_BY_GPT))


def test_default_impl_and_wgrad_fusion_match_stock_local_unfused(tmp_path):
    """Defaults (TE layer spec served by megatron-adapt, gradient-accumulation fusion into main_grad)
    against `--transformer-impl local --no-gradient-accumulation-fusion`, both on the cpu backend,
    fp32, TP=2, same seed: the same model, so the same losses (fp32 summation order differs)."""
    args = ["--tensor-model-parallel-size", "2"]
    report = tmp_path / "report.json"
    default = pretrain(args, tmp_path, "default", env={"MEGATRON_ADAPT_REPORT": str(report)}).check()
    local = pretrain([*args, *LOCAL_UNFUSED], tmp_path, "local_unfused").check()
    assert_patched(default)
    assert sorted(default.losses) == sorted(local.losses) == list(range(1, 11))
    diffs = [abs(default.losses[i] - local.losses[i]) for i in default.losses]
    assert max(diffs) < 1e-4, (default.losses, local.losses)
    assert_loss_falls(default)
    calls = {}
    for o in json.loads(report.read_text())["ops"]:
        calls[o["op"]] = calls.get(o["op"], 0) + o["calls"]
    assert calls.get("wgrad_accumulate", 0) > 0 and calls.get("layer_norm", 0) > 0, calls


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_cuda_graph_switch_on_cpu_names_why_and_trains(tmp_path):
    """MEGATRON_ADAPT_CUDA_GRAPHS through Megatron's real parse_args: on the cpu backend `auto`
    stays eager and says why; `local` does the same, and under MEGATRON_ADAPT_STRICT=1 refuses."""
    why = "CUDA graphs need the cuda backend (this process runs cpu)"
    auto = pretrain([], tmp_path, "graphs_auto", iters=3, env={"MEGATRON_ADAPT_CUDA_GRAPHS": "auto"}).check()
    assert f"MEGATRON_ADAPT_CUDA_GRAPHS=auto: running eager: {why}" in auto.out
    assert "cuda_graph_impl ................................. none" in auto.out
    strict = pretrain([], tmp_path, "graphs_strict", iters=3,
                      env={"MEGATRON_ADAPT_CUDA_GRAPHS": "local", "MEGATRON_ADAPT_STRICT": "1"})
    assert strict.rc != 0 and "StrictFallbackError" in strict.out and why in strict.out

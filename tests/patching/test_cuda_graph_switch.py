"""MEGATRON_ADAPT_CUDA_GRAPHS: the switch that turns Megatron's --cuda-graph-impl local on through
the wrapped `parse_args`, refuses configurations graphs cannot capture (naming why), and never
overrides a launch's own flag. Each case in a fresh interpreter with the environment it needs.

The MoE cases go through Megatron's real argument parser (`megatron.training.arguments.parse_args`
with a stock command line), and where the switch turns graphs on, through Megatron's own
`validate_args` and `TransformerConfig` (whose __post_init__ checks the graph scope against the MoE
settings), so the configuration the switch chooses is one Megatron accepts. The backend is named
cuda to the switch (the decision under test); the process itself runs the cpu backend."""
import json
import textwrap

import pytest

CASE = textwrap.dedent("""
    import sys, types
    sys.argv = {argv!r}
    import megatron_adapt
    from megatron_adapt import report
    megatron_adapt.apply("cpu", quiet=True)  # the configuration (switch, strict) comes from the environment
    from megatron_adapt.patches.cuda_graphs import build_switch
    ns = types.SimpleNamespace(cuda_graph_impl={impl!r}, num_experts={experts!r}, tensor_model_parallel_size={tp!r},
                               pipeline_model_parallel_size={pp!r}, context_parallel_size={cp!r})
    wrapper = build_switch(types.SimpleNamespace(name={backend!r}), None)
    out = wrapper(lambda: ns, None, (), {{}})
    print("IMPL", out.cuda_graph_impl)
    import json
    print("FALLBACKS", json.dumps([o["fallback_reason"] for o in report.as_dict()["ops"] if o["fallback_reason"]]))
    print("OPS", report.as_dict()["ops"])
""")


def run_case(python, mode, backend="cuda", impl="none", experts=None, strict=False, tp=1, pp=1, cp=1,
             argv=("pretrain_gpt.py",), extra_env=None):
    """mode None: MEGATRON_ADAPT_CUDA_GRAPHS unset (its default)."""
    env = {"MEGATRON_ADAPT_STRICT": "1" if strict else "0", **(extra_env or {})}
    if mode is not None:
        env["MEGATRON_ADAPT_CUDA_GRAPHS"] = mode
    return python(CASE.format(impl=impl, experts=experts, backend=backend, tp=tp, pp=pp, cp=cp, argv=list(argv)),
                  env=env, check=False, unset=() if mode is not None else ("MEGATRON_ADAPT_CUDA_GRAPHS",))


@pytest.mark.parametrize("mode", ["local", "auto"])
def test_turns_graphs_on_where_they_capture(python, mode):
    proc = run_case(python, mode)
    assert proc.returncode == 0, proc.stderr
    assert "IMPL local" in proc.stdout
    assert f"--cuda-graph-impl local (MEGATRON_ADAPT_CUDA_GRAPHS={mode}): whole layers" in proc.stdout
    assert "turned on Megatron's --cuda-graph-impl local; captured: every transformer layer whole" in proc.stderr


def test_off_leaves_megatron_alone(python):
    proc = run_case(python, "off")
    assert proc.returncode == 0 and "IMPL none" in proc.stdout and "cuda_graphs.switch" not in proc.stdout


def test_launch_flag_wins(python):
    proc = run_case(python, "local", impl="transformer_engine")
    assert "IMPL transformer_engine" in proc.stdout and "the launch's own flag kept" in proc.stdout


@pytest.mark.parametrize("backend,experts,reason", [
    ("cpu", None, "CUDA graphs need the cuda backend (this process runs cpu)"),
    ("cuda", 8, "MoE with --moe-token-dispatcher-type allgather"),  # Megatron's default dispatcher
])
def test_refusal_names_the_reason(python, backend, experts, reason):
    local = run_case(python, "local", backend=backend, experts=experts)
    fallbacks = json.loads(local.stdout.split("FALLBACKS ", 1)[1].splitlines()[0])
    assert "IMPL none" in local.stdout and len(fallbacks) == 1 and fallbacks[0].startswith(reason), local.stdout
    assert f"running eager: {reason}" in local.stderr
    auto = run_case(python, "auto", backend=backend, experts=experts)
    assert "IMPL none" in auto.stdout and f"eager (MEGATRON_ADAPT_CUDA_GRAPHS=auto: {reason}" in auto.stdout
    strict = run_case(python, "local", backend=backend, experts=experts, strict=True)
    assert strict.returncode != 0 and "StrictFallbackError" in strict.stderr and reason in strict.stderr


def test_unknown_mode_is_a_clear_error(python):
    proc = python("from megatron_adapt.config import Config; Config.resolve()", check=False,
                  env={"MEGATRON_ADAPT_CUDA_GRAPHS": "always"})
    assert proc.returncode != 0 and "MEGATRON_ADAPT_CUDA_GRAPHS='always': expected one of auto, off, local" in proc.stderr


# ---- through Megatron's real parse_args ---------------------------------------------------------

# One interpreter parses every command line of a test (importing megatron.training is the slow part):
# per case, the switch's decision, its report entries and stderr line, and where it turned graphs
# on, what Megatron's validate_args and TransformerConfig made of it.
PARSE = textwrap.dedent("""
    import contextlib, io, json, os, sys, types
    import megatron_adapt
    from megatron_adapt import report
    megatron_adapt.apply("cpu", quiet=True)
    try:
        from megatron.training import arguments
    except ImportError:       # megatron-core wheels before 0.17 ship no megatron.training
        sys.path.append(os.environ["MEGATRON_LM_PATH"])
        from megatron.training import arguments
    from megatron.core import package_info
    from megatron_adapt.patches.cuda_graphs import build_switch
    scope_flag = "--cuda-graph-modules" if (package_info.MAJOR, package_info.MINOR) >= (0, 19) else "--cuda-graph-scope"
    # the switch as the cuda backend applies it, around Megatron's own (unwrapped) parse_args
    switch = build_switch(types.SimpleNamespace(name="cuda"), None)
    for argv in {cases!r}:            # each case as its own launch: the start-up line is said once per process
        report.reset_op_counts()
        report._said.clear()
        sys.argv = ["pretrain_gpt.py", *[scope_flag if a == "SCOPE" else a for a in argv]]
        err, out = io.StringIO(), {{}}
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = switch(arguments.parse_args.__wrapped__, None, (), {{}})
            out["impl"] = ns.cuda_graph_impl
            ops = report.as_dict()["ops"]
            out["fallbacks"] = [o["fallback_reason"] for o in ops if o["fallback_reason"]]
            out["switch"] = [o["implementation"] for o in ops if o["op"] == "cuda_graphs.switch"]
            # Megatron's own checks of what the switch chose (not for fp8: this process runs the
            # cpu backend, whose config check refuses fp8; tests/cuda/test_cuda_graphs.py runs it)
            if ns.cuda_graph_impl == "local" and "--fp8-format" not in argv:
                arguments.validate_args(ns, {{}})
                config = arguments.core_transformer_config_from_args(ns)
                scopes = getattr(config, "cuda_graph_modules", getattr(config, "cuda_graph_scope", None))
                out["config"] = [config.cuda_graph_impl, list(scopes), config.num_moe_experts,
                                 config.moe_pad_expert_input_to_capacity]
        out["stderr"] = err.getvalue()
        print("CASE", json.dumps(out), flush=True)
""")

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "2", "--lr", "1e-4",
        "--bf16", "--disable-bias-linear"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm", "--moe-permute-fusion",
       "--moe-router-fusion", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
TO_PAD = "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"


def _training_importable():
    import importlib.util
    import os
    if importlib.util.find_spec("megatron.training") is not None:
        return True
    from megatron_checkout import mismatch_reason
    path = os.environ.get("MEGATRON_LM_PATH")
    return bool(path) and os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")) \
        and mismatch_reason(path) is None


real_parser = pytest.mark.skipif(
    not _training_importable(),
    reason="needs megatron.training (megatron-core >= 0.17 wheels ship it; else MEGATRON_LM_PATH at a matching checkout)")


def parse_cases(python, cases, mode="local", strict=False):
    env = {"MEGATRON_ADAPT_CUDA_GRAPHS": mode, "MEGATRON_ADAPT_STRICT": "1" if strict else "0"}
    proc = python(PARSE.format(cases=cases), env=env, check=False, timeout=900)
    outs = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    return proc, outs


FP8 = ["--fp8-format", "hybrid", "--fp8-recipe"]

ACCEPTED = [
    (TINY, "whole layers"),
    (TINY + MOE + ALLTOALL + PADDED, "whole layers, MoE capacity-padded"),
]
REFUSED = [
    (TINY + FP8 + ["delayed", "--fp8-interval", "2"],
     "--fp8-interval > 1: a captured layer replays its delayed-scaling update every step"),
    (TINY + MOE + ALLTOALL, "dropless MoE (--num-experts without a capacity factor): the alltoall dispatcher "
                            "copies every layer's per-expert token counts to the host"),
    (TINY + MOE + ALLTOALL + ["--moe-expert-capacity-factor", "1.0"],
     "MoE token dropping without padding (--moe-expert-capacity-factor without --moe-pad-expert-input-to-capacity)"),
    (TINY + MOE + ALLTOALL + ["--moe-expert-capacity-factor", "-1", "--moe-pad-expert-input-to-capacity"],
     "dropless MoE"),
    (TINY + MOE + ["--moe-token-dispatcher-type", "allgather"] + PADDED,
     "MoE with --moe-token-dispatcher-type allgather: its dispatch_postprocess reads the per-expert token "
     "counts back to the host"),
    (TINY + MOE + ALLTOALL + PADDED + ["SCOPE", "moe_router", "moe_preprocess"],
     "MoE with --cuda-graph-modules moe_router moe_preprocess: under --cuda-graph-impl local GPT's "
     "TransformerLayer graphs the whole layer for attn / mlp and builds no graph for moe"),
    (TINY + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-granularity full: Megatron allows full recompute only with the full_iteration graph"),
    (TINY + ["--recompute-granularity", "selective"],       # Megatron's default attention dropout 0.1
     "--recompute-granularity selective (core_attn) with --attention-dropout > 0: Megatron does not "
     "recompute graphed attention that draws dropout"),
]


@real_parser
def test_real_parser_decisions(python):
    """Each command line through parse_args: accepted ones get --cuda-graph-impl local with the
    whole-layer scope, which Megatron's validate_args and TransformerConfig take; refused ones stay
    eager with the reason in the report (a fallback, under `local`) and on stderr; every MoE
    refusal names what would capture. A launch's own --cuda-graph-impl is kept even for dropless
    MoE (the user's call, checked by Megatron alone)."""
    own_flag = TINY + MOE + ALLTOALL + ["--cuda-graph-impl", "local"]
    fp8 = TINY + FP8 + ["tensorwise"]          # fp8 linears capture too (docs/fp8.md)
    cases = [argv for argv, _ in ACCEPTED + REFUSED] + [own_flag, fp8]
    proc, outs = parse_cases(python, cases)
    assert proc.returncode == 0 and len(outs) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    for (argv, scope), out in zip(ACCEPTED, outs):
        assert out["impl"] == "local" and out["fallbacks"] == [], out
        assert out["switch"] == [f"--cuda-graph-impl local (MEGATRON_ADAPT_CUDA_GRAPHS=local): {scope}"], out
        moe = "--num-experts" in argv
        # validate_args and TransformerConfig.__post_init__ took it: the local impl, whole-layer scope
        assert out["config"] == ["local", [], 4 if moe else None, moe], out
        captured = out["stderr"].split("captured: ", 1)[1].splitlines()[0]
        assert captured.startswith("every transformer layer whole"), captured
        assert ("capacity-padded permute, all-to-all, grouped experts, unpermute" in captured) == moe, captured
        assert "eager: embedding, output layer, loss and optimizer" in captured, captured
    for (argv, reason), out in zip(REFUSED, outs[len(ACCEPTED):]):
        assert out["impl"] == "none" and len(out["fallbacks"]) == 1, out
        assert out["fallbacks"][0].startswith(reason), out["fallbacks"][0]
        assert f"MEGATRON_ADAPT_CUDA_GRAPHS=local: running eager: {reason}" in out["stderr"]
        if "--num-experts" in argv:
            assert TO_PAD in out["fallbacks"][0], out["fallbacks"][0]
    own = outs[-2]
    assert own["impl"] == "local" and own["switch"] == ["--cuda-graph-impl local (the launch's own flag kept)"], own
    assert outs[-1]["impl"] == "local" and outs[-1]["fallbacks"] == [], outs[-1]
    assert outs[-1]["switch"] == ["--cuda-graph-impl local (MEGATRON_ADAPT_CUDA_GRAPHS=local): whole layers"], outs[-1]


@real_parser
def test_real_parser_dropless_moe_auto_and_strict(python):
    reason = "dropless MoE (--num-experts without a capacity factor)"
    _, (auto,) = parse_cases(python, [TINY + MOE + ALLTOALL], mode="auto")
    assert auto["impl"] == "none" and auto["fallbacks"] == [] and \
        auto["switch"][0].startswith(f"eager (MEGATRON_ADAPT_CUDA_GRAPHS=auto: {reason}")
    strict, _ = parse_cases(python, [TINY + MOE + ALLTOALL], strict=True)
    assert strict.returncode != 0 and "StrictFallbackError" in strict.stderr and reason in strict.stderr


PACKED = textwrap.dedent("""
    import types
    import megatron_adapt
    megatron_adapt.apply("cpu", quiet=True)
    from megatron_adapt.patches.cuda_graphs import build_switch, packed_refusal
    cuda = types.SimpleNamespace(name="cuda")
    for flag in ("sft", "dataloader_inter_document_masking"):
        ns = types.SimpleNamespace(cuda_graph_impl="none", num_experts=None, **{{flag: True}})
        print("IMPL", build_switch(cuda, None)(lambda: ns, None, (), {{}}).cuda_graph_impl)
        print("REFUSED", packed_refusal(cuda, {{"cuda_graph_impl": "local", flag: True}}))
        print("SERVED", packed_refusal(cuda, {{"cuda_graph_impl": "none", flag: True}}),
              packed_refusal(cuda, {{"cuda_graph_impl": "local", flag: False}}))
""")


def test_packed_sequences_stay_eager_and_a_launch_flag_is_refused(python):
    """Packed (thd) batches: the THD attention lays out each batch's documents from cu_seqlens read
    on the host, which a graph replay would not redo. The switch says so and runs eager; a launch's own
    --cuda-graph-impl with --sft / --dataloader-inter-document-masking is refused at start."""
    proc = python(PACKED.format(), env={"MEGATRON_ADAPT_CUDA_GRAPHS": "auto"}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("IMPL none") == 2, proc.stdout
    for flag in ("--sft", "--dataloader-inter-document-masking"):
        assert (f"MEGATRON_ADAPT_CUDA_GRAPHS=auto: running eager: {flag}: packed (thd) attention reads each "
                "batch's cu_seqlens on the host") in proc.stderr, proc.stderr
        assert (f"REFUSED {flag} with --cuda-graph-impl local: the cuda backend cannot run it: packed (thd) "
                "attention reads") in proc.stdout, proc.stdout
    assert proc.stdout.count("SERVED None None") == 2, proc.stdout


# ---- the default (auto), what auto leaves eager, a typed flag ---------------------------------------

def test_default_is_auto_and_says_so(python):
    """No MEGATRON_ADAPT_CUDA_GRAPHS: a pretrain_gpt.py launch on cuda gets Megatron's layer graphs,
    the report and the start-up line say it was the default and how to turn it off."""
    proc = run_case(python, None)
    assert proc.returncode == 0, proc.stderr
    assert "IMPL local" in proc.stdout
    assert "--cuda-graph-impl local (MEGATRON_ADAPT_CUDA_GRAPHS=auto (default)): whole layers" in proc.stdout
    assert ("MEGATRON_ADAPT_CUDA_GRAPHS=auto (default): turned on Megatron's --cuda-graph-impl local" in proc.stderr
            and "MEGATRON_ADAPT_CUDA_GRAPHS=off or --cuda-graph-impl none runs eager" in proc.stderr), proc.stderr


def test_default_on_a_backend_without_graphs_is_in_the_report_only(python):
    proc = run_case(python, None, backend="cpu")
    assert proc.returncode == 0 and "IMPL none" in proc.stdout, proc.stderr
    assert ("eager (MEGATRON_ADAPT_CUDA_GRAPHS=auto (default): CUDA graphs need the cuda backend "
            "(this process runs cpu))") in proc.stdout
    assert "MEGATRON_ADAPT_CUDA_GRAPHS" not in proc.stderr, proc.stderr
    chosen = run_case(python, "auto", backend="cpu")          # chosen by the user: said on stderr too
    assert "MEGATRON_ADAPT_CUDA_GRAPHS=auto: running eager: CUDA graphs need the cuda backend" in chosen.stderr


@pytest.mark.parametrize("argv", [["pretrain_gpt.py", "--cuda-graph-impl", "none"],
                                  ["pretrain_gpt.py", "--cuda-graph-impl=none"]])
def test_a_typed_none_wins_over_the_default(python, argv):
    proc = run_case(python, None, argv=argv)
    assert "IMPL none" in proc.stdout and "--cuda-graph-impl none (the launch's own flag kept)" in proc.stdout
    assert "turned on" not in proc.stderr


@pytest.mark.parametrize("case,reason", [
    (dict(argv=["pretrain_mamba.py"]), "auto turns graphs on for pretrain_gpt.py launches, where "
                                        "megatron-adapt measured them (this process runs pretrain_mamba.py)"),
    (dict(cp=2), "--context-parallel-size 2: graphs are not yet measured with it here"),
])
def test_auto_leaves_unmeasured_configurations_eager_local_tries_them(python, case, reason):
    auto = run_case(python, None, **case)
    assert "IMPL none" in auto.stdout and reason in auto.stdout, auto.stdout
    assert f"running eager: {reason}" in auto.stderr and "MEGATRON_ADAPT_CUDA_GRAPHS=local or" in auto.stderr
    local = run_case(python, "local", **case)
    assert "IMPL local" in local.stdout, local.stdout


def test_expandable_segments_without_nccl_graph_register_stay_eager(python):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    proc = run_case(python, None, extra_env=env)
    assert "IMPL none" in proc.stdout and "set NCCL_GRAPH_REGISTER=0" in proc.stdout, proc.stdout
    ok = run_case(python, None, extra_env={**env, "NCCL_GRAPH_REGISTER": "0"})
    assert "IMPL local" in ok.stdout, ok.stdout


EVAL = textwrap.dedent("""
    import torch
    from megatron.core.transformer.module import MegatronModule
    from megatron_adapt.patches.cuda_graphs import build_eval_eager
    class Layer(MegatronModule):
        def __init__(self):
            torch.nn.Module.__init__(self)
        def forward(self, x, inference_context=None):
            return "eager"
    manager = type("Manager", (), {{"func": {func}}})()
    call = build_eval_eager(None, None)
    graphs = lambda module, args, kwargs: "graph"        # Megatron's CudaGraphManager.__call__
    layer = Layer()
    print("TRAIN", call(graphs, manager, (layer, (1,), {{}}), {{}}))
    layer.eval()
    print("EVAL", call(graphs, manager, (layer, (1,), {{}}), {{}}))
    print("INFERENCE", call(graphs, manager, (layer, (1,), {{"inference_context": object()}}), {{}}))
    # core 0.19's inline capture of one function, no backward: captured in eval mode by design
    inline = type("Manager", (), {{"func": None, "_inline_capture": True, "need_backward": False}})()
    print("INLINE", call(graphs, inline, (layer, (1,), {{}}), {{}}))
    print("NOT A MODULE", call(graphs, inline, (object(), (1,), {{}}), {{}}))
    from megatron_adapt import report
    print("COUNTS", report.op_counts().get("cuda_graph_layer_forward"))
""")


@pytest.mark.parametrize("func", ["None", "lambda *a, **k: 'eager func'"])
def test_a_layer_in_eval_mode_runs_eager_under_graphs(python, func):
    """CudaGraphManager.__call__ wrapped: training and inference (with an inference_context) go to
    Megatron's graphs, a validation forward (eval mode) to the module's eager forward (the manager's
    own func where Megatron set one). tests/cuda/test_cuda_graphs.py checks it with real graphs."""
    proc = python(EVAL.format(func=func))
    eager = "eager func" if func != "None" else "eager"
    assert f"TRAIN graph\nEVAL {eager}\nINFERENCE graph\nINLINE graph\nNOT A MODULE graph" in proc.stdout, proc.stdout
    # the report counts the eval-mode forwards that ran eager (training ones are Megatron's graphs)
    assert "COUNTS {'eager (eval mode: validation)': 1}" in proc.stdout, proc.stdout


def test_tensor_parallel_is_captured_pipeline_parallel_is_refused(python):
    """auto takes tensor parallelism (measured on 2 GPUs, docs/cuda-graphs.md); pipeline parallelism
    stays eager in every mode: Megatron's schedule asserts on the layer graphs' view outputs."""
    tp = run_case(python, None, tp=2)
    assert "IMPL local" in tp.stdout, tp.stdout
    why = "--pipeline-model-parallel-size 2: Megatron's pipeline schedule frees each stage's output"
    for mode in (None, "local"):
        pp = run_case(python, mode, pp=2)
        assert "IMPL none" in pp.stdout and why in pp.stdout and "counter-productive to free a view" in pp.stdout, pp.stdout


BUILD_REPORT = textwrap.dedent("""
    import torch, types
    import megatron_adapt
    from megatron_adapt import report
    megatron_adapt.apply("cpu", quiet=True)
    from megatron_adapt.patches import cuda_graphs
    capturing = [False]
    torch.cuda.is_available = lambda: True                          # a GPU and the build's capture
    torch.cuda.is_current_stream_capturing = lambda: capturing[0]   # phases, faked
    report.ran("rms_norm", "cuda.triton")                            # before the build: neither count

    def build():   # Megatron's builder: warm-up runs eagerly, then the capture, per layer
        for layer in range(2):
            for warmup in range(3):
                report.ran("fp8_wgrad", "cuda.scaled_mm+main_grad.add_ (eager)")
            capturing[0] = True
            report.ran("fp8_wgrad", "cuda.cublaslt(beta=1, nvmath)")
            report.ran("rms_norm", "cuda.triton")
            capturing[0] = False

    cuda_graphs._capturing(types.SimpleNamespace(name="cuda"), "Megatron (test)", 4, build)
    (built,) = report.as_dict()["cuda_graphs"]
    print("CAPTURED", sorted(built["captured_ops"].items()))
    print("WARMUP", sorted(built["warmup_ops"].items()))
    report.ran("rms_norm", "cuda.triton")                            # after it: counted once, as always
    print("TOTAL", report.op_counts()["rms_norm"], report.uncaptured_counts())
    print("TABLE", report.format_table().splitlines()[-1])
""")


def test_a_graph_build_tells_its_captured_calls_from_its_warmup_runs(python):
    """Megatron's builder runs each layer eagerly (its warm-up runs) before capturing it: the report's
    `captured_ops` holds only calls made while the stream captures, `warmup_ops` the eager ones (an
    fp8 wgrad's eager `add_` path in warm-up is not in the graphs), and counting stops after the build."""
    proc = python(BUILD_REPORT)
    assert ("CAPTURED [('fp8_wgrad [cuda.cublaslt(beta=1, nvmath)]', 2), ('rms_norm [cuda.triton]', 2)]"
            in proc.stdout), proc.stdout + proc.stderr
    assert "WARMUP [('fp8_wgrad [cuda.scaled_mm+main_grad.add_ (eager)]', 6)]" in proc.stdout, proc.stdout
    assert "TOTAL {'cuda.triton': 4} {'fp8_wgrad': {'cuda.scaled_mm+main_grad.add_ (eager)': 6}}" in proc.stdout, proc.stdout
    assert "run eagerly in the builder's warm-up runs: fp8_wgrad" in proc.stdout, proc.stdout
    assert "2 backend op calls" not in proc.stderr and "4 backend op calls captured" in proc.stderr, proc.stderr
    assert "6 more ran eagerly in the builder's warm-up runs" in proc.stderr, proc.stderr

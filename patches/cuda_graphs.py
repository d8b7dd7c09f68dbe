"""Megatron's own CUDA graphs (--cuda-graph-impl local): say in the report that they were built
and which backend ops ran inside them; name the op when one cannot be captured.

`megatron.core.transformer.cuda_graphs.create_cudagraphs` runs at the end of every schedule
function; on the first step it captures every recorded layer's forward and backward graph (the
layers ran eagerly once to record the order, and the backend's run-time choices among libraries
were made then: providers never time anything inside a capture). The wrapper counts the graphs
and the op calls made while capturing (report: cuda_graphs, `captured_ops`); the calls Megatron's
warm-up runs make eagerly before each capture are counted apart (`warmup_ops`). If a capture raises, the error is
raised again naming the innermost megatron-adapt backend frame it came through (module, function
and the ops that module serves), so a kernel that cannot be captured is named, not guessed.

`--cuda-graph-scope full_iteration` goes another way: `megatron.core.full_cuda_graph.
FullCudaGraphWrapper` wraps the whole forward-backward function (every micro-batch) and captures
it once, at iteration `--cuda-graph-warmup-steps`. Its `__call__` is wrapped the same way: that
capture is counted and reported, and a failure inside a backend op is named.

MEGATRON_ADAPT_CUDA_GRAPHS=auto (the default) | local | off turns Megatron's own `--cuda-graph-impl
local` on without editing a launch script (`parse_args` wrapped: the flag is set before
`validate_args` checks it). Small models' eager steps wait on the host (docs/host-time.md); graphs
replay a layer's kernels with one launch. `auto` turns graphs on only where megatron-adapt measured
them (stock pretrain_gpt.py; data and tensor parallel, not context / expert parallel) and Megatron
can capture (never with pipeline parallelism: Megatron's schedule asserts on the graphs' outputs);
everywhere else the run stays eager and the start-up line and the report say why. `local` tries every configuration Megatron can capture (an
eager fallback is a fallback, an error under MEGATRON_ADAPT_STRICT=1). A launch's own
--cuda-graph-impl, `none` included, always wins; `off` leaves Megatron's flags alone.
MoE (`--num-experts`) is captured whole-layer only, and only with the alltoall dispatcher and
capacity-padded dispatch (static shapes, nothing read back to the host); `_moe_why_not` says why
everything else is refused, docs/moe.md ("CUDA graphs") has Megatron's code for it.

Evaluation under layer graphs runs eager (`build_eval_eager`): Megatron's CudaGraphManager replays the
training-mode graph for a layer in eval mode, dropout and MoE aux-loss bookkeeping included, so a
validation loss would be computed with dropout on.
"""
import os
import sys
import time

from megatron_adapt import report, start_checks
from megatron_adapt.spec import WRAP, PatchSpec

def _backend_frame(exc):
    """Where in megatron-adapt's backends exc was raised: (innermost frame of a module that
    serves ops, as 'backends/<backend>/<module>.py (function)'; the ops that module serves;
    the innermost backend frame of any module), or None. Chained causes are searched too."""
    from megatron_adapt import backends
    from megatron_adapt.backends import STANDARD_LAYOUT

    served = {}
    for op, path in STANDARD_LAYOUT.items():
        served.setdefault(path.split(":")[0][1:], []).append(op)
    root = os.path.dirname(os.path.abspath(backends.__file__)) + os.sep
    op_frame, inner, seen, e = None, None, set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            path = os.path.abspath(code.co_filename)
            if path.startswith(root) and os.sep in path[len(root):]:   # backends/<backend>/<module>.py
                module = os.path.splitext(os.path.basename(path))[0]
                where = (f"backends/{path[len(root):].replace(os.sep, '/')} "
                         f"({getattr(code, 'co_qualname', code.co_name)})")
                inner = where
                if module in served:
                    op_frame = (where, sorted(served[module]))
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    if inner is None:
        return None
    where, ops = op_frame or (inner, [])
    return where, ops, inner


class GraphCaptureError(RuntimeError):
    """A CUDA graph capture failed inside a megatron-adapt backend op."""


def _capturing(backend, label, graphs, run):
    """run() captures `graphs` CUDA graphs: count the backend op calls made meanwhile, report them,
    and name the op if the capture fails inside one."""
    import torch

    before, warm_before = report.op_counts(), report.uncaptured_counts()
    t0 = time.perf_counter()
    try:
        # no CUDA (the interpreter's tests of this wrapper): nothing captures, every call counts as before
        with report.building_graphs(torch.cuda.is_current_stream_capturing if torch.cuda.is_available()
                                    else None):
            result = run()
    except Exception as exc:
        where = _backend_frame(exc)
        if where is None:
            raise
        site, ops, inner = where
        raise GraphCaptureError(
            f"CUDA graph capture ({label}) failed in megatron-adapt's "
            f"{backend.name} backend op {' / '.join(ops) or '?'}, at {site}"
            f"{'' if inner == site else f' (innermost: {inner})'}: {type(exc).__name__}: {exc}. "
            f"That op cannot run inside a CUDA graph: disable its patch area "
            f"(MEGATRON_ADAPT_DISABLE) or run without --cuda-graph-impl.") from exc
    after, warm_after = report.op_counts(), report.uncaptured_counts()
    captured, warmup = {}, {}
    for op, impls in after.items():
        for impl, n in impls.items():
            warm = warm_after.get(op, {}).get(impl, 0) - warm_before.get(op, {}).get(impl, 0)
            inside = n - before.get(op, {}).get(impl, 0) - warm
            if inside:
                captured[f"{op} [{impl}]"] = inside
            if warm:
                warmup[f"{op} [{impl}]"] = warm
    seconds = round(time.perf_counter() - t0, 3)
    report.graphs_built(label, graphs, seconds, captured, warmup)
    if report._rank() == 0:
        print(f"megatron-adapt: {graphs} CUDA graphs built by {label} in {seconds} s, "
              f"{sum(captured.values())} backend op calls captured in them: "
              + (", ".join(f"{k} x{v}" for k, v in captured.items()) or "none")
              + (f"; {sum(warmup.values())} more ran eagerly in the builder's warm-up runs"
                 if warmup else ""), file=sys.stderr, flush=True)
    return result


def build(backend, original):
    def create_cudagraphs(wrapped, instance, args, kwargs):
        from megatron.core.transformer import cuda_graphs as cg

        record = getattr(cg, "_CudagraphGlobalRecord", None)
        pending = 0 if record is None or record.cudagraph_created else len(record.cudagraph_record)
        if not pending:
            return wrapped(*args, **kwargs)
        return _capturing(backend, "Megatron (--cuda-graph-impl local)", pending,
                          lambda: wrapped(*args, **kwargs))
    return create_cudagraphs


def build_full_iteration(backend, original):
    def full_iteration_call(wrapped, instance, args, kwargs):
        stage = "validation" if kwargs.get("forward_only") else "training"
        captures = (instance.curr_iter(stage) == instance.cuda_graph_warmup_steps
                    and type(instance).cuda_graph.get(stage) is None)
        if not captures:
            return wrapped(*args, **kwargs)
        return _capturing(backend, f"Megatron (--cuda-graph-impl local --cuda-graph-scope full_iteration, "
                                   f"{stage})", 1,
                          lambda: wrapped(*args, **kwargs))
    return full_iteration_call


def _scope_names(args) -> list[str]:
    """The launch's --cuda-graph-modules (0.19) / --cuda-graph-scope (0.15 - 0.18) as names, as
    parse_args leaves them (enum members or strings); "full" means whole layers, as empty does."""
    raw = getattr(args, "cuda_graph_modules", None) or getattr(args, "cuda_graph_scope", None) \
        or getattr(args, "cuda_graph_scope_deprecated", None) or []
    if isinstance(raw, str):
        raw = raw.split(",")
    return [n for n in (getattr(v, "name", v) for v in raw) if n != "full"]


def _capacity_padded(args) -> bool:
    """--moe-expert-capacity-factor (>= 0; Megatron reads a negative one as dropless) with
    --moe-pad-expert-input-to-capacity: every expert gets exactly `capacity` rows."""
    factor = getattr(args, "moe_expert_capacity_factor", None)
    return factor is not None and factor >= 0 and bool(getattr(args, "moe_pad_expert_input_to_capacity", False))


PADDED = "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"


def _moe_why_not(args) -> str | None:
    """Why whole-layer graphs cannot capture this MoE configuration, or None.

    Megatron's local graphs (CudaGraphManager) capture a GPT layer whole: GPT's layer specs build
    TransformerLayer, whose create_mcore_cudagraph_manager gives the whole layer one graph for an
    empty scope or `attn` / `mlp`, and no graph at all for `moe`, `moe_router`, `moe_preprocess`
    (the partial MoE graphs are MoETransformerLayer's, which only the hybrid / Mamba specs build).
    So an MoE layer is captured whole or not at all, and whole needs static shapes with nothing
    read back to the host: the alltoall dispatcher with capacity-padded dispatch."""
    dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
    if dispatcher != "alltoall":
        why = {"allgather": "its dispatch_postprocess reads the per-expert token counts back to the host "
                            "(.cpu(), .item()) in every layer, padded or not",
               "flex": "the flex dispatcher's all-to-all is DeepEP's / HybridEP's, not served"}
        return (f"MoE with --moe-token-dispatcher-type {dispatcher}: "
                f"{why.get(dispatcher, 'not a dispatcher megatron-adapt has checked for capture')}; "
                f"whole-layer graphs need alltoall with {PADDED}")
    scopes = _scope_names(args)
    if scopes:
        return (f"MoE with --cuda-graph-modules {' '.join(scopes)}: under --cuda-graph-impl local GPT's "
                "TransformerLayer graphs the whole layer for attn / mlp and builds no graph for moe / "
                "moe_router / moe_preprocess (those partial graphs are MoETransformerLayer's, which GPT's "
                f"layer specs do not build); leave the scope empty and use {PADDED}")
    if not _capacity_padded(args):
        factor = getattr(args, "moe_expert_capacity_factor", None)
        dropping = factor is not None and factor >= 0
        what = ("MoE token dropping without padding (--moe-expert-capacity-factor without "
                "--moe-pad-expert-input-to-capacity)" if dropping else
                "dropless MoE (--num-experts without a capacity factor)")
        return (f"{what}: the alltoall dispatcher copies every layer's per-expert token counts to the "
                "host and waits for them (sizes change every step), so whole-layer graphs cannot capture "
                "the MoE layer, and the local implementation has no partial MoE graph for GPT's "
                f"TransformerLayer; {PADDED} gives static shapes that whole-layer graphs capture")
    return None


def _packed_flags(settings: dict) -> list[str]:
    return [flag for flag, name in (("--sft", "sft"),
                                    ("--dataloader-inter-document-masking", "dataloader_inter_document_masking"))
            if settings.get(name)]


PACKED_WHY = ("packed (thd) attention reads each batch's cu_seqlens on the host to lay out its "
              "documents, which a graph replay would not redo")


def packed_refusal(backend, args) -> str | None:
    """A launch's own --cuda-graph-impl with packed sequences: refused at start."""
    graphs = args.get("cuda_graph_impl") or "none"
    flags = _packed_flags(args)
    if graphs == "none" or not flags:
        return None
    return (f"{' '.join(flags)} with --cuda-graph-impl {graphs}: {start_checks.where(backend)} cannot run it: "
            f"{PACKED_WHY}. Use one of the two.")


start_checks.register("cuda_graphs", "packed_sequences", from_args=packed_refusal)


def _before_sm100() -> bool:
    import torch
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10


def graph_plan(args, backend_name: str) -> str | None:
    """Why Megatron's layer-scope CUDA graphs cannot capture this configuration, or None if they can."""
    if backend_name != "cuda":
        return f"CUDA graphs need the cuda backend (this process runs {backend_name})"
    packed = _packed_flags(vars(args))
    if packed:
        return f"{' '.join(packed)}: {PACKED_WHY}"
    if getattr(args, "num_experts", None):
        why = _moe_why_not(args)
        if why:
            return why
    if getattr(args, "fp8", None) and str(getattr(args, "fp8_recipe", "delayed")).endswith("delayed") \
            and int(getattr(args, "fp8_interval", 1) or 1) > 1:
        return ("--fp8-interval > 1: a captured layer replays its delayed-scaling update every step "
                "(docs/fp8.md)")
    if getattr(args, "cpu_offloading", False) or getattr(args, "cpu_offloading_num_layers", 0):
        return "--cpu-offloading moves activations to the host inside the layer"
    if getattr(args, "recompute_granularity", None) == "full":
        return ("--recompute-granularity full: Megatron allows full recompute only with the "
                "full_iteration graph (TransformerConfig), not with layer graphs")
    pipeline = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if pipeline > 1:
        return (f"--pipeline-model-parallel-size {pipeline}: Megatron's pipeline schedule frees each stage's "
                "output, and under layer graphs that output is a view (the recording node returns its input): "
                "AssertionError 'counter-productive to free a view of another tensor' in the first step "
                "(measured on 2 H100s, core_v0.16.1)")
    recomputed = _graphed_recompute_with_dropout(args)
    if recomputed:
        return recomputed
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") \
            and os.environ.get("NCCL_GRAPH_REGISTER", "") != "0" and _before_sm100():
        return ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True without NCCL_GRAPH_REGISTER=0: Megatron's "
                "CudaGraphManager refuses it before sm100 (illegal memory access); set NCCL_GRAPH_REGISTER=0")
    if getattr(args, "inference_dynamic_batching", False) or getattr(args, "enable_cuda_graph", False) \
            or getattr(args, "external_cuda_graph", False):
        return "Megatron's own CUDA graph flags are set"
    return None


def _graphed_recompute_with_dropout(args) -> str | None:
    """TransformerConfig refuses selective recompute of a module that draws dropout inside a
    whole-layer graph (its recompute would draw other masks)."""
    if getattr(args, "recompute_granularity", None) != "selective":
        return None
    modules = getattr(args, "recompute_modules", None) or ["core_attn"]   # Megatron's default
    if getattr(args, "attention_dropout", 0.0) and "core_attn" in modules:
        return ("--recompute-granularity selective (core_attn) with --attention-dropout > 0: Megatron "
                "does not recompute graphed attention that draws dropout (TransformerConfig)")
    if getattr(args, "hidden_dropout", 0.0) and {"mlp", "moe"} & set(modules):
        return ("--recompute-modules mlp / moe with --hidden-dropout > 0: Megatron does not recompute "
                "a graphed MLP / MoE that draws dropout (TransformerConfig)")
    return None


MEASURED_SCRIPTS = ("pretrain_gpt.py",)
UNMEASURED_PARALLEL = (("--context-parallel-size", "context_parallel_size"),
                       ("--expert-model-parallel-size", "expert_model_parallel_size"))
TRY = "MEGATRON_ADAPT_CUDA_GRAPHS=local or --cuda-graph-impl local to try them"


def auto_plan(args, backend_name: str, script: str) -> str | None:
    """graph_plan, narrowed to what megatron-adapt measured graphs with (auto): stock
    pretrain_gpt.py's models, data and tensor parallel (docs/cuda-graphs.md). Context and expert
    parallel layers capture their all-to-alls / ring exchanges too, but are not measured here
    against eager for loss and memory."""
    why = graph_plan(args, backend_name)
    if why:
        return why
    if os.path.basename(script or "") not in MEASURED_SCRIPTS:
        return (f"auto turns graphs on for pretrain_gpt.py launches, where megatron-adapt measured them "
                f"(this process runs {os.path.basename(script or '') or 'no script'}); {TRY}")
    for flag, name in UNMEASURED_PARALLEL:
        size = int(getattr(args, name, 1) or 1)
        if size > 1:
            return f"{flag} {size}: graphs are not yet measured with it here; {TRY}"
    return None


def typed_impl(argv: list[str]) -> str | None:
    """The --cuda-graph-impl value the launch typed (`none` included), or None."""
    for i, arg in enumerate(argv):
        if arg == "--cuda-graph-impl" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--cuda-graph-impl="):
            return arg.split("=", 1)[1]
    return None


def captured(args) -> str:
    """What the layer graphs capture for this configuration (graph_plan(...) is None), and what
    stays eager."""
    if getattr(args, "num_experts", None):
        layers = ("every transformer layer whole, MoE layers included: norms, attention, router and aux "
                  "loss, capacity-padded permute, all-to-all, grouped experts, unpermute")
    else:
        layers = "every transformer layer whole: norms, attention, MLP"
    return (f"{layers}, forward and backward; eager: embedding, output layer, loss and optimizer "
            "(outside the layers, which are all Megatron's layer graphs cover)")


def build_switch(backend, original):
    def parse_args(wrapped, instance, args, kwargs):
        from megatron_adapt.core import active_config

        ns = wrapped(*args, **kwargs)
        config = active_config()
        mode = config.cuda_graphs
        if mode == "off":
            return ns
        current = getattr(ns, "cuda_graph_impl", "none")
        typed = typed_impl(sys.argv[1:])
        if current != "none" or typed is not None:
            report.ran("cuda_graphs.switch", f"--cuda-graph-impl {current} (the launch's own flag kept)")
            return ns
        setting = f"MEGATRON_ADAPT_CUDA_GRAPHS={mode}" + ("" if config.cuda_graphs_chosen else " (default)")
        why_not = (graph_plan(ns, backend.name) if mode == "local"
                   else auto_plan(ns, backend.name, sys.argv[0] if sys.argv else ""))
        if why_not is None:
            ns.cuda_graph_impl = "local"
            scope = "whole layers, MoE capacity-padded" if getattr(ns, "num_experts", None) else "whole layers"
            report.ran("cuda_graphs.switch", f"--cuda-graph-impl local ({setting}): {scope}")
            message = (f"{setting}: turned on Megatron's --cuda-graph-impl local; captured: {captured(ns)}; "
                       "MEGATRON_ADAPT_CUDA_GRAPHS=off or --cuda-graph-impl none runs eager")
        elif mode == "local":
            report.fell_back("cuda_graphs.switch", "eager", why_not)
            message = f"{setting}: running eager: {why_not}"
        else:
            report.ran("cuda_graphs.switch", f"eager ({setting}: {why_not})")
            message = f"{setting}: running eager: {why_not}"
            if not config.cuda_graphs_chosen and backend.name != "cuda":
                message = None      # the default on a backend without graphs: the report has it
        if message:
            report.say_once(message)   # pretrain_gpt parses more than once
        return ns
    return parse_args




def build_eval_eager(backend, original):
    """A layer in eval mode (validation, not inference with an inference_context) runs eager: the
    replayed graph is the training-mode forward, with its dropout masks and MoE aux-loss tracking."""
    def call(wrapped, instance, args, kwargs):
        module, call_args, call_kwargs = args[0], args[1], args[2]
        if (getattr(module, "training", True) or call_kwargs.get("inference_context")
                # a manager for one function without backward (core 0.19's inline capture) is not a
                # layer's training graph: it captures and replays in eval mode by design
                or getattr(instance, "_inline_capture", False) or not getattr(instance, "need_backward", True)):
            return wrapped(*args, **kwargs)
        report.ran("cuda_graph_layer_forward", "eager (eval mode: validation)")
        func = getattr(instance, "func", None)
        if func is not None:
            return func(*call_args, **call_kwargs)
        from megatron.core.transformer.module import MegatronModule
        return super(MegatronModule, module).__call__(*call_args, **call_kwargs)
    return call


def build_mla_rope_cache_copies(backend, original):
    """core 0.18+: CudaGraphRunner.create_fwd_graph backs up every buffer of the layer it captures
    and copies each back in place after the forward capture (so the warm-up runs cannot move the MoE
    router's expert bias). Multi-latent attention's fused RoPE (Megatron's Triton kernels) saves
    YaRN's cos / sin cache for its backward: slices of that layer's buffers. The copy back bumps
    their version, and the backward capture fails ("modified by an inplace operation"), in bf16 and
    fp8, with TE or without. Inside a capture the kernels get copies of cos / sin (2048 positions x
    64 in bf16: 256 KiB each per layer), which the restore leaves alone; eager runs are unchanged."""
    import inspect

    import torch

    from megatron_adapt.spec import SkipPatch

    if original is None:
        raise SkipPatch("Megatron's fused MLA RoPE did not import (no Triton)")
    signature = inspect.signature(original)

    def call(wrapped, instance, args, kwargs):
        if not torch.cuda.is_current_stream_capturing():
            return wrapped(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        for name in ("cos", "sin"):
            bound.arguments[name] = bound.arguments[name].clone()
        report.ran("mla_rope_capture", "cuda.cos_sin_copies (inside a capture: core 0.18+ restores layer buffers in place)")
        return wrapped(*bound.args, **bound.kwargs)
    return call


MLA = "megatron.core.transformer.multi_latent_attention"

SPECS = [
    PatchSpec("megatron.training.arguments:parse_args", area="cuda_graphs", mode=WRAP,
              build=build_switch, optional=True),
    PatchSpec("megatron.core.transformer.cuda_graphs:create_cudagraphs", area="cuda_graphs",
              mode=WRAP, build=build),
    PatchSpec("megatron.core.transformer.cuda_graphs:CudaGraphManager.__call__", area="cuda_graphs",
              mode=WRAP, build=build_eval_eager),
    PatchSpec("megatron.core.full_cuda_graph:FullCudaGraphWrapper.__call__", area="cuda_graphs",
              mode=WRAP, build=build_full_iteration),
    # the buffer restore after a layer's forward capture came with core 0.18 (cuda_graphs.py)
    *(PatchSpec(f"{MLA}:fused_apply_mla_rope_for_{part}", area="cuda_graphs", mode=WRAP, backends=("cuda",),
                versions=">=0.18.0,<0.20.0", build=build_mla_rope_cache_copies, check_signature=False)
      for part in ("q", "kv")),
]

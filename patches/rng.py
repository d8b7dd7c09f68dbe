"""Megatron's "CUDA" RNG state accessors, on the backend's own generator.

`_set_cuda_rng_state` defers its work through `torch.cuda._lazy_call`, which on a build without
CUDA silently queues the callback forever: the RNG tracker would never switch states.

`CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None` (True) on every release
0.15-0.19, so without Transformer Engine its forward NameErrors on `FP8GlobalStateManager`: the
activation-recompute helper (MLA / MoE `--recompute-modules`, Megatron's own unit test) cannot run.
Without TE (the module's HAVE_TE) fp8 is off; asking for it (fp8 truthy) is a clear error.

`initialize_rng_tracker(use_te_rng_tracker=True)` asks for TE's tracker, whose point is that CUDA
graphs can capture it. Without TE Megatron silently builds its plain tracker instead, and a graph
capture then stops at "RNG tracker does not support cudagraphs!" (Megatron's RL unit test sets it
up that way; its training start-up passes use_cudagraphable_rng itself). On the cuda backend that
request becomes Megatron's own graph-safe tracker (use_cudagraphable_rng=True), TE's counterpart.
"""
import sys

from megatron_adapt.spec import WRAP, PatchSpec, SkipPatch

MODULE = "megatron.core.tensor_parallel.random"


def build_get(backend, original):
    get_state = backend.op("rng_get_state")

    def _get_cuda_rng_state(device=None, clone=False, graph_safe=False):
        state = get_state()
        return state.clone() if clone else state
    return _get_cuda_rng_state


def build_set(backend, original):
    set_state = backend.op("rng_set_state")

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        set_state(new_state)
    return _set_cuda_rng_state


def build_checkpoint_init(backend, original):
    if getattr(sys.modules[MODULE], "HAVE_TE", True):
        raise SkipPatch("Transformer Engine installed: Megatron's FP8 state manager is there")

    def __init__(self, fp8=False):
        if fp8:
            raise RuntimeError("CheckpointWithoutOutput(fp8=True) needs Transformer Engine's FP8 state "
                               "manager; Transformer Engine is not installed")
        original(self, fp8)
        self.fp8 = False
    return __init__


def build_initialize_rng_tracker(backend, original):
    if getattr(sys.modules[MODULE], "HAVE_TE", True):
        raise SkipPatch("Transformer Engine installed: use_te_rng_tracker gets TE's tracker")
    import inspect

    signature = inspect.signature(original)

    def initialize_rng_tracker(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("use_te_rng_tracker"):
            bound.arguments["use_cudagraphable_rng"] = True
        return wrapped(*bound.args, **bound.kwargs)
    return initialize_rng_tracker


SPECS = [
    PatchSpec(f"{MODULE}:initialize_rng_tracker", area="rng", build=build_initialize_rng_tracker,
              mode=WRAP, backends=("cuda",)),
    PatchSpec(f"{MODULE}:CheckpointWithoutOutput.__init__", area="rng", build=build_checkpoint_init),
    PatchSpec(f"{MODULE}:_get_cuda_rng_state", area="rng", build=build_get, backends=("cpu", "npu")),
    PatchSpec(f"{MODULE}:_set_cuda_rng_state", area="rng", build=build_set, backends=("cpu", "npu")),
]

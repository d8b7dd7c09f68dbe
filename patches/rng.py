"""Megatron's "CUDA" RNG state accessors, on the backend's own generator.

`_set_cuda_rng_state` defers its work through `torch.cuda._lazy_call`, which on a build without
CUDA silently queues the callback forever: the RNG tracker would never switch states.
"""
from megatron_adapt.spec import PatchSpec

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


SPECS = [
    PatchSpec(f"{MODULE}:_get_cuda_rng_state", area="rng", build=build_get, backends=("cpu", "npu")),
    PatchSpec(f"{MODULE}:_set_cuda_rng_state", area="rng", build=build_set, backends=("cpu", "npu")),
]

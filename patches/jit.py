"""megatron.core.jit.jit_fuser: eager on backends where torch.compile is no help.

Megatron decorates its fusions with `jit_fuser` (torch.compile) at import time, so the choice must
be made before `megatron.core.fusions` is imported: the post-import hook on `megatron.core.jit`
runs first. On CPU, Inductor would compile every fusion with g++ (~10 s start-up) for tiny
models; on NPU torch.compile has no backend. `--disable-jit-fuser` comes too late to help.
"""
from megatron_adapt.spec import PatchSpec


def eager(func=None, *args, **kwargs):
    """A drop-in for torch.compile used as a decorator: returns the function unchanged."""
    if func is None:
        return lambda f: f
    return func


def build(backend, original):
    return eager


SPECS = [
    PatchSpec("megatron.core.jit:jit_fuser", area="jit", build=build, backends=("cpu", "npu"),
              check_signature=False),
]

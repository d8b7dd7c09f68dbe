"""Megatron-LM's training start-up (megatron.training, megatron.legacy): present only with a
Megatron-LM checkout on the path, so every spec here is optional.

* `initialize_megatron(allow_no_cuda=True)` on the cpu backend: Megatron asserts CUDA otherwise.
* `fused_kernels.load`: builds Megatron's legacy CUDA extensions with nvcc at start-up. Nothing
  uses them once the backend's softmax is patched in; building them needs a CUDA toolkit.
  `megatron.legacy.fused_kernels` is gone from core_v0.17 (and `megatron.legacy` from 0.18).
* `compile_helpers`: runs `make` in megatron/core/datasets. A checkout has the Makefile but no
  built extension; the megatron-core wheel has the built extension but no Makefile. Reuse the
  wheel's extension when it matches this interpreter, otherwise run Megatron's make.
"""
import glob
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import shutil

from megatron_adapt import report
from megatron_adapt.spec import PatchSpec, WRAP


def build_initialize(backend, original):
    signature = inspect.signature(original)

    def initialize_megatron(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return wrapped(*bound.args, **bound.kwargs)
    return initialize_megatron


def build_fused_kernels_load(backend, original):
    def load(args):
        """Megatron's legacy fused kernels are served by the backend's ops: nothing to build."""
        report.ran("fused_kernels.load", f"{backend.name}: skipped build, backend ops serve them")
    return load


def _wheel_helpers():
    """The helpers_cpp extension shipped in an installed megatron-core wheel, for this Python."""
    try:
        files = importlib.metadata.distribution("megatron-core").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        name = str(f)
        if name.startswith("megatron/core/datasets/helpers_cpp") and any(
                name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES):
            path = f.locate()
            if os.path.exists(path):
                return str(path)
    return None


def build_compile_helpers(backend, original):
    def compile_helpers():
        """Make megatron.core.datasets.helpers_cpp importable (see the module docstring)."""
        import megatron.core.datasets as datasets

        here = os.path.dirname(os.path.abspath(datasets.__file__))
        if any(glob.glob(os.path.join(here, "helpers_cpp" + s))
               for s in importlib.machinery.EXTENSION_SUFFIXES):
            report.ran("compile_helpers", "existing helpers_cpp extension")
            return
        wheel = _wheel_helpers()
        if wheel is not None:
            shutil.copy2(wheel, os.path.join(here, os.path.basename(wheel)))
            report.ran("compile_helpers", "megatron-core wheel's prebuilt helpers_cpp")
            return
        report.fell_back("compile_helpers", "megatron make", "no prebuilt helpers_cpp for this Python")
        original()
    return compile_helpers


SPECS = [
    PatchSpec("megatron.training.initialize:initialize_megatron", area="training", mode=WRAP,
              build=build_initialize, backends=("cpu",), optional=True),
    PatchSpec("megatron.legacy.fused_kernels:load", area="training", build=build_fused_kernels_load,
              versions=">=0.15.0,<0.17.0", optional=True),
    PatchSpec("megatron.core.datasets.utils:compile_helpers", area="training",
              build=build_compile_helpers),
]

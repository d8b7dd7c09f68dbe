"""EMULATION of torch_npu.contrib.transfer_to_npu.

The real module redirects torch.cuda.* / 'cuda' device strings / Tensor.cuda to the NPU and nccl
to hccl in init_process_group, at import time. The emulated NPU is the CPU, so the equivalent
redirection is megatron-adapt's CPU device layer (torch.cuda.* answered on the CPU, CUDA
placements rewritten to the CPU, nccl groups -> gloo); importing this module installs it, and
(unlike the real module) `uninstall()` removes it again. torch.cuda.is_available() is left
False: tensors stay plain CPU tensors and Megatron must not take CUDA-only paths.

One consequence of leaving it False, handled here: Megatron-LM's
`megatron.training.initialize.initialize_megatron` starts with
`assert torch.cuda.is_available(), "Megatron requires CUDA."`. On a real NPU that assertion
passes because the real transfer_to_npu maps torch.cuda.is_available to torch.npu.is_available.
To let stock Megatron-LM scripts start on the emulated NPU, this module passes
`allow_no_cuda=True` to initialize_megatron (a post-import hook on megatron.training.initialize,
inert after uninstall()). That assertion is the only thing it changes; everything after it runs
as it would.
"""
import inspect

import wrapt

from megatron_adapt.backends.cpu import device as _cpu_device

_installed_here = not _cpu_device.installed()
_cpu_device.install()
_active = True


def _initialize_megatron(wrapped, instance, args, kwargs):
    if not _active:
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.arguments["allow_no_cuda"] = True
    return wrapped(*bound.args, **bound.kwargs)


@wrapt.when_imported("megatron.training.initialize")
def _on_megatron_initialize(module):
    if _active and hasattr(module, "initialize_megatron"):
        wrapt.wrap_function_wrapper(module, "initialize_megatron", _initialize_megatron)


def uninstall() -> None:
    global _installed_here, _active
    _active = False
    if _installed_here:
        _cpu_device.uninstall()
        _installed_here = False

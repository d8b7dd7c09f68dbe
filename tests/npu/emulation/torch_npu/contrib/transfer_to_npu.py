"""EMULATION of torch_npu.contrib.transfer_to_npu.

The real module redirects torch.cuda.* / 'cuda' device strings / Tensor.cuda to the NPU and nccl
to hccl in init_process_group, at import time. The emulated NPU is the CPU, so the equivalent
redirection is megatron-adapt's CPU device layer (torch.cuda.* answered on the CPU, CUDA
placements rewritten to the CPU, nccl groups -> gloo); importing this module installs it, and
(unlike the real module) `uninstall()` removes it again. torch.cuda.is_available() is left
False: tensors stay plain CPU tensors and Megatron must not take CUDA-only paths.
"""
from megatron_adapt.backends.cpu import device as _cpu_device

_installed_here = not _cpu_device.installed()
_cpu_device.install()


def uninstall() -> None:
    global _installed_here
    if _installed_here:
        _cpu_device.uninstall()
        _installed_here = False

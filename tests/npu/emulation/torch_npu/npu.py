"""EMULATION of the `torch.npu` namespace torch_npu installs: one CPU behind every "NPU".

TORCH_NPU_EMULATION_DEVICES (default 1) sets how many NPUs the emulation claims; 0 makes
is_available() False (an NPU machine whose driver sees no device).
"""
import os

import torch

_current = [0]


def device_count() -> int:
    return int(os.environ.get("TORCH_NPU_EMULATION_DEVICES", "1"))


def is_available() -> bool:
    return device_count() > 0


def current_device() -> int:
    return _current[0]


def set_device(device) -> None:
    index = device if isinstance(device, int) else (torch.device(device).index or 0)
    if not 0 <= index < max(1, device_count()):
        raise RuntimeError(f"emulated torch.npu.set_device: invalid device {device!r}")
    _current[0] = index


def synchronize(device=None) -> None:
    pass


class _Generators(tuple):
    """torch.npu.default_generators: every emulated NPU shares the CPU default generator."""


def __getattr__(name):
    if name == "default_generators":
        return _Generators([torch.default_generator] * max(1, device_count()))
    raise AttributeError(name)


def get_rng_state(device="npu"):
    return torch.get_rng_state()


def set_rng_state(new_state, device="npu"):
    torch.set_rng_state(new_state)


def manual_seed(seed):
    torch.manual_seed(int(seed))


def manual_seed_all(seed):
    torch.manual_seed(int(seed))


def initial_seed():
    return torch.initial_seed()

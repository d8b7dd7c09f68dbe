"""The generator Megatron's "CUDA" RNG tracker forks is the current NPU's default generator.

Megatron's _set_cuda_rng_state goes through torch.cuda._lazy_call and
torch.cuda.default_generators; on Ascend the device generators are torch.npu.default_generators
(MindSpeed sets them with `torch.npu.default_generators[idx].set_state(state)`). These act
immediately on the current device's generator.
"""
import torch


def _generator():
    return torch.npu.default_generators[torch.npu.current_device()]


def get_state():
    return _generator().get_state()


def set_state(state):
    _generator().set_state(state)

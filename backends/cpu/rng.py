"""On CPU, the generator Megatron's "CUDA" RNG tracker forks is the CPU default generator.

Megatron's own _set_cuda_rng_state queues a torch.cuda._lazy_call callback, which on a CPU build is
silently never run: the tracker would never switch states. These run immediately.
"""
import torch


def get_state():
    return torch.get_rng_state()


def set_state(state):
    torch.set_rng_state(state)

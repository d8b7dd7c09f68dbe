"""The cpu backend: Megatron over gloo on machines with no accelerator.

Its ops are plain PyTorch and device-agnostic, so they are also the reference every other backend's
kernels are tested against, and the fallback they report when a shape is outside their kernels.
"""
from megatron_adapt.backends import STANDARD_LAYOUT, Backend

OPS = dict(STANDARD_LAYOUT)

BACKEND = Backend(name="cpu", ops=OPS, package=__name__, device_layer=".device",
                  describe=lambda: "PyTorch reference ops on CPU, gloo collectives")

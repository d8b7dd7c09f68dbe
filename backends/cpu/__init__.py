"""The cpu backend: Megatron over gloo on machines with no accelerator.

Its ops are the references (`megatron_adapt.backends.reference`), each with its report entry; its
own parts are the device layer, the RNG state and the optimizers' foreach flags.
"""
from megatron_adapt.backends import STANDARD_LAYOUT, Backend

OPS = dict(STANDARD_LAYOUT)

BACKEND = Backend(name="cpu", ops=OPS, package=__name__, device_layer=".device",
                  describe=lambda: "PyTorch reference ops on CPU, gloo collectives")

"""The cpu backend: Megatron over gloo on machines with no accelerator.

Its ops are the references (`megatron_adapt.backends.reference`), each with its report entry; its
own parts are the device layer, the RNG state and the optimizers' foreach flags.
"""
from megatron_adapt.backends import FP8_GEMM_OPS, STANDARD_LAYOUT, Backend

# fp8 GEMMs are not served on the cpu backend (.fp8 says why: the fp8_unavailable op).
OPS = {op: path for op, path in STANDARD_LAYOUT.items() if op not in FP8_GEMM_OPS}

BACKEND = Backend(name="cpu", ops=OPS, package=__name__, device_layer=".device",
                  describe=lambda: "PyTorch reference ops on CPU, gloo collectives")

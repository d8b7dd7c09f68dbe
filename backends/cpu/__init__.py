"""The cpu backend: Megatron over gloo on machines with no accelerator.

Its ops are plain PyTorch and device-agnostic, so they are also the reference every other backend's
kernels are tested against, and the fallback they report when a shape is outside their kernels.
"""
from megatron_adapt.backends import Backend

OPS = {
    "vocab_parallel_cross_entropy": ".cross_entropy:vocab_parallel_cross_entropy",
    "rms_norm": ".norms:rms_norm",
    "layer_norm": ".norms:layer_norm",
    "scaled_masked_softmax": ".softmax:scaled_masked_softmax",
    "attention": ".attention:attention",
    "rope": ".rope:rope",
    "swiglu": ".activations:swiglu",
    "bias_swiglu": ".activations:bias_swiglu",
    "bias_gelu": ".activations:bias_gelu",
    "adam": ".optimizers:Adam",
    "sgd": ".optimizers:SGD",
    "multi_tensor_l2norm": ".multi_tensor:l2norm",
    "multi_tensor_scale": ".multi_tensor:scale",
    "rng_get_state": ".rng:get_state",
    "rng_set_state": ".rng:set_state",
}

BACKEND = Backend(name="cpu", ops=OPS, package=__name__, device_layer=".device",
                  describe=lambda: "PyTorch reference ops on CPU, gloo collectives")

"""The cuda backend: Megatron at fused-kernel speed on NVIDIA GPUs with nothing to compile."""
from megatron_adapt.backends import Backend
from megatron_adapt.backends.cpu import OPS as REFERENCE_OPS
from megatron_adapt.errors import BackendUnavailableError


def check():
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "MEGATRON_ADAPT_BACKEND=cuda but no CUDA device is visible "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
            "Use MEGATRON_ADAPT_BACKEND=cpu or auto.")


# Start from the PyTorch reference ops (device-agnostic) and override with our kernels.
OPS = {name: f"megatron_adapt.backends.cpu{path}" for name, path in REFERENCE_OPS.items()
       if not name.startswith("rng_")}
OPS.update({
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
})

BACKEND = Backend(name="cuda", ops=OPS, package=__name__, check=check,
                  describe=lambda: "Triton and PyTorch fused kernels on NVIDIA GPUs")

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
    "adam": ".optimizers:Adam",
})

BACKEND = Backend(name="cuda", ops=OPS, package=__name__, check=check,
                  describe=lambda: "Triton and PyTorch fused kernels on NVIDIA GPUs")

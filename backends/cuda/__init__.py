"""The cuda backend: Megatron at fused-kernel speed on NVIDIA GPUs with nothing to compile."""
from megatron_adapt.backends import STANDARD_LAYOUT, Backend
from megatron_adapt.errors import BackendUnavailableError


def check():
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "MEGATRON_ADAPT_BACKEND=cuda but no CUDA device is visible "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
            "Use MEGATRON_ADAPT_BACKEND=cpu or auto.")


# Every op has a kernel here; Megatron's own CUDA RNG needs no rng ops, and Megatron's own Triton
# kernels serve multi-latent attention's fused YaRN RoPE (rope_cos_sin) and Mamba's decode steps
# (ssm_conv_update / ssm_state_update, core_v0.17+).
MEGATRONS_OWN = {"rope_cos_sin", "ssm_conv_update", "ssm_state_update"}
OPS = {op: path for op, path in STANDARD_LAYOUT.items()
       if not op.startswith("rng_") and op not in MEGATRONS_OWN}

BACKEND = Backend(name="cuda", ops=OPS, package=__name__, check=check,
                  describe=lambda: "Triton and PyTorch fused kernels on NVIDIA GPUs")

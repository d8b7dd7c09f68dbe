"""The npu backend: Ascend NPUs through torch_npu ops and HCCL."""
from megatron_adapt.backends import Backend
from megatron_adapt.errors import BackendUnavailableError


def check():
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            "MEGATRON_ADAPT_BACKEND=npu needs torch_npu (Ascend's PyTorch adapter, installed with "
            f"the CANN toolkit): {exc}. Use MEGATRON_ADAPT_BACKEND=cpu or auto.") from None
    import torch

    if not torch.npu.is_available():
        raise BackendUnavailableError("MEGATRON_ADAPT_BACKEND=npu but torch_npu sees no NPU device.")


BACKEND = Backend(name="npu", ops={}, package=__name__, check=check,
                  describe=lambda: "torch_npu fused ops on Ascend NPUs, HCCL collectives")

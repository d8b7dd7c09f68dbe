"""The npu backend: Ascend NPUs through torch_npu ops and HCCL.

Every op of megatron_adapt.ops goes through the torch_npu op named in docs/npu-backend.md, or
through torch math that torch_npu dispatches to NPU kernels (layer norm, cross entropy, foreach,
fused AdamW). Shapes and dtypes outside a kernel's documented limits take the PyTorch reference,
reported with report.fell_back. Verified against an emulation of the torch_npu op contract only
(tests/npu/emulation): no Ascend NPU was available while this was written.

Targets Ascend Extension for PyTorch 6.0.0 and later: torch_npu 2.1.0.post10+, 2.4.0.post2+
(6.0.0), 2.5.1 (7.0.0), 2.6.0 (7.1.0) and 2.6.0.post5 (7.3.0) (see TARGET_TORCH_NPU). The call
forms that differ between those releases are chosen once, at load, from torch_npu.__version__
(_lib.api()).
"""
from megatron_adapt.backends import FP8_GEMM_OPS, STANDARD_LAYOUT, Backend
from megatron_adapt.errors import BackendUnavailableError

TARGET_TORCH_NPU = ("2.1.0.post10", "2.4.0.post2", "2.5.1", "2.6.0", "2.6.0.post5")

# fp8 GEMMs are not served on the npu backend (.fp8 says why: the fp8_unavailable op).
OPS = {op: path for op, path in STANDARD_LAYOUT.items() if op not in FP8_GEMM_OPS}


def check():
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            "MEGATRON_ADAPT_BACKEND=npu needs torch_npu (Ascend's PyTorch adapter, installed with "
            f"the CANN toolkit; targeted: {', '.join(TARGET_TORCH_NPU)}): {exc}. "
            "Use MEGATRON_ADAPT_BACKEND=cpu or auto.") from None
    import torch

    if not torch.npu.is_available():
        raise BackendUnavailableError("MEGATRON_ADAPT_BACKEND=npu but torch_npu sees no NPU device "
                                      "(check the CANN driver and ASCEND_RT_VISIBLE_DEVICES).")
    from ._lib import api

    api()  # the release's call forms, chosen once here


def _describe() -> str:
    from ._lib import api

    return f"{api().describe()} fused ops on Ascend NPUs, HCCL collectives"


BACKEND = Backend(name="npu", ops=OPS, package=__name__, check=check, device_layer=".device",
                  describe=_describe)

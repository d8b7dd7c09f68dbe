"""Offloading's copies on Ascend: `copy_(non_blocking=True)`, which torch_npu queues on the current
stream as an asynchronous transfer between pinned host memory and the NPU (its DMA engines; Ascend
has no setting like CUDA_DEVICE_MAX_CONNECTIONS that would serialise them with the compute)."""
from megatron_adapt import report


def host_copy(dst, src):
    report.ran("host_copy", "npu.copy_async")
    return dst.copy_(src, non_blocking=True)

"""Copies between device memory and pinned host memory for activation offloading, done by SM
kernels where the copy engines would be serialised with the compute.

Under CUDA_DEVICE_MAX_CONNECTIONS=1 (what Megatron asks for with tensor or context parallelism on
Hopper and earlier) every stream feeds one hardware queue, and a copy-engine transfer on a side
stream takes its turn with the compute kernels instead of running beside them
(scripts/offload_overlap_probe.py: 2 offloaded layers cost 1.15x under one queue, 1.03x under 8,
docs/model-families.md). A kernel is different: kernels of different streams in that one queue run
side by side, which is how Megatron's own communication kernels overlap the GEMMs there. So under
one queue the copy is a Triton kernel on a few SMs that loads and stores pinned host memory through
its unified (UVA) address, as NCCL moves data; with more queues it stays a copy-engine transfer,
which costs no SMs.

Torch's pinned-memory allocator keeps a host block alive until the copy-engine transfers recorded
on it have run; it does not see a kernel's. So each kernel copy's host tensor is held here, with an
event, until that event has completed.
"""
from __future__ import annotations

import collections
import os

import torch

from megatron_adapt import report

from ._common import cdiv, interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the cuda backend needs Triton for its other kernels too
    triton = None

# Programs of the copy kernel: enough loads in flight to fill the host link both ways (measured on
# an H200: docs/model-families.md), few enough that the GEMMs keep their SMs.
PROGRAMS = 16
BLOCK = 4096            # 4-byte words per program and loop step (16 KiB)
MAX_WORDS = 2 ** 31 - BLOCK * PROGRAMS

if triton is not None:
    @triton.jit
    def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for base in range(start, n, step):
            offs = base + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


_held: collections.deque = collections.deque()   # (event, host tensor) of kernel copies in flight


def one_hardware_queue() -> bool:
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"


def _why_not_kernel(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    if triton is None:
        return "Triton is not installed"
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return "dtype or shape differ"
    if not (dst.is_contiguous() and src.is_contiguous()):
        return "a strided tensor"
    if src.nbytes % 4 or src.nbytes // 4 >= MAX_WORDS:
        return f"{src.nbytes} bytes (the kernel moves whole 4-byte words, under 8 GiB)"
    host = dst if dst.device.type == "cpu" else src
    if not interpreting() and not host.is_pinned():
        return "pageable host memory (a kernel reaches only pinned memory)"
    return None


def _release_done():
    while _held and _held[0][0].query():
        _held.popleft()


def _kernel_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    words = src.nbytes // 4
    if words:
        grid = (min(PROGRAMS, cdiv(words, BLOCK)),)
        _copy_kernel[grid](src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), words,
                           BLOCK=BLOCK, num_warps=4)
    if dst.is_cuda or src.is_cuda:
        _release_done()
        event = torch.cuda.Event()
        event.record()
        _held.append((event, dst if dst.device.type == "cpu" else src))
    return dst


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) between the device and pinned host memory, queued on the current stream:
    an SM kernel under one hardware queue, a copy-engine transfer otherwise (and for what the
    kernel does not take: strided tensors, odd byte counts, pageable memory -- said in the report)."""
    if one_hardware_queue():
        reason = _why_not_kernel(dst, src)
        if reason is None:
            report.ran("host_copy", "cuda.sm_kernel (one hardware queue)")
            return _kernel_copy(dst, src)
        report.fell_back("host_copy", "cuda.copy_engine", reason)
    else:
        report.ran("host_copy", "cuda.copy_engine")
    return dst.copy_(src, non_blocking=True)

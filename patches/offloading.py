"""Activation offloading without Transformer Engine: Megatron's two kinds, served.

* `--cpu-offloading-num-layers N` (config.cpu_offloading): Megatron's transformer block takes its
  offload context from TE's `get_cpu_offload_context` and, without TE, asserts "CPU Offloading is
  enabled when TE is not present". The block's module global is bound to
  backends/activation_offload's context (saved-tensor hooks, side-stream copies, reload one layer
  ahead in the backward). With cpu_offloading off the pair is (nullcontext(), None), as TE's.
  TE's weight offloading (cpu_offloading_weights) is refused at start: TE itself deprecated it, and
  the weights here are Megatron's parameters, which stay on the device. With CUDA graphs (Megatron
  allows `full_iteration`) it is refused too: the copies and pinned buffers are per step.
* `--fine-grained-activation-offloading` (Megatron's own manager, pipeline_parallel/
  fine_grained_activation_offload.py): it does its own copies and only switches TE's
  `cpu_offload.CPUOffloadEnabled` flag, raising "TE CPU offload is not available" without TE.
  The flag's module is bound to a namespace holding that flag; no TE module reads it here.
  pretrain() first pins the process to its GPU's CPUs through cuda-python and pynvml
  (`set_ideal_affinity_for_current_gpu`, "Please install cuda-python" without them): replaced by
  the same pinning read from sysfs (the device's PCI address -> its `local_cpulist`), so neither
  package is needed; the cpu backend has no device to be near, and leaves the affinity as it is.
"""
from __future__ import annotations

import os
import types
from contextlib import nullcontext

from megatron_adapt import report, start_checks
from megatron_adapt.spec import PatchSpec, SkipPatch
from megatron_adapt.start_checks import where

AREA = "offloading"
TE_PRESENT = "Transformer Engine is installed: its offloading serves Megatron"


def _require_no_te():
    if start_checks.te_installed():
        raise SkipPatch(TE_PRESENT)


def build_offload_context(backend, original):
    _require_no_te()
    from megatron_adapt.backends.activation_offload import offload_context

    streams = backend.name != "cpu"
    impl = f"{backend.name}.{'side_streams' if streams else 'host_copy'}"

    def get_cpu_offload_context(enabled, num_layers, model_layers, activation_offloading,
                                weight_offloading, double_buffering=False,
                                retain_pinned_cpu_buffers=False):
        """TE's signature. double_buffering and retain_pinned_cpu_buffers are about TE's own
        pinned buffers: here pinned host memory comes from torch's caching host allocator, which
        keeps it across steps, and reloads run as far ahead as backends/activation_offload says."""
        if not enabled or not activation_offloading or num_layers <= 0:
            return nullcontext(), None
        return offload_context(num_layers, model_layers, streams,
                               on_offload=lambda: report.ran("activation_offload", impl))
    return get_cpu_offload_context


def build_te_cpu_offload(backend, original):
    """The module Megatron's fine-grained manager flips `CPUOffloadEnabled` on."""
    _require_no_te()
    if original is not None:
        raise SkipPatch("the TE extension already holds a cpu_offload module")
    return types.SimpleNamespace(
        CPUOffloadEnabled=False,
        __doc__="megatron-adapt: TE's cpu_offload flag for Megatron's fine-grained offload manager "
                "(no TE module reads it; Megatron's manager does the copies)")


def build_gpu_affinity(backend, original):
    def set_ideal_affinity_for_current_gpu():
        """Megatron's: pin this process to the CPUs nearest its device (report: which)."""
        cpus = device_local_cpus(backend)
        if cpus is None:
            report.ran("device_affinity", f"{backend.name}.unchanged")
            return
        os.sched_setaffinity(0, cpus)
        report.ran("device_affinity", f"{backend.name}.sysfs_local_cpulist")
    return set_ideal_affinity_for_current_gpu


def device_local_cpus(backend) -> set[int] | None:
    """The CPUs the kernel lists as local to the current CUDA device and this process may use, or
    None: no such device (cpu backend; npu: torch_npu's properties carry no PCI address), or none
    of those CPUs is allowed to this process."""
    if backend.name != "cuda":
        return None
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    address = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    path = f"/sys/bus/pci/devices/{address}/local_cpulist"
    try:
        text = open(path).read().strip()
    except OSError as e:
        raise RuntimeError(f"set_ideal_affinity_for_current_gpu: cannot read {path} ({e}): the "
                           f"CPUs local to GPU {address} are unknown") from e
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return (cpus & os.sched_getaffinity(0)) or None   # none of them allowed here: leave it


def single_queue_notice(backend, s: dict) -> str | None:
    """The notice (printed once per process, rank 0) when offloading runs on cuda under
    CUDA_DEVICE_MAX_CONNECTIONS=1. One hardware queue serialises the side-stream copies with the
    compute kernels: measured (scripts/offload_overlap_probe.py, one H100, 2 of 16 layers at the
    0.95B bench model's shapes) the step took 1.15x with 1 connection and 1.03x with 8, the
    device-to-host copies 32 % and 94 % hidden. Megatron asks for 1 only with tensor or context
    parallelism on Hopper and earlier, so the notice says whether this run could do without."""
    offloading = s.get("cpu_offloading") or s.get("fine_grained_activation_offloading")
    if not offloading or backend.name != "cuda" or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        return None
    tp, cp = s.get("tensor_model_parallel_size") or 1, s.get("context_parallel_size") or 1
    advice = (f"this run has tensor parallel {tp} and context parallel {cp}, for which Megatron asks for "
              "1 on Hopper and earlier: expect the copies to add to the step"
              if tp > 1 or cp > 1 else
              "Megatron asks for 1 only with tensor or context parallelism (on Hopper and earlier), and this "
              "run has neither: unset CUDA_DEVICE_MAX_CONNECTIONS (or set it to 8) to hide the copies")
    message = ("activation offloading on the cuda backend with CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware "
               "queue runs the offload copies in turn with the compute kernels, so the copies are not hidden "
               f"behind the compute; {advice} (docs/model-families.md, activation offloading)")
    report.say_once(f"notice: {message}", key="offloading: one hardware queue")
    return message


def offload_refusal(backend, s: dict) -> str | None:
    if not s.get("cpu_offloading"):
        return None
    if s.get("cpu_offloading_weights"):
        return (f"cpu_offloading_weights: {where(backend)} cannot run it: weight offloading is "
                f"Transformer Engine's (deprecated there too); megatron-adapt offloads "
                f"activations only. Set cpu_offloading_weights=False.")
    graphs = s.get("cuda_graph_impl") or "none"
    if graphs != "none":   # Megatron itself refuses every impl but full_iteration
        return (f"--cpu-offloading-num-layers with --cuda-graph-impl {graphs}: {where(backend)} cannot "
                f"run it: megatron-adapt's activation offloading takes pinned host buffers and copies "
                f"on side streams at every step, which a CUDA graph cannot capture. Use one of the two.")
    return None


def offload_start(backend, s: dict) -> str | None:
    """The start-up check: the single-queue notice, then the refusal (or None)."""
    single_queue_notice(backend, s)
    return offload_refusal(backend, s)


start_checks.register(
    AREA, "offload",
    from_args=offload_start,
    from_config=lambda backend, config: offload_start(backend, {
        n: getattr(config, n, None) for n in ("cpu_offloading", "cpu_offloading_weights", "cuda_graph_impl",
                                              "fine_grained_activation_offloading",
                                              "tensor_model_parallel_size", "context_parallel_size")}))


SPECS = [
    PatchSpec("megatron.core.transformer.transformer_block:get_cpu_offload_context", area=AREA,
              build=build_offload_context, create=True, check_signature=False),
    PatchSpec("megatron.core.extensions.transformer_engine:cpu_offload", area=AREA,
              build=build_te_cpu_offload, create=True, check_signature=False),
    PatchSpec("megatron.core.pipeline_parallel.utils:set_ideal_affinity_for_current_gpu", area=AREA,
              build=build_gpu_affinity, versions=">=0.16.0,<0.20.0"),
]

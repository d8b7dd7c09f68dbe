"""The NPU device layer: torch_npu's own CUDA-to-NPU redirection, plus nccl -> hccl for every group.

install() imports `torch_npu` and `torch_npu.contrib.transfer_to_npu`. The latter is Ascend's
supported migration path (MindSpeed and megatron_npu both import it first): it rebinds
`torch.cuda.*` to `torch.npu.*`, `Tensor.cuda` / `Module.cuda` to `.npu`, rewrites 'cuda' device
arguments of tensor factories and `.to()` to 'npu', and maps 'nccl' to 'hccl' in
`init_process_group`. It does not touch `new_group`, where Megatron may name a backend, so this
layer wraps both `init_process_group` and `new_group` to map nccl -> hccl (and drops a CUDA
`device_id`, which HCCL cannot bind; groups then initialise lazily, as before torch 2.3).

transfer_to_npu works by import-time side effects and offers no undo. To keep install() /
uninstall() reversible, install() snapshots the attributes of every object it is known to patch
before importing it; uninstall() calls the module's own `uninstall()` if it has one (the test
emulation does), then puts back every snapshotted attribute that changed. A later install()
re-runs the redirection (reloads the module). Verified under the emulation only: see
docs/npu-backend.md.
"""
from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.distributed as dist

from megatron_adapt.errors import BackendUnavailableError

from ._lib import torch_npu

TRANSFER = "torch_npu.contrib.transfer_to_npu"

_saved: list[tuple[object, str, object]] = []
_snapshot: list[tuple[object, dict]] = []
_state = {"installed": False, "undone": False}


def _patched_owners() -> list[object]:
    """Everything transfer_to_npu (torch_npu 2.1 - 2.6) sets attributes on."""
    import torch.nn.parallel
    import torch.profiler
    import torch.utils._device

    owners = [torch, torch.cuda, torch.Tensor, torch.nn.Module, torch.jit, torch.profiler,
              torch.UntypedStorage, torch.nn.parallel.DistributedDataParallel,
              torch.utils._device.DeviceContext, getattr(torch.cuda, "device", None), dist]
    for name in ("torch.cuda.amp", "torch.cuda.random", "torch.utils._triton",
                 "torch.distributed.fsdp.fully_sharded_data_parallel"):
        module = sys.modules.get(name)
        if module is not None:
            owners.append(module)
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is not None:
        owners.append(fsdp.FullyShardedDataParallel)
    if dist.is_available():
        owners.append(dist.ProcessGroup)
    return [o for o in owners if o is not None]


def _hccl(backend):
    if isinstance(backend, str) and "nccl" in backend:
        return backend.replace("nccl", "hccl")
    return backend


def _is_cuda_device(device) -> bool:
    return (isinstance(device, torch.device) and device.type == "cuda") or (
        isinstance(device, str) and device.startswith("cuda"))


def _wrap_init_process_group(original):
    def init_process_group(backend=None, *args, **kwargs):
        if _is_cuda_device(kwargs.get("device_id")):
            kwargs.pop("device_id")
        return original(_hccl(backend), *args, **kwargs)
    init_process_group.__wrapped__ = original
    return init_process_group


def _wrap_new_group(original):
    def new_group(*args, **kwargs):
        if len(args) > 2:
            args = (*args[:2], _hccl(args[2]), *args[3:])
        if "backend" in kwargs:
            kwargs["backend"] = _hccl(kwargs["backend"])
        if _is_cuda_device(kwargs.get("device_id")):
            kwargs.pop("device_id")
        return original(*args, **kwargs)
    new_group.__wrapped__ = original
    return new_group


def installed() -> bool:
    return _state["installed"]


def install() -> None:
    """Idempotent. Raises BackendUnavailableError when torch_npu is missing."""
    if _state["installed"]:
        return
    try:
        torch_npu()
    except ImportError as exc:
        raise BackendUnavailableError(f"the npu device layer needs torch_npu: {exc}") from None
    _snapshot[:] = [(owner, dict(vars(owner))) for owner in _patched_owners()]
    module = sys.modules.get(TRANSFER)
    if module is None:
        importlib.import_module(TRANSFER)
    elif _state["undone"]:
        importlib.reload(module)  # we undid its redirection: run it again
    if dist.is_available():
        from torch.distributed import distributed_c10d

        for name, wrap in (("init_process_group", _wrap_init_process_group),
                           ("new_group", _wrap_new_group)):
            original = getattr(dist, name)
            wrapped = wrap(original)
            _saved.append((dist, name, original))
            setattr(dist, name, wrapped)
            # new_subgroups_by_enumeration (Megatron's HyperCommGrid) calls distributed_c10d's own
            # `new_group` global, with backend="nccl"
            if name == "new_group" and distributed_c10d is not dist:
                _saved.append((distributed_c10d, name, getattr(distributed_c10d, name)))
                setattr(distributed_c10d, name, wrapped)
    _state.update(installed=True, undone=False)


def _restore(owner, saved: dict) -> None:
    current = vars(owner)
    for name, value in saved.items():
        if current.get(name, _MISSING) is not value:
            try:
                setattr(owner, name, value)
            except (AttributeError, TypeError):
                pass  # read-only slot: nothing was patched there
    for name in [n for n in current if n not in saved]:
        if not isinstance(current[name], types.ModuleType):  # lazily imported submodules stay
            try:
                delattr(owner, name)
            except (AttributeError, TypeError):
                pass


_MISSING = object()


def uninstall() -> None:
    if not _state["installed"]:
        return
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
    module = sys.modules.get(TRANSFER)
    undo = getattr(module, "uninstall", None)
    if callable(undo):
        undo()
    for owner, saved in _snapshot:
        _restore(owner, saved)
    _snapshot.clear()
    _state.update(installed=False, undone=True)

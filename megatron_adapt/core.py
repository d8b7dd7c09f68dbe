"""apply() / revert() / report(): select the backend, gate the version, register every patch."""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import platform

from . import applier, report as _report
from .config import Config
from .errors import MegatronAdaptError
from .versions import check_supported, megatron_core_version, patching_version

log = logging.getLogger("megatron_adapt")

_state: dict = {}


def patch_modules() -> list[str]:
    from megatron_adapt.patches import AREAS

    return [f"megatron_adapt.patches.{a}" for a in AREAS]


def all_specs():
    specs = []
    for name in patch_modules():
        specs.extend(importlib.import_module(name).SPECS)
    return specs


def active_backend():
    """The Backend applied in this process, or None."""
    return _state.get("backend")


def active_config() -> Config:
    """The Config applied in this process (the environment's when nothing is applied)."""
    return _state.get("config") or Config.resolve()


def apply(backend: str | None = None, **switches):
    """Patch Megatron for `backend` (default: MEGATRON_ADAPT_BACKEND, else auto).

    Idempotent with the same choice; a different backend needs revert() first. On any error the
    process is left unpatched.
    """
    from megatron_adapt import backends as _backends

    config = Config.resolve(backend, **switches)
    if _state:
        if config.backend in ("auto", _state["backend"].name) and config == _state["requested"]:
            return _state["backend"]
        raise MegatronAdaptError(
            f"megatron-adapt is already applied with backend {_state['backend'].name!r}; "
            "call megatron_adapt.revert() before applying another configuration")
    version = megatron_core_version()
    untested = check_supported(version, config.allow_untested)
    if config.backend == "auto":
        name, why = _backends.auto_select()
    else:
        name, why = config.backend, f"{config.backend} requested"
    chosen = _backends.load(name)  # unknown / unavailable -> clear error, nothing patched
    import torch

    _report.set_context(strict=config.strict, backend=chosen.name, backend_reason=why,
                        megatron_core=str(version) if version else None, torch=torch.__version__,
                        python=platform.python_version(), backend_description=chosen.describe(),
                        attention_layout=config.attention_layout, external=config.external,
                        untested_megatron=untested)
    device = chosen.device()
    try:
        if device is not None and config.enabled("device"):
            device.install()
        _state.update(backend=chosen, config=config, requested=config, device=device)
        applier.register(all_specs(), chosen, config, patching_version(version),
                         untested=str(version) if untested else None)
    except BaseException:
        revert()
        raise
    if config.report_path and not _state.get("atexit"):
        atexit.register(_write_report_at_exit, os.getpid())
        _state["atexit"] = True
    return chosen


def _write_report_at_exit(pid=None):
    if pid is not None and os.getpid() != pid:
        return  # a forked child (data worker, checkpoint writer) inherits atexit and stale counts
    config = _state.get("config")
    if config and config.report_path:
        path = config.report_path
        rank = _report._rank()
        path = path if rank == 0 else f"{path}.rank{rank}"
        # A process that ran no op (torchrun's agent exiting after its workers; a helper process
        # a rank spawned, such as the checkpoint writer, which re-applies through sitecustomize
        # and exits after its rank) does not overwrite the report a rank wrote.
        if _report.op_counts() or not os.path.exists(path):
            _report.write_json(path)


def revert() -> None:
    """Restore every site that still holds our object and remove the device layer. Idempotent."""
    applier.revert_all()
    device = _state.get("device")
    if device is not None:
        device.uninstall()
    keep_atexit = _state.get("atexit")
    _state.clear()
    if keep_atexit:
        _state["atexit"] = True

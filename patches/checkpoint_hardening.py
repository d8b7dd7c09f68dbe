"""Checkpoint hardening (MEGATRON_ADAPT_CHECKPOINT_HARDEN=1; off by default, then every spec here
is reported `skipped`).

Save: every file Megatron's checkpoint save writes ends 0640 and every directory 0750, whatever the
process umask. Two mechanisms, because neither alone is enough:

* a temporary umask 027 around the save call. Files and directories created *during* the call are
  never looser than 0640 / 0750, not even for an instant. But the umask is process-global (another
  thread creating files meanwhile gets it too, and a thread still writing after the call returns,
  such as the async checkpoint writer or a persistent writer process forked earlier, does not),
  and a umask only removes bits: a file created 0600 stays 0600.
* chmod-after-write of the whole checkpoint tree (`harden_tree`) once the save is complete: after
  a synchronous save returns, and, for an asynchronous save, as the last finalize function of the
  async request (after Megatron's own finalizers have written `metadata.json` and
  `latest_checkpointed_iteration.txt`). This is what makes the modes exact; the umask keeps the
  window in which a fresh file is looser than 0640 closed for everything the calling thread writes.

Covered entry points: `megatron.core.dist_checkpointing.save` (torch_dist: `common.pt`,
`metadata.json`, `.metadata`, `__<rank>_<n>.distcp`, sharded-object files; sync and async) and,
with a Megatron-LM checkout, `megatron.training.checkpointing.save_checkpoint` (every format,
including `--ckpt-format torch`'s `mp_rank_*/model_optim_rng.pt`, and the tracker file
`latest_checkpointed_iteration.txt` in the save root) and `schedule_async_save` (`--async-save`).
A file that cannot be chmod-ed (owned by another user) raises `CheckpointSecurityError` naming it;
a file that vanished meanwhile (Megatron's retention thread deleting an old iteration) is skipped.

Load: `megatron.core.dist_checkpointing.load` / `load_common_state_dict` and the checkout's
`_load_base_checkpoint` (behind `load_checkpoint` and `load_args_from_checkpoint`) first walk the
checkpoint directory being loaded and refuse, with `CheckpointSecurityError` naming the path, any
file or directory that is world-writable. They then run with `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`, so
every `torch.load` Megatron makes inside them (the torch_dist `common.pt` and sharded-object
files, the torch format's `model_optim_rng.pt`) is `weights_only=True`, including calls that pass
nothing (torch < 2.6 defaults to False) and whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
(together with hardening it is refused at apply). Megatron's formats allow it: megatron.core
registers the non-tensor types its checkpoints hold (argparse.Namespace, numpy RNG state, its
enums, ...) with `torch.serialization.add_safe_globals` (`megatron/core/safe_globals.py`). Not
covered by weights_only: PyTorch DCP reads the torch_dist `.metadata` file with `pickle.load`
(torch/distributed/checkpoint/filesystem.py), which has no restricted mode; the world-writable
refusal is the only guard for that file. See docs/checkpoints.md.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import stat

from megatron_adapt import report
from megatron_adapt.errors import MegatronAdaptError
from megatron_adapt.spec import PatchSpec, SkipPatch

FILE_MODE, DIR_MODE, UMASK = 0o640, 0o750, 0o027
SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
TRAINING = "megatron.training.checkpointing"
ASYNC = "megatron.training.async_utils"


class CheckpointSecurityError(MegatronAdaptError, PermissionError):
    """A checkpoint path fails the hardening rules (world-writable on load, not chmod-able on save)."""


def harden_tree(root) -> int:
    """chmod every directory under (and including) `root` to 0750 and every file to 0640; symlinks
    are left alone. Returns how many modes were changed."""
    root = os.fspath(root)
    changed = 0

    def fix(path, mode):
        nonlocal changed
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
                return
            os.chmod(path, mode)
            changed += 1
        except FileNotFoundError:
            return  # removed meanwhile (a temporary file renamed, an old iteration deleted)
        except PermissionError as e:
            raise CheckpointSecurityError(
                f"{path}: cannot set mode {mode:#o} on this checkpoint path ({e.strerror}); it is "
                f"probably owned by another user. Fix its owner or mode, or unset "
                f"MEGATRON_ADAPT_CHECKPOINT_HARDEN") from e

    if not os.path.isdir(root):
        if os.path.exists(root):
            fix(root, FILE_MODE)
        return changed
    for dirpath, _dirs, files in os.walk(root):
        fix(dirpath, DIR_MODE)
        for name in files:
            fix(os.path.join(dirpath, name), FILE_MODE)
    return changed


def check_tree(root) -> None:
    """Refuse (CheckpointSecurityError naming the path) any world-writable file or directory under
    `root` (a file or a directory). Symlinks are judged by their target."""
    root = os.fspath(root)
    paths = [root] if not os.path.isdir(root) else []
    if not paths:
        for dirpath, _dirs, files in os.walk(root):
            paths.append(dirpath)
            paths.extend(os.path.join(dirpath, f) for f in files)
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue  # a dangling link or a file removed meanwhile: Megatron reports what it misses
        if mode & stat.S_IWOTH:
            kind = "directory" if stat.S_ISDIR(mode) else "file"
            raise CheckpointSecurityError(
                f"refusing to load checkpoint {kind} {path}: it is world-writable (mode "
                f"{stat.S_IMODE(mode):#o}), so anyone could have replaced its contents. Check it, "
                f"then `chmod o-w` it (MEGATRON_ADAPT_CHECKPOINT_HARDEN=1 saves files 0640 and "
                f"directories 0750)")


@contextlib.contextmanager
def _umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def _weights_only():
    """torch.load inside Megatron's checkpoint loaders is weights_only=True whatever it passes."""
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def _require_switch():
    from megatron_adapt.core import active_config

    if not active_config().checkpoint_harden:
        raise SkipPatch("MEGATRON_ADAPT_CHECKPOINT_HARDEN is not set")


def _argument(original, args, kwargs, name):
    bound = inspect.signature(original).bind(*args, **kwargs)
    return bound.arguments.get(name)


def _harden_after(request, root):
    """Append the chmod pass to an async request (it then runs after Megatron's own finalizers)."""
    if request is not None:
        if not callable(getattr(request, "add_finalize_fn", None)):
            raise CheckpointSecurityError(
                f"{root}: MEGATRON_ADAPT_CHECKPOINT_HARDEN=1 cannot harden this asynchronous save: its "
                f"request ({type(request).__module__}.{type(request).__qualname__}) has no add_finalize_fn")
        request.add_finalize_fn(lambda: (harden_tree(root), report.ran("checkpoint_harden", "chmod")))
    return request


def build_dist_save(backend, original):
    _require_switch()

    def save(*args, **kwargs):
        directory = _argument(original, args, kwargs, "checkpoint_dir")
        with _umask(UMASK):
            request = original(*args, **kwargs)
        if request is None:
            harden_tree(directory)
            report.ran("checkpoint_harden", "chmod")
            return None
        return _harden_after(request, directory)
    save.__doc__ = original.__doc__
    return save


def _build_dist_load(backend, original):
    _require_switch()

    def load(*args, **kwargs):
        check_tree(_argument(original, args, kwargs, "checkpoint_dir"))
        report.ran("checkpoint_load_check", "refuse world-writable; weights_only=True")
        with _weights_only():
            return original(*args, **kwargs)
    load.__doc__ = original.__doc__
    return load


def build_save_checkpoint(backend, original):
    """megatron.training.checkpointing.save_checkpoint: the save root (args.save) holds the
    iteration directories and the tracker file."""
    _require_switch()

    def save_checkpoint(*args, **kwargs):
        from megatron.training.global_vars import get_args

        root = getattr(get_args(), "save", None)
        with _umask(UMASK):
            result = original(*args, **kwargs)
        if root and not getattr(get_args(), "async_save", False):
            harden_tree(root)
            report.ran("checkpoint_harden", "chmod")
        return result
    save_checkpoint.__doc__ = original.__doc__
    return save_checkpoint


def build_schedule_async_save(backend, original):
    """--async-save: the chmod pass becomes the request's last finalizer, after Megatron's
    finalizers have written metadata.json and the tracker file."""
    _require_switch()

    def schedule_async_save(async_request):
        from megatron.training.global_vars import get_args

        root = getattr(get_args(), "save", None)
        if root:
            _harden_after(async_request, root)
        with _umask(UMASK):  # a writer process forked here inherits it
            return original(async_request)
    schedule_async_save.__doc__ = original.__doc__
    return schedule_async_save


def build_load_base_checkpoint(backend, original):
    _require_switch()

    def _load_base_checkpoint(*args, **kwargs):
        load_dir = _argument(original, args, kwargs, "load_dir")
        if load_dir and os.path.exists(load_dir):
            check_tree(load_dir)
            report.ran("checkpoint_load_check", "refuse world-writable; weights_only=True")
        with _weights_only():
            return original(*args, **kwargs)
    _load_base_checkpoint.__doc__ = original.__doc__
    return _load_base_checkpoint


SPECS = [
    PatchSpec(f"{SERIALIZATION}:save", area="checkpoint_hardening", build=build_dist_save),
    PatchSpec(f"{SERIALIZATION}:load", area="checkpoint_hardening", build=_build_dist_load),
    PatchSpec(f"{SERIALIZATION}:load_common_state_dict", area="checkpoint_hardening",
              build=_build_dist_load),
    PatchSpec(f"{TRAINING}:save_checkpoint", area="checkpoint_hardening",
              build=build_save_checkpoint, optional=True),
    PatchSpec(f"{TRAINING}:_load_base_checkpoint", area="checkpoint_hardening",
              build=build_load_base_checkpoint, optional=True),
    PatchSpec(f"{ASYNC}:schedule_async_save", area="checkpoint_hardening",
              build=build_schedule_async_save, optional=True),
]

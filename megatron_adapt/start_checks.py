"""Refusal at start: a Megatron feature that the selected backend cannot serve stops the process
before any model is built, naming the flag, the backend and the reason (never halfway through a
model build, never a silent fallback).

Patch areas register checks here. The `start_checks` area (patches/start_checks.py) runs them from
the two places Megatron passes through before it builds anything:

* `megatron.training.global_vars:set_global_variables`: Megatron-LM's start-up, right after its
  arguments are parsed and validated, before distributed set-up. A check's `from_args(backend,
  settings)` gets the parsed arguments as a dict (Megatron's argument names).
* `TransformerConfig.__post_init__`: megatron-core users who build a config themselves. A check's
  `from_config(backend, config)` gets the finished config.

Either returns the refusal (a message that names the flag, the backend and the reason) or None.
With Transformer Engine installed no check runs (TE serves what these checks refuse), and a check
whose area MEGATRON_ADAPT_DISABLE turns off does not run.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from . import report
from .errors import UnsupportedFeatureError


@dataclass(frozen=True)
class Check:
    area: str                                                   # MEGATRON_ADAPT_DISABLE switch
    name: str                                                   # unique; re-registering replaces
    from_args: Callable[[Any, dict], str | None] | None = None
    from_config: Callable[[Any, Any], str | None] | None = None


_checks: dict[str, Check] = {}


def register(area: str, name: str, from_args=None, from_config=None) -> Check:
    check = _checks[name] = Check(area, name, from_args, from_config)
    return check


def checks() -> list[Check]:
    return list(_checks.values())


def te_installed() -> bool:
    """Megatron's own answer: its TE extension imported with HAVE_TE set."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:   # noqa: BLE001 (an import error of the extension means no usable TE)
        return False
    return bool(getattr(te_ext, "HAVE_TE", False))


def served_without_te(name: str, obj, serves: str):
    """A patch build that installs `obj` under a name Megatron asks Transformer Engine for (`name`,
    used by `serves`), and steps aside when TE is installed: then TE's own object serves."""
    def build(backend, original):
        if te_installed():
            from .spec import SkipPatch

            raise SkipPatch(f"Transformer Engine is installed: its {name} serves {serves}")
        return obj
    return build


def where(backend) -> str:
    return f"the {backend.name} backend"


def refuse(message: str):
    """Print the refusal once (rank 0: every rank raises it) and raise UnsupportedFeatureError."""
    if report._rank() == 0:
        print(f"megatron-adapt: {message}", file=sys.stderr, flush=True)
    raise UnsupportedFeatureError(message)


def _enabled(check: Check) -> bool:
    from .core import active_config

    return active_config().enabled(check.area)


def run_args_checks(backend, args) -> None:
    """Every registered argument check, in registration order; the first refusal is raised."""
    if args is None or te_installed():
        return
    settings = vars(args)
    for check in checks():
        if check.from_args is not None and _enabled(check):
            why = check.from_args(backend, settings)
            if why is not None:
                refuse(why)


def run_config_checks(backend, config) -> None:
    if config is None or te_installed():
        return
    for check in checks():
        if check.from_config is not None and _enabled(check):
            why = check.from_config(backend, config)
            if why is not None:
                refuse(f"{type(config).__name__}: {why}")

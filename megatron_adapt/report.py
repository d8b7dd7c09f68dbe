"""What ran: one record per patch, and per op the implementations that actually executed.

Ops call `ran(op, impl)` on every call (a dict increment) and `fell_back(op, impl, reason)`
when they could not take their fast path, so a silent fallback cannot happen: it is counted,
shown in the table, and with MEGATRON_ADAPT_STRICT=1 it raises.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

from .errors import StrictFallbackError

APPLIED, SKIPPED, DISABLED, FAILED, PENDING, REVERTED = (
    "applied", "skipped", "disabled", "failed", "pending", "reverted")
NOT_FOUND = "target not found"  # the reason's prefix when a patch's target does not exist


@dataclass
class PatchRecord:
    target: str
    area: str
    mode: str
    status: str = PENDING
    reason: str = ""
    implementation: str = ""
    sites: list[str] = field(default_factory=list)       # every place now holding our object
    unrebound: list[str] = field(default_factory=list)   # references we saw but could not rebind


_patch_records: dict[str, PatchRecord] = {}
_op_counts: Counter = Counter()            # (op, impl) -> calls
_op_fallbacks: dict[tuple[str, str], str] = {}   # (op, impl) -> first reason
_strict = False
_context: dict = {}
_selections: list[dict] = []               # providers' choices: op, inputs, chosen, how, timings
_graphs: list[dict] = []                   # CUDA graphs built: by whom, how many, ops captured
_capture_probe = None                      # while graphs are built: says if the current stream captures
_uncaptured: Counter = Counter()           # (op, impl) -> calls during a build but outside its captures


def set_context(*, strict: bool, **info) -> None:
    global _strict
    _strict = strict
    _context.clear()
    _context.update(info)


def patch_record(spec) -> PatchRecord:
    rec = _patch_records.get(spec.target)
    if rec is None:
        rec = _patch_records[spec.target] = PatchRecord(spec.target, spec.area, spec.mode)
    return rec


def ran(op: str, impl: str) -> None:
    """Count one call of `op` served by `impl`. Hot path: keep it a dict increment."""
    _op_counts[(op, impl)] += 1
    if _capture_probe is not None and not _capture_probe():
        _uncaptured[(op, impl)] += 1


def fell_back(op: str, impl: str, reason: str) -> None:
    """`op` could not use its preferred kernel and ran `impl` instead, because `reason`."""
    if _strict:
        raise StrictFallbackError(
            f"{op}: fell back to {impl} because {reason} (MEGATRON_ADAPT_STRICT=1 forbids fallbacks)")
    ran(op, impl)
    _op_fallbacks.setdefault((op, impl), reason)


def selected(op: str, inputs: str, chosen: str, how: str, notes: dict) -> None:
    """An op's implementation for one input signature was chosen among libraries (providers)."""
    _selections.append({"op": op, "inputs": inputs, "chosen": chosen, "how": how, "candidates": notes})


def graphs_built(impl: str, graphs: int, seconds: float, captured_ops: dict, warmup_ops: dict) -> None:
    """CUDA graphs were captured (`impl`); `captured_ops`: op [impl] -> calls made while capturing;
    `warmup_ops`: the calls the builder made eagerly meanwhile (Megatron's warm-up runs before each
    capture), which the graphs do not hold."""
    _graphs.append({"impl": impl, "graphs": graphs, "seconds": seconds, "captured_ops": captured_ops,
                    "warmup_ops": warmup_ops})


@contextlib.contextmanager
def building_graphs(is_capturing):
    """Inside, a call made while `is_capturing()` is False is also counted apart (uncaptured_counts),
    so a graph build can tell its captured calls from its eager warm-up runs."""
    global _capture_probe
    outer, _capture_probe = _capture_probe, is_capturing
    try:
        yield
    finally:
        _capture_probe = outer


def uncaptured_counts() -> dict[str, dict[str, int]]:
    """op -> impl -> calls made inside building_graphs() outside a capture."""
    out: dict[str, dict[str, int]] = {}
    for (op, impl), n in sorted(_uncaptured.items()):
        out.setdefault(op, {})[impl] = n
    return out


@contextlib.contextmanager
def uncounted():
    """Calls made inside (a providers measurement) leave the op counts as they were."""
    saved, saved_uncaptured = _op_counts.copy(), _uncaptured.copy()
    try:
        yield
    finally:
        _op_counts.clear()
        _op_counts.update(saved)
        _uncaptured.clear()
        _uncaptured.update(saved_uncaptured)


def op_counts() -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (op, impl), n in sorted(_op_counts.items()):
        out.setdefault(op, {})[impl] = n
    return out


def reset_op_counts() -> None:
    _op_counts.clear()
    _uncaptured.clear()
    _op_fallbacks.clear()
    _selections.clear()
    _graphs.clear()


def as_dict() -> dict:
    return {
        **_context,
        "strict": _strict,
        "patches": [asdict(r) for r in _patch_records.values()],
        "ops": [
            {"op": op, "implementation": impl, "calls": n,
             "fallback_reason": _op_fallbacks.get((op, impl), "")}
            for (op, impl), n in sorted(_op_counts.items())
        ],
        "selections": list(_selections),
        "targets_not_found": [r.target for r in _patch_records.values() if r.reason.startswith(NOT_FOUND)],
        "cuda_graphs": list(_graphs),
    }


def format_table(data: dict | None = None) -> str:
    data = data or as_dict()
    lines = [
        f"megatron-adapt: backend={data.get('backend')} ({data.get('backend_reason', '')}) "
        f"megatron-core={data.get('megatron_core')} torch={data.get('torch')} strict={data.get('strict')}",
    ]
    if data.get("untested_megatron"):
        missing = data.get("targets_not_found") or []
        lines.append(f"WARNING: megatron-core {data.get('megatron_core')} is newer than the tested range "
                     "(allowed by MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON=1); patch targets not found: "
                     + (", ".join(missing) if missing else "none so far"))
    rows = [(p["area"], p["target"], p["status"], p["implementation"] or "-",
             p["reason"] + (f" [unrebound: {', '.join(p['unrebound'])}]" if p["unrebound"] else ""))
            for p in data["patches"]]
    header = ("area", "target", "status", "implementation", "why / notes")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines.append(fmt.format(*header))
    lines.extend(fmt.format(*r) for r in rows)
    if data["ops"]:
        lines.append("ops that ran (calls per implementation):")
        for o in data["ops"]:
            why = f"  FELL BACK: {o['fallback_reason']}" if o["fallback_reason"] else ""
            lines.append(f"  {o['op']:<28} {o['implementation']:<36} {o['calls']:>8}{why}")
    if data.get("selections"):
        lines.append("implementations chosen among installed libraries:")
    for sel in data.get("selections", []):
        others = ", ".join(f"{k}={v}" for k, v in sel["candidates"].items())
        lines.append(f"  chosen {sel['chosen']:<32} for {sel['op']} [{sel['inputs']}]: {sel['how']}; {others}")
    for g in data.get("cuda_graphs", []):
        ops = ", ".join(f"{k} x{v}" for k, v in g["captured_ops"].items()) or "none"
        warm = ", ".join(f"{k} x{v}" for k, v in g.get("warmup_ops", {}).items())
        lines.append(f"CUDA graphs: {g['graphs']} built by {g['impl']} in {g['seconds']} s; "
                     f"backend ops captured: {ops}"
                     + (f"; run eagerly in the builder's warm-up runs: {warm}" if warm else ""))
    return "\n".join(lines)


def write_json(path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(as_dict(), f, indent=1)
    os.replace(tmp, path)


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


_said: set[str] = set()


def say_once(message: str, key: str | None = None) -> None:
    """Print `megatron-adapt: <message>` to stderr once per process (under `key`, default the
    message itself), on rank 0 only: start-up notes that Megatron's start-up may reach twice."""
    key = message if key is None else key
    if key in _said:
        return
    _said.add(key)
    if _rank() == 0:
        print(f"megatron-adapt: {message}", file=sys.stderr, flush=True)


def print_startup_table(quiet: bool) -> None:
    if not quiet and _rank() == 0:
        print(format_table(), file=sys.stderr, flush=True)


class _ReportModule(type(sys)):
    """`megatron_adapt.report()` is the public call; `megatron_adapt.report.ran(...)` the op hooks."""

    def __call__(self, as_json: bool = False):
        """The patch table (str), or its dict with as_json=True."""
        return as_dict() if as_json else format_table()


sys.modules[__name__].__class__ = _ReportModule

"""Install and remove patches by identity.

For each spec: resolve the defining attribute, replace it (or wrap it with wrapt), then rebind every
module global in sys.modules that *is* the original (Megatron imports many symbols by name), verify
each site, and report references that cannot be rebound (closures, containers, built ModuleSpecs).
Post-import hooks make import order irrelevant. Revert restores only sites that still hold our object.
"""
from __future__ import annotations

import gc
import inspect
import sys
import types
from dataclasses import dataclass, field

import wrapt

from . import report
from .errors import PatchError
from .spec import REPLACE, PatchSpec, SkipPatch
from .versions import in_range


@dataclass
class Installed:
    spec: PatchSpec
    owner: object
    attr: str
    original: object
    new: object
    owner_had_attr: bool
    sites: list[tuple[dict, str]] = field(default_factory=list)  # module dicts we rebound


_installed: dict[str, Installed] = {}   # target -> what we put there
_ours: dict[int, object] = {}           # id(new) -> new: what we installed, for idempotence
_generation = 0                         # bumps on revert so stale import hooks do nothing


def is_ours(obj) -> bool:
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return False  # shared singletons / interned values: identity says nothing about who set them
    return id(obj) in _ours and _ours[id(obj)] is obj


def installed() -> dict[str, Installed]:
    return dict(_installed)


def _resolve(spec: PatchSpec):
    module = sys.modules[spec.module]
    owner: object = module
    parts = spec.qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    attr = parts[-1]
    if isinstance(owner, type):
        # Look the attribute up without binding it (a staticmethod stays a staticmethod).
        for klass in owner.__mro__:
            if attr in vars(klass):
                return owner, attr, vars(klass)[attr], attr in vars(owner)
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
    if spec.create and not hasattr(owner, attr):
        return owner, attr, None, False  # created by apply, deleted by revert
    return owner, attr, getattr(owner, attr), True


def _params(obj):
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return inspect.signature(target).parameters.values()


def signature_problem(original, new) -> str | None:
    """None if `new` accepts every way of calling `original`, else what it would reject."""
    try:
        old_params, new_params = list(_params(original)), list(_params(new))
    except (TypeError, ValueError):
        return None  # builtins without signatures: nothing to compare
    kinds = {p.kind for p in new_params}
    by_name = {p.name: p for p in new_params}
    positional = [p for p in new_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(old_params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue  # a catch-all (e.g. autograd Function.apply) names no contract to check
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if i >= len(positional) and p.VAR_POSITIONAL not in kinds:
                return f"replacement cannot take positional parameter {i} ({p.name})"
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            q = by_name.get(p.name)
            if q is None and p.VAR_KEYWORD not in kinds:
                return f"replacement has no parameter {p.name!r}"
            if q is not None and p.default is not p.empty and q.default is p.empty:
                return f"parameter {p.name!r} is optional in the original but required in the replacement"
    return None


def _our_cells(obj) -> set[int]:
    """ids of the closure cells (and their tuples) of a function we built, or of a class's methods."""
    funcs = [obj] if inspect.isfunction(obj) else [
        f.__func__ if isinstance(f, (staticmethod, classmethod)) else f
        for f in (vars(obj).values() if inspect.isclass(obj) else ())]
    ids = set()
    for f in funcs:
        closure = getattr(f, "__closure__", None) or ()
        ids.add(id(closure))
        ids.update(id(c) for c in closure)
    return ids


def _describe_referrer(container, original) -> str | None:
    if isinstance(container, (types.FrameType, types.FunctionType, types.MethodType)):
        return None
    if type(container).__name__ in ("getset_descriptor", "member_descriptor", "wrapper_descriptor",
                                    "method_descriptor", "weakref", "ReferenceType"):
        return None
    if isinstance(container, tuple) and any(isinstance(o, type) for o in container):
        return None  # a class's __mro__ / __bases__
    if isinstance(container, dict):
        if container.get("__module__") and "__qualname__" in container:
            return None  # a subclass's namespace (e.g. its __init__'s super() cell holder)
        keys = [k for k, v in container.items() if v is original]
        owners = [o for o in gc.get_referrers(container) if getattr(o, "__dict__", None) is container]
        where = type(owners[0]).__name__ if owners else "dict"
        return f"{where}[{', '.join(map(str, keys))}]"
    if isinstance(container, types.CellType):
        for holder in gc.get_referrers(container):
            if isinstance(holder, tuple):
                for fn in gc.get_referrers(holder):
                    if inspect.isfunction(fn) and fn.__closure__ is holder:
                        if fn.__qualname__.startswith(getattr(original, "__qualname__", "?") + "."):
                            return None  # the original class's own methods (super()'s __class__ cell)
                        if fn.__module__ == "typing":
                            return None  # typing.Protocol's subclass hook holds the class, never calls it
                        return f"closure of {fn.__module__}.{fn.__qualname__}"
        return "closure cell"
    return type(container).__name__


def _find_unrebound(inst: Installed) -> list[str]:
    """References to the original that the applier cannot rebind: reported, never ignored."""
    original = inst.original
    if not (inspect.isfunction(original) or inspect.isclass(original)):
        return []
    skip = {id(d) for d, _ in inst.sites} | _our_cells(inst.new) | {id(inst.__dict__)}
    if hasattr(inst.owner, "__dict__"):
        skip.add(id(vars(inst.owner)))
    found = set()
    # For a third-party original (torch.optim.AdamW) only Megatron's references are ours to report.
    megatron_owned = (getattr(original, "__module__", "") or "").startswith("megatron")
    for ref in gc.get_referrers(original):
        if id(ref) in skip:
            continue
        if isinstance(ref, dict) and ref.get("__name__") == getattr(original, "__module__", None):
            continue  # the module that defines it
        desc = _describe_referrer(ref, original)
        if desc and (megatron_owned or "megatron" in desc):
            found.add(desc)
    return sorted(found)[:8]


def _alias_modules(original):
    """Modules whose globals may alias `original`: all of them for Megatron's own objects; only
    Megatron's (and the script's) for third-party objects such as torch.optim.AdamW, which we
    replace for Megatron and must not replace for everyone else."""
    own = (getattr(original, "__module__", "") or "").startswith("megatron")
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron_adapt"):
            continue
        if own or name.startswith("megatron") or name == "__main__":
            yield name, mod


class _Outcome(Exception):
    """How apply_spec ends, recorded in one place: raised by the step that stops a spec.

    status, reason: the report record's. After recording, `error` (the build's own exception) is
    re-raised, or with `fatal` a PatchError naming the target (chained to this outcome's __cause__).
    """

    def __init__(self, status: str, reason: str = "", *, fatal: bool = False, error: Exception | None = None):
        super().__init__(reason)
        self.status, self.reason, self.fatal, self.error = status, reason, fatal, error


def apply_spec(spec: PatchSpec, backend, config, version, untested: str | None = None) -> None:
    """gate -> find target -> build -> install -> rebind aliases -> verify; record how it ended."""
    rec = report.patch_record(spec)
    if spec.target in _installed:
        return  # idempotent: the record of the apply that installed it stands
    rec.status, rec.reason, rec.unrebound = report.PENDING, "", []
    try:
        _gate(spec, backend, config, version)
        owner, attr, original, had = _find_target(spec, config.strict, untested)
        if is_ours(original):
            raise _Outcome(report.APPLIED, "installed already, through another of its names")
        built = _build(spec, backend, original, config.strict)
        inst = _install(spec, owner, attr, original, had, _new_object(spec, original, built))
        rec.sites = [spec.target, *_rebind_aliases(inst)]
        _verify(inst, rec.sites[1:])
        rec.unrebound = _find_unrebound(inst)
        rec.implementation = getattr(inst.new, "__megatron_adapt_impl__", None) or _name(built)
        outcome = _Outcome(report.APPLIED)
    except _Outcome as stop:
        outcome = stop
    rec.status, rec.reason = outcome.status, outcome.reason
    if outcome.error is not None:
        raise outcome.error
    if outcome.fatal:
        raise PatchError(f"{spec.target}: {outcome.reason}") from outcome.__cause__


def _gate(spec: PatchSpec, backend, config, version) -> None:
    """Stop before touching Megatron when the area is off, or the backend or version does not want it."""
    if not config.enabled(spec.area):
        raise _Outcome(report.DISABLED, f"area {spec.area!r} disabled")
    if backend.name not in spec.backends:
        raise _Outcome(report.SKIPPED, f"not needed on the {backend.name} backend")
    if not in_range(spec.versions, version):
        raise _Outcome(report.SKIPPED, f"megatron-core {version} outside {spec.versions}")


def _find_target(spec: PatchSpec, strict: bool, untested: str | None):
    """(owner, attr, original, owner had it): a missing target is reported, and fatal when strict."""
    try:
        return _resolve(spec)
    except (KeyError, AttributeError) as exc:
        where = f" in untested megatron-core {untested}" if untested else ""
        raise _Outcome(report.SKIPPED if spec.optional else report.FAILED, f"{report.NOT_FOUND}{where}: {exc}",
                       fatal=strict and not spec.optional) from exc


def _build(spec: PatchSpec, backend, original, strict: bool):
    """The backend's implementation: a build that does not load is a failure, never silent."""
    try:
        return spec.build(backend, original)
    except SkipPatch as why:
        raise _Outcome(report.SKIPPED, str(why)) from None
    except Exception as exc:
        raise _Outcome(report.FAILED, f"build failed: {type(exc).__name__}: {exc}",
                       error=exc if strict else None) from None


def _new_object(spec: PatchSpec, original, built):
    """What goes in the original's place: a replacement that takes every call the original takes, or a wrapper."""
    if spec.mode != REPLACE:
        return wrapt.FunctionWrapper(original, built)
    if spec.check_signature and callable(original) and not inspect.isclass(original):
        problem = signature_problem(original, built)
        if problem:
            raise _Outcome(report.FAILED, f"signature incompatible: {problem}", fatal=True)
    return built


def _install(spec: PatchSpec, owner, attr, original, had, new) -> Installed:
    """Set the defining attribute and remember it, so that apply is idempotent and revert exact."""
    setattr(owner, attr, new)
    inst = _installed[spec.target] = Installed(spec, owner, attr, original, new, had)
    _ours[id(new)] = new
    return inst


def _rebind_aliases(inst: Installed) -> list[str]:
    """Rebind module globals that are the original (Megatron imports by name); returns their names."""
    names: list[str] = []
    if isinstance(inst.owner, type) or not callable(inst.original):
        return names  # values (flags) have no identity to chase
    for name, mod in _alias_modules(inst.original):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict) or mod is inst.owner:
            continue
        for key, value in list(d.items()):
            if value is inst.original:
                d[key] = inst.new
                inst.sites.append((d, key))
                names.append(f"{name}:{key}")
    return names


def _verify(inst: Installed, site_names: list[str]) -> None:
    """Every site must hold the new object now: a half-patched process is an error."""
    bad = [s for (d, k), s in zip(inst.sites, site_names) if d[k] is not inst.new]
    owner, attr = inst.owner, inst.attr
    current = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if current is not inst.new or bad:  # (on a class, getattr would bind a wrapt wrapper)
        raise _Outcome(report.FAILED, f"verification failed at {bad or inst.spec.target}", fatal=True)


def _name(obj) -> str:
    if not callable(obj):
        return repr(obj)
    module = getattr(obj, "__module__", "?").replace("megatron_adapt.", "")
    return f"{module}.{getattr(obj, '__qualname__', type(obj).__name__).split('.')[-1]}"


def select(specs, version, backend: str | None = None) -> list[PatchSpec]:
    """One spec per target: the one whose version range holds `version` (and, where specs of one
    target serve different backends, the one for `backend`).

    A target that changed between megatron-core releases has one spec per range; overlapping
    ranges among specs for a common backend are a bug in the patch module. Where no range holds the
    version, the first spec stays, and apply_spec records it as skipped with its range.
    """
    by_target: dict[str, list[PatchSpec]] = {}
    for s in specs:
        by_target.setdefault(s.target, []).append(s)
    chosen = []
    for target, group in by_target.items():
        fitting = [s for s in group if in_range(s.versions, version)]
        clash = [(a, b) for i, a in enumerate(fitting) for b in fitting[i + 1:] if set(a.backends) & set(b.backends)]
        if clash:
            raise PatchError(f"{target}: specs with overlapping version ranges "
                             f"{[s.versions for s in clash[0]]} for megatron-core {version}")
        mine = [s for s in fitting if backend in s.backends]
        chosen.append((mine or fitting or group)[0])
    return chosen


def register(specs, backend, config, version, untested: str | None = None) -> None:
    """Apply each spec now if its module is loaded, else when it is imported.

    version: the megatron-core that selects specs; untested: the real version when it is a newer,
    opted-in release (missing targets are then reported as such).
    """
    generation = _generation

    def hook_for(module_specs):
        def hook(module):
            if generation != _generation:
                return
            for s in module_specs:
                apply_spec(s, backend, config, version, untested)
        return hook

    by_module: dict[str, list[PatchSpec]] = {}
    for s in select(specs, version, backend.name):
        rec = report.patch_record(s)
        if version is not None and not in_range(s.versions, version):
            # Known now: a target this release does not have (or has changed) is not waited for.
            rec.status, rec.reason = report.SKIPPED, f"megatron-core {version} outside {s.versions}"
            continue
        by_module.setdefault(s.module, []).append(s)
    for module, module_specs in by_module.items():
        wrapt.register_post_import_hook(hook_for(module_specs), module)


def revert_all() -> None:
    global _generation
    _generation += 1
    for target, inst in reversed(list(_installed.items())):
        for d, key in inst.sites:
            if d.get(key) is inst.new:
                d[key] = inst.original
        current = vars(inst.owner).get(inst.attr) if isinstance(inst.owner, type) else getattr(inst.owner, inst.attr, None)
        if current is inst.new:
            if inst.owner_had_attr:
                setattr(inst.owner, inst.attr, inst.original)
            else:
                delattr(inst.owner, inst.attr)
        report.patch_record(inst.spec).status = report.REVERTED
        _ours.pop(id(inst.new), None)
    _installed.clear()

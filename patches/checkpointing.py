"""Resuming distributed-optimizer checkpoints when the optimizer is PyTorch's Adam.

Without Transformer Engine or apex (`distrib_optimizer.HAVE_APEX_OR_TE = False`: every cpu and npu
run, and cuda runs without either library), `DistributedOptimizer.state_dict()` reads Adam's step
from the inner optimizer's per-parameter state and asserts that there is exactly one value. On
`--load`, Megatron calls it (through `sharded_state_dict(is_loading=True)`) on a freshly built
optimizer whose state is still empty, to get the *template* the checkpoint is loaded into: the
assert fires and stock Megatron cannot resume `--use-distributed-optimizer` checkpoints on that path.

The wrapper gives that one call a step to read: while the inner state is empty it briefly holds a
single `{"step": 0}` entry, so Megatron's own state_dict() runs unchanged (the "state" key is not
part of what it returns). The template's step is a placeholder: `load_state_dict` takes the
step from the checkpoint. With the state populated (after a step or a load) nothing changes.

States written the FusedAdam way (exp_avg / exp_avg_sq and no step: Megatron's `init_state_fn`
for sharded loading, which the backends' Adam keeps as they are, see backends/reference.make_adam)
get the same treatment for the call: the step the other states hold, else the group's, else 0.

Loading the reshardable formats, Megatron drops "step" from the loaded tensors and sets it from the
param groups; `_set_main_param_and_optimizer_states` then asks for every tensor of the live state,
torch's step included. The live step is kept (build_set_states).
"""
import contextlib
import sys

import torch

from megatron_adapt.spec import PatchSpec, SkipPatch

MODULE = "megatron.core.optimizer.distrib_optimizer"


def build_state_dict(backend, original):
    module = sys.modules[MODULE]
    if getattr(module, "HAVE_APEX_OR_TE", True):
        raise SkipPatch("Transformer Engine / apex optimizer: its step lives in param_groups")

    def state_dict(self):
        inner = getattr(self, "optimizer", None)
        state = getattr(inner, "state", None)
        if inner is None or state is None or getattr(self, "is_stub_optimizer", False):
            return original(self)
        with _temporary_steps(inner, state):
            return original(self)
    state_dict.__doc__ = original.__doc__
    return state_dict


def build_set_states(backend, original):
    """Megatron's loaders of the reshardable formats drop "step" from the loaded tensors ("Handle
    torch Adam 'step' state separately": load_state_dict sets it from the param groups), then
    `_set_main_param_and_optimizer_states` copies into every tensor of the live state, torch's
    per-parameter step included: KeyError 'step'. The live step, which load_state_dict set, is
    kept (copied onto itself)."""
    if getattr(sys.modules[MODULE], "HAVE_APEX_OR_TE", True):
        raise SkipPatch("Transformer Engine / apex optimizer: no per-parameter step")

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)
    _set_main_param_and_optimizer_states.__doc__ = original.__doc__
    return _set_main_param_and_optimizer_states


_NO_PARAMETER_KEY = "megatron_adapt: step of a rank that owns no parameter"


@contextlib.contextmanager
def _temporary_steps(inner, state):
    """While Megatron's state_dict reads them: a `{"step": 0}` entry for the first parameter (or,
    on a rank that owns none, under a non-tensor key) when the state is empty, and a step for each
    state without one (the step another state holds, else the group's, else 0). All removed
    afterwards."""
    if len(state) == 0:
        # A data-parallel rank can own no parameter at all (a small model split over many ranks):
        # torch's state_dict keeps a non-tensor key as it is, so the step entry goes under one.
        first = next((p for group in inner.param_groups for p in group["params"]), None)
        created = _NO_PARAMETER_KEY if first is None else first
        targets = [state.setdefault(created, {})]
    else:
        targets = [s for s in state.values() if s and "step" not in s]
        created = None
    if targets:
        known = [s["step"] for s in state.values() if "step" in s]
        group_steps = [g["step"] for g in inner.param_groups if "step" in g]
        step = known[0] if known else torch.tensor(float(group_steps[0] if group_steps else 0))
        for s in targets:
            s["step"] = step
    try:
        yield
    finally:
        if created is not None:
            state.pop(created, None)
        for s in targets:
            s.pop("step", None)


SPECS = [
    # A plain replacement calling the original: the applier's identity check cannot see a wrapt
    # wrapper installed on a class (class attribute access returns a bound wrapper).
    PatchSpec(f"{MODULE}:DistributedOptimizer.state_dict", area="checkpointing",
              build=build_state_dict),
    PatchSpec(f"{MODULE}:DistributedOptimizer._set_main_param_and_optimizer_states", area="checkpointing",
              build=build_set_states),
]

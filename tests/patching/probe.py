"""Run one patch-mechanics scenario in a fresh interpreter and print its findings as JSON.

    python probe.py before|after|idempotent|revert|disabled|consumers
"""
import importlib
import json
import os
import sys
import warnings

os.environ["MEGATRON_ADAPT_AUTO"] = "0"

import megatron_adapt  # noqa: E402
from megatron_adapt import applier  # noqa: E402
from megatron_adapt.core import all_specs  # noqa: E402

def _present(spec):
    """Optional specs whose module this megatron-core lacks (e.g. a 0.16-only module on 0.15) are
    left out: the applier reports them as skipped, there is nothing to probe."""
    if not spec.optional:
        return True
    import importlib.util
    try:
        return importlib.util.find_spec(spec.module) is not None
    except ModuleNotFoundError:
        return False


def specs_for_this_megatron():
    """The spec the applier picks per target for the installed megatron-core (a target that changed
    between releases has one spec per range), leaving out those outside their range."""
    from megatron_adapt.versions import in_range, megatron_core_version

    version = megatron_core_version()
    return [s for s in applier.select(all_specs(), version)
            if in_range(s.versions, version) and _present(s)
            and not s.module.startswith(("megatron.training", "megatron.legacy"))]


SPECS = specs_for_this_megatron()
MODULES = sorted({s.module for s in SPECS})
# Consumers that import patched names into their own globals: each must see our object.
ALIASES = {
    "megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy":
        ["megatron.core.tensor_parallel:vocab_parallel_cross_entropy"],
    "megatron.core.fusions.fused_cross_entropy:fused_vocab_parallel_cross_entropy":
        ["megatron.core.models.common.language_module.language_module:fused_vocab_parallel_cross_entropy"],
    "megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl": ["megatron.core.transformer.mlp:bias_swiglu_impl"],
    "megatron.core.fusions.fused_bias_gelu:bias_gelu_impl": ["megatron.core.transformer.mlp:bias_gelu_impl"],
    "megatron.core.transformer.torch_norm:WrappedTorchNorm": ["megatron.core.models.backends:WrappedTorchNorm"],
    "megatron.core.utils:get_te_version": ["megatron.core.models.bert.bert_model:_get_te_version",
                                           "megatron.core.extensions.transformer_engine:get_te_version"],
    "megatron.core.utils:local_multi_tensor_l2_norm": ["megatron.core.optimizer.clip_grads:l2_norm_impl"],
    "megatron.core.utils:local_multi_tensor_scale": ["megatron.core.optimizer.clip_grads:multi_tensor_scale_impl"],
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": [],
    **{f"megatron.core.dist_checkpointing.serialization:{name}": [f"megatron.core.dist_checkpointing:{name}"]
       for name in ("save", "load", "load_common_state_dict")},
    **{f"megatron.core.transformer.moe.moe_utils:{name}": [f"megatron.core.transformer.moe.token_dispatcher:{name}"]
       for name in ("permute", "unpermute", "sort_chunks_by_idxs")},
    **{f"megatron.core.transformer.moe.moe_utils:{name}": [f"megatron.core.transformer.moe.router:{name}"]
       for name in ("topk_routing_with_score_function", "compute_routing_scores_for_aux_loss",
                    "switch_load_balancing_loss_func")},
}
CONSUMER_MODULES = ["megatron.core.models.gpt.gpt_model", "megatron.core.models.gpt.gpt_layer_specs",
                    "megatron.core.optimizer", "megatron.core.optimizer.clip_grads"]


MISSING = object()  # a name Megatron leaves unbound (a `create` spec's target before apply)
CREATED = {s.target for s in SPECS if s.create}


def lookup(path):
    module, qualname = path.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        if path in CREATED and not isinstance(obj, type) and not hasattr(obj, part):
            return MISSING
        obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)
    return obj


def import_megatron():
    for m in MODULES + CONSUMER_MODULES:
        importlib.import_module(m)


def snapshot():
    out = {}
    records = {p["target"]: p for p in megatron_adapt.report(as_json=True)["patches"]}
    for s in SPECS:
        inst = applier.installed().get(s.target)
        current = lookup(s.target)
        out[s.target] = {
            "status": records[s.target]["status"], "reason": records[s.target]["reason"],
            # (or installed through another of its names, e.g. a module re-exporting ours with `import *`)
            "ours": (inst is not None and current is inst.new) or applier.is_ours(current),
            "aliases_ours": [inst is not None and lookup(a) is inst.new for a in ALIASES.get(s.target, [])],
            "id": id(current), "sites": records[s.target]["sites"], "missing": current is MISSING,
        }
    return out


def originals():
    return {s.target: lookup(s.target) for s in SPECS}


def main(scenario):
    result = {}
    if scenario == "before":
        megatron_adapt.apply("cpu")
        import_megatron()
        result = snapshot()
    elif scenario == "after":
        import_megatron()
        megatron_adapt.apply("cpu")
        result = snapshot()
    elif scenario == "idempotent":
        import_megatron()
        megatron_adapt.apply("cpu")
        first = snapshot()
        megatron_adapt.apply("cpu")
        result = {"first": first, "second": snapshot()}
    elif scenario == "revert":
        import_megatron()
        orig = originals()
        targets = {s.target for s in SPECS}   # aliases of this release's patches only
        alias_orig = {a: lookup(a) for t in ALIASES if t in targets for a in ALIASES[t]}
        import torch
        set_device = torch.cuda.set_device
        megatron_adapt.apply("cpu")
        patched = snapshot()
        megatron_adapt.revert()
        restored = {t: lookup(t) is o for t, o in orig.items()}
        alias_restored = {a: lookup(a) is o for a, o in alias_orig.items()}
        megatron_adapt.revert()  # second revert: a no-op
        device_restored = torch.cuda.set_device is set_device
        megatron_adapt.apply("cpu")
        reapplied = snapshot()
        result = {"patched": patched, "restored": restored, "alias_restored": alias_restored,
                  "device_restored": device_restored, "reapplied": reapplied}
    elif scenario == "disabled":
        import_megatron()
        orig = originals()
        areas = sorted({s.area for s in SPECS})
        megatron_adapt.apply("cpu", disable=areas)
        snap = snapshot()
        result = {t: {**snap[t], "original": lookup(t) is orig[t]} for t in orig}
    print("PROBE-JSON:" + json.dumps(result))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # here, not at import: contract.py imports _present
    main(sys.argv[1])

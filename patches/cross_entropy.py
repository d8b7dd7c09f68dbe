"""Vocab-parallel cross entropy, both of Megatron's paths.

`LanguageModule.compute_language_model_loss` calls `tensor_parallel.vocab_parallel_cross_entropy`
(the package re-export) on the unfused path and `fused_vocab_parallel_cross_entropy` (imported by
name into language_module) with `cross_entropy_loss_fusion`; the applier rebinds both aliases.
From core_v0.19 `vocab_parallel_cross_entropy` takes the TP group as a fourth argument (None: the
global TP group), so that target has one spec per release range.
"""
from megatron_adapt.spec import PatchSpec


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def build_unfused(backend, original):
    ce = backend.op("vocab_parallel_cross_entropy")

    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
        return ce(vocab_parallel_logits, target, label_smoothing, _tp_group())
    return vocab_parallel_cross_entropy


def build_unfused_tp_group(backend, original):
    ce = backend.op("vocab_parallel_cross_entropy")

    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        return ce(vocab_parallel_logits, target, label_smoothing,
                  _tp_group() if tp_group is None else tp_group)
    return vocab_parallel_cross_entropy


def build_fused(backend, original):
    ce = backend.op("vocab_parallel_cross_entropy")

    def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
        return ce(vocab_parallel_logits, target, 0.0, tp_group)
    return fused_vocab_parallel_cross_entropy


SPECS = [
    PatchSpec("megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
              area="cross_entropy", build=build_unfused, versions=">=0.15.0,<0.19.0"),
    PatchSpec("megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
              area="cross_entropy", build=build_unfused_tp_group, versions=">=0.19.0,<0.20.0"),
    PatchSpec("megatron.core.fusions.fused_cross_entropy:fused_vocab_parallel_cross_entropy",
              area="cross_entropy", build=build_fused),
]

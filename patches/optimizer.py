"""Megatron's Adam / SGD classes when neither Transformer Engine nor apex provides them.

Without them Megatron builds plain `torch.optim.AdamW` (single-tensor on CPU, foreach on GPU).
We hand it the backend's optimizer in apex's FusedAdam signature (`adam_w_mode`), and clear
`USING_PYTORCH_OPTIMIZER` so Megatron passes that argument. With TE or apex installed, theirs stay.
"""
from megatron_adapt.spec import PatchSpec, SkipPatch

MODULE = "megatron.core.optimizer"


def _require_torch_fallback():
    import sys

    if not getattr(sys.modules[MODULE], "USING_PYTORCH_OPTIMIZER", False):
        raise SkipPatch("Transformer Engine / apex fused optimizer installed: kept")


def build_adam(backend, original):
    _require_torch_fallback()
    return backend.op("adam")


def build_sgd(backend, original):
    _require_torch_fallback()
    return backend.op("sgd")


def build_flag(backend, original):
    _require_torch_fallback()
    return False


SPECS = [
    PatchSpec(f"{MODULE}:Adam", area="optimizer", build=build_adam, check_signature=False),
    PatchSpec(f"{MODULE}:SGD", area="optimizer", build=build_sgd, check_signature=False),
    # Last: the two above read the original flag to decide.
    PatchSpec(f"{MODULE}:USING_PYTORCH_OPTIMIZER", area="optimizer", build=build_flag),
]

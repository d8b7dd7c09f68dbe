"""Multi-tensor L2 norm and scale (gradient clipping, grad-norm logging, fp16 unscaling).

Megatron's local fallbacks for apex's amp_C loop in Python, one kernel per tensor, and return the
norm on "cuda". `clip_grads`, `optimizer` and `training.utils` import them by name (as
`l2_norm_impl`, `multi_tensor_scale_impl`, `multi_tensor_l2norm`); the applier rebinds those.
"""
from megatron_adapt.spec import PatchSpec


def build_l2norm(backend, original):
    l2norm = backend.op("multi_tensor_l2norm")

    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        tensors = [t for group in tensor_lists for t in group]
        return l2norm(tensors).reshape(1), None
    return local_multi_tensor_l2_norm


def build_scale(backend, original):
    scale_op = backend.op("multi_tensor_scale")

    def local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
        scale_op(tensor_lists[0], tensor_lists[1], scale)
    return local_multi_tensor_scale


SPECS = [
    PatchSpec("megatron.core.utils:local_multi_tensor_l2_norm", area="multi_tensor", build=build_l2norm),
    PatchSpec("megatron.core.utils:local_multi_tensor_scale", area="multi_tensor", build=build_scale),
]

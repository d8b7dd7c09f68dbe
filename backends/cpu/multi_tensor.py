"""apex multi_tensor_l2norm / multi_tensor_scale: the references (torch._foreach_* ops)."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def l2norm(tensors):
    report.ran("multi_tensor_l2norm", "torch._foreach_norm")
    return reference.multi_tensor_l2norm(tensors)


def scale(srcs, dsts, factor):
    report.ran("multi_tensor_scale", "torch._foreach_mul")
    reference.multi_tensor_scale(srcs, dsts, factor)

"""Megatron's bias-dropout-add in training (`get_bias_dropout_add(True, fused=True)`).

`get_bias_dropout_add` returns the module global `bias_dropout_add_fused_train`, a torch.compile'd
function; megatron.training.initialize imports it to warm it up (the applier rebinds that alias).
Where x and residual differ in dtype Megatron's releases disagree on which is cast (0.16 casts the
residual down, 0.19 x up), so those calls keep Megatron's function (reported). The unfused and the
inference variants are left as they are.
"""
from megatron_adapt import report
from megatron_adapt.spec import PatchSpec


def build(backend, original):
    op = backend.op("bias_dropout_add")

    def bias_dropout_add_fused_train(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if x.dtype != residual.dtype or (bias is not None and bias.dtype != x.dtype):
            report.fell_back("bias_dropout_add", "megatron.bias_dropout_add_fused_train",
                             f"x {x.dtype}, bias {None if bias is None else bias.dtype}, "
                             f"residual {residual.dtype}")
            return original(x_with_bias, residual, prob)
        return op(x, bias, residual, prob)
    return bias_dropout_add_fused_train


SPECS = [
    PatchSpec("megatron.core.fusions.fused_bias_dropout:bias_dropout_add_fused_train",
              area="bias_dropout_add", build=build),
]

"""Megatron's bias-dropout-add in training (`get_bias_dropout_add(True, fused=True)`).

`get_bias_dropout_add` returns the module global `bias_dropout_add_fused_train`, a torch.compile'd
function; megatron.training.initialize imports it to warm it up (the applier rebinds that alias).
Where x and residual differ in dtype Megatron's releases disagree on which is cast (0.16 casts the
residual down, 0.19 x up), so those calls keep Megatron's function (reported). Megatron's start-up
warm-up passes `bias.expand_as(residual)`: a bias broadcast along the leading dims is read as its
vector (the gradient still reaches the expanded tensor). The unfused and the
inference variants are left as they are.
"""
from megatron_adapt import report
from megatron_adapt.spec import PatchSpec


def _broadcast_vector(bias, x):
    """bias has x's last dim and repeats one vector along every other dim (size 1 or stride 0)."""
    return bias.size(-1) == x.size(-1) and all(
        n == 1 or st == 0 for n, st in zip(bias.shape[:-1], bias.stride()[:-1]))


def build(backend, original):
    op = backend.op("bias_dropout_add")

    def bias_dropout_add_fused_train(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if bias is not None and bias.dim() > 1 and _broadcast_vector(bias, x):
            bias = bias[(0,) * (bias.dim() - 1)]
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

"""SwiGLU, bias-SwiGLU and bias-GeLU: the implementations MLP imports by name.

`mlp.py` does `from ...fused_bias_swiglu import bias_swiglu_impl` and `... import bias_gelu_impl`;
the applier rebinds those aliases. FP8 input storage and CPU offload of the input keep Megatron's
autograd functions (reported).
"""
from megatron_adapt import report
from megatron_adapt.spec import PatchSpec


def build_swiglu(backend, original):
    swiglu, bias_swiglu = backend.op("swiglu"), backend.op("bias_swiglu")

    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store or cpu_offload_input:
            report.fell_back("swiglu", "megatron.SwiGLUFunction", "fp8_input_store / cpu_offload_input")
            return original(input, bias, fp8_input_store, cpu_offload_input)
        shape = input.shape
        x = input.reshape(-1, shape[-1])
        y = swiglu(x) if bias is None else bias_swiglu(x, bias)
        return y.view(*shape[:-1], -1)
    return bias_swiglu_impl


def build_gelu(backend, original):
    bias_gelu = backend.op("bias_gelu")

    def bias_gelu_impl(input, bias):
        return bias_gelu(bias, input)
    return bias_gelu_impl


SPECS = [
    PatchSpec("megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl", area="activations",
              build=build_swiglu),
    PatchSpec("megatron.core.fusions.fused_bias_gelu:bias_gelu_impl", area="activations",
              build=build_gelu),
]

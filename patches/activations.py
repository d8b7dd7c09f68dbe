"""SwiGLU, bias-SwiGLU and bias-GeLU: the implementations MLP imports by name.

`mlp.py` does `from ...fused_bias_swiglu import bias_swiglu_impl` and `... import bias_gelu_impl`;
the applier rebinds those aliases. FP8 input storage and CPU offload of the input keep Megatron's
autograd functions (reported). Inside an fp8 context with delayed scaling, bias-free SwiGLU goes to
the backend's `fp8_swiglu` where it has one: fc2's cast computes the activation, and fc1's
backward cast its gradient (backends/cuda/fp8_swiglu.py), so neither is written in bf16 first.
"""
from megatron_adapt import report
from megatron_adapt.spec import PatchSpec


def build_swiglu(backend, original):
    swiglu, bias_swiglu = backend.op("swiglu"), backend.op("bias_swiglu")
    from megatron_adapt.patches.fp8 import active_recipe

    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        recipe = active_recipe()
        if (bias is None and recipe is not None and recipe.recipe == "delayed"
                and not (fp8_input_store or cpu_offload_input) and "fp8_swiglu" in backend.ops):
            return backend.op("fp8_swiglu")(input)
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

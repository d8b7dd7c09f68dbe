"""Gradient-accumulation fusion (`--gradient-accumulation-fusion`, Megatron's default) without apex.

`megatron.core.tensor_parallel.layers` binds `fused_weight_gradient_mlp_cuda` (apex's CUDA
extension) only when it imports, and its linear layers refuse the flag otherwise. This area binds
that module global to a small namespace whose `wgrad_gemm_accum_fp32/fp16(input, grad_output,
main_grad)` run the backend's `wgrad_accumulate` op, and sets `_grad_accum_fusion_available`. No
`fused_weight_gradient_mlp_cuda` is put in sys.modules: only Megatron's linear layers see it.
With apex installed, apex's extension stays (both specs are skipped, and the report says so).
`--defer-embedding-wgrad-compute` imports the extension by name and is not served.
"""
import types

from megatron_adapt.spec import PatchSpec, SkipPatch

LAYERS = "megatron.core.tensor_parallel.layers"
APEX_PRESENT = "apex's fused_weight_gradient_mlp_cuda is installed; Megatron uses it"


def build_extension(backend, original):
    if original is not None:
        raise SkipPatch(APEX_PRESENT)
    wgrad = backend.op("wgrad_accumulate")
    ext = types.ModuleType("megatron_adapt.wgrad_accumulate",
                           "apex fused_weight_gradient_mlp_cuda's API on the backend's wgrad_accumulate op")

    # apex has one entry point per main_grad dtype; the backend op takes both.
    ext.wgrad_gemm_accum_fp32 = ext.wgrad_gemm_accum_fp16 = wgrad
    ext.__megatron_adapt_impl__ = f"{backend.name}.wgrad_accumulate"
    return ext


def build_available(backend, original):
    if original:  # only apex's import sets it: our module global above leaves the flag alone
        raise SkipPatch(APEX_PRESENT)
    return True


SPECS = [
    PatchSpec(f"{LAYERS}:fused_weight_gradient_mlp_cuda", area="grad_accum_fusion",
              build=build_extension, create=True),
    PatchSpec(f"{LAYERS}:_grad_accum_fusion_available", area="grad_accum_fusion",
              build=build_available),
]

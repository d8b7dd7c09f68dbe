"""Features and model families no backend here serves: refused before any model is built.

Runs every check registered with megatron_adapt.start_checks (fp8's included, patches/fp8.py) from
Megatron-LM's `set_global_variables` (right after argument validation) and from
`TransformerConfig.__post_init__`, and registers the checks of this area:

* `--delay-wgrad-compute` with fp8 / fp4 or with CUDA graphs: the split weight-gradient pass
  (`backward_dw`, patches/delayed_wgrad) is served on the bf16 / fp16 / fp32 linears, eagerly; the
  fp8 linears compute their weight gradients inside the backward, and a graph replay would not
  refill the linears' Python-side stash.
* `--multi-latent-attention --transformer-impl local`: Megatron's local spec gives MLA a
  DotProductAttention, which takes no k_channels / v_channels (TypeError at model build). MLA is
  served through the transformer_engine spec. Refused also where a megatron-core user asks the
  local spec builder for MLA (`get_gpt_layer_local_spec(multi_latent_attention=True)`).
* `--optimizer-cpu-offload` on cpu and npu: Megatron's HybridDeviceOptimizer picks what to offload
  with `param.is_cuda` and then looks every host-side parameter up in its map of offloaded copies:
  with host parameters (cpu) or NPU parameters (npu) that is a KeyError in the first step. Refused
  at start, and where a megatron-core user builds the optimizer.

Model families whose layer specs name TE's classes directly (T5, BERT, LLaVA / ViT, heterogeneous
layers) are served, not refused: patches/layer_specs binds those names to the provider's modules.
Activation offloading is served too (patches/offloading).
"""
from __future__ import annotations

import inspect

from megatron_adapt import start_checks
from megatron_adapt.spec import WRAP, PatchSpec, SkipPatch
from megatron_adapt.start_checks import where

AREA = "start_checks"


# ---------------------------------------------------------------- the two places checks run
def build_args_check(backend, original):
    def set_global_variables(wrapped, instance, args, kwargs):
        start_checks.run_args_checks(backend, args[0] if args else kwargs.get("args"))
        return wrapped(*args, **kwargs)
    return set_global_variables


def build_config_check(backend, original):
    def __post_init__(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        start_checks.run_config_checks(backend, instance)
        return result
    return __post_init__


# ---------------------------------------------------------------- this area's checks
def wgrad_refusal(backend, s: dict) -> str | None:
    """--delay-wgrad-compute is served (patches/delayed_wgrad) except on the fp8 / fp4 linears and
    under CUDA graphs."""
    graphs = s.get("cuda_graph_impl")
    if s.get("delay_wgrad_compute") and graphs not in (None, "none"):
        return (f"--delay-wgrad-compute with --cuda-graph-impl {graphs}: {where(backend)} cannot run it: "
                f"megatron-adapt's linears keep what the deferred weight-gradient GEMM needs in Python "
                f"state that a captured graph's replay does not refill (TE's graphed backward_dw is not "
                f"served). Drop one of the two.")
    if s.get("delay_wgrad_compute") and (s.get("fp8") or s.get("fp4")):
        flag = "--fp8-format" if s.get("fp8") else "--fp4-format"
        return (f"--delay-wgrad-compute with {flag}: {where(backend)} cannot run it: megatron-adapt's "
                f"fp8 / fp4 linears compute their weight gradients inside the backward (the split "
                f"weight-gradient pass, backward_dw, is served on the bf16 / fp16 / fp32 linears only). "
                f"Drop --delay-wgrad-compute or the low-precision format.")
    return None


MLA_LOCAL_WHY = ("Megatron's local spec builds MLA's core attention from DotProductAttention, which "
                 "takes no k_channels / v_channels (TypeError at model build without TE). "
                 "megatron-adapt serves MLA through the transformer_engine spec")


def mla_local_refusal(backend, s: dict) -> str | None:
    if s.get("multi_latent_attention") and s.get("transformer_impl") == "local":
        return (f"--multi-latent-attention --transformer-impl local: {where(backend)} cannot run it: "
                f"{MLA_LOCAL_WHY}: drop --transformer-impl local.")
    return None


OPTIMIZER_OFFLOAD_WHY = ("Megatron's HybridDeviceOptimizer offloads the parameters for which param.is_cuda "
                         "holds and then looks every other parameter up among its offloaded copies "
                         "(a KeyError in the first step): on the cpu backend the parameters are host "
                         "tensors already, on npu they are NPU tensors it never offloads")


def optimizer_offload_refusal(backend, s: dict) -> str | None:
    if s.get("optimizer_cpu_offload") and backend.name in ("cpu", "npu"):
        return (f"--optimizer-cpu-offload: {where(backend)} cannot run it: {OPTIMIZER_OFFLOAD_WHY}. "
                f"Train without --optimizer-cpu-offload.")
    return None


def _settings_of(config) -> dict:
    names = ("delay_wgrad_compute", "fp8", "fp4", "cuda_graph_impl", "multi_latent_attention", "transformer_impl",
             "optimizer_cpu_offload")
    return {n: getattr(config, n, None) for n in names}


for _name, _check in (("delay_wgrad", wgrad_refusal),
                      ("mla_local", mla_local_refusal),
                      ("optimizer_offload", optimizer_offload_refusal)):
    start_checks.register(
        AREA, _name, from_args=_check,
        from_config=lambda backend, config, _check=_check: _check(backend, _settings_of(config)))


# ---------------------------------------------------------------- refused at a spec function

def _spec_refusal(what: str, why: str, when: str | None = None):
    """A wrapper refusing every call, or (`when`: a parameter name of the spec function) the calls
    in which that parameter, as bound with its default, is true."""
    def build(backend, original):
        if start_checks.te_installed():
            raise SkipPatch("Transformer Engine is installed: its modules serve this spec")
        signature = inspect.signature(original)

        def refuse_spec(wrapped, instance, args, kwargs):
            if when is None or _bound(signature, args, kwargs).get(when):
                start_checks.refuse(f"{what}: {where(backend)} cannot build it: {why}.")
            return wrapped(*args, **kwargs)
        return refuse_spec
    return build


def _bound(signature, args, kwargs) -> dict:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return {}       # Megatron raises its own error for a call its function does not take
    bound.apply_defaults()
    return bound.arguments


def build_hybrid_optimizer_refusal(backend, original):
    def __init__(wrapped, instance, args, kwargs):
        start_checks.refuse(f"HybridDeviceOptimizer (--optimizer-cpu-offload): {where(backend)} cannot "
                            f"run it: {OPTIMIZER_OFFLOAD_WHY}.")
    return __init__


GPT_SPECS = "megatron.core.models.gpt.gpt_layer_specs"

SPECS = [
    PatchSpec("megatron.training.global_vars:set_global_variables", area=AREA, mode=WRAP,
              build=build_args_check, optional=True),
    PatchSpec("megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
              area=AREA, mode=WRAP, build=build_config_check),
    # megatron-core users who build the local spec for MLA (the config check sees transformer_impl
    # only). From 0.17 get_gpt_layer_local_spec(*args, **kwargs) delegates to the submodules builder.
    PatchSpec(f"{GPT_SPECS}:get_gpt_layer_local_spec", area=AREA, mode=WRAP,
              build=_spec_refusal("get_gpt_layer_local_spec(multi_latent_attention=True)", MLA_LOCAL_WHY,
                                  when="multi_latent_attention")),
    PatchSpec(f"{GPT_SPECS}:get_gpt_layer_local_submodules", area=AREA, mode=WRAP, versions=">=0.17.0,<0.20.0",
              build=_spec_refusal("get_gpt_layer_local_submodules(multi_latent_attention=True)", MLA_LOCAL_WHY,
                                  when="multi_latent_attention")),
    PatchSpec("megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.__init__",
              area=AREA, mode=WRAP, backends=("cpu", "npu"),
              build=build_hybrid_optimizer_refusal),
]

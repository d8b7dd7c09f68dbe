"""Patches know Megatron: one module per Megatron area, each a list of PatchSpec in SPECS.

A patch adapts Megatron's call signature to a backend-neutral op (megatron_adapt.ops) and never
imports a hardware library. MEGATRON_ADAPT_DISABLE takes these area names.
"""

AREAS = (
    "jit",
    "package_versions",
    "rng",
    "training",
    "cross_entropy",
    "norms",
    "softmax",
    "attention",
    "context_parallel",
    "rope",
    "activations",
    "bias_dropout_add",
    "optimizer",
    "checkpointing",
    "checkpoint_hardening",
    "multi_tensor",
    "grad_accum_fusion",
    "collectives",
    "moe",
    "layer_specs",
    "offloading",
    "start_checks",
    "fp8",
    "ssm",
    "cuda_graphs",
    "startup_report",
)

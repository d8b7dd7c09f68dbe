"""fp8 on the npu backend: not served. megatron-adapt wires no torch_npu fp8 matmul (it has never
run on an Ascend NPU, and which parts have fp8 matrix units was not checked), so `fp8_linear` is
left out of this backend's op table and Megatron's fp8 flags are refused at start."""
from __future__ import annotations


def fp8_unavailable(recipe: str | None = None) -> str:
    return ("megatron-adapt wires no torch_npu fp8 matmul (only bf16/fp16 GEMMs are served on "
            "Ascend)")

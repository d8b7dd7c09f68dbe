"""Weight-gradient accumulation into the fp32 `main_grad` through torch_npu._npu_matmul_add_fp32.

`torch_npu._npu_matmul_add_fp32(Tensor x, Tensor weight, Tensor(a!) C) -> ()` (Ascend/op-plugin
`op_plugin/ops/atb/LinearAtb.cpp`, ATB LinearOperation with transposeA=true, enAccum=true; in the
op-plugin 7.0.0 - 7.3.0 branches, exposed lazily by `op_plugin/python/atb/_atb_ops.py`, which
loads the NNAL/ATB library on first call) computes C += x^T @ weight in place: x = grad_output
[tokens, out], weight = total_input [tokens, in], C = main_grad [out, in] fp32. There is no public
`torch_npu.npu_matmul_add_fp32` (MindSpeed builds its own, `mindspeed.ops.npu_matmul_add`).

Taken only for bf16 operands: the ATB docs (CANN "matmul与inplaceAdd融合" / "Fusion of Matmul and
InplaceAdd", ascendtb_01_0164) say transposeA=true is not supported with float16, and this op
always sets it. fp16, releases before 7.0.0, a missing NNAL library and non-2-D operands take an
addmm_ into main_grad, reported as a fallback with the reason.
"""
import torch

from megatron_adapt import report
from megatron_adapt.backends import cpu_fallback

from ._lib import PROBES, api, torch_npu

IMPL = "npu.torch_npu._npu_matmul_add_fp32"
FALLBACK = "cpu.reference(wgrad_accumulate)"
PROBE = "matmul_add.unavailable"   # in PROBES: why the first call could not load ATB, if it could not


def unfused(input, grad_output, main_grad):  # noqa: A002
    forms = api()
    if not forms.matmul_add_fp32:
        return (f"{forms.describe()} has no _npu_matmul_add_fp32 (ATB matmul-accumulate, "
                "Ascend Extension 7.0.0 and later)")
    if not hasattr(torch_npu(), "_npu_matmul_add_fp32"):
        return f"torch_npu {forms.version} has no _npu_matmul_add_fp32 (built without the ATB ops)"
    if PROBES.get(PROBE):
        return PROBES[PROBE]
    if main_grad.dtype != torch.float32:
        return f"main_grad dtype {main_grad.dtype} (_npu_matmul_add_fp32 accumulates into fp32 only)"
    if input.dtype == torch.float16 or grad_output.dtype == torch.float16:
        return ("fp16 operands: ATB's matmul-accumulate does not support transposeA with float16 "
                "(CANN ATB docs), and _npu_matmul_add_fp32 always transposes A")
    if input.dtype != torch.bfloat16 or grad_output.dtype != torch.bfloat16:
        return f"operand dtypes {input.dtype}/{grad_output.dtype} (the kernel takes bf16 here)"
    if input.dim() != 2 or grad_output.dim() != 2:
        return f"{input.dim()}-D/{grad_output.dim()}-D operands (2-D [tokens, features] only)"
    return None


def wgrad_accumulate(input, grad_output, main_grad):  # noqa: A002 (apex's argument order)
    why = unfused(input, grad_output, main_grad)
    if why is None:
        if input.numel() == 0 or grad_output.numel() == 0:
            report.ran("wgrad_accumulate", IMPL + ".empty(nothing to add)")
            return  # the kernel rejects empty operands; MindSpeed returns early too
        try:
            torch_npu()._npu_matmul_add_fp32(grad_output, input, main_grad)
        except OSError as exc:  # the lazy ATB loader: NNAL not installed / not sourced
            why = PROBES[PROBE] = f"_npu_matmul_add_fp32 could not load ATB: {exc}"
        else:
            report.ran("wgrad_accumulate", IMPL)
            return
    cpu_fallback("wgrad_accumulate", why, input, grad_output, main_grad)  # reported as FALLBACK

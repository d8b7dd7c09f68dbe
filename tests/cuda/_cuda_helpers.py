"""Shared by tests/cuda: device, shape tables and the relative-error check."""
import torch

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if GPU else torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# ||out - ref|| / ||ref|| against an fp32 (or fp64) reference: fp32 kernels land near 1e-6;
# bf16/fp16 outputs are dominated by the final rounding (2^-9 / 2^-12 per element).
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.2e-2, torch.float16: 2.5e-3}


def rel_err(out, ref):
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype, what="", scale=1.0):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    tol = TOL[dtype] * scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g} ({dtype})"


def ran_impl(op):
    """Implementations that served `op` since the last reset (report counts)."""
    from megatron_adapt import report
    return set(report.op_counts().get(op, {}))


def reset():
    from megatron_adapt import report
    report.reset_op_counts()

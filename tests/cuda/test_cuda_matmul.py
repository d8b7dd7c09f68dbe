"""wgrad_accumulate (gradient-accumulation fusion): bf16/fp16 operands into an fp32 main_grad."""
import pytest
import torch

from _cuda_helpers import DEVICE, GPU
from megatron_adapt import report
from megatron_adapt.backends.cuda import matmul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wgrad_accumulate_into_fp32_main_grad(dtype):
    report.reset_op_counts()
    torch.manual_seed(0)
    t, n_in, n_out = (4096, 512, 1536) if GPU else (64, 24, 40)
    x = torch.randn(t, n_in, device=DEVICE).to(dtype)
    dy = torch.randn(t, n_out, device=DEVICE).to(dtype)
    main_grad = torch.randn(n_out, n_in, device=DEVICE)
    expect = main_grad.double() + dy.double().t() @ x.double()
    matmul.wgrad_accumulate(x, dy, main_grad)
    err = ((main_grad.double() - expect).norm() / expect.norm()).item()
    assert err < 1e-5, err                                # fp32 accumulation of exact products
    impls = report.op_counts()["wgrad_accumulate"]
    if GPU:
        assert impls == {"cuda.addmm_" if dtype == torch.float32 else "cuda.addmm(out_dtype=fp32)": 1}
    else:  # CPU tensors: the reference, reported as a fallback
        assert set(impls) == {"cpu.reference(wgrad_accumulate)", "cpu.addmm_"}

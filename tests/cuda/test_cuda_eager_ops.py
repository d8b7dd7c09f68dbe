"""MEGATRON_ADAPT_EAGER_OPS: eager CUDA calls of the norms, activations and bias-dropout-add take
PyTorch's native ops (default `torch`), a CUDA-graph capture takes our Triton kernels, and
non-CUDA tensors (the interpreter) always take Triton. The native path must compute the op's
contract: checked against the fp32 reference, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

from megatron_adapt.backends.cuda import activations, dropout, norms
from megatron_adapt.backends.cuda._common import NATIVE
from megatron_adapt.config import Config
from megatron_adapt.errors import ConfigError

from _cuda_helpers import DEVICE, GPU, assert_close, ran_impl, reset

needs_gpu = pytest.mark.skipif(not GPU, reason="the native choice applies to CUDA tensors: needs a GPU")


def test_default_is_torch_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("MEGATRON_ADAPT_EAGER_OPS", raising=False)
    assert Config.resolve().eager_ops == "torch"
    assert Config.resolve(eager_ops="triton").eager_ops == "triton"
    monkeypatch.setenv("MEGATRON_ADAPT_EAGER_OPS", "fast")
    with pytest.raises(ConfigError, match="MEGATRON_ADAPT_EAGER_OPS='fast'.*torch, triton"):
        Config.resolve()


def test_tensors_off_cuda_keep_the_triton_kernel(monkeypatch):
    """Under TRITON_INTERPRET (no GPU) the default must still run our kernel, or the numerics tests
    of this directory would test nothing of ours."""
    if GPU:
        pytest.skip("checks the interpreter path (CPU tensors)")
    monkeypatch.delenv("MEGATRON_ADAPT_EAGER_OPS", raising=False)
    reset()
    x = torch.randn(4, 32)
    norms.rms_norm(x, torch.ones(32), 1e-5)
    assert ran_impl("rms_norm") == {"cuda.triton"}


def _cases(dtype):
    h = 256
    x = torch.randn(8, 2 * h, device=DEVICE, dtype=dtype)
    w, b = torch.rand(h, device=DEVICE, dtype=dtype) + 0.5, torch.randn(h, device=DEVICE, dtype=dtype)
    xh = x[:, :h].contiguous()
    bias2 = torch.randn(2 * h, device=DEVICE, dtype=dtype)

    def ref_rms(x, w):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    def ref_swiglu(x):
        a, g = x.float().chunk(2, -1)
        return F.silu(a) * g
    return [
        ("rms_norm", lambda t, w: norms.rms_norm(t, w, 1e-5), ref_rms, (xh, w)),
        ("layer_norm", lambda t, w, b: norms.layer_norm(t, w, b, 1e-5),
         lambda t, w, b: F.layer_norm(t.float(), (h,), w.float(), b.float(), 1e-5), (xh, w, b)),
        ("swiglu", activations.swiglu, ref_swiglu, (x,)),
        ("bias_swiglu", activations.bias_swiglu, lambda t, b: ref_swiglu(t.float() + b.float()), (x, bias2)),
        ("bias_gelu", activations.bias_gelu,
         lambda b, y: F.gelu(y.float() + b.float(), approximate="tanh"), (b, xh)),
        ("bias_dropout_add", lambda t, b, r: dropout.bias_dropout_add(t, b, r, 0.0),
         lambda t, b, r: r.float() + t.float() + b.float(), (xh, b, torch.randn_like(xh))),
    ]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_cuda_calls_take_native_ops_that_meet_the_contract(monkeypatch, dtype):
    monkeypatch.setenv("MEGATRON_ADAPT_EAGER_OPS", "torch")
    for op, fn, ref, args in _cases(dtype):
        reset()
        ins = [a.detach().clone().requires_grad_() for a in args]
        refs = [a.detach().clone().requires_grad_() for a in args]
        out = fn(*ins)
        assert ran_impl(op) == {NATIVE}, op
        expect = ref(*refs)
        assert_close(out, expect, dtype, f"{op} forward")
        dy = torch.randn_like(out)
        out.backward(dy)
        expect.backward(dy.float())
        for i, (a, r) in enumerate(zip(ins, refs)):
            assert_close(a.grad, r.grad, dtype, f"{op} grad {i}", scale=2.0)


@needs_gpu
def test_a_graph_capture_takes_triton_and_replays_it(monkeypatch):
    monkeypatch.setenv("MEGATRON_ADAPT_EAGER_OPS", "torch")
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(512, device="cuda", dtype=torch.bfloat16) + 0.5
    norms.rms_norm(x, w, 1e-5)              # warm-up: Triton compiles outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        monkeypatch.setenv("MEGATRON_ADAPT_EAGER_OPS", "triton")
        norms.rms_norm(x, w, 1e-5)
        monkeypatch.setenv("MEGATRON_ADAPT_EAGER_OPS", "torch")
    torch.cuda.current_stream().wait_stream(s)
    reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = norms.rms_norm(x, w, 1e-5)
    assert ran_impl("rms_norm") == {"cuda.triton"}
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    reset()
    eager = norms.rms_norm(x, w, 1e-5)
    assert ran_impl("rms_norm") == {NATIVE}
    assert_close(y, eager, torch.bfloat16, "captured Triton vs eager native")

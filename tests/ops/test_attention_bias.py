"""The attention_bias op (T5's relative position embedding: a learned bias added to the scaled
scores) on every backend, against softmax(q k^T * scale + bias, masked) v written out in fp64,
forward and backward, the bias's gradient included: padding masks with fully masked (padded)
query rows, causal, GQA. cpu; cuda's module on the device the tests have (its math path on CPU, the
memory-efficient kernel on a GPU); npu under the torch_npu emulation (a reported reference)."""
import importlib
import os
import sys

import pytest
import torch

from megatron_adapt import report

HERE = os.path.dirname(os.path.abspath(__file__))
EMULATION = os.path.join(os.path.dirname(HERE), "npu", "emulation")
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def reference(q, k, v, bias, mask, causal, scale):
    q, k, v, bias = (t.double() for t in (q, k, v, bias))
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale + bias
    sq, sk = s.shape[-2:]
    masked = torch.zeros(sq, sk, dtype=torch.bool, device=s.device)
    if causal:
        masked = torch.triu(torch.ones_like(masked), diagonal=1 + sk - sq)
    if mask is not None:
        masked = masked | mask
    s = s.masked_fill(masked, torch.finfo(torch.float64).min)
    return torch.softmax(s, -1) @ v


def op(backend):
    if backend == "npu":
        sys.path.insert(0, EMULATION)
        try:
            return importlib.import_module("megatron_adapt.backends.npu.attention").attention_bias
        finally:
            sys.path.remove(EMULATION)
    return importlib.import_module(f"megatron_adapt.backends.{backend}.attention").attention_bias


CASES = {   # b, hq, hkv, sq, sk, causal, padding
    "padding": (2, 4, 4, 16, 16, False, True),
    "causal": (2, 4, 4, 16, 16, True, False),
    "gqa_cross": (2, 4, 2, 8, 24, False, True),
}


@pytest.mark.parametrize("backend", ["cpu", "cuda", "npu"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_bias_matches_the_math(backend, case):
    b, hq, hkv, sq, sk, causal, padding = CASES[case]
    device = DEVICE if backend == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, sq, 16, generator=g)
    k, v = (torch.randn(b, hkv, sk, 16, generator=g) for _ in range(2))
    bias = torch.randn(1, hq, sq, sk, generator=g)        # T5's: [1, heads, sq, sk]
    mask = None
    if padding:   # batch 1: the last 5 keys and the last 3 queries are padding (rows fully masked)
        pad_q, pad_k = torch.zeros(b, sq, dtype=torch.bool), torch.zeros(b, sk, dtype=torch.bool)
        pad_q[1, -3:], pad_k[1, -5:] = True, True
        mask = pad_q.view(b, 1, sq, 1) | pad_k.view(b, 1, 1, sk)
    scale = 0.3
    ins = [t.to(device).requires_grad_() for t in (q, k, v, bias)]
    report.reset_op_counts()
    out = op(backend)(*ins, None if mask is None else mask.to(device), causal, scale, 0.0, None)
    impl = report.op_counts()["attention_bias"]
    gout = torch.randn(out.shape, generator=g)
    real = torch.ones(b, 1, sq, 1, dtype=torch.bool) if mask is None else ~mask.all(-1, keepdim=True)
    (out.float().cpu() * gout * real).sum().backward()   # the loss reads real queries only
    refs = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = reference(*refs, mask, causal, scale)
    ((ref * gout.double()) * real).sum().backward()
    assert torch.isfinite(out).all()      # padded rows included
    torch.testing.assert_close((out.cpu().double() * real), ref.detach() * real, atol=1e-5, rtol=1e-5)
    for name, mine, theirs in zip("qkvb", ins, refs):
        torch.testing.assert_close(mine.grad.cpu().double(), theirs.grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"d{name}: {m}")
    want = {"cpu": "cpu.torch.sdpa", "cuda": f"cuda.sdpa.{'efficient' if DEVICE.type == 'cuda' else 'math'}",
            "npu": "npu.torch.sdpa (reference)"}[backend]
    assert set(impl) == {want}, impl

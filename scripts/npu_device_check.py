#!/usr/bin/env python3
"""One command for a maintainer with an Ascend NPU: run every npu op once on the device against
the cpu backend's reference and print a table (op, implementation taken, max abs error, pass/fail).

    python scripts/npu_device_check.py            # exit 0: all pass; 1: a mismatch; 2: no NPU

The npu backend was written and tested against an emulation of torch_npu only (no Ascend NPU was
available); this script is the quick check of that work on real hardware. Each row's
implementation column says whether the torch_npu kernel ran or which reported fallback did (and
why); compare it with the call forms the header prints (chosen from torch_npu.__version__) and
with tests/npu/torch_npu_api.py, which cites the source of every signature relied on.
--allow-emulation runs it against tests/npu/emulation (how this script itself is tested).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _fail(msg: str) -> None:
    print(f"npu_device_check: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _device(allow_emulation: bool) -> str:
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        _fail(f"cannot import torch_npu ({exc}); this check needs an Ascend NPU with torch_npu + CANN installed")
    if getattr(torch_npu, "EMULATION", False):
        if not allow_emulation:
            _fail("the imported torch_npu is megatron-adapt's test EMULATION, not Ascend's (pass --allow-emulation)")
        return "cpu"   # the emulated NPU is the CPU
    if not torch.npu.is_available():
        _fail("torch_npu sees no NPU device (check the driver, CANN set_env.sh and ASCEND_RT_VISIBLE_DEVICES)")
    return "npu"


def cases():
    """(op, args builder, tolerance, output/gradient picker). Inputs are built on the CPU from one
    seed; the npu op gets device copies, the reference fp32 copies of the same values."""
    bf, h = torch.bfloat16, torch.float16
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    routing = torch.zeros(6, 4, dtype=torch.bool)
    for t, (a, b) in enumerate([(0, 1), (1, 2), (0, 3), (2, 3), (0, 2), (1, 3)]):
        routing[t, a] = routing[t, b] = True
    yield "rms_norm", (r(4, 7, 64, dtype=bf), r(64, dtype=bf), 1e-5), {}, 2e-2
    yield "layer_norm", (r(4, 64, dtype=bf), r(64, dtype=bf), r(64, dtype=bf), 1e-5), {}, 3e-2
    yield "scaled_masked_softmax", (r(2, 4, 64, 64, dtype=h), None, 0.125, True), {}, 2e-3
    yield "attention", (r(2, 4, 128, 64, dtype=bf), r(2, 2, 128, 64, dtype=bf), r(2, 2, 128, 64, dtype=bf)), \
        {"causal": True}, 2e-2
    yield "attention(window)", (r(1, 4, 96, 64, dtype=h), r(1, 4, 96, 64, dtype=h), r(1, 4, 96, 64, dtype=h)), \
        {"causal": True, "window_size": (31, 0)}, 2e-3
    yield "rope", (r(16, 2, 4, 64, dtype=bf), r(16, 1, 1, 64, scale=3.0)), {}, 2e-2
    yield "rope(interleave)", (r(16, 2, 4, 64, dtype=bf), r(16, 1, 1, 64, scale=3.0), True), {}, 2e-2
    yield "swiglu", (r(8, 256, dtype=bf),), {}, 2e-2
    yield "bias_gelu", (r(128, dtype=bf), r(8, 128, dtype=bf)), {}, 2e-2
    yield "vocab_parallel_cross_entropy", (r(4, 3, 1001, scale=4.0), torch.randint(0, 1001, (4, 3), generator=g),
                                           0.0, None), {}, 1e-4
    yield "wgrad_accumulate", (r(64, 32, dtype=bf), r(64, 48, dtype=bf), r(48, 32)), {}, 1e-3
    yield "grouped_gemm", (r(24, 32, dtype=bf), r(4, 32, 16, dtype=bf, scale=0.2), torch.tensor([5, 0, 12, 7])), {}, 3e-2
    yield "moe_permute", (r(6, 32, dtype=bf), routing, None, 12), {}, 0.0


def _cp_blocks(dev):
    """The context-parallel ring's blocks (NpuBlocks: npu_fusion_attention / _grad per all-visible or
    causal piece) at CP 2, bf16, GQA: every (rank, source) block's out, lse, dq, dk, dv against the
    math blocks in fp32 -> the largest error relative to the largest reference value."""
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.npu.attention import NpuBlocks

    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for rank in (0, 1):
        for src in (0, 1):
            ok = cp.visible(*cp.sbhd_meta(2, 256, 2, rank), *cp.sbhd_meta(2, 256, 2, src), True, None)
            q, k, v = (torch.randn(2, h, 256, 64, generator=g).bfloat16() for h in (8, 2, 2))
            out, lse = NpuBlocks.fwd(q.to(dev), k.to(dev), v.to(dev), ok.to(dev), 0.125, None)
            w_out, w_lse = cp._block_fwd(q.float(), k.float(), v.float(), ok, 0.125)
            dout = torch.randn(w_out.shape, generator=g)
            got = NpuBlocks.bwd(q.to(dev), k.to(dev), v.to(dev), ok.to(dev), 0.125, w_out.to(dev), dout.to(dev),
                                w_lse.to(dev), None)
            want = cp._block_bwd(q.float(), k.float(), v.float(), ok, 0.125, w_out, dout, w_lse)
            for a, b in zip((out, lse) + tuple(got), (w_out, w_lse) + tuple(want)):
                worst = max(worst, ((a.float().cpu() - b).abs().max() / b.abs().max()).item())
    return worst


def _run(fn, args, kwargs, dev, dtype=None, grad=True):
    moved, leaves = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.to(dev) if dtype is None or not a.is_floating_point() else a.to(dev, dtype)
            if a.is_floating_point() and grad:
                a = a.detach().requires_grad_(True)
                leaves.append(a)
        moved.append(a)
    out = fn(*moved, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    if first is None:                      # in place (wgrad_accumulate): the accumulator is the result
        return [moved[2].detach().float().cpu()]
    results = [first.detach().float().cpu()]
    if first.requires_grad:
        grad = torch.ones_like(first).to(first.device) * 0.5
        first.backward(grad)
        results += [leaf.grad.float().cpu() for leaf in leaves if leaf.grad is not None]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow-emulation", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    dev = _device(opts.allow_emulation)

    from megatron_adapt import report
    from megatron_adapt.backends import cpu, npu
    from megatron_adapt.backends.npu import _lib

    npu.check()
    npu.BACKEND.op("rms_norm")   # loads the backend's modules
    print(f"npu_device_check: {_lib.api().describe()}; device {dev}"
          + (f" ({torch.npu.get_device_name()})" if dev == "npu" else " (EMULATION)"))
    rows, failed = [], 0
    for label, args, kwargs, tol in cases():
        name = label.split("(")[0]
        grad = name != "wgrad_accumulate"   # in place into main_grad, no autograd
        report.reset_op_counts()
        report.set_context(strict=False)
        try:
            got = _run(npu.BACKEND.op(name), [a.clone() if isinstance(a, torch.Tensor) else a for a in args],
                       kwargs, dev, grad=grad)
            impls = [f"{o['implementation']}" + (f" [FELL BACK: {o['fallback_reason']}]" if o["fallback_reason"] else "")
                     for o in report.as_dict()["ops"] if not o["implementation"].startswith("cpu.")
                     or o["fallback_reason"]]
            want = _run(cpu.BACKEND.op(name), [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args],
                        kwargs, "cpu", torch.float32, grad)
            err = max((a - b).abs().max().item() for a, b in zip(got, want)) if got else float("nan")
            ok = len(got) == len(want) and err <= tol * 4
        except Exception as exc:  # noqa: BLE001 (a row per op, whatever happens)
            impls, err, ok = [f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"], float("nan"), False
        failed += not ok
        rows.append((label, "; ".join(impls) or "-", f"{err:.3g}", "PASS" if ok else "FAIL"))
    report.reset_op_counts()
    try:
        err = _cp_blocks(dev)
        falls = [o["fallback_reason"] for o in report.as_dict()["ops"] if o["fallback_reason"]]
        impl = "npu.fusion_attention_blocks" + (f" [FELL BACK: {falls[0]}]" if falls else "")
        ok = err <= 2e-2 and not falls
    except Exception as exc:  # noqa: BLE001
        impl, err, ok = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", float("nan"), False
    failed += not ok
    rows.append(("attention_cp(blocks, rel err)", impl, f"{err:.3g}", "PASS" if ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows + [("op", "implementation", "max abs err", "")]) for i in range(3)]
    print(f"{'op':<{widths[0]}}  {'implementation':<{widths[1]}}  {'max abs err':>{widths[2]}}  result")
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
    print(f"npu_device_check: {len(rows) - failed}/{len(rows)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The npu backend's context-parallel blocks (NpuBlocks: each ring block cut into all-visible and
causal pieces, one npu_fusion_attention call per piece in layout BNSD, merged by log-sum-exp; the
backward runs npu_fusion_attention_grad per piece from the ring's final out / lse, fed as
softmax_max = lse, softmax_sum = 1) through the torch_npu emulation: every (rank, source) block of
Megatron's load-balanced split at CP 2 and 4 against the torch-math blocks, forward and backward,
GQA; windows and dropout take the math, reported; and the whole op (backends/npu attention_cp)
in 2 gloo processes for every --cp-comm-type against full attention (tests/ops/test_cp_attention.py's
cases). The emulation checks the calls against the real signatures; the kernels' own numerics
need an Ascend NPU."""
import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spy(torch_npu, monkeypatch):
    calls = {"npu_fusion_attention": [], "npu_fusion_attention_grad": []}
    for name in calls:
        real = getattr(torch_npu, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name].append(kwargs)
            return _real(*args, **kwargs)
        monkeypatch.setattr(torch_npu, name, spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_npu_blocks_match_math_blocks(torch_npu, report, monkeypatch, cp_size, dtype):
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.npu import attention as attn

    calls = _spy(torch_npu, monkeypatch)
    b, hq, hkv, d, s_local, scale = 2, 4, 2, 16, 16, 0.3
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(0)
    blocks = 0
    for rank in range(cp_size):
        qpos, qdoc = cp.sbhd_meta(b, s_local, cp_size, rank)
        for src in range(cp_size):
            kpos, kdoc = cp.sbhd_meta(b, s_local, cp_size, src)
            ok = cp.visible(qpos, qdoc, kpos, kdoc, True, None)
            if not bool(ok.any()):
                continue
            blocks += 1
            q = torch.randn(b, hq, s_local, d, generator=g).to(dtype)
            k, v = (torch.randn(b, hkv, s_local, d, generator=g).to(dtype) for _ in range(2))
            out, lse = attn.NpuBlocks.fwd(q, k, v, ok, scale, None)
            want_out, want_lse = cp._block_fwd(q, k, v, ok, scale, None)
            where = f"cp{cp_size} r{rank} s{src}"
            torch.testing.assert_close(out, want_out, atol=tol, rtol=tol, msg=lambda m: f"out {where}: {m}")
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5, msg=lambda m: f"lse {where}: {m}")
            dout = torch.randn(out.shape, generator=g)
            got = attn.NpuBlocks.bwd(q, k, v, ok, scale, want_out, dout, want_lse, None)
            want = cp._block_bwd(q, k, v, ok, scale, want_out, dout, want_lse, None)
            for name, a, w in zip(("dq", "dk", "dv"), got, want):
                assert a.shape == w.shape and a.dtype == torch.float32, (name, a.shape, w.shape)
                torch.testing.assert_close(a, w, atol=tol, rtol=tol, msg=lambda m: f"{name} {where}: {m}")
    assert "attention_cp" not in report.op_counts()            # no block took the math
    fwd, bwd = calls["npu_fusion_attention"], calls["npu_fusion_attention_grad"]
    assert len(fwd) == len(bwd) >= blocks
    causal = [c for c in fwd if c["sparse_mode"] == 3]
    assert causal and all(c["atten_mask"].shape == (2048, 2048) for c in causal)
    assert all(c["atten_mask"] is None for c in fwd if c["sparse_mode"] == 0)
    assert {c["sparse_mode"] for c in fwd} == {0, 3}
    for c in bwd:
        assert c["softmax_sum"].eq(1).all() and c["softmax_max"].shape[-1] == 8 and c["keep_prob"] == 1.0
        assert c["attention_in"].dtype == dtype


def test_windows_and_dropout_take_the_math_blocks(torch_npu, report, monkeypatch):
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.npu import attention as attn

    calls = _spy(torch_npu, monkeypatch)
    qpos, qdoc = cp.sbhd_meta(1, 32, 2, 0)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    for ok, drop in ((cp.visible(qpos, qdoc, qpos, qdoc, True, (5, 0)), None),
                     (cp.visible(qpos, qdoc, qpos, qdoc, True, None), (0.1, 7))):
        out, lse = attn.NpuBlocks.fwd(q, k, v, ok, 0.3, drop)
        want, want_lse = cp._block_fwd(q, k, v, ok, 0.3, drop)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
    assert not calls["npu_fusion_attention"]
    falls = {o["implementation"]: o["fallback_reason"] for o in report.as_dict()["ops"] if o["op"] == "attention_cp"}
    assert "no cover by all-visible and causal pieces" in falls[attn.BLOCK_FALLBACK]


@pytest.mark.parametrize("d,dropout_p,served,why", [
    (16, 0.0, True, None), (800, 0.0, False, "head dim 800"), (16, 0.1, False, "dropout")])
def test_attention_cp_passes_the_npu_blocks_where_the_kernel_serves(torch_npu, report, monkeypatch, d, dropout_p,
                                                                    served, why):
    """The wiring: blocks=NpuBlocks to the ring, reported as npu.fusion_attention_blocks.<comm>; head
    dims beyond the kernel's limit and dropout take the math blocks, reported with the reason."""
    from megatron_adapt.backends import npu as npu_backend
    from megatron_adapt.backends.npu import attention as attn

    seen = []
    monkeypatch.setattr(attn.context_parallel, "attention_cp", lambda *a, **kw: seen.append((a, kw)) or a[0])
    q = torch.randn(1, 2, 4, d)
    npu_backend.BACKEND.op("attention_cp")(q, q, q, None, None, True, 0.1, None, None, "a2a", dropout_p)
    (args, kw), = seen
    assert (kw.get("blocks") is attn.NpuBlocks) == served and args[-1] == dropout_p
    ops = [o for o in report.as_dict()["ops"] if o["op"] == "attention_cp"]
    if served:
        assert [(o["implementation"], o["fallback_reason"]) for o in ops] == [("npu.fusion_attention_blocks.a2a", "")]
    else:
        (o,) = ops
        assert o["implementation"] == "npu.torch.a2a" and why in o["fallback_reason"]


def _worker(rank, port, q):
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(TESTS, "ops"))
    from test_cp_attention import CASES, _case, cp_groups

    import torch_npu
    from megatron_adapt import report
    from megatron_adapt.backends.npu.attention import attention_cp

    calls = [0, 0]
    fwd, bwd = torch_npu.npu_fusion_attention, torch_npu.npu_fusion_attention_grad

    def count_fwd(*a, **kw):
        calls[0] += 1
        return fwd(*a, **kw)

    def count_bwd(*a, **kw):
        calls[1] += 1
        return bwd(*a, **kw)
    torch_npu.npu_fusion_attention, torch_npu.npu_fusion_attention_grad = count_fwd, count_bwd
    groups = cp_groups(rank, port)
    res = {"profile": torch_npu.PROFILE}
    for name, layout, comm, dtype, window in CASES:
        report.reset_op_counts()
        calls[:] = [0, 0]
        try:
            res[name] = _case(rank, name, layout, comm, dtype, window, groups, attention_cp)
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            res[name] = f"{type(exc).__name__}: {exc}"
        res[name + "-impls"] = (sorted(report.op_counts().get("attention_cp", {})), tuple(calls))
    q.put((rank, res))
    dist.destroy_process_group()


def test_attention_cp_in_two_processes_matches_full_attention(torch_npu):
    """Every case of tests/ops/test_cp_attention.py through the npu backend's attention_cp (the
    emulation goes to the spawned ranks on sys.path, the profile in the environment); run under the
    first and last profile (4 and 5 outputs of npu_fusion_attention_grad)."""
    if torch_npu.PROFILE not in ("6.0.0", "7.3.0"):
        pytest.skip("the two-process run covers the first and last profile")
    from adapt_testutil import spawn_ranks

    sys.path.insert(0, os.path.join(TESTS, "ops"))
    try:
        from test_cp_attention import CASES
    finally:
        sys.path.remove(os.path.join(TESTS, "ops"))
    results = spawn_ranks(_worker)
    for rank, res in results.items():
        assert res["profile"] == torch_npu.PROFILE
        for name, layout, comm, dtype, window in CASES:
            errs = res[name]
            assert isinstance(errs, dict), f"rank {rank} {name}: {errs}"
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for what, err in errs.items():
                assert err < tol, f"rank {rank} {name} {what}: max |err| {err}"
            impls, (n_fwd, n_bwd) = res[name + "-impls"]
            comm_type = comm.split("/")[0]
            assert f"npu.fusion_attention_blocks.{comm_type}" in impls, (rank, name, impls)
            if layout == "sbhd" and window is None:       # every block has a cover: no math
                assert "npu.torch.block" not in impls and n_fwd > 0 and n_bwd == n_fwd, (rank, name, impls)
            if window is not None:
                assert "npu.torch.block" in impls, (rank, name, impls)

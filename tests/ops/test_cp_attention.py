"""Context-parallel attention (backends/context_parallel.py through the cpu backend's attention_cp
op) in 2 gloo processes, against full attention over the whole sequence with an explicit mask
(tests/thd_cases.truth), forward and backward: fp32 1e-5, bf16 2e-2. Every --cp-comm-type (p2p
ring, allgather, a2a, a2a+p2p with the pair of groups either way round), SBHD with Megatron's
load-balanced 2·CP chunks (causal, sliding window) and THD split as TE's
thd_get_partitioned_indices (uneven documents crossing chunk boundaries, a document of length 1,
padding between documents), THD split as one row in 2·CP chunks (core_v0.19's per-sequence split
of --dataloader-inter-document-masking batches: documents cut anywhere, with and without padding), GQA."""
import os

import pytest
import torch

from adapt_testutil import spawn_ranks

CASES = [  # (name, layout, comm, dtype, window)
    ("sbhd-p2p", "sbhd", "p2p", torch.float32, None),
    ("sbhd-allgather", "sbhd", "allgather", torch.float32, None),
    ("sbhd-a2a", "sbhd", "a2a", torch.float32, None),
    ("sbhd-a2a+p2p(2x1)", "sbhd", "a2a+p2p", torch.float32, None),
    ("sbhd-a2a+p2p(1x2)", "sbhd", "a2a+p2p/1x2", torch.float32, None),
    ("sbhd-p2p-window", "sbhd", "p2p", torch.float32, (3, 0)),
    ("sbhd-a2a-window", "sbhd", "a2a", torch.float32, (5, 0)),
    ("sbhd-p2p-bf16", "sbhd", "p2p", torch.bfloat16, None),
    ("thd-p2p", "thd", "p2p", torch.float32, None),
    ("thd-allgather", "thd", "allgather", torch.float32, None),
    ("thd-a2a", "thd", "a2a", torch.float32, None),
    ("thd-a2a+p2p(1x2)", "thd", "a2a+p2p/1x2", torch.float32, None),
    ("thd-p2p-window", "thd", "p2p", torch.float32, (2, 0)),
    # the whole packed row in 2·CP chunks (core_v0.19's --dataloader-inter-document-masking split)
    ("thdseq-p2p", "thdseq", "p2p", torch.float32, None),
    ("thdseq-allgather", "thdseq", "allgather", torch.float32, None),
    ("thdseq-a2a", "thdseq", "a2a", torch.float32, None),
    ("thdseq-a2a+p2p(1x2)", "thdseq", "a2a+p2p/1x2", torch.float32, None),
    ("thdseq-p2p-window", "thdseq", "p2p", torch.float32, (2, 0)),
    ("thdseq-padded-p2p", "thdseq-padded", "p2p", torch.float32, None),
]
LENGTHS, SLOTS = [5, 1, 9, 3], [8, 4, 12, 4]   # slots: multiples of 2·CP = 4
SEQ_LENGTHS = [5, 1, 9, 3, 10]                  # 28 tokens, chunks of 7: documents cut anywhere


def _case(rank, name, layout, comm, dtype, window, groups, attention_cp=None):
    import thd_cases
    from megatron_adapt.backends import context_parallel as cp
    if attention_cp is None:
        from megatron_adapt.backends.cpu.attention import attention_cp

    cp_size, hq, hkv, d, scale = 2, 4, 2, 8, 0.4
    g = torch.Generator().manual_seed(3)
    if layout == "sbhd":
        b, s = 2, 16
        q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
        pos, doc = cp.sbhd_meta(b, s // cp_size, cp_size, rank)
        idx = pos[0]
        gpos, gdoc = torch.arange(s), torch.zeros(s, dtype=torch.long)
    else:
        lengths, slots = (LENGTHS, SLOTS) if layout in ("thd", "thdseq-padded") else (SEQ_LENGTHS, SEQ_LENGTHS)
        b, s = 1, sum(slots)
        q, k, v = (torch.randn(1, h, s, d, generator=g) for h in (hq, hkv, hkv))
        cu, cu_p = thd_cases.cu(lengths), thd_cases.cu(slots)
        if layout == "thd":
            idx = cp.thd_partitioned_indices(cu_p, s, cp_size, rank)
            pos, doc = cp.thd_meta(cu, cu_p, s, cp_size, rank)
        else:          # Megatron's per-sequence split of the row: the sbhd chunks of its s tokens
            idx = cp.sbhd_meta(1, s // cp_size, cp_size, rank)[0][0]
            pos, doc = cp.thd_sequence_meta(cu, None if slots is lengths else cu_p, s, cp_size, rank)
        gpos, gdoc = torch.zeros(s, dtype=torch.long), torch.full((s,), -1)
        for i, (start, n) in enumerate(zip(cu_p[:-1].tolist(), lengths)):
            gpos[start:start + n], gdoc[start:start + n] = torch.arange(n), i
    q, k, v = (t.to(dtype).float() for t in (q, k, v))     # the values dtype can hold
    gout = torch.randn(b, hq, s, d, generator=g)
    # this rank's tokens through the op
    xs = [t[:, :, idx].to(dtype).detach().requires_grad_(True) for t in (q, k, v)]
    out = attention_cp(*xs, pos, doc, True, scale, window, groups[comm], comm.split("/")[0])
    (out.float() * gout[:, :, idx]).sum().backward()
    got = [out.detach().float()] + [x.grad.float() for x in xs]
    # truth: full attention over every token in fp32, gradients of sum(out * gout)
    tq, tk, tv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    tout = torch.stack([thd_cases.truth(tq[i].transpose(0, 1), tk[i].transpose(0, 1), tv[i].transpose(0, 1),
                                        gdoc, gpos, True, window, scale).transpose(0, 1) for i in range(b)])
    (tout * gout).sum().backward()
    refs = [tout.detach(), tq.grad, tk.grad, tv.grad]
    return {what: (got[j] - refs[j][:, :, idx]).abs().max().item()
            for j, what in enumerate(("out", "dq", "dk", "dv"))}


def _dropout_case(rank, comm, groups):
    """Attention dropout: with one torch seed the masks repeat, so the output is a function of the
    inputs; its gradient (the op's backward, masks drawn again) must match central differences of
    the loss summed over both ranks, along a random direction."""
    import torch.distributed as dist
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.cpu.attention import attention_cp

    b, s, hq, hkv, d = 2, 16, 4, 2, 8
    g = torch.Generator().manual_seed(4)
    full = [torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv)]
    dirs = [torch.randn(t.shape, generator=g) for t in full]
    gout = torch.randn(b, hq, s, d, generator=g)
    pos, doc = cp.sbhd_meta(b, s // 2, 2, rank)
    idx = pos[0]
    xs = [t[:, :, idx].clone() for t in full]
    ds = [t[:, :, idx] for t in dirs]

    def loss(inputs, p=0.3):
        torch.manual_seed(11)
        out = attention_cp(*inputs, pos, doc, True, 0.4, None, groups[comm], comm.split("/")[0], p)
        return out, (out * gout[:, :, idx]).sum()

    def total(t):
        t = t.detach().clone()
        dist.all_reduce(t)
        return t.item()
    leaves = [x.clone().requires_grad_(True) for x in xs]
    out, l = loss(leaves)
    l.backward()
    analytic = total(sum((x.grad * dd).sum() for x, dd in zip(leaves, ds)))
    eps = 1e-2
    plus = total(loss([x + eps * dd for x, dd in zip(xs, ds)])[1])
    minus = total(loss([x - eps * dd for x, dd in zip(xs, ds)])[1])
    numeric = (plus - minus) / (2 * eps)
    again, _ = loss(xs)
    plain, _ = loss(xs, 0.0)
    return {"analytic": analytic, "numeric": numeric, "repeats": bool(torch.equal(again, out.detach())),
            "changes": (plain - out.detach()).abs().max().item()}


DROPOUT = ["p2p", "allgather", "a2a", "a2a+p2p/1x2"]


def cp_groups(rank, port):
    """This rank of a 2-process gloo world, and the process group(s) each comm type runs over
    (a2a+p2p: [a2a group, p2p group], CP 2x1 and 1x2)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in (0, 1)]
    return {"p2p": world, "allgather": world, "a2a": world,
            "a2a+p2p": [world, singles[rank]], "a2a+p2p/1x2": [singles[rank], world]}


def _worker(rank, port, q):
    import torch.distributed as dist

    groups = cp_groups(rank, port)
    res = {}
    for name, layout, comm, dtype, window in CASES:
        try:
            res[name] = _case(rank, name, layout, comm, dtype, window, groups)
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            res[name] = f"{type(exc).__name__}: {exc}"
    for comm in DROPOUT:
        try:
            res[f"dropout-{comm}"] = _dropout_case(rank, comm, groups)
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            res[f"dropout-{comm}"] = f"{type(exc).__name__}: {exc}"
    from megatron_adapt import report
    res["impls"] = sorted(report.op_counts().get("attention_cp", {}))
    res.update(_flash_blocks_cases(rank, groups))
    q.put((rank, res))
    dist.destroy_process_group()


def _flash_blocks_cases(rank, groups):
    """The cuda backend's flash blocks (FlashBlocks: each ring block cut into all-visible and causal
    pieces, one kernel call per piece, merged by log-sum-exp) with the kernels stood in by
    tests/flash_standin.py, both log-sum-exp layouts: every case again, and per case how many
    kernel calls ran and how many blocks took the math (windows, documents)."""
    import flash_standin
    from megatron_adapt import report
    from megatron_adapt.backends import context_parallel as cp
    from megatron_adapt.backends.cuda import attention as cuda_attention

    cuda_attention._FLASH_VARLEN, cuda_attention._FLASH_BWD = flash_standin.forward, flash_standin.backward
    op = lambda *a: cp.attention_cp(*a, blocks=cuda_attention.FlashBlocks)  # noqa: E731
    res = {}
    for layout_name in ("hT", "bhs"):
        flash_standin.LAYOUT[:] = [layout_name]
        for name, layout, comm, dtype, window in CASES:
            report.reset_op_counts()
            flash_standin.calls[0] = 0
            key = f"flash-{layout_name}-{name}"
            try:
                res[key] = _case(rank, name, layout, comm, dtype, window, groups, op)
            except Exception as exc:  # noqa: BLE001 (reported to the test)
                res[key] = f"{type(exc).__name__}: {exc}"
            res[key + "-calls"] = (flash_standin.calls[0],
                                   report.op_counts().get("attention_cp", {}).get("cuda.torch.block", 0))
    return res


_results = {}


def results():
    if not _results:
        _results.update(spawn_ranks(_worker))
    return _results


@pytest.mark.parametrize("name,layout,comm,dtype,window", CASES, ids=[c[0] for c in CASES])
def test_cp_attention_matches_full_attention(name, layout, comm, dtype, window):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rank in (0, 1):
        err = results()[rank][name]
        assert isinstance(err, dict), err
        assert max(err.values()) <= tol, (rank, err)


@pytest.mark.parametrize("lse_layout", ["hT", "bhs"])
@pytest.mark.parametrize("name,layout,comm,dtype,window", CASES, ids=[c[0] for c in CASES])
def test_flash_blocks_match_full_attention(name, layout, comm, dtype, window, lse_layout):
    """Through the cuda backend's FlashBlocks (kernels stood in on CPU): the same bounds. SBHD
    without a window runs every block as flash pieces; windows and THD documents (which end
    inside chunks here) take the math for the blocks that need it."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rank in (0, 1):
        err = results()[rank][f"flash-{lse_layout}-{name}"]
        assert isinstance(err, dict), err
        assert max(err.values()) <= tol, (rank, err)
        kernel_calls, math_blocks = results()[rank][f"flash-{lse_layout}-{name}-calls"]
        if layout == "sbhd" and window is None:
            assert kernel_calls > 0 and math_blocks == 0, (rank, kernel_calls, math_blocks)
        if window is not None:
            assert math_blocks > 0, (rank, kernel_calls, math_blocks)


@pytest.mark.parametrize("comm", DROPOUT)
def test_dropout_gradient_matches_central_differences(comm):
    res = results()[0][f"dropout-{comm}"]
    assert isinstance(res, dict), res
    assert res["repeats"] and res["changes"] > 1e-2, res
    assert abs(res["analytic"] - res["numeric"]) <= 2e-3 * max(1.0, abs(res["numeric"])), res


def test_report_names_each_comm_type():
    assert results()[0]["impls"] == ["cpu.torch.a2a", "cpu.torch.a2a+p2p", "cpu.torch.allgather", "cpu.torch.p2p"]


def test_thd_partitioned_indices_as_te_defines_them():
    """Each padded slot in 2·CP chunks; rank r holds chunks r and 2·CP-1-r of every sequence."""
    import thd_cases
    from megatron_adapt.backends import context_parallel as cp

    cu_p = thd_cases.cu(SLOTS)     # slots 8, 4, 12, 4 at 0, 8, 12, 24; CP=2: chunks of 2, 1, 3, 1
    assert cp.thd_partitioned_indices(cu_p, 28, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23, 24, 27]
    assert cp.thd_partitioned_indices(cu_p, 28, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20, 25, 26]
    pos, doc = cp.thd_meta(thd_cases.cu(LENGTHS), cu_p, 28, 2, 1)
    assert pos[0].tolist() == [2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert doc[0].tolist() == [0, 0, 0, -1, -1, -1, 2, 2, 2, 2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="padded length 6 .* not a multiple of 2 x context-parallel size = 4"):
        cp.thd_partitioned_indices(thd_cases.cu([8, 6, 2]), 16, 2, 0)


def test_thd_sequence_meta_places_tokens_of_the_row_split():
    """core_v0.19's per-sequence split: rank r holds chunks r and 2·CP-1-r of the whole packed row
    (28 tokens, chunks of 7); each token's document and its offset there, padding -1."""
    import thd_cases
    from megatron_adapt.backends import context_parallel as cp

    cu = thd_cases.cu(SEQ_LENGTHS)     # documents at 0, 5, 6, 15, 18
    pos, doc = cp.thd_sequence_meta(cu, None, 28, 2, 0)       # tokens 0-6 and 21-27
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 3, 4, 5, 6, 7, 8, 9]
    assert doc[0].tolist() == [0, 0, 0, 0, 0, 1, 2, 4, 4, 4, 4, 4, 4, 4]
    pos, doc = cp.thd_sequence_meta(cu, None, 28, 2, 1)       # tokens 7-20
    assert pos[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 0, 1, 2]
    assert doc[0].tolist() == [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    pos, doc = cp.thd_sequence_meta(thd_cases.cu(LENGTHS), thd_cases.cu(SLOTS), 28, 2, 1)
    assert pos[0].tolist() == [7, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert doc[0].tolist() == [-1, 1, -1, -1, -1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="ends at 18, not at the 28 packed tokens"):
        cp.thd_sequence_meta(thd_cases.cu([5, 13]), None, 28, 2, 0)


@pytest.mark.parametrize("drop", [None, (0.1, 1234)])
def test_math_blocks_in_row_chunks_equal_one_chunk(monkeypatch, drop):
    """The ring's math blocks go in query-row chunks that bound the fp32 scores' bytes
    (SCORE_BYTES); chunks of 5 rows give what one chunk gives, forward and backward, GQA and a
    causal load-balanced block included. With dropout the block stays one chunk (its masks are
    drawn for the whole block)."""
    from megatron_adapt.backends import context_parallel as cp
    b, hq, hkv, s, d = 2, 4, 2, 24, 8
    g = torch.Generator().manual_seed(3)
    qpos, qdoc = cp.sbhd_meta(b, s, 2, 0)
    kpos, kdoc = cp.sbhd_meta(b, s, 2, 1)
    for ok in (cp.visible(qpos, qdoc, qpos, qdoc, True, None), cp.visible(qpos, qdoc, kpos, kdoc, True, None)):
        q = torch.randn(b, hq, s, d, generator=g)
        k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
        dout = torch.randn(b, hq, s, d, generator=g)
        out1, lse1 = cp._block_fwd(q, k, v, ok, 0.3, drop)
        grads1 = cp._block_bwd(q, k, v, ok, 0.3, out1, dout, lse1, drop)
        monkeypatch.setattr(cp, "SCORE_BYTES", 4 * b * hq * s * 5)
        assert len(cp._row_chunks(q, s, drop)) == (1 if drop else 5)
        out2, lse2 = cp._block_fwd(q, k, v, ok, 0.3, drop)
        grads2 = cp._block_bwd(q, k, v, ok, 0.3, out1, dout, lse1, drop)
        monkeypatch.undo()
        torch.testing.assert_close(out2, out1, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse2, lse1, atol=1e-6, rtol=1e-6)
        for a, w in zip(grads2, grads1):
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)

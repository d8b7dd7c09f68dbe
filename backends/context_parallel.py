"""Context-parallel attention: each rank of a group holds some of the tokens; attention over all of
them, for the four ways Megatron's --cp-comm-type moves them (backend-neutral: torch.distributed
collectives and torch math; a backend's `attention_cp` op names what runs).

Which token attends to which is given per token, not by its place in the tensor: its position in
its document (`pos`) and the document (`doc`, -1 for padding, which attends to nothing and is seen
by nothing). Key j is visible to query i when doc[j] == doc[i] >= 0 and, if causal,
pos[j] <= pos[i], and, with a window (left, right), pos[i] - left <= pos[j] <= pos[i] + right.
So any split of a sequence across ranks works (Megatron's load-balanced 2·CP chunks, TE's thd
split per document, core_v0.19's split of a whole packed row) and packed (thd) sequences are one
batch row with several documents.

  p2p        ring: k/v (with their pos/doc) pass round the group; each rank merges its partial
             outputs through their log-sum-exp; the backward passes k/v and their gradients round
             the ring again (flash-attention's backward from the saved output and log-sum-exp).
  allgather  k/v all-gathered; the backward all-reduces their gradients and keeps its own part.
  a2a        Ulysses: an all-to-all trades the sequence split for a head split (heads must divide
             by the group size), attention over the whole sequence, and back.
  a2a+p2p    a2a inside the first group of a pair [a2a group, p2p group], then the ring over the
             second (Megatron's hierarchical CP groups, in TE's order).

Attention dropout: masks drawn from one seed per call and rank (the ring's blocks from seed +
step), so the backward draws them again.

Scores are materialised per block of (local queries x one rank's keys) in fp32 (MathBlocks): this
serves the cpu backend and checks the algorithms. A backend may pass fused block kernels (`blocks`,
the cuda backend's flash blocks, the npu backend's fusion-attention blocks; block_pieces cuts a block
into the all-visible and causal pieces such kernels take); the ring, the merges and the collectives stay here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")
_FILL = -1e30   # finite: fully masked rows stay finite under autograd (their output is zeroed)


def visible(qpos, qdoc, kpos, kdoc, causal, window_size):
    """bool [b, 1, sq, sk]: True where key j is visible to query i (pos/doc [b, s] int64)."""
    qp, qd, kp, kd = qpos[:, None, :, None], qdoc[:, None, :, None], kpos[:, None, None, :], kdoc[:, None, None, :]
    ok = (qd == kd) & (qd >= 0)
    if causal:
        ok = ok & (kp <= qp)
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            ok = ok & (kp >= qp - left)
        if right >= 0:
            ok = ok & (kp <= qp + right)
    return ok


def _expand(k, hq):
    return k if k.size(1) == hq else k.repeat_interleave(hq // k.size(1), 1)


def _reduce_heads(dk, hkv):
    b, hq, s, d = dk.shape
    return dk if hq == hkv else dk.view(b, hkv, hq // hkv, s, d).sum(2)


def _dropout_seed(dropout_p, device):
    """A seed for this call's dropout masks, drawn from the device's default generator (Megatron's
    model-parallel RNG tracker forks it around the call) and offset by the global rank (ranks of a
    CP group draw the same seed; their masks must differ), or None without dropout. The ring adds
    its step."""
    if not dropout_p:
        return None
    base = int(torch.randint(0, 2 ** 60, (1,), device=device).item())
    return base + (dist.get_rank() if dist.is_initialized() else 0) * 1_000_003


def _keep(shape, device, dropout_p, seed):
    """The dropout scale: 0 where dropped, 1 / (1 - p) where kept, drawn from `seed` (so the
    backward draws the same)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return (torch.rand(shape, generator=gen, device=device) >= dropout_p).float() / (1.0 - dropout_p)


def masked_attention(q, k, v, ok, scale, dropout_p=0.0, seed=None):
    """Autograd-friendly attention under visibility ok [b, 1, sq, sk] (fp32 math, q's dtype out);
    rows that see nothing give 0."""
    s = (q.float() @ _expand(k, q.size(1)).float().transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~ok, _FILL), -1)
    if seed is not None:
        p = p * _keep(p.shape, q.device, dropout_p, seed)
    out = (p @ _expand(v, q.size(1)).float()) * ok.any(-1, keepdim=True)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------- who holds which tokens
def sbhd_meta(b, s_local, cp_size, cp_rank, device=None):
    """pos/doc [b, s_local] of this rank's tokens under Megatron's load-balanced split: the sequence
    in 2·cp_size chunks, this rank holding chunks cp_rank and 2·cp_size - 1 - cp_rank."""
    c = s_local // 2
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    pos = torch.cat([first, second]).to(device).expand(b, -1)
    return pos, torch.zeros_like(pos)


def thd_slots(cu_seqlens_padded, total, cp_size):
    """[(start, length)] of each padded slot, each a multiple of 2·cp_size (ValueError otherwise)."""
    cu = [int(x) for x in cu_seqlens_padded.tolist()]
    slots = [(cu[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]
    for i, (_, n) in enumerate(slots):
        if n % (2 * cp_size):
            raise ValueError(f"packed sequence {i}: padded length {n} (cu_seqlens_padded) is not a multiple of "
                             f"2 x context-parallel size = {2 * cp_size}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens_padded ends at {cu[-1]}, not at the {total} packed tokens")
    return slots


def thd_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank):
    """What Transformer Engine's tex.thd_get_partitioned_indices returns: the indices (int64, on
    cu_seqlens_padded's device) of the packed tokens this rank holds: of each sequence's padded slot,
    split in 2·cp_size chunks, the chunks cp_rank and 2·cp_size - 1 - cp_rank, sequences in order."""
    parts = []
    for start, n in thd_slots(cu_seqlens_padded, total, cp_size):
        c = n // (2 * cp_size)
        parts += [torch.arange(start + cp_rank * c, start + (cp_rank + 1) * c),
                  torch.arange(start + (2 * cp_size - 1 - cp_rank) * c, start + (2 * cp_size - cp_rank) * c)]
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return idx.to(cu_seqlens_padded.device)


def thd_meta(cu_seqlens, cu_seqlens_padded, total, cp_size, cp_rank, device=None):
    """pos/doc [1, total / cp_size] of this rank's packed tokens (thd_partitioned_indices' order);
    padding (past a sequence's length within its slot) has doc -1."""
    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    cu = [int(x) for x in cu_seqlens.tolist()]
    pos, doc = [], []
    for i, (start, n) in enumerate(thd_slots(padded, total, cp_size)):
        c = n // (2 * cp_size)
        p = torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                       torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)])
        pos.append(p)
        doc.append(torch.where(p < cu[i + 1] - cu[i], i, -1))
    pos = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
    doc = torch.cat(doc) if doc else torch.zeros(0, dtype=torch.long)
    return pos.to(device).unsqueeze(0), doc.to(device).unsqueeze(0)


def thd_sequence_meta(cu_seqlens, cu_seqlens_padded, total, cp_size, cp_rank, device=None):
    """pos/doc [1, total / cp_size] of this rank's packed tokens when the whole packed row (all
    its documents together, as one sequence) was split in 2·cp_size chunks, this rank holding
    chunks cp_rank and 2·cp_size - 1 - cp_rank (core_v0.19's per-sequence balancing, which
    pretrain_gpt.py uses for --dataloader-inter-document-masking): documents are cut anywhere.
    Each token's document is the slot of cu_seqlens_padded (else cu_seqlens) holding its global
    index, its position the offset in that slot; padding (past a sequence's length within its
    slot) has doc -1."""
    if total % (2 * cp_size):
        raise ValueError(f"{total} packed tokens are not a multiple of 2 x context-parallel size = {2 * cp_size}")
    padded = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).long().cpu()
    real = cu_seqlens.long().cpu()
    if int(padded[-1]) != total:
        raise ValueError(f"cu_seqlens{'_padded' if cu_seqlens_padded is not None else ''} ends at "
                         f"{int(padded[-1])}, not at the {total} packed tokens")
    glob, _ = sbhd_meta(1, total // cp_size, cp_size, cp_rank)
    glob = glob[0]
    slot = torch.searchsorted(padded[1:], glob, right=True)
    pos = glob - padded[slot]
    doc = torch.where(pos < real[slot + 1] - real[slot], slot, -1)
    return pos.to(device).unsqueeze(0), doc.to(device).unsqueeze(0)


# ----------------------------------------------------------------------------- ring (p2p)
SCORE_BYTES = 1 << 28   # a block's fp32 scores go in query-row chunks of at most this many bytes


def _row_chunks(q, sk, drop):
    """Query-row ranges whose fp32 scores [b, h, rows, sk] stay within SCORE_BYTES: a ring block of
    4 x 32 heads x 2048 x 2048 is 2.1 GB a tensor, and its backward holds several at once (Megatron's
    custom-process-group test at CP=2 on cpu). One range with dropout (its masks are drawn for the
    whole block)."""
    b, h, sq = q.shape[:3]
    rows = sq if drop is not None else max(1, SCORE_BYTES // (4 * b * h * max(sk, 1)))
    return [slice(r, min(r + rows, sq)) for r in range(0, sq, rows)]


def _rows(ok, r):
    return ok if ok.size(2) == 1 else ok[:, :, r]


def _block_fwd(q, k, v, ok, scale, drop=None):
    """(out fp32, lse fp32 [b, h, sq]) of q against one block of keys; lse -inf where nothing is
    seen. drop = (dropout_p, seed): the block's probabilities dropped (the normaliser is not)."""
    kk, vv = _expand(k, q.size(1)).float(), _expand(v, q.size(1)).float()
    outs, lses = [], []
    for r in _row_chunks(q, k.size(2), drop):
        s = (q[:, :, r].float() @ kk.transpose(-1, -2)) * scale
        s = s.masked_fill(~_rows(ok, r), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        del s
        if drop is not None:
            p = p * _keep(p.shape, q.device, *drop)
        outs.append(p @ vv)
        lses.append(lse)
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 2), torch.cat(lses, 2))


def _merge(out, lse, o, l):
    if out is None:
        return o, l
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), 0.0, new)
    a, b = torch.exp(lse - safe).unsqueeze(-1), torch.exp(l - safe).unsqueeze(-1)
    return out * a + o * b, new


def _block_bwd(q, k, v, ok, scale, out, dout, lse, drop=None):
    """Gradients (fp32) of one block from the final out / lse (flash-attention's backward, with
    the forward's dropout masks drawn again from their seed), in query-row chunks (_row_chunks)."""
    hq, hkv = q.size(1), k.size(1)
    kk, vv = _expand(k, hq).float(), _expand(v, hq).float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
    for r in _row_chunks(q, k.size(2), drop):
        qr, do, lr = q[:, :, r].float(), dout[:, :, r], lse[:, :, r]
        s = (qr @ kk.transpose(-1, -2)) * scale
        p = torch.exp(s.masked_fill_(~_rows(ok, r), float("-inf")) - torch.where(torch.isinf(lr), 0.0, lr).unsqueeze(-1))
        del s
        keep = _keep(p.shape, q.device, *drop) if drop is not None else None
        dv += (p if keep is None else p * keep).transpose(-1, -2) @ do
        dp = do @ vv.transpose(-1, -2)
        if keep is not None:
            dp = dp * keep
        ds = p.mul_(dp.sub_((do * out[:, :, r]).sum(-1, keepdim=True)))
        del dp
        dq[:, :, r] = (ds @ kk) * scale
        dk += (ds.transpose(-1, -2) @ qr) * scale
    return dq, _reduce_heads(dk, hkv), _reduce_heads(dv, hkv)


_TRIL: dict = {}


def _tril(n, device):
    t = _TRIL.get((n, device))
    if t is None:
        t = _TRIL[(n, device)] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return t


def block_pieces(ok):
    """[(q slice, k slice, causal)] that cover the visible part of a ring block ok [b, 1, sq, sk],
    each all visible or causal (lower-triangular over equal lengths), or None where the block has no
    such cover (windows, documents that end inside a chunk, a pattern that differs across the
    batch). Tried on the whole block, then on grids of square cells of length c = min(sq, sk),
    c / 2, c / 4, ... down to c / 16 and no less than 2 tokens (Megatron's 2·CP chunks give halves;
    allgather's and all-to-all's gathered order finer grids, up to CP = 8); one host sync per grid."""
    m = ok[0, 0]
    sq, sk = m.shape
    if not bool((ok == m).all()):
        return None
    grids = [(sq, sk)]
    c = min(sq, sk)
    smallest = max(2, c // 16)
    while c >= smallest:
        if sq % c == 0 and sk % c == 0 and (c, c) != (sq, sk):
            grids.append((c, c))
        if c % 2:
            break
        c //= 2
    for cq, ck in grids:
        nq, nk = sq // cq, sk // ck
        cells = m.reshape(nq, cq, nk, ck).transpose(1, 2).reshape(nq, nk, cq * ck)
        full, empty = cells.all(-1), ~cells.any(-1)
        tril = ((cells == _tril(cq, m.device).reshape(-1)).all(-1) if cq == ck else torch.zeros_like(full))
        full, empty, tril = torch.stack([full, empty, tril]).tolist()
        if not all(full[i][j] or empty[i][j] or tril[i][j] for i in range(nq) for j in range(nk)):
            continue
        pieces = []
        for i in range(nq):
            qs, j = slice(i * cq, (i + 1) * cq), 0
            while j < nk:
                if full[i][j]:                       # a run of all-visible cells: one piece
                    e = j
                    while e + 1 < nk and full[i][e + 1]:
                        e += 1
                    pieces.append((qs, slice(j * ck, (e + 1) * ck), False))
                    j = e + 1
                    continue
                if tril[i][j] and not empty[i][j]:
                    pieces.append((qs, slice(j * ck, (j + 1) * ck), True))
                j += 1
        return pieces
    return None


class PieceBlocks:
    """Block kernels for the ring from one backend's fused attention call: each block cut into
    all-visible and causal pieces (block_pieces), `piece_fwd(q, k, v, causal, scale) -> (out, lse)`
    per piece merged by log-sum-exp; the backward runs `piece_bwd(dout, q, k, v, out, lse, causal,
    scale) -> (dq, dk, dv)` per piece from the ring's final out / lse. A block with no such cover,
    or dropout, takes the math (`fallback` names it in the report, with `why`)."""

    def __init__(self, piece_fwd, piece_bwd, fallback, why):
        self.piece_fwd, self.piece_bwd, self.fallback, self.why = piece_fwd, piece_bwd, fallback, why

    def fwd(self, q, k, v, ok, scale, drop):
        pieces = None if drop is not None else block_pieces(ok)
        if pieces is None:
            from megatron_adapt import report
            report.fell_back("attention_cp", self.fallback, self.why)
            return _block_fwd(q, k, v, ok, scale, drop)
        b, hq, sq, _ = q.shape
        out = q.new_zeros(b, hq, sq, v.size(-1), dtype=torch.float32)
        lse = q.new_full((b, hq, sq), float("-inf"), dtype=torch.float32)
        for qs, ks, causal in pieces:
            o, l = self.piece_fwd(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal, scale)
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, l)
        return out, lse

    def bwd(self, q, k, v, ok, scale, out, dout, lse, drop):
        pieces = None if drop is not None else block_pieces(ok)
        if pieces is None:
            return _block_bwd(q, k, v, ok, scale, out, dout, lse, drop)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for qs, ks, causal in pieces:
            gq, gk, gv = self.piece_bwd(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                        lse[:, :, qs], causal, scale)
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
        return dq, dk, dv


class MathBlocks:
    """The ring's blocks in torch math (scores materialised in fp32): any visibility pattern,
    dropout. A backend may pass its own object with the same two functions (fused kernels)."""
    fwd = staticmethod(_block_fwd)
    bwd = staticmethod(_block_bwd)


def _shift(tensors, group):
    """Send to the next rank of the group, receive from the previous one: every send and receive
    of a step in one batch_isend_irecv (one NCCL group call, as Megatron's own p2p does; sends and
    receives issued one by one failed on two H100s with an illegal memory access), the send
    buffers held until the batch completes."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    sends = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    del sends
    return bufs


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qpos, qdoc, kpos, kdoc, causal, scale, window_size, group, dropout_p, seed, blocks):
        size = dist.get_world_size(group)
        out = lse = None
        cur = [k, v, kpos, kdoc]
        drop = (lambda step: None) if seed is None else (lambda step: (dropout_p, seed + step))
        for step in range(size):
            ok = visible(qpos, qdoc, cur[2], cur[3], causal, window_size)
            if ok.any():
                out, lse = _merge(out, lse, *blocks.fwd(q, cur[0], cur[1], ok, scale, drop(step)))
            if step < size - 1:
                cur = _shift(cur, group)
        if out is None:
            out = q.new_zeros(q.shape[:-1] + (v.size(-1),), dtype=torch.float32)
            lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        ctx.save_for_backward(q, k, v, qpos, qdoc, kpos, kdoc, out, lse)
        ctx.causal, ctx.scale, ctx.window, ctx.group, ctx.drop = causal, scale, window_size, group, drop
        ctx.blocks = blocks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, qpos, qdoc, kpos, kdoc, out, lse = ctx.saved_tensors
        size = dist.get_world_size(ctx.group)
        dout = dout.float()
        dq = torch.zeros_like(q, dtype=torch.float32)
        cur = [k, v, kpos, kdoc, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(size):
            ok = visible(qpos, qdoc, cur[2], cur[3], ctx.causal, ctx.window)
            if ok.any():
                gq, gk, gv = ctx.blocks.bwd(q, cur[0], cur[1], ok, ctx.scale, out, dout, lse, ctx.drop(step))
                dq += gq
                cur[4] += gk
                cur[5] += gv
            # k/v go on round the ring; their gradients travel with them and the last shift
            # brings each rank's own back to it
            if step < size - 1:
                cur = _shift(cur, ctx.group)
            elif size > 1:
                cur = cur[:4] + _shift(cur[4:], ctx.group)
        return (dq.to(q.dtype), cur[4].to(k.dtype), cur[5].to(v.dtype)) + (None,) * 11


class _Local(torch.autograd.Function):
    """Attention of local queries over keys already gathered (allgather, a2a) through a backend's
    block kernels: one block, the ring's forward and backward without the ring."""

    @staticmethod
    def forward(ctx, q, k, v, ok, scale, blocks):
        out, lse = blocks.fwd(q, k, v, ok, scale, None)
        ctx.save_for_backward(q, k, v, ok, out, lse)
        ctx.scale, ctx.blocks = scale, blocks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, ok, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.blocks.bwd(q, k, v, ok, ctx.scale, out, dout.float(), lse, None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# ----------------------------------------------------------------------------- collectives with autograd
def _gather_meta(t, group):
    parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _AllGatherSeq(torch.autograd.Function):
    """[b, h, s, d] -> [b, h, size * s, d] (ranks in group order); backward: all-reduce, own part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        s = g.size(2) // dist.get_world_size(ctx.group)
        return g.narrow(2, dist.get_rank(ctx.group) * s, s), None


def _a2a(x, group, heads_to_seq):
    """heads_to_seq: [b, h, s, d] -> [b, h / size, size * s, d] (scatter heads, gather sequence);
    else the inverse."""
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    if heads_to_seq:
        send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()    # [size, b, h/n, s, d]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)                              # [src, b, h/n, s, d]
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)
    s_loc = s // size
    send = x.reshape(b, h, size, s_loc, d).permute(2, 0, 1, 3, 4).contiguous()      # [dst, b, h, s/n, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                                  # [src, b, h, s/n, d]
    return recv.transpose(0, 1).reshape(b, size * h, s_loc, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, heads_to_seq):
        ctx.group, ctx.heads_to_seq = group, heads_to_seq
        return _a2a(x, group, heads_to_seq)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group, not ctx.heads_to_seq), None, None


# ----------------------------------------------------------------------------- the algorithms
def check(comm_type, hq, hkv, group_sizes):
    """None if these heads can go through comm_type over groups of these sizes, else why not."""
    if comm_type not in COMM_TYPES:
        return f"cp_comm_type {comm_type!r} is none of {', '.join(COMM_TYPES)}"
    if comm_type in ("a2a", "a2a+p2p"):
        n = group_sizes[0]
        if hq % n or hkv % n:
            return (f"cp_comm_type {comm_type}: {hq} query and {hkv} key/value heads per tensor-parallel "
                    f"rank must both divide by the all-to-all group size {n}")
    return None


def attention_cp(q, k, v, pos, doc, causal, scale, window_size, groups, comm_type, dropout_p=0.0, blocks=None):
    """q [b, hq, s, d], k/v [b, hkv, s, d(v)]: this rank's tokens; pos/doc [b, s] int64 as in the
    module docstring; groups: one process group, or [a2a group, p2p group] for a2a+p2p; dropout on
    the attention probabilities with masks drawn from one seed per call (the device's default
    generator); blocks: the ring's block kernels (MathBlocks by default). -> out [b, hq, s, dv] in
    q's dtype."""
    blocks = blocks or MathBlocks
    group_list = list(groups) if isinstance(groups, (list, tuple)) else [groups]
    why = check(comm_type, q.size(1), k.size(1), [dist.get_world_size(g) for g in group_list])
    if why:
        raise ValueError(why)
    pos, doc = pos.long(), doc.long()
    seed = _dropout_seed(dropout_p, q.device)
    if comm_type == "p2p":
        return _Ring.apply(q, k, v, pos, doc, pos, doc, causal, scale, window_size, group_list[0], dropout_p, seed,
                           blocks)
    if comm_type == "allgather":
        g = group_list[0]
        kf, vf = _AllGatherSeq.apply(k, g), _AllGatherSeq.apply(v, g)
        ok = visible(pos, doc, _gather_meta(pos, g), _gather_meta(doc, g), causal, window_size)
        if blocks is not MathBlocks and seed is None:
            return _Local.apply(q, kf, vf, ok, scale, blocks)
        return masked_attention(q, kf, vf, ok, scale, dropout_p, seed)
    a2a = group_list[0]
    qa, ka, va = (_AllToAll.apply(t, a2a, True) for t in (q, k, v))
    pa, da = _gather_meta(pos, a2a), _gather_meta(doc, a2a)
    if comm_type == "a2a":
        ok = visible(pa, da, pa, da, causal, window_size)
        if blocks is not MathBlocks and seed is None:
            out = _Local.apply(qa, ka, va, ok, scale, blocks)
        else:
            out = masked_attention(qa, ka, va, ok, scale, dropout_p, seed)
    else:
        out = _Ring.apply(qa, ka, va, pa, da, pa, da, causal, scale, window_size, group_list[1], dropout_p, seed,
                          blocks)
    return _AllToAll.apply(out, a2a, False)


MATH_WHY = ("context parallelism runs its attention blocks in torch math with the scores materialised "
            "(backends/context_parallel.py)")
DROPOUT_WHY = ("attention dropout under context parallelism: the fused blocks cannot replay the kernel's "
               "dropout masks in the ring's backward")


def served_attention_cp(blocks, why, fused_impl, math_impl, q, k, v, pos, doc, causal, scale, window_size,
                        groups, comm_type, dropout_p=0.0):
    """attention_cp on a backend's fused `blocks` (reported `<fused_impl>.<comm_type>`), or, where `why`
    (the backend's reason they cannot take these inputs) or dropout rules them out, on MathBlocks,
    reported as a fallback (`<math_impl>.<comm_type>`)."""
    from megatron_adapt import report
    why = why or (DROPOUT_WHY if dropout_p else None)
    if why:
        report.fell_back("attention_cp", f"{math_impl}.{comm_type}", f"{MATH_WHY}: {why}")
        blocks = None
    else:
        report.ran("attention_cp", f"{fused_impl}.{comm_type}")
    return attention_cp(q, k, v, pos, doc, causal, scale, window_size, groups, comm_type, dropout_p, blocks=blocks)


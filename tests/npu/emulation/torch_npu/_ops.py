"""EMULATION of the torch_npu ops megatron-adapt's npu backend calls: contract checks + CPU math.

Each function has the real op's name, parameter names, defaults and return structure, and raises
(EmulatedNPUError, a RuntimeError like torch_npu's own op checks) on inputs the documentation
rules out. Math is done in fp32 and cast to the input dtype; autograd flows through it, standing
in for the real ops' registered backward kernels. Sources: Ascend/op-plugin docs/context/
torch_npu-<op>.md and the Ascend Extension for PyTorch API reference (6.0.0 - 7.x).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
COMPRESSED = 2048
INT_MAX = 2147483647
_seed_counter = itertools.count()


class EmulatedNPUError(RuntimeError):
    """An input the real torch_npu op rejects (or that the emulation does not model)."""


def _check(cond, msg):
    if not cond:
        raise EmulatedNPUError(msg)


def _check_tensor(name, t, dtypes=FLOATS):
    _check(isinstance(t, torch.Tensor), f"{name} must be a Tensor, got {type(t).__name__}")
    _check(t.dtype in dtypes, f"{name} dtype {t.dtype} not supported (expected one of {dtypes})")


# --------------------------------------------------------------------------- npu_rms_norm
def npu_rms_norm(input, gamma, epsilon=1e-06):  # noqa: A002 (schema `Tensor self`, bound as `input`)
    """npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor y, Tensor rstd).

    self: fp16/bf16/fp32, 1-8 dims; gamma: same dtype, the trailing dims of self.
    rstd = 1/sqrt(mean(x^2) + eps) over gamma's dims, fp32, keepdim.
    """
    _check_tensor("input", input)
    _check_tensor("gamma", gamma)
    _check(gamma.dtype == input.dtype, f"gamma dtype {gamma.dtype} must equal input dtype {input.dtype}")
    _check(1 <= input.dim() <= 8, f"input must have 1-8 dims, got {input.dim()}")
    _check(1 <= gamma.dim() <= input.dim() and tuple(gamma.shape) == tuple(input.shape[input.dim() - gamma.dim():]),
           f"gamma shape {tuple(gamma.shape)} must be the trailing dims of input {tuple(input.shape)}")
    _check(isinstance(epsilon, float), "epsilon must be a float")
    dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x * rstd * gamma.float()).to(input.dtype)
    return y, rstd.detach()


# --------------------------------------------------------------------------- npu_swiglu
def npu_swiglu(input, dim=-1):  # noqa: A002 (the real parameter name)
    """npu_swiglu(Tensor input, int dim=-1) -> Tensor: silu(A) * B, A|B the halves along dim.

    1-8 dims, fp16/bf16/fp32, contiguous, non-empty, size along dim even.
    """
    _check_tensor("input", input)
    _check(1 <= input.dim() <= 8, f"input must have 1-8 dims, got {input.dim()}")
    _check(isinstance(dim, int) and -input.dim() <= dim < input.dim(), f"dim {dim} out of range")
    _check(input.numel() > 0, "empty input is not supported")
    _check(input.is_contiguous(), "non-contiguous input is not supported")
    _check(input.size(dim) % 2 == 0, f"size {input.size(dim)} along dim {dim} must be even")
    a, b = torch.chunk(input.float(), 2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# --------------------------------------------------------------------------- npu_scaled_masked_softmax
def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False) -> Tensor.

    x: fp16/bf16/fp32, NCHW with H, W in [32, 4096] and multiples of 32. mask: bool, broadcastable
    to x, True = masked. fixed_triu_mask is documented as reserved: only False is supported.
    Masked scores are filled with -10000 after scaling (Megatron's convention; the real kernel's
    fill value for fully masked rows is not documented -- tests avoid such rows).
    """
    _check_tensor("x", x)
    _check(x.dim() == 4, f"x must be 4-D (NCHW), got {x.dim()}-D")
    for name, n in (("H", x.size(2)), ("W", x.size(3))):
        _check(32 <= n <= 4096 and n % 32 == 0, f"{name}={n}: must be in [32, 4096] and divisible by 32")
    _check(isinstance(mask, torch.Tensor) and mask.dtype == torch.bool,
           f"mask must be a bool Tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    try:
        torch.broadcast_shapes(mask.shape, x.shape)
        ok = torch.broadcast_shapes(mask.shape, x.shape) == x.shape
    except RuntimeError:
        ok = False
    _check(ok, f"mask shape {tuple(mask.shape)} cannot be broadcast to x {tuple(x.shape)}")
    _check(fixed_triu_mask is False, "fixed_triu_mask is reserved: only False is supported")
    s = x.float() * float(scale)
    s = s.masked_fill(mask, -10000.0)
    return torch.softmax(s, dim=-1).to(x.dtype)


# --------------------------------------------------------------------------- npu_rotary_mul
def _rotate(x, mode):
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).reshape(x.shape)


def _rotary_shapes(shape, mode):
    a, b, c, d = shape
    if mode == "interleave":      # 11SD (BNSD), 1S1D (BSND), S11D (SBND)
        return {(1, 1, c, d), (1, b, 1, d), (a, 1, 1, d)}
    return {(1, 1, c, d), (a, 1, c, d), (a, b, c, d),      # BNSD: 11SD, B1SD, BNSD
            (1, b, 1, d), (a, b, 1, d),                    # BSND: 1S1D, BS1D, BSND
            (a, 1, 1, d)}                                  # SBND: S11D, SB1D, SBND


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):  # noqa: A002
    """npu_rotary_mul(input, r1, r2, rotary_mode='half') -> input * r1 + rotate(input) * r2.

    All 4-D, one dtype (fp16/bf16/fp32); D even and < 896; r1/r2 in one of the layouts the docs
    list for the input's layout (BNSD/BSND/SBND; interleave mode only the broadcast 11SD/1S1D/S11D).
    """
    _check(rotary_mode in ("half", "interleave"), f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        _check_tensor(name, t)
        _check(t.dim() == 4, f"{name} must be 4-D, got {t.dim()}-D")
    _check(r1.dtype == input.dtype and r2.dtype == input.dtype, "input, r1 and r2 must share one dtype")
    d = input.size(-1)
    _check(d % 2 == 0 and d < 896, f"D={d}: must be even and < 896")
    _check(r1.shape == r2.shape, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    _check(tuple(r1.shape) in _rotary_shapes(tuple(input.shape), rotary_mode),
           f"r1/r2 shape {tuple(r1.shape)} not supported for input {tuple(input.shape)} in {rotary_mode} mode")
    x = input.float()
    return (x * r1.float() + _rotate(x, rotary_mode) * r2.float()).to(input.dtype)


def npu_rotary_mul_6_0(input, r1, r2):  # noqa: A002
    """npu_rotary_mul as 6.0.0 has it (no rotary_mode): rotate-half only."""
    return npu_rotary_mul(input, r1, r2)


# --------------------------------------------------------------------------- npu_fusion_attention
def _to_bnsd(t, layout, n):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, n, h // n).permute(0, 2, 1, 3)
    s, b, h = t.shape  # SBH
    return t.view(s, b, n, h // n).permute(1, 2, 0, 3)


def _from_bnsd(t, layout):
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout == "BSH":
        return t.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _sparse_mask(sq, sk, sparse_mode, pre, nxt, device):
    """The mask (True = masked) a sparse mode generates, on top of / instead of atten_mask."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    if sparse_mode == 0:      # band around the top-left diagonal
        return (j - i > nxt) | (i - j > pre)
    if sparse_mode == 1:      # allMask: atten_mask only
        return torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if sparse_mode == 2:      # leftUpCausal
        return j > i
    if sparse_mode == 3:      # rightDownCausal
        return j > i + (sk - sq)
    # 4: band from the bottom-right diagonal
    off = sk - sq
    return (j > i + off + nxt) | (j < i + off - pre)


def _attend(q, k, v, masked, scale, keep_prob):
    """q [B, Nq, Sq, D], k/v [B, Nkv, Sk, D], masked bool broadcastable to [B, Nq, Sq, Sk] or None."""
    group = q.size(1) // k.size(1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    smax = s.amax(dim=-1, keepdim=True)
    dead = torch.isinf(smax) & (smax < 0)            # a fully masked row: output 0
    smax_safe = torch.where(dead, torch.zeros_like(smax), smax)
    e = torch.exp(s - smax_safe)
    ssum = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(dead, torch.ones_like(ssum), ssum)
    if keep_prob < 1.0:
        p = F.dropout(p, p=1.0 - keep_prob, training=True)
    out = torch.matmul(p, v.float()).to(q.dtype)
    return out, smax_safe.detach(), ssum.detach()


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """npu_fusion_attention(...) -> (attention_out, softmax_max, softmax_sum, softmax_out, seed,
    offset, numels).

    Modelled: layouts BSH/SBH/BSND/BNSD/TND; GQA (Nq a multiple of Nkv, Nq <= 256); D <= 768,
    Dq = Dk; sparse_mode 0 (atten_mask + pre/next band from the top-left), 1 (atten_mask only),
    2 (leftUpCausal), 3 (rightDownCausal), 4 (band from the bottom-right, pre/next), the last three
    taking the compressed 2048x2048 triu mask; atten_mask None = full attention, whatever the
    sparse mode; keep_prob dropout (torch's RNG, not the kernel's Philox stream).
    Not modelled (error): pse, prefix, sparse modes 5-8. padding_mask is unsupported by the op.
    softmax_max / softmax_sum are [B, N, Sq, 8] fp32 (the row max / sum broadcast over 8, as the
    kernel stores them); softmax_out is an empty reserved tensor.
    """
    nq, nkv = _validate(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
                        pre_tockens, next_tockens, inner_precise, prefix, sparse_mode)
    if input_layout == "TND":
        return _tnd(query, key, value, nq, atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                    actual_seq_qlen, actual_seq_kvlen, sparse_mode)

    q, k, v = _to_bnsd(query, input_layout, nq), _to_bnsd(key, input_layout, nkv), _to_bnsd(value, input_layout, nkv)
    masked = _masked(atten_mask, sparse_mode, pre_tockens, next_tockens, q.size(0), nq, q.size(2), k.size(2), q.device)
    out, smax, ssum = _attend(q, k, v, masked, float(scale), float(keep_prob))
    return _outputs(_from_bnsd(out, input_layout), smax, ssum, keep_prob, q.size(0) * nq * q.size(2) * k.size(2))


def _validate(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, pre_tockens,
              next_tockens, inner_precise, prefix, sparse_mode):
    """The checks npu_fusion_attention and npu_fusion_attention_grad share -> (Nq, Nkv)."""
    _check(isinstance(input_layout, str) and input_layout in LAYOUTS,
           f"input_layout {input_layout!r} not supported (expected one of {LAYOUTS})")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    _check(key.dtype == query.dtype and value.dtype == query.dtype, "query, key and value must share one dtype")
    _check(isinstance(head_num, int) and not isinstance(head_num, bool) and head_num > 0,
           f"head_num must be a positive int, got {head_num!r}")
    _check(padding_mask is None, "padding_mask is not supported")
    if pse is not None or prefix is not None:
        raise EmulatedNPUError("pse / prefix are not modelled by the emulation")
    _check(isinstance(sparse_mode, int) and 0 <= sparse_mode <= 8, f"sparse_mode {sparse_mode!r} out of range 0-8")
    if sparse_mode >= 5:
        raise EmulatedNPUError(f"sparse_mode {sparse_mode} (prefix / varlen split) is not modelled by the emulation")
    _check(isinstance(keep_prob, (int, float)) and 0.0 < keep_prob <= 1.0, f"keep_prob {keep_prob!r} not in (0, 1]")
    _check(inner_precise in (0, 1, 2), f"inner_precise {inner_precise!r} not in (0, 1, 2)")
    _check(isinstance(pre_tockens, int) and isinstance(next_tockens, int), "pre_tockens / next_tockens must be ints")
    if sparse_mode in (0, 4):
        if next_tockens < 0:
            _check(pre_tockens >= -next_tockens, "next_tockens < 0 needs pre_tockens >= |next_tockens|")
        if pre_tockens < 0:
            _check(next_tockens >= -pre_tockens, "pre_tockens < 0 needs next_tockens >= |pre_tockens|")
    _check(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
    ndim = 3 if input_layout in ("BSH", "SBH", "TND") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(t.dim() == ndim, f"{name} must be {ndim}-D for layout {input_layout}, got {t.dim()}-D")

    if input_layout in ("BSH", "SBH"):
        _check(query.size(-1) % head_num == 0, f"H={query.size(-1)} not divisible by head_num={head_num}")
        d = query.size(-1) // head_num
        _check(key.size(-1) % d == 0, f"key H={key.size(-1)} not a multiple of D={d}")
        nq, nkv = head_num, key.size(-1) // d
        bdim = 0 if input_layout == "BSH" else 1
        _check(key.size(bdim) == query.size(bdim), "batch sizes of query and key differ")
    else:
        ndim_n = {"BSND": 2, "BNSD": 1, "TND": 1}[input_layout]
        nq, nkv, d = query.size(ndim_n), key.size(ndim_n), query.size(-1)
        _check(nq == head_num, f"head_num {head_num} != query heads {nq}")
        _check(key.size(-1) == d, f"Dq={d} != Dk={key.size(-1)}")
        if input_layout != "TND":
            _check(key.size(0) == query.size(0), "batch sizes of query and key differ")
    _check(1 <= d <= 768, f"D={d} out of range 1-768")
    _check(nq <= 256 and nq % nkv == 0, f"Nq={nq}, Nkv={nkv}: Nq must be <= 256 and a multiple of Nkv")

    if atten_mask is not None:
        _check(isinstance(atten_mask, torch.Tensor) and atten_mask.dtype in (torch.bool, torch.uint8),
               f"atten_mask must be bool or uint8, got {getattr(atten_mask, 'dtype', type(atten_mask).__name__)}")
        if sparse_mode in (2, 3, 4):
            _check(tuple(atten_mask.shape) == (COMPRESSED, COMPRESSED),
                   f"sparse_mode {sparse_mode} takes the compressed {COMPRESSED}x{COMPRESSED} mask, "
                   f"got {tuple(atten_mask.shape)}")
            triu = torch.triu(torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=atten_mask.device), 1)
            _check(torch.equal(atten_mask.bool(), triu),
                   f"sparse_mode {sparse_mode}: atten_mask must be the 2048x2048 upper-triangular (diagonal=1) mask")

    return nq, nkv


def _masked(atten_mask, sparse_mode, pre_tockens, next_tockens, b, nq, sq, sk, device):
    """The bool mask (True = masked, broadcastable to [B, N, Sq, Skv]) of a BNSD call, or None."""
    if atten_mask is None:
        return None
    if sparse_mode in (0, 1):
        m = atten_mask.bool()
        shapes = {(sq, sk), (1, 1, sq, sk), (b, 1, sq, sk), (b, nq, sq, sk)}
        _check(tuple(m.shape) in shapes,
               f"atten_mask shape {tuple(m.shape)} not one of SS/11SS/B1SS/BNSS for B={b} N={nq} Sq={sq} Skv={sk}")
        return m | _sparse_mask(sq, sk, sparse_mode, pre_tockens, next_tockens, device)
    return _sparse_mask(sq, sk, sparse_mode, pre_tockens, next_tockens, device)


def npu_fusion_attention_7_3(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                             softmax_layout="", sink=None):
    """7.3.0 adds softmax_layout (7.2.0) and sink; neither is modelled beyond their defaults."""
    _check(softmax_layout == "" and sink is None, "softmax_layout / sink are not modelled by the emulation")
    return npu_fusion_attention(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                                keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
                                actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False):
    """npu_fusion_attention_grad(...) -> (dq, dk, dv, dpse): flash attention's backward.

    The probabilities are recomputed from the scores and the given row statistics,
    p = exp(scale_value * q k^T (masked) - softmax_max) / softmax_sum, and
    dv = p^T dy, ds = p * (dy v^T - rowsum(dy * attention_in)), dq = scale ds k, dk = scale ds^T q;
    dq/dk/dv in query/key/value's layout and shape (GQA: dk/dv with the kv heads), query's dtype.
    So softmax_max = the row log-sum-exp with softmax_sum = 1 serves as well as the forward's own
    pair: how ring attention feeds the ring's final statistics. Same layouts, masks, sparse modes
    and limits as npu_fusion_attention (op-plugin FlashAttentionKernelNpuOpApi.cpp runs both through
    aclnnFlashAttentionScore(Grad)). dpse: an empty tensor without pse (the meta registration's).
    Required here: softmax_max / softmax_sum fp32 [B, N, Sq, 8] and attention_in, dy like query
    (the kernel reads them; what it does without them is not documented). Not modelled (error):
    keep_prob < 1 (the dropout mask is replayed from seed / offset / numels), layout TND, pse, prefix.
    """
    nq, nkv = _validate(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
                        pre_tockens, next_tockens, inner_precise, prefix, sparse_mode)
    _check(input_layout != "TND", "layout TND is not modelled by the emulation's npu_fusion_attention_grad")
    _check(keep_prob == 1.0, "keep_prob < 1: replaying the dropout mask (seed / offset / numels) is not modelled")
    _check(softmax_in is None, "softmax_in is reserved")
    for name, t in (("dy", dy), ("attention_in", attention_in)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a Tensor (the emulation requires it)")
        _check(t.dtype == query.dtype and t.shape == query.shape,
               f"{name} {t.dtype} {tuple(t.shape)} must be like query {query.dtype} {tuple(query.shape)}")
    q, k, v = _to_bnsd(query, input_layout, nq), _to_bnsd(key, input_layout, nkv), _to_bnsd(value, input_layout, nkv)
    b, _, sq, _ = q.shape
    sk = k.size(2)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _check(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (b, nq, sq, 8),
               f"{name} must be fp32 [B, N, Sq, 8] = {(b, nq, sq, 8)}, got "
               f"{getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")
    masked = _masked(atten_mask, sparse_mode, pre_tockens, next_tockens, b, nq, sq, sk, q.device)
    group = nq // nkv
    kk, vv = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * float(scale_value)
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    ssum = softmax_sum[..., :1]
    p = torch.exp(s - softmax_max[..., :1]) / torch.where(ssum == 0, torch.ones_like(ssum), ssum)
    do, o = _to_bnsd(dy, input_layout, nq).float(), _to_bnsd(attention_in, input_layout, nq).float()
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vv.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq = (ds @ kk) * float(scale_value)
    dk = (ds.transpose(-1, -2) @ q.float()) * float(scale_value)
    if group > 1:
        dk, dv = (t.view(b, nkv, group, sk, t.size(-1)).sum(2) for t in (dk, dv))
    grads = tuple(_from_bnsd(t.to(query.dtype), input_layout) for t in (dq, dk, dv))
    return grads + (torch.empty(0, dtype=query.dtype),)


def npu_fusion_attention_grad_7_3(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                  atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                  attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                                  next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                                  actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                  sync=False, softmax_layout="", sink=None):
    """7.3.0 adds softmax_layout and sink (not modelled beyond their defaults) and a fifth output,
    dsink (the meta registration's torch.empty([]) without sink)."""
    kw = dict(locals())
    _check(softmax_layout == "" and sink is None, "softmax_layout / sink are not modelled by the emulation")
    for name in ("query", "key", "value", "dy", "head_num", "input_layout", "softmax_layout", "sink"):
        del kw[name]
    return npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, **kw) + (torch.empty([]),)


def _outputs(out, smax, ssum, keep_prob, numel):
    seed = torch.initial_seed() & 0xFFFFFFFF
    offset = next(_seed_counter)
    empty = torch.empty(0, dtype=out.dtype)
    return (out, smax.expand(*smax.shape[:-1], 8).contiguous(), ssum.expand(*ssum.shape[:-1], 8).contiguous(),
            empty, seed, offset, numel if keep_prob < 1.0 else 0)


def _tnd(query, key, value, n, atten_mask, scale, keep_prob, pre, nxt, qlen, kvlen, sparse_mode):
    _check(qlen is not None and kvlen is not None, "layout TND needs actual_seq_qlen and actual_seq_kvlen")
    qlen, kvlen = [int(x) for x in qlen], [int(x) for x in kvlen]
    _check(len(qlen) == len(kvlen) and 1 <= len(qlen) <= 2048, "actual_seq_qlen / actual_seq_kvlen lengths differ or exceed 2K")
    _check(all(a <= b for a, b in zip(qlen, qlen[1:])) and all(a <= b for a, b in zip(kvlen, kvlen[1:])),
           "actual_seq_qlen / actual_seq_kvlen must be cumulative (non-decreasing)")
    _check(qlen[-1] <= query.size(0) and kvlen[-1] <= key.size(0), "cumulative lengths exceed T")
    if atten_mask is not None and sparse_mode in (0, 1):
        _check(atten_mask.dim() == 2, "layout TND takes only an SS atten_mask")
    outs, maxes, sums = [], [], []
    q0 = k0 = 0
    for q1, k1 in zip(qlen, kvlen):
        q = query[q0:q1].permute(1, 0, 2).unsqueeze(0)
        k = key[k0:k1].permute(1, 0, 2).unsqueeze(0)
        v = value[k0:k1].permute(1, 0, 2).unsqueeze(0)
        sq, sk = q1 - q0, k1 - k0
        masked = None
        if atten_mask is not None:
            masked = _sparse_mask(sq, sk, sparse_mode, pre, nxt, q.device)
            if sparse_mode in (0, 1):
                masked = masked | atten_mask.bool()[:sq, :sk]
        o, m, s = _attend(q, k, v, masked, float(scale), float(keep_prob))
        outs.append(o[0].permute(1, 0, 2))
        maxes.append(m[0].permute(1, 0, 2))
        sums.append(s[0].permute(1, 0, 2))
        q0, k0 = q1, k1
    out = torch.cat(outs) if outs else query.new_zeros(0)
    if q0 < query.size(0):  # tokens after the last sequence take no part
        out = torch.cat([out, query.new_zeros(query.size(0) - q0, n, value.size(-1))])
    smax, ssum = torch.cat(maxes), torch.cat(sums)
    return _outputs(out, smax, ssum, keep_prob, 0)


# --------------------------------------------------------------------------- _npu_matmul_add_fp32
def _npu_matmul_add_fp32(x, weight, C):  # noqa: N803 (the real parameter name)
    """_npu_matmul_add_fp32(Tensor x, Tensor weight, Tensor(a!) C) -> (): C += x^T @ weight.

    op-plugin ops/atb/LinearAtb.cpp (7.0.0+): ATB LinearOperation with transposeA=true,
    transposeB=false, enAccum=true. x [m, k], weight [m, n] (bf16; the ATB docs rule out float16
    with transposeA), C [k, n] fp32, updated in place; returns nothing. Forward only (no autograd).
    """
    _check_tensor("x", x, (torch.float16, torch.bfloat16))
    _check_tensor("weight", weight, (torch.float16, torch.bfloat16))
    _check_tensor("C", C, (torch.float32,))
    _check(x.dtype == weight.dtype, f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    _check(x.dtype != torch.float16, "LinearOperation: transposeA=true is not supported with float16 inputs")
    _check(x.dim() == 2 and weight.dim() == 2 and C.dim() == 2, "x, weight and C must be 2-D")
    _check(x.shape[0] == weight.shape[0], f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: first dims differ")
    _check(tuple(C.shape) == (x.shape[1], weight.shape[1]),
           f"C {tuple(C.shape)} must be [{x.shape[1]}, {weight.shape[1]}]")
    with torch.no_grad():
        C.add_(x.float().t() @ weight.float())


# --------------------------------------------------------------------- npu_grouped_matmul
_QUANT = ("bias", "scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
          "activation_input", "activation_quant_scale", "activation_quant_offset")


def _no_quant(args):
    _check(all(args.get(k) is None for k in _QUANT), "quantisation / bias arguments are not modelled by the emulation")


def _groups(group_list, group_list_type, n):
    counts = group_list if group_list_type == 1 else [e - s for s, e in zip([0] + group_list[:-1], group_list)]
    _check(all(c >= 0 for c in counts), f"group_list {group_list} must be non-decreasing (cumsum) / non-negative")
    _check(len(counts) <= 1024, "at most 1024 groups")
    _check(sum(counts) == n, f"group_list covers {sum(counts)}, the grouped axis has {n}")
    return counts


def _rows(a, weights, counts, output_dtype):
    """group_type 0: rows of a [M, k] in groups, weights [E] x [k, n] -> [M, n]."""
    _check(a.dim() == 2, f"x must be 2-D, got {tuple(a.shape)}")
    _check(len(weights) == len(counts), f"weight has {len(weights)} groups, group_list {len(counts)}")
    for w in weights:
        _check(w.dim() == 2 and w.shape[0] == a.shape[1], f"contraction sizes differ: x {tuple(a.shape)}, weight {tuple(w.shape)}")
    outs = [c.float() @ w.float() for c, w in zip(torch.split(a, counts), weights)]
    return [torch.cat(outs).to(output_dtype or a.dtype)]


def _k_axis(a, w, counts, output_dtype):
    """group_type 2 (aclnnGroupedMatmulV4, single x/weight/y): x [k, M] *transposed* (stride
    [1, k]), weight [M, n] not transposed, groups along M -> y [E, k, n]."""
    _check(a.dim() == 2 and w.dim() == 2, "group_type 2 takes 2-D x and weight")
    _check(a.stride() == (1, a.shape[0]) and not a.is_contiguous(),
           f"group_type 2: x must be transposed (a [k, M] view with stride [1, k]), got stride {a.stride()}")
    _check(w.is_contiguous(), "group_type 2: weight must not be transposed")
    _check(a.shape[1] == w.shape[0], f"x {tuple(a.shape)} and weight {tuple(w.shape)}: grouped axes differ")
    blocks = [xa.float() @ wb.float() for xa, wb in zip(torch.split(a, counts, dim=1), torch.split(w, counts))]
    return [torch.stack(blocks).to(output_dtype or a.dtype)]


def _gmm_tensor_form(x, weight, args, *, k_axis):
    """The 7.x single-tensor modes: x [one tensor], weight [one [E, k, n] tensor], y one tensor."""
    _check(isinstance(x, (list, tuple)) and len(x) == 1, "x must be a list of one tensor (single-tensor mode)")
    _check(isinstance(weight, (list, tuple)) and len(weight) == 1, "weight must be a list of one tensor")
    a, w = x[0], weight[0]
    _check_tensor("x[0]", a)
    _check_tensor("weight[0]", w)
    _check(a.dtype == w.dtype, f"x ({a.dtype}) and weight ({w.dtype}) must share a dtype")
    _no_quant(args)
    _check(args["split_item"] in (2, 3), f"split_item {args['split_item']}: the emulation models the single-tensor modes 2 and 3")
    _check(args["group_list_type"] in (0, 1), f"group_list_type {args['group_list_type']} must be 0 (cumsum) or 1 (counts)")
    _check(args["act_type"] == 0, "activations are not modelled")
    group_list, group_type, out = args["group_list"], args["group_type"], args["output_dtype"]
    _check(isinstance(group_list, torch.Tensor) and group_list.dim() == 1 and group_list.dtype == torch.int64,
           "group_list must be a 1-D int64 tensor")
    if group_type == 2 and k_axis:
        return _k_axis(a, w, _groups(group_list.tolist(), args["group_list_type"], a.shape[1]), out)
    _check(group_type == 0, f"group_type {group_type}: the emulation models 0 (and 2 where the release has it)")
    _check(a.is_contiguous(), "x does not support transposition in group_type 0")
    _check(w.dim() == 3, f"group_type 0 (single tensors) takes weight [E, k, n], got {tuple(w.shape)}")
    return _rows(a, list(w.unbind(0)), _groups(group_list.tolist(), args["group_list_type"], a.shape[0]), out)


def npu_grouped_matmul_6_0(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, group_list=None, split_item=0, output_dtype=None):
    """6.0.0: group_list int[] (cumulative ends), no group_type / group_list_type; weight a list of
    2-D tensors (aclnnGroupedMatmul reads weight[i].sizes()[1]); fp16/bf16 (int8: quantised, not
    modelled). Modelled: x one tensor, y one tensor (split_item 2/3)."""
    args = dict(locals())
    _check(isinstance(x, (list, tuple)) and len(x) == 1, "x must be a list of one tensor (single-tensor mode)")
    _check(isinstance(weight, (list, tuple)) and len(weight) >= 1, "weight must be a list of tensors")
    a = x[0]
    _check_tensor("x[0]", a, (torch.float16, torch.bfloat16))
    for i, w in enumerate(weight):
        _check_tensor(f"weight[{i}]", w, (a.dtype,))
    _no_quant(args)
    _check(split_item in (2, 3), f"split_item {split_item}: the emulation models the single-tensor modes 2 and 3")
    if isinstance(group_list, torch.Tensor):
        raise TypeError("npu_grouped_matmul(): argument 'group_list' must be tuple of ints, not Tensor")
    _check(isinstance(group_list, (list, tuple)) and all(isinstance(v, int) for v in group_list),
           "group_list must be a list of ints")
    return _rows(a, list(weight), _groups(list(group_list), 0, a.shape[0]), output_dtype)


def npu_grouped_matmul_7_0(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None,
                           activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
                           split_item=0, group_type=-1, group_list_type=0, act_type=0, output_dtype=None):
    """7.0.0: Tensor group_list, group_type (default -1), group_list_type. The op-plugin code has no
    output shape for group_type 2 (it allocates [x.size(0), n]): K-axis grouping is refused here."""
    args = dict(locals())
    _check(group_type != 2, "group_type 2 (K-axis) has no [E, k, n] output in this release")
    return _gmm_tensor_form(x, weight, args, k_axis=False)


def npu_grouped_matmul_7_1(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None,
                           activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
                           split_item=0, group_type=None, group_list_type=0, act_type=0, tuning_config=None,
                           output_dtype=None):
    """7.1.0: group_type must be passed and be -1 or 0 (TORCH_CHECK in GroupedMatmulKernelNpuOpApi.cpp)."""
    args = dict(locals())
    _check(group_type is not None, "Requires manual passing group_type, current is None.")
    _check(group_type in (-1, 0), f"group_type currently only support -1 and 0, current value is {group_type}")
    return _gmm_tensor_form(x, weight, args, k_axis=False)


def npu_grouped_matmul_7_3(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None,
                           activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
                           split_item=0, group_type=None, group_list_type=0, act_type=0, tuning_config=None,
                           output_dtype=None):
    """7.2.0 / 7.3.0: group_type -1, 0 or 2; 2 (K-axis) needs x transposed, weight not, y [E, k, n]."""
    args = dict(locals())
    _check(group_type is not None, "Requires manual passing group_type, current is None.")
    _check(group_type in (-1, 0, 2), f"The group type must be -1, 0 or 2, but now is [{group_type}]")
    return _gmm_tensor_form(x, weight, args, k_axis=True)


# --------------------------------------------------------------------- npu_moe_token_(un)permute
def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None,
    bool padded_mode=False) -> (Tensor permuted_tokens, Tensor sorted_indices).

    tokens [T, h] bf16; indices [T, topk] (or [T]) int64 expert ids. Rows are the stable argsort
    of indices.view(-1) (expert-major, flat position ascending), the first num_out_tokens kept;
    sorted_indices (int32, [T * topk]) is the inverse of that sort: the row of each flat position,
    which npu_moe_token_unpermute takes. padded_mode=True is not supported (documented).
    Autograd flows to tokens (the real op registers a backward).
    """
    _check_tensor("tokens", tokens, (torch.bfloat16,))
    _check(tokens.dim() == 2, "tokens must be 2-D")
    _check(isinstance(indices, torch.Tensor) and indices.dtype == torch.int64 and indices.dim() in (1, 2)
           and indices.shape[0] == tokens.shape[0], "indices must be int64 [T] or [T, topk]")
    _check(not padded_mode, "padded_mode=True is not supported")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    inverse = torch.argsort(order, stable=True).to(torch.int32)
    if num_out_tokens is not None:
        _check(0 <= num_out_tokens <= order.numel(), f"num_out_tokens {num_out_tokens} out of range")
        order = order[:num_out_tokens]
    return tokens.index_select(0, order // topk), inverse


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None,
    bool padded_mode=False, int[]? restore_shape=None) -> Tensor.

    permuted_tokens [N, h] bf16, sorted_indices int32 [N] from npu_moe_token_permute, probs
    [T, topk] bf16 with T * topk == N (None: topk = 1). out[t] = sum_j probs[t, j] *
    permuted_tokens[sorted_indices[t * topk + j]], in fp32, returned in bf16. (The op-plugin
    page's reference code index_copies with the forward sort instead; the two ops are used as a
    pair, so the emulation keeps the pair consistent with the permute page.)
    """
    _check_tensor("permuted_tokens", permuted_tokens, (torch.bfloat16,))
    _check(isinstance(sorted_indices, torch.Tensor) and sorted_indices.dtype == torch.int32
           and sorted_indices.dim() == 1, "sorted_indices must be 1-D int32")
    _check(sorted_indices.numel() == permuted_tokens.shape[0], "sorted_indices must have one entry per row")
    _check(not padded_mode, "padded_mode=True is not supported")
    topk = 1
    if probs is not None:
        _check_tensor("probs", probs, (torch.bfloat16,))
        _check(probs.dim() == 2 and probs.numel() == permuted_tokens.shape[0], "probs must be [T, topk], T * topk == rows")
        topk = probs.shape[1]
    rows = permuted_tokens.float().index_select(0, sorted_indices.long())
    rows = rows.view(-1, topk, permuted_tokens.shape[1])
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


# --------------------------------------------------------------------- profiles
PROFILES = {   # Ascend Extension for PyTorch release -> (torch_npu.__version__, its ops)
    "6.0.0": "2.1.0.post10",
    "7.0.0": "2.5.1",
    "7.1.0": "2.6.0",
    "7.3.0": "2.6.0.post5",
}
_COMMON = dict(npu_rms_norm=npu_rms_norm, npu_swiglu=npu_swiglu, npu_scaled_masked_softmax=npu_scaled_masked_softmax)


def profile_ops(release):
    """The torch_npu functions one release has, under their real names (see torch_npu_api.py)."""
    ops = dict(_COMMON, npu_fusion_attention=npu_fusion_attention, npu_fusion_attention_grad=npu_fusion_attention_grad)
    if release == "6.0.0":
        return dict(ops, npu_rotary_mul=npu_rotary_mul_6_0, npu_grouped_matmul=npu_grouped_matmul_6_0)
    ops.update(npu_rotary_mul=npu_rotary_mul, _npu_matmul_add_fp32=_npu_matmul_add_fp32)
    if release == "7.0.0":
        return dict(ops, npu_grouped_matmul=npu_grouped_matmul_7_0)
    ops.update(npu_moe_token_permute=npu_moe_token_permute, npu_moe_token_unpermute=npu_moe_token_unpermute)
    if release == "7.1.0":
        return dict(ops, npu_grouped_matmul=npu_grouped_matmul_7_1)
    return dict(ops, npu_grouped_matmul=npu_grouped_matmul_7_3, npu_fusion_attention=npu_fusion_attention_7_3,
                npu_fusion_attention_grad=npu_fusion_attention_grad_7_3)

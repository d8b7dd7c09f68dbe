"""The EMULATION rejects what the real torch_npu ops reject (per the op-plugin documentation), so a
backend that passes the wrong layout, mask, dtype or sparse mode fails here rather than on an NPU.
Also: its npu_fusion_attention models every sparse mode the backend uses, checked against masks
written out by hand; strict mode turns the backend's fallbacks into errors."""
import pytest
import torch

from megatron_adapt.errors import StrictFallbackError


def fa_inputs(layout="BNSD", b=1, n=2, s=8, d=4, dtype=torch.float16):
    shape = {"BNSD": (b, n, s, d), "BSND": (b, s, n, d), "BSH": (b, s, n * d), "SBH": (s, b, n * d),
             "TND": (b * s, n, d)}[layout]
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


def triu2048():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


@pytest.mark.parametrize("kwargs,message", [
    (dict(input_layout="BHSD"), "input_layout"),
    (dict(input_layout="bnsd"), "input_layout"),
    (dict(sparse_mode=9), "sparse_mode"),
    (dict(sparse_mode=-1), "sparse_mode"),
    (dict(atten_mask=torch.zeros(8, 8)), "bool or uint8"),                     # float mask
    (dict(atten_mask=torch.zeros(8, 8, dtype=torch.int32)), "bool or uint8"),
    (dict(atten_mask=torch.zeros(8, 8, dtype=torch.bool), sparse_mode=2), "compressed"),
    (dict(atten_mask=~triu2048(), sparse_mode=3), "upper-triangular"),
    (dict(atten_mask=torch.zeros(1, 2, 8, 7, dtype=torch.bool)),
     "atten_mask shape"),
    (dict(keep_prob=0.0), "keep_prob"),
    (dict(keep_prob=1.5), "keep_prob"),
    (dict(padding_mask=torch.zeros(1)), "padding_mask"),
    (dict(head_num=3), "head_num"),
    (dict(pre_tockens=2, next_tockens=-3, atten_mask=torch.zeros(8, 8, dtype=torch.bool)), "pre_tockens"),
    (dict(input_layout="TND"), "actual_seq_qlen"),
    (dict(sparse_mode=7, atten_mask=triu2048()), "not modelled"),
])
def test_fusion_attention_rejects(torch_npu, kwargs, message):
    kwargs = dict(kwargs)   # the parameter dict is shared by every profile's run
    layout = kwargs.pop("input_layout", "BNSD")
    q, k, v = fa_inputs("BNSD" if layout not in ("TND",) else "TND")
    args = dict(head_num=2, input_layout=layout)
    args.update(kwargs)
    with pytest.raises(torch_npu.EmulatedNPUError, match=message):
        torch_npu.npu_fusion_attention(q, k, v, **args)


def test_fusion_attention_rejects_shapes(torch_npu):
    q, k, v = fa_inputs(n=6)
    with pytest.raises(torch_npu.EmulatedNPUError, match="multiple of Nkv"):
        torch_npu.npu_fusion_attention(q, k[:, :4], v[:, :4], 6, "BNSD")
    with pytest.raises(torch_npu.EmulatedNPUError, match="one dtype"):
        torch_npu.npu_fusion_attention(q, k.float(), v, 6, "BNSD")
    with pytest.raises(torch_npu.EmulatedNPUError, match="4-D"):
        torch_npu.npu_fusion_attention(q[0], k[0], v[0], 6, "BNSD")
    with pytest.raises(torch_npu.EmulatedNPUError, match="divisible by head_num"):
        torch_npu.npu_fusion_attention(*fa_inputs("SBH", n=2, d=5), 4, "SBH")
    with pytest.raises(torch_npu.EmulatedNPUError, match="dtype"):
        torch_npu.npu_fusion_attention(*fa_inputs(dtype=torch.float64), 2, "BNSD")


def _reference(q, k, v, masked, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return torch.softmax(s, -1) @ v.float()


@pytest.mark.parametrize("sq,sk", [(8, 8), (6, 10)])
@pytest.mark.parametrize("mode,pre,nxt", [(0, 2, 1), (1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 3, 0), (4, 2, 2)])
def test_fusion_attention_sparse_modes_against_hand_written_masks(torch_npu, sq, sk, mode, pre, nxt):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, sq, 4), torch.randn(1, 2, sk, 4), torch.randn(1, 2, sk, 4)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    user = torch.zeros(sq, sk, dtype=torch.bool)
    user[:, -1] = True                                             # an arbitrary user mask
    expected = {
        0: user | (j - i > nxt) | (i - j > pre),                   # band around the top-left diagonal
        1: user,
        2: j > i,                                                  # leftUpCausal
        3: j > i + sk - sq,                                        # rightDownCausal
        4: (j > i + sk - sq + nxt) | (j < i + sk - sq - pre),      # band around the bottom-right one
    }[mode]
    mask = user if mode in (0, 1) else triu2048()
    out = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, scale=0.5, sparse_mode=mode,
                                         pre_tockens=pre, next_tockens=nxt)
    assert len(out) == 7 and isinstance(out[4], int) and out[6] == 0
    torch.testing.assert_close(out[0], _reference(q, k, v, expected, 0.5))


def test_fusion_attention_without_a_mask_ignores_sparse_mode(torch_npu):
    # Documented: with atten_mask=None, sparse_mode / pre / next have no effect (full attention).
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    full = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5)[0]
    for mode in (2, 3, 4):
        torch.testing.assert_close(torch_npu.npu_fusion_attention(
            q, k, v, 2, "BNSD", scale=0.5, sparse_mode=mode, pre_tockens=1, next_tockens=0)[0], full)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_fusion_attention_layouts_agree(torch_npu, layout):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))        # BNSD, GQA below: 4 q heads, 2 kv
    k, v = k[:, :2], v[:, :2]
    to = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2),
          "BSH": lambda t: t.transpose(1, 2).flatten(2), "SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2)}[layout]
    base = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3)[0]
    out = torch_npu.npu_fusion_attention(to(q), to(k), to(v), 4, layout, scale=0.3)[0]
    torch.testing.assert_close(out, to(base))


def test_fusion_attention_tnd(torch_npu):
    torch.manual_seed(2)
    lens = [3, 5, 2]
    q, k, v = (torch.randn(sum(lens), 2, 4) for _ in range(3))
    out = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", atten_mask=triu2048(), sparse_mode=3, scale=0.5,
                                         actual_seq_qlen=[3, 8, 10], actual_seq_kvlen=[3, 8, 10])[0]
    start = 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        expect = _reference(qs, ks, vs, torch.triu(torch.ones(n, n, dtype=torch.bool), 1), 0.5)
        torch.testing.assert_close(out[start:start + n], expect.transpose(0, 1))
        start += n


def message_source(call):
    import inspect

    return inspect.getsource(call)


@pytest.mark.parametrize("call,message", [
    (lambda t: t.npu_rms_norm(torch.randn(2, 8), torch.randn(8).half()), "gamma dtype"),
    (lambda t: t.npu_rms_norm(torch.randn(2, 8), torch.randn(7)), "trailing dims"),
    (lambda t: t.npu_rms_norm(torch.randn(2, 8).double(), torch.randn(8).double()), "dtype"),
    (lambda t: t.npu_swiglu(torch.randn(4, 7)), "even"),
    (lambda t: t.npu_swiglu(torch.randn(6, 4).t()), "non-contiguous"),
    (lambda t: t.npu_swiglu(torch.randn(0, 4)), "empty"),
    (lambda t: t.npu_swiglu(torch.randn(4, 4), dim=2), "dim"),
    (lambda t: t.npu_scaled_masked_softmax(torch.randn(1, 1, 64, 40).half(), torch.zeros(1, 1, 64, 40, dtype=torch.bool)), "W=40"),
    (lambda t: t.npu_scaled_masked_softmax(torch.randn(1, 1, 16, 64).half(), torch.zeros(1, 1, 16, 64, dtype=torch.bool)), "H=16"),
    (lambda t: t.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32).half(), torch.zeros(1, 1, 32, 32)), "bool"),
    (lambda t: t.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32).half(), torch.zeros(1, 1, 32, 31, dtype=torch.bool)), "broadcast"),
    (lambda t: t.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32).half(), torch.zeros(1, 1, 32, 32, dtype=torch.bool), 1.0, True), "fixed_triu_mask"),
    (lambda t: t.npu_scaled_masked_softmax(torch.randn(32, 32).half(), torch.zeros(32, 32, dtype=torch.bool)), "4-D"),
    (lambda t: t.npu_rotary_mul(torch.randn(2, 3, 4, 8), torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8), rotary_mode="full"), "rotary_mode"),
    (lambda t: t.npu_rotary_mul(torch.randn(2, 3, 4, 7), torch.randn(2, 1, 1, 7), torch.randn(2, 1, 1, 7)), "even"),
    (lambda t: t.npu_rotary_mul(torch.randn(2, 3, 4, 8), torch.randn(2, 1, 1, 8).half(), torch.randn(2, 1, 1, 8).half()), "one dtype"),
    (lambda t: t.npu_rotary_mul(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), rotary_mode="interleave"), "not supported"),
    (lambda t: t.npu_rotary_mul(torch.randn(2, 3, 4, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)), "not supported"),
    (lambda t: t.npu_rotary_mul(torch.randn(3, 4, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)), "4-D"),
])
def test_other_ops_reject(torch_npu, call, message):
    if "rotary_mode=" in message_source(call) and torch_npu.PROFILE == "6.0.0":
        message = "unexpected keyword"   # 6.0.0's npu_rotary_mul has no rotary_mode at all
    with pytest.raises((torch_npu.EmulatedNPUError, TypeError), match=message):
        call(torch_npu)


def test_strict_mode_turns_fallbacks_into_errors(torch_npu, report):
    from megatron_adapt.backends import npu

    report.set_context(strict=True)
    with pytest.raises(StrictFallbackError, match="scaled_masked_softmax.*dtype torch.float32"):
        npu.BACKEND.op("scaled_masked_softmax")(torch.randn(1, 1, 64, 64), None, None, True)
    with pytest.raises(StrictFallbackError, match="attention.*head dim"):
        q = torch.randn(1, 1, 4, 800)
        npu.BACKEND.op("attention")(q, q, q)


@pytest.mark.parametrize("layout,hq,hkv,sq,sk,mode", [
    ("BNSD", 4, 4, 8, 8, None), ("BNSD", 4, 2, 8, 8, 3), ("SBH", 4, 2, 6, 10, 3), ("BSH", 2, 2, 8, 8, 2),
    ("BSND", 4, 1, 8, 12, None), ("BNSD", 2, 2, 8, 8, 0),
])
def test_fusion_attention_grad_is_the_forwards_autograd(torch_npu, layout, hq, hkv, sq, sk, mode):
    """npu_fusion_attention_grad from the forward's (softmax_max, softmax_sum, attention_out) gives
    what torch autograd gives through the emulated forward; so does the ring form, softmax_max =
    the row log-sum-exp and softmax_sum = 1."""
    torch.manual_seed(3)
    d, b = 8, 2
    to = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2),
          "BSH": lambda t: t.transpose(1, 2).flatten(2), "SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2)}[layout]
    q = to(torch.randn(b, hq, sq, d)).requires_grad_()
    k, v = (to(torch.randn(b, hkv, sk, d)).requires_grad_() for _ in range(2))
    kw = dict(scale=0.4)
    if mode is not None:
        user = torch.rand(sq, sk) < 0.3
        user[:, 0] = False                                    # every row sees something
        kw.update(atten_mask=user if mode == 0 else triu2048(), sparse_mode=mode)
    out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, hq, layout, **kw)[:3]
    dy = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dy)
    grad_kw = dict(atten_mask=kw.get("atten_mask"), scale_value=0.4, sparse_mode=kw.get("sparse_mode", 0))
    lse = (smax + torch.log(ssum))
    for stats in ((smax, ssum), (lse, torch.ones_like(lse))):
        got = torch_npu.npu_fusion_attention_grad(q.detach(), k.detach(), v.detach(), dy, hq, layout,
                                                  softmax_max=stats[0], softmax_sum=stats[1],
                                                  attention_in=out.detach(), **grad_kw)
        assert len(got) == (5 if torch_npu.PROFILE == "7.3.0" else 4)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.shape == w.shape, name
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kwargs,message", [
    (dict(keep_prob=0.9), "keep_prob"),
    (dict(softmax_sum=None), "softmax_sum"),
    (dict(attention_in=None), "attention_in"),
    (dict(softmax_max=torch.zeros(1, 2, 8, 8, dtype=torch.float16)), "softmax_max"),
    (dict(atten_mask=torch.zeros(8, 8, dtype=torch.bool), sparse_mode=3), "compressed"),
])
def test_fusion_attention_grad_rejects(torch_npu, kwargs, message):
    q, k, v = fa_inputs()
    args = dict(softmax_max=torch.zeros(1, 2, 8, 8), softmax_sum=torch.ones(1, 2, 8, 8), attention_in=q.clone())
    args.update(kwargs)
    with pytest.raises(torch_npu.EmulatedNPUError, match=message):
        torch_npu.npu_fusion_attention_grad(q, k, v, q.clone(), 2, "BNSD", **args)

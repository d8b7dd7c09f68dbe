"""fp8 scaling state (backends/fp8_scaling.py) against Transformer Engine's definitions.

TE's delayed scaling, as its PyTorch reference path writes it (transformer_engine/pytorch/fp8.py,
`_default_get_amax_and_update_history` and `_default_sf_compute`), restated here independently:
amax = max over the history ('max') or its row 0 ('most_recent'); the history is rolled one row
back (torch.roll(h, -1, 0)) and row 0 zeroed; scale = fp8_max / amax / 2^margin where amax is
finite and > 0, else the previous scale; an infinite scale becomes the largest fp32.
Current (tensorwise) scaling: scale = fp8_max / amax, 1 where amax is 0 or not finite.
"""
import math

import pytest
import torch

from megatron_adapt.backends.fp8_scaling import (FP8_MAX, Fp8Recipe, Fp8Scaling, current_scale,
                                                 delayed_scale)

E4M3, E5M2 = 448.0, 57344.0


def te_update(history, scale, algo, fp8_max, margin):
    """TE's reference update on plain Python lists (history: rows of floats, newest in row 0)."""
    cols = len(history[0])
    amax = [max(r[c] for r in history) for c in range(cols)] if algo == "max" else list(history[0])
    history = history[1:] + [history[0]]
    history[0] = [0.0] * cols
    new = []
    for a, s in zip(amax, scale):
        sf = s if not (math.isfinite(a) and a > 0) else fp8_max / a / 2 ** margin
        new.append(torch.finfo(torch.float32).max if math.isinf(sf) else sf)
    return history, new


def test_fp8_max_and_formats():
    assert FP8_MAX[torch.float8_e4m3fn] == torch.finfo(torch.float8_e4m3fn).max == E4M3
    assert FP8_MAX[torch.float8_e5m2] == torch.finfo(torch.float8_e5m2).max == E5M2
    assert Fp8Recipe("hybrid").bwd_dtype == torch.float8_e5m2
    assert Fp8Recipe("e4m3").bwd_dtype == torch.float8_e4m3fn
    assert Fp8Recipe("hybrid").fwd_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8 recipe 'mxfp8'"):
        Fp8Recipe("hybrid", "mxfp8")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length,margin", [(1, 0), (3, 0), (4, 2)])
def test_delayed_update_follows_te(algo, length, margin):
    """Forward state (2 slots, e4m3) and backward state (1 slot, e5m2 under hybrid) over steps
    whose amaxes rise, fall, hit 0 and inf: histories and scales equal TE's update after each."""
    state = Fp8Scaling(Fp8Recipe("hybrid", "delayed", margin=margin, amax_history_len=length,
                                 amax_compute_algo=algo))
    steps = [(2.0, 0.5), (8.0, 0.25), (1.0, 0.0), (0.5, float("inf")), (3.0, 1e-30), (0.0, 4.0)]
    hist = {"fwd": [[0.0, 0.0] for _ in range(length)], "bwd": [[0.0] for _ in range(length)]}
    scale = {"fwd": [1.0, 1.0], "bwd": [1.0]}
    for a, b in steps:
        state.record("fwd", 0, torch.tensor(a))
        state.record("fwd", 1, torch.tensor(b))
        state.record("fwd", 0, torch.tensor(a / 2))   # a second cast in the step: the max is kept
        state.record("bwd", 0, torch.tensor(b))
        hist["fwd"][0] = [a, b]
        hist["bwd"][0] = [b]
        for d, fp8_max in (("fwd", E4M3), ("bwd", E5M2)):
            state.update(d)
            hist[d], scale[d] = te_update(hist[d], scale[d], algo, fp8_max, margin)
            assert torch.equal(state.amax_history[d], torch.tensor(hist[d], dtype=torch.float32)), (d, a, b)
            torch.testing.assert_close(state.scale[d], torch.tensor(scale[d]), rtol=1e-6, atol=0)


def test_delayed_interval_recomputes_every_nth_update():
    state = Fp8Scaling(Fp8Recipe("e4m3", "delayed", interval=2))
    seen = []
    for a in (4.0, 8.0, 16.0, 32.0):
        state.record("fwd", 0, torch.tensor(a))
        state.update("fwd")
        seen.append(state.scale["fwd"][0].item())
    assert seen == [E4M3 / 4.0, E4M3 / 4.0, E4M3 / 16.0, E4M3 / 16.0]


def test_current_scale():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45])
    got = current_scale(amax, E4M3)
    assert got[0].item() == E4M3 / 2 and got[1].item() == 1.0 and got[2].item() == 1.0 and got[3].item() == 1.0
    assert got[4].item() == torch.finfo(torch.float32).max
    # delayed_scale's margin
    torch.testing.assert_close(delayed_scale(torch.tensor([7.0]), torch.tensor([3.0]), E4M3, 3),
                               torch.tensor([E4M3 / 7.0 / 8.0]))


def test_state_bytes_roundtrip_and_history_length_change():
    a = Fp8Scaling(Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo="max"))
    for v in (1.0, 5.0, 2.0):
        a.record("fwd", 0, torch.tensor(v))
        a.record("bwd", 0, torch.tensor(v * 3))
        a.update("fwd")
        a.update("bwd")
    blob = a.to_bytes()
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    b = Fp8Scaling(Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo="max"))
    b.load_state_dict(Fp8Scaling.from_bytes(blob))
    for d in ("fwd", "bwd"):
        assert torch.equal(a.scale[d], b.scale[d]) and torch.equal(a.amax_history[d], b.amax_history[d])
    assert b.updates == a.updates == {"fwd": 3, "bwd": 3}
    short = Fp8Scaling(Fp8Recipe("hybrid", "delayed", amax_history_len=2))
    short.load_state_dict(Fp8Scaling.from_bytes(blob))
    assert torch.equal(short.amax_history["fwd"], a.amax_history["fwd"][:2])
    assert Fp8Scaling.from_bytes(torch.empty(0, dtype=torch.uint8)) is None and Fp8Scaling.from_bytes(None) is None

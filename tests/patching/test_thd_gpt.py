"""Tier 3 for packed sequences on core 0.16.1 (whose pretrain_gpt.py cannot pack): Megatron's
GPTModel fed PackedSeqParams (qkv_format thd, with and without cu_seqlens_padded) against the same
documents run one per sequence, fp32, on the TE spec megatron-adapt serves and on the local spec,
RoPE fusion on (megatron-adapt's fused_apply_rotary_pos_emb_thd) and off (Megatron's own thd RoPE).
Per-token loss within 2e-3 (the issue's bound; it lands near 1e-6) and every parameter's gradient
within 1e-4 relative. A control packs the same tokens as one document: its losses must differ."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "thd_worker.py")


@lru_cache(maxsize=None)
def result():
    out = run_python([WORKER], timeout=600).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))[len("PROBE-JSON:"):])


@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_thd_loss_equals_one_document_per_sequence(spec, fusion, padded):
    res = result()[f"{spec}/fusion={fusion}/padded={padded}"]
    assert res["tokens"] == 22
    assert res["max_abs_loss_diff"] <= 2e-3, res
    assert res["max_grad_rel_diff"] <= 1e-4, res
    assert res["core_attention"] == ("AdaptDotProductAttention" if spec == "te" else "DotProductAttention")


def test_control_one_document_differs():
    assert result()["control_one_document"]["max_abs_loss_diff"] > 1e-2


def test_report_names_the_thd_op():
    assert result()["impls"]["attention_thd"] == ["cpu.torch.sdpa.per_sequence"]

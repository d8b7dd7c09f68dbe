"""BERT, T5, heterogeneous GPT and ModelOpt's GPT spec from their TE-naming layer specs without TE (patches/layer_specs), against
Megatron's local specs on Megatron's own attention, with the same weights: per-token loss on real
tokens within 1e-5 and every parameter's gradient within 1e-4 relative (fp32; both land near 5e-7).
T5 with --position-embedding-type relative (a learned attention bias, which Megatron's own
DotProductAttention does not take) against the same model on attention written out in fp32.

T5's TE spec gets TE 1.10's mask layout ([b, 1, 1, s] padding masks, a causal decoder, a (query, key)
padding pair for cross attention); the local spec gets [b, 1, sq, sk] masks. The cpu backend, and
the npu backend under the torch_npu emulation (its attention through npu_fusion_attention: never
run on an Ascend NPU here)."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "te_spec_families_worker.py")
EMULATION = os.path.join(os.path.dirname(HERE), "npu", "emulation")


@lru_cache(maxsize=None)
def result(backend):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [EMULATION, os.environ.get("PYTHONPATH")]))} \
        if backend == "npu" else None
    out = run_python([WORKER, backend], env=env, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


BACKENDS = ["cpu", "npu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["bert", "t5"])
def test_te_spec_matches_megatrons_local_spec(backend, family):
    res = result(backend)[family]
    assert "error" not in res, res.get("error")
    assert res["loss_diff"] <= 1e-5, res
    assert res["grad_rel_diff"] <= 1e-4, res
    assert 3.0 < res["loss"] < 6.0, res   # ~ln(96): a real loss, not zeros
    modules = res["te_modules"]
    assert "AdaptDotProductAttention" in modules and "AdaptLayerNormColumnParallelLinear" in modules, modules


@pytest.mark.parametrize("backend", BACKENDS)
def test_heterogeneous_te_spec_matches_megatrons_local_spec(backend):
    """Per-layer GQA, a no-op attention, attention and MLP replaced by TE's gathered norm + linear
    (served by AdaptLayerNormColumnParallelLinearGathered), per-layer FFN sizes."""
    res = result(backend)["heterogeneous"]
    assert "error" not in res, res.get("error")
    assert res["loss_diff"] <= 1e-5 and res["grad_rel_diff"] <= 1e-4, res
    assert res["layer_kinds"] == ["SelfAttention/MLP", "IdentityOp/MLP",
                                  "AdaptLayerNormColumnParallelLinearGathered/AdaptLayerNormColumnParallelLinearGathered",
                                  "SelfAttention/MLP"], res


@pytest.mark.parametrize("backend", BACKENDS)
def test_t5_gets_te_mask_layout_and_keeps_its_final_norms(backend):
    res = result(backend)["t5"]
    assert res["mask_layouts"] == {"te": [[3, 1, 1, 16], None, "pair"],
                                   "local": [[3, 1, 16, 16], [3, 1, 8, 8], [3, 1, 8, 16]]}, res
    assert res["final_norms"] == ["decoder.final_layernorm.bias", "decoder.final_layernorm.weight",
                                  "encoder.final_layernorm.bias", "encoder.final_layernorm.weight"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_t5_relative_position_bias_matches_explicit_attention(backend):
    """--position-embedding-type relative: the learned bias through the backend's attention_bias op
    against the same model on attention written out in fp32; the bias tables get gradients."""
    res = result(backend)["t5_relative"]
    assert "error" not in res, res.get("error")
    assert res["loss_diff"] <= 1e-5 and res["grad_rel_diff"] <= 1e-4, res
    assert res["reference_modules"] == 6, res          # 2 encoder + 2 x 2 decoder layers
    assert all(g > 0 for g in res["bias_grad_max"].values()) and len(res["bias_grad_max"]) == 2, res
    impl = {"cpu": "cpu.torch.sdpa", "npu": "npu.torch.sdpa (reference)"}[backend]
    assert res["attention_bias_calls"] == {impl: 4}, res   # encoder and decoder self attention


def test_bert_uses_megatrons_b1ss_padding_mask():
    assert result("cpu")["bert"]["attn_mask_dimensions"] == "b1ss"


@pytest.mark.parametrize("backend,impl", [("cpu", "cpu.torch.sdpa"), ("npu", "npu.torch_npu.npu_fusion_attention")])
def test_attention_served_by_the_backend(backend, impl):
    counts = result(backend)["op_counts"]["attention"]
    assert set(counts) == {impl}, counts
    assert sum(counts.values()) == 10   # TE-spec models: BERT 2 layers, T5 2 + 2 x 2, heterogeneous 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_modelopt_gpt_spec_matches_megatrons_local_spec(backend):
    """NVIDIA ModelOpt's post-training GPT spec (its Norm builds TE's norms only, its attention is TE's)
    on the backend norm and attention: the local spec's weights load strictly, the loss within 1e-5
    and every gradient within 1e-4 relative of the local spec on Megatron's own attention; ModelOpt's
    MLA spec builds its down projections on ModelOpt's own Linear and trains."""
    res = result(backend)["modelopt"]
    assert "error" not in res, res.get("error")
    assert res["load"] == "<All keys matched successfully>", res
    assert res["loss_diff"] <= 1e-5 and res["grad_rel_diff"] <= 1e-4 and 3.0 < res["loss"] < 6.0, res
    assert "AdaptDotProductAttention" in res["modelopt_modules"], res
    assert res["mla_down_proj"] == "megatron.core.post_training.modelopt.layers.Linear", res
    assert res["mla_loss_finite"] and res["mla_down_grad"], res

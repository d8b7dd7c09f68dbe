"""Megatron-LM's own packed-sequence (thd) attention tests under megatron-adapt, cpu backend, 2
processes: tests/unit_tests/transformer/test_attention_packed_seq.py (SelfAttention from the TE
layer spec fed PackedSeqParams, with and without cu_seqlens_padded, plain and with core-attention
recompute). Without megatron-adapt's thd path 4 of them fail (Megatron's "Packed sequence is not
supported by DotProductAttention"); here 6 pass and the 2 fused-RoPE ones skip on Megatron's own
"requires TE" condition. The 8-process CP files are run by hand (docs/long-context.md)."""
import json
import os
import subprocess
import sys

import pytest

LM = os.environ.get("MEGATRON_LM_PATH")
NEEDS_CHECKOUT = True
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "megatron_unit_tests.py")
FILE = "tests/unit_tests/transformer/test_attention_packed_seq.py"

pytestmark = [
    pytest.mark.skipif(not LM, reason="MEGATRON_LM_PATH is not set: Megatron-LM's unit tests come from a checkout"),
    pytest.mark.skipif(bool(LM) and not os.path.isfile(os.path.join(LM or "", FILE)),
                       reason=f"MEGATRON_LM_PATH={LM} has no {FILE}"),
]


def test_packed_seq_attention_tests_pass(tmp_path):
    out = tmp_path / "ut"
    proc = subprocess.run([sys.executable, SCRIPT, "--backend", "cpu", "--nproc", "2", "--out", str(out), "--set",
                           "none", "--files", FILE, "--run-timeout", "500"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = json.loads((out / "summary.json").read_text())
    tests = summary["runs"][0]["reports"]["0"]
    outcomes = {nodeid.split("::", 1)[1]: rec for nodeid, rec in tests.items()}
    passed = [n for n, r in outcomes.items() if r["outcome"] == "passed"]
    skipped = {n: r.get("reason") for n, r in outcomes.items() if r["outcome"] == "skipped"}
    assert len(passed) == 6 and len(outcomes) == 8, (outcomes, proc.stdout[-3000:])
    assert all("thd" not in n and ("fused_rope" in n) for n in skipped), skipped
    assert all(r == "Fused RoPE requires TE >= 1.4.0" for r in skipped.values()), skipped
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


THD_CORRECTNESS = "tests/unit_tests/transformer/test_thd_correctness.py"


@pytest.mark.skipif(bool(LM) and not os.path.isfile(os.path.join(LM or "", THD_CORRECTNESS)),
                    reason=f"MEGATRON_LM_PATH={LM} has no {THD_CORRECTNESS} (new in core_v0.19)")
def test_thd_correctness_sbhd_against_thd(tmp_path):
    """core_v0.19's test_thd_correctness: one TE-spec TransformerLayer in bf16, SBHD against THD,
    outputs bitwise and gradients at cosine 0.999. varlen_mixed failed on the layer-norm weight's
    gradient (cosine 0.996) until the cpu layer_norm accumulated it in fp32."""
    cases = [f"{THD_CORRECTNESS}::test_thd_format[{c}]" for c in ("short_seqs", "varlen_mixed")]
    out = tmp_path / "ut"
    proc = subprocess.run([sys.executable, SCRIPT, "--backend", "cpu", "--nproc", "2", "--out", str(out), "--set",
                           "none", "--files", *cases, "--run-timeout", "500"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = json.loads((out / "summary.json").read_text())
    tests = summary["runs"][0]["reports"]["0"]
    outcomes = {nodeid: rec["outcome"] for nodeid, rec in tests.items()}
    assert outcomes == dict.fromkeys(cases, "passed"), (outcomes, proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

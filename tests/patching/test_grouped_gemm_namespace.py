"""Tier 1, area moe: the stand-in for the grouped_gemm package (`grouped_gemm_util.ops.gmm`, core 0.15 -
0.16's legacy GroupedMLP) answers as the package does: the grouped product per expert, and the
package's own error for all-zero batch sizes (Megatron's test_grouped_mlp compares the message)."""
import json

from adapt_testutil import run_python

CODE = r"""
import json, torch, megatron_adapt
megatron_adapt.apply("cpu", quiet=True)
from megatron_adapt.core import active_backend
from megatron_adapt.patches.moe import _gmm_namespace

gg = _gmm_namespace(active_backend())
torch.manual_seed(0)
a, b = torch.randn(5, 4), torch.randn(2, 4, 3)
sizes = torch.tensor([2, 3])
out = gg.ops.gmm(a, b, sizes, trans_b=False)
ref = torch.cat([a[:2] @ b[0], a[2:] @ b[1]])
try:
    gg.ops.gmm(torch.randn(0, 4), b, torch.zeros(2), trans_b=False)
    zero = "no error"
except Exception as e:
    zero = f"{type(e).__name__}: {e}"
print(json.dumps({"max_err": (out - ref).abs().max().item(), "zero": zero}))
"""


def test_gmm_matches_per_expert_products_and_the_packages_zero_batch_error():
    res = json.loads(run_python(CODE, env={"MEGATRON_ADAPT_AUTO": "0"}).stdout.strip().splitlines()[-1])
    assert res["max_err"] < 1e-5, res
    assert res["zero"] == "ValueError: Input batch_sizes should not be all zeros!", res

"""Tier 1, area layer_specs: the module types Megatron's activation logging hooks
(megatron.training.activation_logging, core_v0.19). Its LINEAR_TYPES appends the TE classes its import
finds; without TE those are Megatron's MagicMock stand-ins and `isinstance` raised TypeError as soon as
logging started (Megatron's tests/unit_tests/test_activation_logging.py: 3 failures). The builder keeps
the real classes, drops the stand-ins and adds the classes megatron-adapt builds under TE's names."""
import json

from adapt_testutil import run_python

CODE = r"""
import json, unittest.mock as mock
import torch
import megatron_adapt
megatron_adapt.apply("cpu", quiet=True)
from megatron_adapt.core import active_backend
from megatron_adapt.patches import layer_specs, moe
from megatron.core.tensor_parallel import ColumnParallelLinear

backend = active_backend()
stand_in = mock.MagicMock(spec=str)            # what TENorm is in Megatron's extension without TE
types_ = layer_specs.build_activation_types(backend, (torch.nn.Linear, ColumnParallelLinear, stand_in))
grouped = layer_specs.build_grouped_activation_types(backend, ())
provider = layer_specs.build_provider(backend, None)()
qkv = provider.column_parallel_layer_norm_linear()
norm = provider.layer_norm()
print(json.dumps({
    "all_classes": all(isinstance(t, type) for t in types_),
    "kept": [t.__name__ for t in types_[:2]],
    "qkv_served": qkv in types_, "norm_served": norm in types_,
    "isinstance_ok": isinstance(torch.nn.Linear(2, 2), types_),
    "grouped": sorted(t.__name__ for t in grouped),
    "grouped_are_backends": set(grouped) == set(moe.grouped_linear_classes(backend)),
}))
"""

def test_activation_logging_types_are_classes_and_include_the_served_te_names():
    out = run_python(CODE, env={"MEGATRON_ADAPT_AUTO": "0"}, timeout=300).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["all_classes"] and res["isinstance_ok"], res
    assert res["kept"] == ["Linear", "ColumnParallelLinear"], res
    assert res["qkv_served"] and res["norm_served"], res
    assert res["grouped"] == ["AdaptColumnParallelGroupedLinear", "AdaptRowParallelGroupedLinear"], res
    assert res["grouped_are_backends"], res

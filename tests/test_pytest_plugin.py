"""megatron_adapt.apps.pytest_plugin against a miniature of Megatron-LM's tests/unit_tests layout (no
checkout needed): a conftest that downloads and asks is_te_min_version, a Utils with
initialize_model_parallel, a test module importing Transformer Engine's fp8 names at module level.
The real suite runs in tests/megatron_lm/test_megatron_unit_tests.py."""
import contextlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import types

import pytest

from megatron_adapt.apps import pytest_plugin

# The console script pip installed for this Python (its scripts directory), else the one on PATH.
LAUNCHER = next((p for p in (os.path.join(sysconfig.get_path("scripts"), "megatron-adapt-run"),
                             shutil.which("megatron-adapt-run")) if p and os.path.exists(p)), "megatron-adapt-run")

CONFTEST = """
import pytest
from megatron.core.utils import is_te_min_version
from tests.unit_tests.download import download_and_extract_asset
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils

@pytest.fixture(scope="session", autouse=True)
def ensure_test_data():
    try:
        download_and_extract_asset(assets_dir="/nonexistent")
    except Exception as e:
        print(f"Failed to download test data: {e}")
        pytest.download_error = str(e)

@pytest.fixture(autouse=True)
def set_env():
    assert not is_te_min_version("1.3")
"""
DOWNLOAD = "def download_and_extract_asset(assets_dir):\n    raise SystemExit('the network was used')\n"
UTILITIES = """
class Utils:
    calls = []
    rank = 0

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs):
        Utils.calls.append((tensor_model_parallel_size, pipeline_model_parallel_size, kwargs))

    @staticmethod
    def initialize_distributed():
        Utils.calls.append("initialize_distributed")

    @staticmethod
    def fake_initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, **kwargs):
        Utils.calls.append(("fake", tensor_model_parallel_size, pipeline_model_parallel_size))
"""
TEST_MODULE = """
import sys
import pytest
from transformer_engine.pytorch.fp8 import check_fp8_support, fp8_autocast
from megatron.core.utils import is_te_min_version
from tests.unit_tests.test_utilities import Utils

TE_AT_IMPORT = is_te_min_version("1.0")

def test_no_te_package_is_left_behind():
    assert "transformer_engine" not in sys.modules and not TE_AT_IMPORT
    import megatron.core.extensions.transformer_engine as te_ext
    assert not te_ext.HAVE_TE

def test_fp8_is_not_available():
    ok, reason = check_fp8_support()
    assert not ok and "not installed" in reason
    with fp8_autocast(enabled=False):
        pass
    with pytest.raises(RuntimeError, match="FP8 is not available"):
        with fp8_autocast(enabled=True):
            pass

def test_download_refused():
    assert "no downloads" in pytest.download_error

@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (4, 1), (2, 2)])
def test_layouts(tp, pp):
    Utils.initialize_model_parallel(tp, pp)
    assert Utils.calls[-1][:2] == (tp, pp)

def test_expert_layout():
    Utils.initialize_model_parallel(1, 1, expert_model_parallel_size=4)

@pytest.mark.parametrize("instances", [2, 4])
def test_distributed_optimizer_instances(instances):
    # each instance is a data-parallel subgroup (test_optimizer_shards_cover_every_param)
    Utils.initialize_model_parallel(num_distributed_optimizer_instances=instances)

def _baseline_then_layout(tp, cp):
    assert tp * cp <= 2, "ran a layout the world size cannot hold"   # (the expensive baseline)
    Utils.initialize_model_parallel(tp, 1, context_parallel_size=cp)

@pytest.mark.parametrize("tp,cp", [(1, 4), (2, 1)])
def test_baseline_first(tp, cp):
    # Megatron's correctness tests build a baseline model before asking for the layout:
    # a layout the world cannot hold is skipped from the parameters, before the test runs
    _baseline_then_layout(tp, cp)

@pytest.mark.parametrize("pp_size", [8])
def test_layout_parsing(pp_size):
    # a layout parsed, no parallel state: runs in any world
    assert pp_size == 8

@pytest.mark.parametrize("tp,pp", [(1, 4)])
def test_faked_layout(tp, pp):
    # Megatron's layout tests fake the ranks (fake_initialize_model_parallel): one process serves
    Utils.fake_initialize_model_parallel(tp, pp)

class TestSetUpOnce:
    # Megatron's TestDynamicContext: the parallel state is set up once for the class; a test tears
    # it down for a bigger layout (Utils.initialize_model_parallel destroys first)
    def test_asks_for_more_ranks(self):
        Utils.calls.append("destroyed")
        Utils.initialize_model_parallel(1, 4)

    def test_next_finds_a_parallel_state(self):
        assert Utils.calls[-1] == (1, 1, {}), Utils.calls[-3:]

    def test_sets_up_a_calculator_then_asks_for_more_ranks(self):
        # test_pipeline_layout: its own unset_num_microbatches_calculator() is never reached
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
        init_num_microbatches_calculator(0, None, 1, 1, 1)
        Utils.initialize_model_parallel(1, 4)

    def test_next_can_set_up_its_calculator(self):
        from megatron.core.num_microbatches_calculator import (
            init_num_microbatches_calculator, unset_num_microbatches_calculator)
        init_num_microbatches_calculator(0, None, 1, 1, 1)
        unset_num_microbatches_calculator()

class MoEModelTestContainer:
    # Megatron's (tests/unit_tests/transformer/moe/test_token_dispatcher.py) destroys the parallel
    # state in __del__
    def __init__(self):
        self.me = self                       # a reference cycle: only the cyclic GC frees it
    def __del__(self):
        Utils.calls.append("container collected")

def test_leaves_a_container_in_a_cycle():
    MoEModelTestContainer()

def test_after_the_container():
    assert Utils.calls[-1] == "container collected", Utils.calls[-3:]

def test_listed_in_the_skip_table():
    raise AssertionError("the skip table should have skipped this")

def test_destroy_frees_the_groups():
    # Megatron's destroy_model_parallel() forgets its gloo groups; each keeps threads alive
    import os, torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_adapt.apps.ports import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        before = len(os.listdir("/proc/self/task"))
        for _ in range(3):
            ps.initialize_model_parallel(1, 1)
            ps.destroy_model_parallel()
        after = len(os.listdir("/proc/self/task"))
        assert after < before + 10, (before, after)
    finally:
        dist.destroy_process_group()

_LEFT_BEHIND = []

def test_leaves_a_ddp_held_by_its_hooks():
    # Megatron's DDP hooks each parameter's AccumulateGrad node with a closure over the DDP; a module
    # that keeps a forward output (the MoE token dispatchers keep local_probs) holds that graph: a
    # cycle through C++ autograd nodes that Python's cyclic GC does not see
    import weakref, torch, torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_adapt.apps.ports import free_port

    class KeepsItsOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
        def forward(self, x):
            self.kept = self.linear(x)
            return self.kept

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), KeepsItsOutput())
        ddp(torch.ones(2, 4))
        _LEFT_BEHIND.append(weakref.ref(ddp.module))
        _LEFT_BEHIND.append(ddp)          # still referenced here: must survive the release
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()

def test_after_the_ddp():
    kept_module, kept_ddp = _LEFT_BEHIND
    assert kept_ddp.module is not None    # a DDP Python still holds is left alone
    _LEFT_BEHIND.clear()
    assert kept_module() is kept_ddp.module

def test_after_letting_the_ddp_go():
    # the previous test dropped the last Python reference; its teardown released the cycle
    import gc
    gc.collect()
    from megatron.core.distributed import DistributedDataParallel
    alive = [o for o in gc.get_referrers(DistributedDataParallel) if isinstance(o, DistributedDataParallel)]
    assert not alive, alive

from megatron.core.hyper_comm_grid import HyperCommGrid

class TestGridOfEight:
    # Megatron's 8-GPU tests build their grids in setup_class, outside Utils
    @classmethod
    def setup_class(cls):
        cls.grid = HyperCommGrid(shape=[4, 2], dim_names=["tp", "dp"])

    def test_on_the_grid(self):
        raise AssertionError("setup_class should have raised")

def test_oversized_grid_is_the_tested_error():
    with pytest.raises(RuntimeError, match="is over sized"):
        HyperCommGrid(shape=[4, 2], dim_names=["tp", "dp"])

def test_other_runtime_errors_stay_failures():
    raise RuntimeError("Grid shape [4, 2] is over sized with world size 2 (raised by the test itself)")
"""

# A module of TE_CLASS_TESTS: the TE class names it imports inside a test are the provider's classes
TE_CLASSES_MODULE = """
import megatron.core.extensions.transformer_engine as te_ext

BEFORE = te_ext.TEColumnParallelLinear

class TestMLAQKNormResolution:
    def test_te_names_are_the_classes_the_model_was_built_from(self):
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
        from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider
        provider = TESpecProvider()
        assert TEColumnParallelLinear is provider.column_parallel_linear()
        assert TENorm is provider.layer_norm()

def test_the_names_are_restored_after_the_test():
    assert te_ext.TEColumnParallelLinear is BEFORE
"""

# A module of TE_CLASS_MODULES: the names it imports at module level are the provider's classes
TE_CLASSES_AT_IMPORT = """
from megatron.core.extensions.transformer_engine import TERowParallelLinear

def test_imported_name_is_the_providers():
    from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider
    assert TERowParallelLinear is TESpecProvider().row_parallel_linear()
"""

TE_LIBRARY_MODULE = """
from transformer_engine.pytorch.float8_tensor import Float8Tensor

def test_checkpoints_te_tensors():
    raise AssertionError("a module that cannot import never runs")
"""


# Megatron's TempNamedDir in miniature: one named directory for every rank, removed by rank 0's
# cleanup(), with the removing finalizer registered on every rank
TEMP_NAMED_DIR = """
import os
import weakref
from tempfile import TemporaryDirectory

from tests.unit_tests.test_utilities import Utils


class TempNamedDir(TemporaryDirectory):
    def __init__(self, name, sync=True):
        self.name = str(name)
        os.makedirs(self.name, exist_ok=True)
        self._ignore_cleanup_errors = False
        self._finalizer = weakref.finalize(self, self._cleanup, self.name, warn_message="implicit")

    def cleanup(self):
        if Utils.rank == 0:
            super().cleanup()

    def __exit__(self, *exc):
        self.cleanup()
"""
# a test that takes the default process group as given (listed in NEEDS_DEFAULT_GROUP), and one that is not
DEFAULT_GROUP_MODULE = """
from tests.unit_tests.test_utilities import Utils


class TestHyperCommGrid:
    def test_finds_the_default_group_made(self):
        assert Utils.calls.count("initialize_distributed") == 1, Utils.calls


class TestHyperCommGridIntegration:
    def test_is_not_listed(self):
        assert Utils.calls.count("initialize_distributed") == 1, Utils.calls
"""
SHARED_DIR_MODULE = """
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils


def test_a_later_rank_leaves_the_shared_dir_to_rank_0(tmp_path):
    Utils.rank = 1
    try:
        with TempNamedDir(tmp_path / "shared", sync=False):
            pass
        assert (tmp_path / "shared").is_dir()
    finally:
        Utils.rank = 0


def test_rank_0_removes_the_shared_dir(tmp_path):
    with TempNamedDir(tmp_path / "shared", sync=False):
        pass
    assert not (tmp_path / "shared").exists()
"""


def make_tree(root):
    files = {"tests/__init__.py": "", "tests/unit_tests/__init__.py": "",
             "tests/unit_tests/conftest.py": CONFTEST, "tests/unit_tests/download.py": DOWNLOAD,
             "tests/unit_tests/test_utilities.py": UTILITIES,
             "tests/unit_tests/models/__init__.py": "",
             "tests/unit_tests/models/test_gpt_model.py": TEST_MODULE,
             "tests/unit_tests/models/test_hybrid_model.py": TE_CLASSES_MODULE,
             "tests/unit_tests/models/mimo/__init__.py": "",
             "tests/unit_tests/models/mimo/test_mimo_1f1b_schedule.py": TE_CLASSES_AT_IMPORT,
             # imports TE's own library at module level: a [te] entry of the real skip table turns
             # its import error into a skip
             "tests/unit_tests/dist_checkpointing/__init__.py": TEMP_NAMED_DIR,
             "tests/unit_tests/dist_checkpointing/test_shared_dir.py": SHARED_DIR_MODULE,
             "tests/unit_tests/test_hyper_comm_grid.py": DEFAULT_GROUP_MODULE,
             "tests/unit_tests/dist_checkpointing/test_fp8.py": TE_LIBRARY_MODULE}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def run_pytest(root, *args, launcher=True, **env):
    cmd = ([LAUNCHER] if launcher else []) + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                              "-rs", *args, "tests/unit_tests"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_ADAPT_BACKEND": "cpu",
                "MEGATRON_ADAPT_QUIET": "1", "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
    full_env.pop("MEGATRON_LM_PATH", None)
    full_env.pop("MEGATRON_ADAPT_AUTO", None)
    full_env.update(env)
    return subprocess.run(cmd, cwd=root, env=full_env, capture_output=True, text=True, timeout=300)


def test_plugin_serves_megatrons_test_layout(tmp_path, monkeypatch):
    make_tree(tmp_path)
    # the same import in a module the skip table does not list stays a collection error
    (tmp_path / "tests/unit_tests/dist_checkpointing/test_unlisted_te.py").write_text(TE_LIBRARY_MODULE)
    # a listed module that imports another test module which imports TE's fp8 names (Megatron's
    # test_dynamic_sink_attention_e2e imports test_dynamic_engine); collected before that module
    (tmp_path / "tests/unit_tests/inference").mkdir()
    (tmp_path / "tests/unit_tests/inference/__init__.py").write_text("")
    (tmp_path / "tests/unit_tests/inference/test_dynamic_sink_attention_e2e.py").write_text(
        "from tests.unit_tests.models.test_gpt_model import check_fp8_support\n\n"
        "def test_imports_a_te_importing_test_module():\n    assert check_fp8_support()[0] is False\n")
    # A skip-table entry for one test of this tree, as the real table has for Megatron's files.
    table = tmp_path / "extra_skip.py"
    table.write_text(textwrap.dedent("""
        from megatron_adapt.apps import pytest_plugin as p
        p.SKIPS.append(p.Skip("tests/unit_tests/models/test_gpt_model.py::test_listed_in_*", "te",
                              "exercises a TE module"))
    """))
    proc = run_pytest(tmp_path, "-p", "extra_skip", "-p", "megatron_adapt.apps.pytest_plugin",
                      "--continue-on-collection-errors",
                      "--megatron-adapt-json", str(tmp_path / "out" / "rank{rank}.json"),
                      PYTHONPATH=str(tmp_path))
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]  # the one meant to fail
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert report["backend"] == "cpu" and report["world_size"] == 2
    tests = {k.split("::", 1)[1]: v for k, v in report["tests"].items() if "::" in k}
    for name in ("test_no_te_package_is_left_behind", "test_fp8_is_not_available", "test_download_refused",
                 "test_layouts[2-1]", "test_layouts[1-2]"):
        assert tests[name]["outcome"] == "passed", (name, tests[name])
    for name, need in (("test_layouts[4-1]", "TP4 x PP1 x CP1 needs a world size divisible by 4"),
                       ("test_layouts[2-2]", "divisible by 4"), ("test_expert_layout", "EP4 x ETP1 x PP1"),
                       ("test_distributed_optimizer_instances[4]", "4 distributed-optimizer instances needs a world size divisible by 4")):
        assert tests[name]["outcome"] == "skipped" and need in tests[name]["reason"], (name, tests[name])
        assert tests[name]["reason"].startswith("[ranks]"), tests[name]
    assert tests["test_distributed_optimizer_instances[2]"]["outcome"] == "passed", tests
    assert tests["test_baseline_first[2-1]"]["outcome"] == "passed", tests
    param_skip = tests["test_baseline_first[1-4]"]
    assert param_skip["outcome"] == "skipped" and "parametrised TP1 x PP1 x CP4" in param_skip["reason"], param_skip
    assert tests["test_faked_layout[1-4]"]["outcome"] == "passed", tests
    assert tests["TestSetUpOnce::test_asks_for_more_ranks"]["outcome"] == "skipped", tests
    assert tests["TestSetUpOnce::test_next_finds_a_parallel_state"]["outcome"] == "passed", tests
    assert tests["TestSetUpOnce::test_sets_up_a_calculator_then_asks_for_more_ranks"]["outcome"] == "skipped", tests
    assert tests["TestSetUpOnce::test_next_can_set_up_its_calculator"]["outcome"] == "passed", tests
    assert tests["test_after_the_container"]["outcome"] == "passed", tests["test_after_the_container"]
    assert tests["test_destroy_frees_the_groups"]["outcome"] == "passed", tests["test_destroy_frees_the_groups"]
    for name in ("test_leaves_a_ddp_held_by_its_hooks", "test_after_the_ddp", "test_after_letting_the_ddp_go"):
        assert tests[name]["outcome"] == "passed", (name, tests[name])
    assert tests["test_layout_parsing[8]"]["outcome"] == "passed", tests
    assert tests["test_imports_a_te_importing_test_module"]["outcome"] == "passed", tests
    # Megatron's shared checkpoint directory: removed by rank 0 only (the finalizer of the other
    # ranks removed it at the end of their `with` blocks)
    for name in ("TestHyperCommGrid::test_finds_the_default_group_made",
                 "TestHyperCommGridIntegration::test_is_not_listed",
                 "test_a_later_rank_leaves_the_shared_dir_to_rank_0", "test_rank_0_removes_the_shared_dir"):
        assert tests[name]["outcome"] == "passed", (name, tests[name])
    te_classes = {k: v for k, v in report["tests"].items() if "test_hybrid_model.py" in k}
    assert len(te_classes) == 2 and all(v["outcome"] == "passed" for v in te_classes.values()), te_classes
    at_import = {k: v for k, v in report["tests"].items() if "test_mimo_1f1b_schedule.py" in k}
    assert [v["outcome"] for v in at_import.values()] == ["passed"], at_import
    grid_skip = tests["TestGridOfEight::test_on_the_grid"]
    assert grid_skip["outcome"] == "skipped" and grid_skip["reason"].startswith("[ranks]"), grid_skip
    assert "hyper_comm_grid.py says \"Grid shape [4, 2] is over sized with world size 2" in grid_skip["reason"], grid_skip
    assert tests["test_oversized_grid_is_the_tested_error"]["outcome"] == "passed", tests
    assert tests["test_other_runtime_errors_stay_failures"]["outcome"] == "failed", tests
    skipped = tests["test_listed_in_the_skip_table"]
    assert skipped["outcome"] == "skipped" and skipped["reason"].startswith("[te] needs Transformer Engine"), skipped
    te_library = report["tests"]["tests/unit_tests/dist_checkpointing/test_fp8.py"]
    assert te_library["outcome"] == "skipped" and "Float8Tensor" in te_library["reason"], te_library
    assert te_library["reason"].startswith("[te] needs Transformer Engine"), te_library
    unlisted = report["tests"]["tests/unit_tests/dist_checkpointing/test_unlisted_te.py"]
    assert unlisted["outcome"] == "error" and "transformer_engine" in unlisted["message"], unlisted


def test_plugin_is_inert_unless_enabled(tmp_path):
    make_tree(tmp_path)
    proc = run_pytest(tmp_path)
    assert proc.returncode != 0 and "No module named 'transformer_engine'" in proc.stdout, proc.stdout[-3000:]
    assert "the network was used" not in proc.stdout or "no downloads" not in proc.stdout


def test_plugin_refuses_without_megatron_adapt_applied(tmp_path):
    """`import megatron_adapt` (the plugin's own import) applies; MEGATRON_ADAPT_AUTO=0 says not to."""
    make_tree(tmp_path)
    proc = run_pytest(tmp_path, "-p", "megatron_adapt.apps.pytest_plugin", launcher=False, MEGATRON_ADAPT_AUTO="0")
    assert proc.returncode != 0 and "megatron-adapt is not applied" in proc.stderr, proc.stderr[-3000:]


def test_skip_table_entries_are_well_formed_and_give_a_reason():
    assert pytest_plugin.SKIPS, "the skip table is empty"
    for s in pytest_plugin.SKIPS:
        assert s.pattern.startswith("tests/unit_tests/") and "::" in s.pattern or s.pattern.endswith(".py"), s
        assert len(s.reason) > 20, s
    with pytest.raises(ValueError, match="unknown skip category"):
        pytest_plugin.Skip("tests/unit_tests/x.py", "flaky", "no such category")


def test_a_memory_skip_applies_only_on_a_host_with_less_memory(monkeypatch):
    big = pytest_plugin.Skip("tests/unit_tests/x.py::test_big", "memory", "needs 53 GB of host memory for 2 ranks",
                             backends=("cpu",), needs_host_gb=64)
    monkeypatch.setattr(pytest_plugin, "SKIPS", [big])
    from megatron_adapt.versions import megatron_core_version
    version = megatron_core_version()
    mem_total_kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal:")).split()[1])
    assert abs(pytest_plugin.host_memory_gb() - mem_total_kb * 1024 / 1e9) < 0.05 * pytest_plugin.host_memory_gb()
    monkeypatch.setattr(pytest_plugin, "host_memory_gb", lambda: 24.0)
    assert pytest_plugin.skips_for("cpu", version) == [big]
    assert pytest_plugin.skips_for("cuda", version) == []
    monkeypatch.setattr(pytest_plugin, "host_memory_gb", lambda: 251.0)
    assert pytest_plugin.skips_for("cpu", version) == []


LIFTED_MODULE = """
import pytest
from megatron.core.utils import is_te_min_version

@pytest.mark.skipif(not is_te_min_version("1.7.0.dev0"),
                    reason="Expert with TE Linear is only supported in TE 1.7.0 and later.")
def test_served():
    pass

@pytest.mark.skipif(not is_te_min_version("1.9.0.dev0"),
                    reason="TE Grouped MLP is only supported in TE 1.9.0.dev0 and later.")
class TestServedClass:
    def test_in_class(self):
        pass

@pytest.mark.skipif(not is_te_min_version("1.5.0"),
                    reason="use_te_rng_tracker requires TransformerEngine version >= 1.5")
def test_not_served():
    pass

@pytest.mark.skipif(True, reason="CUDA not available")
@pytest.mark.skipif(not is_te_min_version("1.7.0"),
                    reason="Transformer Engine under v1.7.0 doesn't support MoE training.")
def test_served_but_another_skipif_holds():
    pass
"""


def test_megatrons_te_version_skipifs_for_served_features_are_lifted(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "tests/unit_tests/models/test_lifted.py").write_text(textwrap.dedent(LIFTED_MODULE))
    proc = run_pytest(tmp_path, "-p", "megatron_adapt.apps.pytest_plugin",
                      "--megatron-adapt-json", str(tmp_path / "out" / "rank{rank}.json"))
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    mod = "tests/unit_tests/models/test_lifted.py::"
    tests = {k[len(mod):]: v for k, v in report["tests"].items() if k.startswith(mod)}
    assert tests["test_served"]["outcome"] == "passed", (tests, proc.stdout[-3000:])
    assert tests["TestServedClass::test_in_class"]["outcome"] == "passed", tests
    assert tests["test_not_served"] == {"outcome": "skipped",
                                       "reason": "use_te_rng_tracker requires TransformerEngine version >= 1.5"}
    assert tests["test_served_but_another_skipif_holds"] == {"outcome": "skipped", "reason": "CUDA not available"}
    lifted = {k[len(mod):]: v for k, v in report["lifted_skipifs"].items() if k.startswith(mod)}
    assert lifted == {
        "test_served": ["Expert with TE Linear is only supported in TE 1.7.0 and later."],
        "TestServedClass::test_in_class": ["TE Grouped MLP is only supported in TE 1.9.0.dev0 and later."],
        "test_served_but_another_skipif_holds": ["Transformer Engine under v1.7.0 doesn't support MoE training."]}


def test_a_conditional_skip_applies_only_while_its_condition_holds(monkeypatch):
    from megatron_adapt.versions import megatron_core_version
    version = megatron_core_version()
    state = {"lacks": True}
    cond = pytest_plugin.Skip("tests/unit_tests/x.py::test_profiled", "torch", "reads a newer torch's profiler field",
                              backends=("cuda",), when=lambda: state["lacks"])
    monkeypatch.setattr(pytest_plugin, "SKIPS", [cond])
    assert pytest_plugin.skips_for("cuda", version) == [cond]
    state["lacks"] = False
    assert pytest_plugin.skips_for("cuda", version) == []
    # the real check: this machine's torch (2.13) has the field, so the mfsdp_v2 entries do not apply here
    from torch.autograd.profiler_util import FunctionEvent
    has = "linked_correlation_id" in inspect.signature(FunctionEvent.__init__).parameters
    assert pytest_plugin.torch_profiler_lacks_linked_correlation_id() is (not has)


def test_a_test_past_its_time_limit_fails_and_the_run_goes_on(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "tests" / "unit_tests" / "test_slow.py").write_text(textwrap.dedent("""
        import time

        def test_hangs():
            time.sleep(120)

        def test_after():
            pass
    """))
    proc = run_pytest(tmp_path, "-p", "megatron_adapt.apps.pytest_plugin", "--megatron-adapt-test-timeout", "3",
                      "--megatron-adapt-json", str(tmp_path / "out" / "rank{rank}.json"), "-k", "slow")
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    tests = {k.split("::", 1)[1]: v for k, v in report["tests"].items() if "::" in k}
    assert tests["test_hangs"]["outcome"] == "failed", tests
    assert "ran past its time limit of 3 s" in tests["test_hangs"]["message"], tests["test_hangs"]
    assert tests["test_after"]["outcome"] == "passed" and report["finished"], tests
    assert proc.returncode == 1, proc.stdout[-3000:]


def test_a_listed_slow_test_gets_its_own_longer_limit(tmp_path):
    """SLOW raises the limit for the tests listed there (by their real node ids), on their backend only;
    the run's limit still stops every other test."""
    make_tree(tmp_path)
    (tmp_path / "tests/unit_tests/transformer").mkdir()
    (tmp_path / "tests/unit_tests/transformer/__init__.py").write_text("")
    (tmp_path / "tests/unit_tests/transformer/test_transformer_block_custom_pgs.py").write_text(textwrap.dedent("""
        import time
        import pytest

        class TestTransformerBlockWithProcessGroups:
            @pytest.mark.parametrize("world_size, tp_size, cp_size, dp_size", [(2, 2, 1, 1), (1, 1, 1, 1)])
            def test_params_and_grads_match_transformer_block(self, world_size, tp_size, cp_size, dp_size):
                time.sleep(6)
    """))
    proc = run_pytest(tmp_path, "-p", "megatron_adapt.apps.pytest_plugin", "--megatron-adapt-test-timeout", "3",
                      "--megatron-adapt-json", str(tmp_path / "out" / "rank{rank}.json"), "-k", "custom_pgs")
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    tests = {k.rsplit("[", 1)[1]: v for k, v in report["tests"].items() if "[" in k}
    assert tests["2-2-1-1]"]["outcome"] == "passed", (tests, proc.stdout[-2000:])
    assert tests["1-1-1-1]"]["outcome"] == "failed" and "time limit of 3 s" in tests["1-1-1-1]"]["message"], tests
    name = ("tests/unit_tests/transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups::"
            "test_params_and_grads_match_transformer_block[2-1-2-1]")
    assert pytest_plugin.time_limit(name, 150, "cpu") == 1500
    assert pytest_plugin.time_limit(name.replace("2-1-2-1", "2-2-1-1"), 150, "cpu") == 900
    assert pytest_plugin.time_limit(name, 150, "cuda") == 150
    assert pytest_plugin.time_limit(name, 0, "cpu") == 0
    assert pytest_plugin.time_limit(name.replace("2-1-2-1", "8-2-2-2"), 150, "cpu") == 150


def test_deselected_tests_are_recorded(tmp_path):
    """scripts/megatron_unit_tests.py passes Megatron CI's own selection (-m "not flaky_in_dev"); the
    tests it leaves out are listed in the JSON, not silently absent."""
    make_tree(tmp_path)
    (tmp_path / "tests" / "unit_tests" / "test_marked.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.flaky_in_dev
        def test_flaky_in_dev():
            raise AssertionError("deselected, never run")

        def test_runs():
            pass
    """))
    proc = run_pytest(tmp_path, "-p", "megatron_adapt.apps.pytest_plugin", "-m", "not flaky_in_dev",
                      "-W", "ignore::pytest.PytestUnknownMarkWarning",
                      "--megatron-adapt-json", str(tmp_path / "out" / "rank{rank}.json"), "-k", "marked")
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    marked = [n for n in report["deselected"] if "test_marked.py" in n]   # (-k deselects the rest)
    assert marked == ["tests/unit_tests/test_marked.py::test_flaky_in_dev"], report["deselected"]
    assert report["markexpr"] == "not flaky_in_dev", report
    assert report["tests"]["tests/unit_tests/test_marked.py::test_runs"]["outcome"] == "passed", proc.stdout[-2000:]


def test_the_script_runs_megatrons_dev_environment(monkeypatch):
    """With Megatron CI's dev selection, the runs set NVIDIA_PYTORCH_VERSION above 25.05, which the
    tests that skip themselves "for LTS test" read (a value the caller set is kept)."""
    import argparse
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "megatron_unit_tests.py")
    spec = importlib.util.spec_from_file_location("megatron_unit_tests_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.delenv("NVIDIA_PYTORCH_VERSION", raising=False)
    dev = argparse.Namespace(backend="cpu", marker=script.MEGATRON_CI_MARKER)
    assert script.run_environment(dev, "/lm")["NVIDIA_PYTORCH_VERSION"] == script.DEV_NGC_RELEASE
    assert "NVIDIA_PYTORCH_VERSION" not in script.run_environment(argparse.Namespace(backend="cpu", marker=""), "/lm")
    monkeypatch.setenv("NVIDIA_PYTORCH_VERSION", "24.01")
    assert script.run_environment(dev, "/lm")["NVIDIA_PYTORCH_VERSION"] == "24.01"


def test_nvlink_multicast_off_reads_the_machines_switches(monkeypatch):
    """The NVLS dispatcher's multicast test is a [cuda] skip only where multicast is turned off."""
    for name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    assert not pytest_plugin.nvlink_multicast_off()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert pytest_plugin.nvlink_multicast_off()
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert pytest_plugin.nvlink_multicast_off()
    from megatron_adapt.versions import megatron_core_version
    node = ("tests/unit_tests/inference/test_moe_dispatching_and_routing.py::TestNVLSAllGatherVDispatcher::"
            "test_cuda_graph_dispatch_combine[1-42]")
    reason = pytest_plugin.skip_reason(node, pytest_plugin.skips_for("cuda", megatron_core_version()))
    assert reason.startswith("[cuda]") and "multicast" in reason


def test_dsa_tests_of_both_layouts_see_the_providers_te_classes():
    """DSA's tests build the indexer from TELinear / TENorm imported in setup: core 0.19 keeps them under
    experimental_attention_variant/, core 0.16 in transformer/ (found at 2 ranks on cuda, 2026-11-28)."""
    for path in ("transformer/experimental_attention_variant/test_attention_variant_dsa.py",
                 "transformer/test_attention_variant_dsa.py"):
        item = types.SimpleNamespace(nodeid=f"tests/unit_tests/{path}::TestDSAIndexer::test_dsa_indexer_forward[16]")
        assert not isinstance(pytest_plugin._te_classes_for(item), contextlib.nullcontext), path


def test_the_oom_fallback_test_is_skipped_only_on_a_host_short_for_its_ranks(monkeypatch):
    """Megatron's test_oom_is_handled needs ~1.2 x a GPU's memory per rank on the host: skipped on
    cuda where the host has less for the run's ranks (a 125 GiB host with one 141 GB H200), run where it
    has enough (2 ranks on a 251 GB host with two 80 GB H100s); never on a machine without a GPU."""
    gpu = {"gb": 141.0}
    monkeypatch.setattr(pytest_plugin, "gpu_memory_gb", lambda: gpu["gb"])
    for host, world, short in [(134.0, "1", True), (251.0, "1", False), (251.0, "2", True)]:
        monkeypatch.setattr(pytest_plugin, "host_memory_gb", lambda host=host: host)
        monkeypatch.setenv("WORLD_SIZE", world)
        assert pytest_plugin.host_short_for_the_oom_fallback() is short, (host, world)
    gpu["gb"] = 80.0
    assert pytest_plugin.host_short_for_the_oom_fallback() is False       # 2 ranks x 96 GB < 251
    gpu["gb"] = None
    assert pytest_plugin.host_short_for_the_oom_fallback() is False
    node = "tests/unit_tests/dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled"
    assert pytest_plugin.time_limit(node, 150, "cuda") == 900 and pytest_plugin.time_limit(node, 150, "cpu") == 150


def test_gpu_memory_is_read_from_nvidia_smi_and_none_without_it(monkeypatch):
    def smi(cmd, **kw):
        assert cmd[0] == "nvidia-smi"
        return types.SimpleNamespace(stdout="81559\n143771\n")
    monkeypatch.setattr(pytest_plugin.subprocess, "run", smi)
    assert pytest_plugin.gpu_memory_gb() == pytest.approx(143771 * 2**20 / 1e9)

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(pytest_plugin.subprocess, "run", missing)
    assert pytest_plugin.gpu_memory_gb() is None

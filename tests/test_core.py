"""The core: backend selection, version gate, strict mode, signature checks, launcher, report.
Bad input must give a clear error and leave nothing patched."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from adapt_testutil import run_python

NOTHING_PATCHED = textwrap.dedent("""
    import torch, torch.distributed as dist
    from megatron_adapt import applier, core
    assert not applier.installed(), applier.installed()
    assert core.active_backend() is None
    assert 'megatron_adapt' not in getattr(torch.cuda.set_device, '__module__', '')
    assert 'megatron_adapt' not in getattr(dist.init_process_group, '__module__', '')
    print('NOTHING-PATCHED')
""")


def expect_error(setup: str, env=None):
    code = "import megatron_adapt\ntry:\n" + textwrap.indent(setup, "    ") + \
        "\nexcept Exception as exc:\n    print('ERROR:', type(exc).__name__, exc)\nelse:\n    print('NO ERROR')\n" + NOTHING_PATCHED
    proc = run_python(code, env=env)
    assert "NOTHING-PATCHED" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_unknown_backend_lists_the_choices():
    out = expect_error("megatron_adapt.apply('tpu')")
    assert "UnknownBackendError" in out and "auto, cpu, cuda, npu" in out, out


def test_unknown_backend_from_environment_fails_at_import():
    proc = run_python("import megatron_adapt", env={"MEGATRON_ADAPT_AUTO": "1", "MEGATRON_ADAPT_BACKEND": "gpu"},
                      check=False)
    assert proc.returncode != 0 and "unknown backend 'gpu'" in proc.stderr, proc.stderr[-2000:]


def test_cuda_requested_without_gpu_fails_clearly():
    out = expect_error("megatron_adapt.apply('cuda')")
    assert "BackendUnavailableError" in out and "no CUDA device" in out, out


def test_npu_requested_without_torch_npu_fails_clearly():
    out = expect_error("megatron_adapt.apply('npu')")
    assert "BackendUnavailableError" in out and "torch_npu" in out, out


def test_auto_picks_cpu_here():
    proc = run_python("import megatron_adapt; print(megatron_adapt.apply().name)")
    assert proc.stdout.strip().endswith("cpu")


def fake_megatron(root, version: str, files: dict | None = None):
    """A `megatron.core` package of the given version (package_info.py) with `files` in it."""
    major, minor, patch = version.split(".")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    for name, text in (files or {}).items():
        path = core / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return {"PYTHONPATH": str(root)}


def test_unsupported_megatron_version_names_the_range(tmp_path):
    out = expect_error("megatron_adapt.apply('cpu')", env=fake_megatron(tmp_path, "0.99.0"))
    assert "UnsupportedMegatronVersionError" in out and "0.99.0" in out and ">=0.15.0,<0.20.0" in out, out
    assert "MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON=1" in out, out  # newer: the opt-in is named


def test_an_older_megatron_cannot_be_opted_into(tmp_path):
    env = {**fake_megatron(tmp_path, "0.14.0"), "MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON": "1"}
    out = expect_error("megatron_adapt.apply('cpu')", env=env)
    assert "UnsupportedMegatronVersionError" in out and "0.14.0" in out, out
    assert "ALLOW_UNTESTED" not in out, out  # the opt-in is for newer releases only


def test_opt_in_to_a_newer_megatron_warns_once_and_reports_targets_not_found(tmp_path):
    """An untested newer release is patched as the newest supported one: present targets apply,
    missing ones are listed (nothing raises), and the loud warning comes once per process."""
    env = fake_megatron(tmp_path, "0.20.0", {
        "jit.py": "jit_fuser = lambda f: f\n",                  # present: applies
        "fusions/fused_softmax.py": "class SomethingElse: pass\n",  # FusedScaleMaskSoftmax gone
    })
    env["MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON"] = "1"
    proc = run_python(textwrap.dedent("""
        import warnings, megatron_adapt
        warnings.simplefilter('always')
        megatron_adapt.apply('cpu'); megatron_adapt.revert(); megatron_adapt.apply('cpu')
        import megatron.core.jit, megatron.core.fusions.fused_softmax
        data = megatron_adapt.report(as_json=True)
        status = {p['target']: (p['status'], p['reason']) for p in data['patches']}
        print('UNTESTED', data['untested_megatron'], data['megatron_core'])
        print('JIT', status['megatron.core.jit:jit_fuser'][0])
        print('NOTFOUND', data['targets_not_found'])
        print('SOFTMAX', status['megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward'])
        print(megatron_adapt.report().splitlines()[1])
    """), env={**env, "PYTHONWARNINGS": "default"})
    out = proc.stdout
    assert "UNTESTED True 0.20.0" in out and "JIT applied" in out, out
    assert "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward" in out.split("NOTFOUND")[1], out
    assert "target not found in untested megatron-core 0.20.0" in out, out
    assert out.splitlines()[-1].startswith("WARNING: megatron-core 0.20.0 is newer than the tested range"), out
    assert proc.stderr.count("is NEWER than the tested range") == 1, proc.stderr


def test_a_target_changed_between_releases_gets_the_spec_of_its_range():
    """One spec per release range for the same target: the applier installs the one whose range
    holds the running megatron-core, and overlapping ranges are refused."""
    from packaging.version import Version

    from megatron_adapt.applier import select
    from megatron_adapt.errors import PatchError
    from megatron_adapt.spec import PatchSpec

    old = PatchSpec("megatron.core.x:f", area="x", build=lambda b, o: o, versions=">=0.15.0,<0.19.0")
    new = PatchSpec("megatron.core.x:f", area="x", build=lambda b, o: o, versions=">=0.19.0,<0.20.0")
    assert select([old, new], Version("0.16.1")) == [old]
    assert select([old, new], Version("0.19.2")) == [new]
    assert select([old, new], Version("0.14.0")) == [old]  # none fits: recorded as skipped by range
    both = PatchSpec("megatron.core.x:f", area="x", build=lambda b, o: o, versions=">=0.18.0")
    with pytest.raises(PatchError, match="overlapping"):
        select([old, new, both], Version("0.19.2"))


def test_every_changed_target_has_a_spec_for_every_supported_release_line():
    """No release line in SUPPORTED falls between two per-version specs of one target."""
    from packaging.version import Version

    from megatron_adapt.applier import select
    from megatron_adapt.core import all_specs
    from megatron_adapt.versions import SUPPORTED, in_range

    specs = all_specs()
    for line in ("0.15.0", "0.16.0", "0.17.0", "0.18.0", "0.19.0", "0.19.9"):
        assert Version(line) in SUPPORTED
        for spec in select(specs, Version(line)):
            multi = [s for s in specs if s.target == spec.target]
            if len(multi) > 1:
                assert in_range(spec.versions, Version(line)), (line, spec.target, [s.versions for s in multi])


def test_strict_mode_turns_a_fallback_into_an_error_naming_op_and_reason():
    code = textwrap.dedent("""
        import megatron_adapt, torch
        megatron_adapt.apply('cpu', strict=True)
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import attention_mask_func
        sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None)
        try:
            sm(torch.randn(1, 2, 4, 4), None, softmax_offset=torch.zeros(2))
        except megatron_adapt.StrictFallbackError as exc:
            print('STRICT:', exc)
    """)
    out = run_python(code).stdout
    assert "STRICT: scaled_masked_softmax: fell back" in out and "softmax_offset" in out, out


def test_fallback_without_strict_is_reported():
    code = textwrap.dedent("""
        import megatron_adapt, torch
        megatron_adapt.apply('cpu')
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import attention_mask_func
        sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None)
        sm(torch.randn(1, 2, 4, 4), None, softmax_offset=torch.zeros(2))
        print(megatron_adapt.report())
    """)
    out = run_python(code).stdout
    assert "FELL BACK: softmax_offset" in out, out


def test_signature_check_rejects_a_narrower_replacement():
    from megatron_adapt.applier import signature_problem

    def original(a, b=1, *, c=2):
        pass

    assert signature_problem(original, lambda a, b=1, *, c=2: 0) is None
    assert signature_problem(original, lambda a, **kw: 0) is not None  # b positional lost
    assert "c" in signature_problem(original, lambda a, b=1: 0)
    assert "optional" in signature_problem(original, lambda a, b, *, c=2: 0)
    assert signature_problem(original, lambda *args, **kwargs: 0) is None


def test_spec_outside_its_version_range_is_skipped_with_reason():
    code = textwrap.dedent("""
        import megatron_adapt
        from megatron_adapt import applier, report
        from megatron_adapt.spec import PatchSpec
        from megatron_adapt.config import Config
        from megatron_adapt.versions import megatron_core_version
        from megatron_adapt.backends import load
        import megatron.core.utils
        spec = PatchSpec('megatron.core.utils:is_te_min_version', area='x', build=lambda b, o: o,
                         versions='>=0.99')
        applier.apply_spec(spec, load('cpu'), Config(), megatron_core_version())
        rec = report.patch_record(spec)
        print(rec.status, '|', rec.reason)
    """)
    out = run_python(code).stdout
    assert out.startswith("skipped |") and "outside >=0.99" in out, out


def test_report_cli_and_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_adapt.cli", "report", "--json"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["backend"] == "cpu" and data["megatron_core"]
    statuses = {p["target"]: p["status"] for p in data["patches"]}
    assert statuses["megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward"] == "applied"
    assert not [t for t, s in statuses.items() if s in ("failed", "pending")], statuses


def test_launcher_patches_every_python_process_it_starts(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys
        import megatron_adapt
        from megatron_adapt import core
        print('PARENT', core.active_backend().name)
        out = subprocess.run([sys.executable, '-c', 'from megatron_adapt import core; print(core.active_backend().name)'],
                             capture_output=True, text=True).stdout
        print('CHILD', out.strip())
    """))
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_ADAPT_AUTO"}
    env.update(PYTHONWARNINGS="ignore", MEGATRON_ADAPT_REPORT=str(report_path))
    proc = subprocess.run([sys.executable, "-m", "megatron_adapt.launcher", sys.executable, str(script)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PARENT cpu" in proc.stdout and "CHILD cpu" in proc.stdout, proc.stdout
    assert json.loads(report_path.read_text())["backend"] == "cpu"


def test_disable_environment_switch():
    proc = run_python("import megatron_adapt; megatron_adapt.apply('cpu');"
                      "import megatron.core.tensor_parallel as tp;"
                      "print(megatron_adapt.report(as_json=True)['patches'][0]['status'])",
                      env={"MEGATRON_ADAPT_DISABLE": "jit,softmax"})
    assert proc.stdout.strip().endswith("disabled")


def test_value_patches_sharing_a_singleton_both_apply_and_create_specs_revert_by_deleting():
    """Two flags patched to the same value (True / False are singletons) are both applied: the
    applier's "is this already ours" identity check must not mistake one for the other. A `create`
    spec binds a name the module lacks and revert deletes it again."""
    code = textwrap.dedent("""
        import types
        import megatron_adapt
        from megatron_adapt import applier, report
        from megatron_adapt.spec import PatchSpec
        from megatron_adapt.config import Config
        from megatron_adapt.versions import megatron_core_version
        from megatron_adapt.backends import load
        mod = types.ModuleType('megatron_fake_flags'); mod.A = False; mod.B = True
        import sys; sys.modules[mod.__name__] = mod
        specs = [PatchSpec('megatron_fake_flags:A', area='x', build=lambda b, o: True),
                 PatchSpec('megatron_fake_flags:B', area='x', build=lambda b, o: False),
                 PatchSpec('megatron_fake_flags:C', area='x', build=lambda b, o: ('made', o), create=True)]
        for s in specs:
            applier.apply_spec(s, load('cpu'), Config(), megatron_core_version())
        print([report.patch_record(s).status for s in specs], mod.A, mod.B, mod.C)
        applier.revert_all()
        print(mod.A, mod.B, hasattr(mod, 'C'))
    """)
    out = run_python(code).stdout.splitlines()
    assert out[-2] == "['applied', 'applied', 'applied'] True False ('made', None)", out
    assert out[-1] == "False True False", out


def test_unknown_attention_layout_fails_clearly():
    out = expect_error("megatron_adapt.apply('cpu')", env={"MEGATRON_ADAPT_AUTO": "0",
                                                           "MEGATRON_ADAPT_ATTENTION_LAYOUT": "hbs"})
    assert "ConfigError" in out and "MEGATRON_ADAPT_ATTENTION_LAYOUT='hbs'" in out and "bshd" in out, out


def test_batch_first_attention_layout_matches_megatron():
    """MEGATRON_ADAPT_ATTENTION_LAYOUT=bshd: Megatron's DotProductAttention on batch-first copies
    gives Megatron's own result (causal with the dataloader mask, and a padding mask)."""
    code = textwrap.dedent("""
        import os, torch
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533', RANK='0', WORLD_SIZE='1')
        import megatron_adapt
        megatron_adapt.apply('cpu', quiet=True)
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron_adapt import applier, report
        dist.init_process_group('gloo'); parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0)
        core = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type='self')
        orig = applier.installed()['megatron.core.transformer.dot_product_attention:DotProductAttention.forward'].original
        q, k, v = (torch.randn(16, 2, 4, 8) for _ in range(3))
        causal = torch.ones(2, 1, 16, 16, dtype=torch.bool).triu(1)
        pad = torch.rand(2, 1, 16, 16) > 0.8; pad[..., 0] = False
        ok = torch.allclose(core(q, k, v, causal), orig(core, q, k, v, causal), atol=1e-5)
        ok &= torch.allclose(core(q, k, v, pad, AttnMaskType.padding), orig(core, q, k, v, pad, AttnMaskType.padding), atol=1e-5)
        print('LAYOUT', report.as_dict()['attention_layout'], 'MATCH', bool(ok), 'CALLS', sum(report.op_counts()['attention'].values()))
    """)
    out = run_python(code, env={"MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_ATTENTION_LAYOUT": "BSH"}).stdout
    assert "LAYOUT bshd MATCH True CALLS 2" in out, out


def test_a_megatron_lm_checkout_of_another_release_line_is_named_as_a_mismatch(tmp_path):
    """tests/megatron_lm skips (naming both versions) when MEGATRON_LM_PATH's checkout is not the
    installed megatron-core's release line; a patch-level difference is no mismatch."""
    from megatron_checkout import installed_version, mismatch_reason

    installed = installed_version()
    assert installed is not None  # CI installs megatron-core
    fake_megatron(tmp_path / "same", f"{installed.major}.{installed.minor}.{installed.micro + 7}")
    fake_megatron(tmp_path / "other", f"{installed.major}.{installed.minor + 1}.0")
    assert mismatch_reason(str(tmp_path / "same")) is None
    reason = mismatch_reason(str(tmp_path / "other"))
    assert f"{installed.major}.{installed.minor + 1}.0" in reason and str(installed) in reason, reason
    assert "not a Megatron-LM checkout" in mismatch_reason(str(tmp_path))
    assert mismatch_reason(None) is None


def test_every_backend_serves_exactly_the_ops_of_the_contract():
    """Each backend's op table names exactly the ops of megatron_adapt.ops.OPS, none missing and
    none extra, and every entry loads. cuda alone leaves out the RNG state ops: Megatron's own
    CUDA RNG serves them there (the rng patch applies on cpu and npu only)."""
    import importlib

    from megatron_adapt.backends import NAMES
    from megatron_adapt.ops import OPS
    from megatron_adapt.patches import rng

    rng_ops = {"rng_get_state", "rng_set_state"}
    left_out = {"cuda": rng_ops}
    for name in NAMES:
        backend = importlib.import_module(f"megatron_adapt.backends.{name}").BACKEND
        expected = set(OPS) - left_out.get(name, set())
        assert set(backend.ops) == expected, (name, sorted(set(backend.ops) ^ expected))
        for op in backend.ops:
            assert callable(backend.op(op)), (name, op)
    rng_specs = [s for s in rng.SPECS if s.qualname.endswith("_cuda_rng_state")]
    assert len(rng_specs) == 2 and all("cuda" not in s.backends for s in rng_specs), rng_specs

"""The core: backend selection, version gate, strict mode, signature checks, launcher, report.
Bad input must give a clear error and leave nothing patched."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from adapt_testutil import free_port, run_python

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
    # one target, disjoint backends (cpu / npu replace it, cuda wraps it from 0.18): each backend its own
    cpu = PatchSpec("megatron.core.x:g", area="x", build=lambda b, o: o, backends=("cpu", "npu"))
    cuda = PatchSpec("megatron.core.x:g", area="x", build=lambda b, o: o, backends=("cuda",), versions=">=0.18.0")
    assert select([cpu, cuda], Version("0.19.2"), "cuda") == [cuda]
    assert select([cpu, cuda], Version("0.19.2"), "cpu") == [cpu]
    assert select([cpu, cuda], Version("0.16.1"), "cuda") == [cpu]   # recorded as not needed on cuda


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


def test_patch_spec_docstring_documents_exactly_its_fields():
    import dataclasses
    import re

    from megatron_adapt.spec import PatchSpec

    documented = re.findall(r"^    (\w+):", PatchSpec.__doc__, re.MULTILINE)
    assert documented == [f.name for f in dataclasses.fields(PatchSpec)], documented


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


def test_every_apply_spec_outcome_keeps_its_status_reason_and_error():
    """Each way apply_spec ends: the record's status | reason, and what it raises (strict mode, a
    replacement with a narrower signature, a site that does not take the new object)."""
    code = textwrap.dedent("""
        import sys, types
        from megatron_adapt import applier, report
        from megatron_adapt.spec import PatchSpec, SkipPatch
        from megatron_adapt.config import Config
        from megatron_adapt.versions import megatron_core_version
        from megatron_adapt.backends import load

        def f(a, b=1):
            return 'original'

        def g(a, b=1):
            return 'original'

        class Stubborn:  # a "module" whose attribute does not take the new object
            f = staticmethod(g)

            def __setattr__(self, name, value):
                pass

        mod = types.ModuleType('megatron_fake_outcomes'); mod.f = f
        sys.modules[mod.__name__] = mod
        sys.modules['megatron_fake_stubborn'] = Stubborn()
        alias = types.ModuleType('megatron_fake_alias'); alias.f_alias = f
        sys.modules[alias.__name__] = alias

        def skip(b, o):
            raise SkipPatch('not wanted here')

        def boom(b, o):
            raise RuntimeError('boom')

        def new_f(a, b=1):
            return 'new'

        cpu, version = load('cpu'), megatron_core_version()
        print(version)
        cases = [
            ('disabled', 'megatron_fake_outcomes:f', dict(build=lambda b, o: new_f), Config(disabled=frozenset({'x'})), None),
            ('backend', 'megatron_fake_outcomes:f', dict(build=lambda b, o: new_f, backends=('npu',)), Config(), None),
            ('version', 'megatron_fake_outcomes:f', dict(build=lambda b, o: new_f, versions='>=0.99'), Config(), None),
            ('missing', 'megatron_fake_outcomes:nope', dict(build=lambda b, o: new_f), Config(), None),
            ('missing-untested', 'megatron_fake_outcomes:nope', dict(build=lambda b, o: new_f), Config(), '0.99.0'),
            ('missing-optional', 'megatron_fake_absent:f', dict(build=lambda b, o: new_f, optional=True), Config(strict=True), None),
            ('missing-strict', 'megatron_fake_absent:f', dict(build=lambda b, o: new_f), Config(strict=True), None),
            ('skip', 'megatron_fake_outcomes:f', dict(build=skip), Config(strict=True), None),
            ('build', 'megatron_fake_outcomes:f', dict(build=boom), Config(), None),
            ('build-strict', 'megatron_fake_outcomes:f', dict(build=boom), Config(strict=True), None),
            ('signature', 'megatron_fake_outcomes:f', dict(build=lambda b, o: (lambda a: 0)), Config(), None),
            ('verify', 'megatron_fake_stubborn:f', dict(build=lambda b, o: new_f), Config(), None),
            ('applied', 'megatron_fake_outcomes:f', dict(build=lambda b, o: new_f), Config(), None),
            ('again', 'megatron_fake_outcomes:f', dict(build=lambda b, o: new_f), Config(), None),
            ('alias-of-ours', 'megatron_fake_alias:f_alias', dict(build=lambda b, o: new_f), Config(), None),
        ]
        for label, target, kw, config, untested in cases:
            spec = PatchSpec(target, area='x', **kw)
            try:
                applier.apply_spec(spec, cpu, config, version, untested)
                raised = '-'
            except Exception as exc:
                cause = type(exc.__cause__).__name__ if exc.__cause__ else ''
                raised = f'{type(exc).__name__}({exc}) from {cause}'
            rec = report.patch_record(spec)
            print(f'{label} | {rec.status} | {rec.reason} | {raised}')
        print('sites', report.patch_record(PatchSpec('megatron_fake_outcomes:f', area='x', build=None)).sites,
              mod.f(0), alias.f_alias(0))
        applier.revert_all()
        print('reverted', mod.f(0), alias.f_alias(0))
    """)
    out = run_python(code).stdout.splitlines()
    v = out.pop(0)
    assert out == [
        "disabled | disabled | area 'x' disabled | -",
        "backend | skipped | not needed on the cpu backend | -",
        f"version | skipped | megatron-core {v} outside >=0.99 | -",
        "missing | failed | target not found: module 'megatron_fake_outcomes' has no attribute 'nope' | -",
        "missing-untested | failed | target not found in untested megatron-core 0.99.0: "
        "module 'megatron_fake_outcomes' has no attribute 'nope' | -",
        "missing-optional | skipped | target not found: 'megatron_fake_absent' | -",
        "missing-strict | failed | target not found: 'megatron_fake_absent' | "
        "PatchError(megatron_fake_absent:f: target not found: 'megatron_fake_absent') from KeyError",
        "skip | skipped | not wanted here | -",
        "build | failed | build failed: RuntimeError: boom | -",
        "build-strict | failed | build failed: RuntimeError: boom | RuntimeError(boom) from ",
        "signature | failed | signature incompatible: replacement cannot take positional parameter 1 (b) | "
        "PatchError(megatron_fake_outcomes:f: signature incompatible: replacement cannot take positional "
        "parameter 1 (b)) from ",
        "verify | failed | verification failed at megatron_fake_stubborn:f | "
        "PatchError(megatron_fake_stubborn:f: verification failed at megatron_fake_stubborn:f) from ",
        "applied | applied |  | -",
        # A repeated apply keeps the first apply's record; a spec whose original is already ours
        # (installed through another name) says so instead of staying pending.
        "again | applied |  | -",
        "alias-of-ours | applied | installed already, through another of its names | -",
        "sites ['megatron_fake_outcomes:f', '__main__:f', 'megatron_fake_alias:f_alias'] new new",
        "reverted original original",
    ], out


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
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PROBE_PORT'], RANK='0', WORLD_SIZE='1')
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
    out = run_python(code, env={"MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_ATTENTION_LAYOUT": "BSH",
                                "PROBE_PORT": free_port()}).stdout
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
    CUDA RNG serves them there (the rng patch applies on cpu and npu only), rope_cos_sin and the
    Mamba decode ops: Megatron's own Triton kernels serve MLA's fused RoPE and Mamba's decode there; cpu and npu leave out fp8_linear
    and fp8_grouped_gemm (their fp8_unavailable op says why)."""
    import importlib

    from megatron_adapt.backends import NAMES
    from megatron_adapt.ops import OPS
    from megatron_adapt.patches import rng

    rng_ops = {"rng_get_state", "rng_set_state"}
    # Megatron's own Triton kernels serve MLA's RoPE and Mamba's decode steps on cuda
    left_out = {"cuda": rng_ops | {"rope_cos_sin", "ssm_conv_update", "ssm_state_update"},
                "cpu": {"fp8_linear", "fp8_grouped_gemm", "fp8_swiglu"},
                "npu": {"fp8_linear", "fp8_grouped_gemm", "fp8_swiglu"}}
    for name in NAMES:
        backend = importlib.import_module(f"megatron_adapt.backends.{name}").BACKEND
        expected = set(OPS) - left_out.get(name, set())
        assert set(backend.ops) == expected, (name, sorted(set(backend.ops) ^ expected))
        for op in backend.ops:
            assert callable(backend.op(op)), (name, op)
    rng_specs = [s for s in rng.SPECS if s.qualname.endswith("_cuda_rng_state")]
    assert len(rng_specs) == 2 and all("cuda" not in s.backends for s in rng_specs), rng_specs


def test_cpu_device_layer_maps_a_device_index_to_the_cpu():
    """`torch.device(torch.cuda.current_device())` (core_v0.16's YaRN RoPE opens it as a device
    context) means GPU N; on a CPU build it raised "Cannot access accelerator device"."""
    proc = run_python(textwrap.dedent("""
        import torch, megatron_adapt
        megatron_adapt.apply("cpu", quiet=True)
        with torch.device(torch.cuda.current_device()):
            x = torch.ones(2)
        assert x.device.type == "cpu" and torch.device("cpu").type == "cpu", x.device
        megatron_adapt.revert()
        print("OK")
        """), env={"MEGATRON_ADAPT_AUTO": "0"})
    assert proc.stdout.strip().endswith("OK"), proc.stdout


def test_cpu_device_layer_maps_nccl_subgroups_to_gloo():
    """Megatron's HyperCommGrid makes its groups with dist.new_subgroups_by_enumeration(...,
    backend="nccl"), which calls distributed_c10d's own new_group: on a CPU build NCCL raised
    "ProcessGroupNCCL is only supported with GPUs" (core_v0.19's MIMO tests)."""
    proc = run_python(textwrap.dedent("""
        import os, torch, megatron_adapt
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PROBE_PORT'], RANK='0', WORLD_SIZE='1')
        megatron_adapt.apply("cpu", quiet=True)
        import torch.distributed as dist
        dist.init_process_group("nccl")
        sub, _ = dist.new_subgroups_by_enumeration([[0]], backend="nccl")
        positional = dist.new_group([0], None, "nccl")
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        print(dist.get_backend(sub), dist.get_backend(positional), t.tolist())
        dist.destroy_process_group()
        """), env={"MEGATRON_ADAPT_AUTO": "0", "PROBE_PORT": free_port()})
    assert proc.stdout.strip().endswith("gloo gloo [1.0, 1.0]"), proc.stdout


_GROUPS_THAT_DIFFER_BY_RANK = textwrap.dedent("""
    import datetime, os, torch, megatron_adapt
    megatron_adapt.apply("cpu", quiet=True)
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=int(os.environ["GROUP_TIMEOUT"]))
    dist.init_process_group("nccl", timeout=timeout)
    r = dist.get_rank()
    # a group whose rank list differs by rank and is never used (test_schedules.py's embedding
    # groups: each pipeline names its own): rank 0 asks for [0, 1], rank 1 for [1]
    dist.new_group(ranks=[0, 1] if r == 0 else [1], timeout=timeout)
    pair = dist.new_group(ranks=[0, 1], timeout=timeout)   # one every rank made alike: used as usual
    t = torch.full((1,), float(r))
    dist.all_reduce(t, group=pair)
    world = torch.ones(1)
    dist.all_reduce(world)
    print(f"rank {r} pair {t.item()} world {world.item()} lazy {os.environ.get('TORCH_GLOO_LAZY_INIT')}", flush=True)
    dist.destroy_process_group()
    """)


def _groups_that_differ_by_rank(tmp_path, env):
    script = tmp_path / "groups.py"
    script.write_text(_GROUPS_THAT_DIFFER_BY_RANK)
    return run_python(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", free_port(),
                       str(script)], env={"MEGATRON_ADAPT_AUTO": "0", **env}, timeout=240, check=False)


def test_cpu_device_layer_groups_connect_at_first_use_as_nccls_do(tmp_path):
    """NCCL makes a communicator at a group's first collective, so Megatron's code can create groups
    whose rank lists differ between ranks and never use them (core_v0.16's test_schedules.py at 8 ranks:
    one pipeline's embedding groups per data-parallel rank). Eager gloo connects inside new_group and
    hung there (11 min, 2026-12-01). The device layer sets TORCH_GLOO_LAZY_INIT; the control (a user's
    TORCH_GLOO_LAZY_INIT=0, which wins) waits in new_group for a member that never comes."""
    ok = _groups_that_differ_by_rank(tmp_path, {"GROUP_TIMEOUT": "120"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = sorted(re.findall(r"rank \d pair \S+ world \S+ lazy \d", ok.stdout))   # ranks' lines interleave
    assert lines == ["rank 0 pair 1.0 world 2.0 lazy 1", "rank 1 pair 1.0 world 2.0 lazy 1"], ok.stdout
    control = _groups_that_differ_by_rank(tmp_path, {"GROUP_TIMEOUT": "15", "TORCH_GLOO_LAZY_INIT": "0"})
    assert control.returncode != 0 and "rank 0 pair" not in control.stdout, control.stdout


def test_cpu_device_layer_cuda_copy_gives_expanded_rows_their_own_memory():
    """`.cuda()` / `.to("cuda")` of an expanded CPU view is a copy on a GPU: writing one row leaves the
    others (Megatron's LLaVA test_preprocess_data builds its input ids so). Plain tensors stay
    the same object, as on a GPU for a tensor already there."""
    proc = run_python(textwrap.dedent("""
        import torch, megatron_adapt
        megatron_adapt.apply("cpu", quiet=True)
        for move in (lambda t: t.cuda(), lambda t: t.to("cuda"), lambda t: t.to(device="cuda")):
            ids = move(torch.arange(4).expand(3, 4))
            ids[0, 0] = -1
            assert ids[:, 0].tolist() == [-1, 0, 0], ids
        plain = torch.ones(3)
        assert plain.cuda() is plain and plain.to("cuda") is plain
        print("OK")
        """), env={"MEGATRON_ADAPT_AUTO": "0"})
    assert proc.stdout.strip().endswith("OK"), proc.stdout


def test_amx_probe_from_a_process_with_threads_runs_in_a_new_interpreter():
    """The AMX probe forks only a single-threaded process: a child forked after OpenMP's pool
    exists could hang in its first matmul (it hung tests/npu in one pytest process)."""
    proc = run_python(textwrap.dedent("""
        import torch
        from megatron_adapt.backends.cpu import device
        torch.matmul(torch.ones(256, 256), torch.ones(256, 256))   # OpenMP's threads now exist
        assert not device._single_threaded()
        threaded, fresh = device._amx_faults(), device._amx_faults_in_a_new_interpreter()
        assert threaded == fresh, (threaded, fresh)   # the threaded process took the new interpreter
        print("OK")
        """), env={"MEGATRON_ADAPT_AUTO": "0", "OMP_NUM_THREADS": "2"}, timeout=200)
    assert proc.stdout.strip().endswith("OK"), proc.stdout


def test_cpu_device_layer_streams_are_recordable():
    """Megatron's EP-overlap schedule nodes (`--overlap-moe-expert-parallel-comm`,
    pipeline_parallel/utils.py ScheduleNode) call `input.record_stream(stream)` on the streams
    `torch.cuda.Stream()` / `current_stream()` give; with a plain-object stand-in the argument
    parser raised "unknown parameter type" at the first MoE dispatch."""
    proc = run_python(textwrap.dedent("""
        import torch, megatron_adapt
        megatron_adapt.apply("cpu", quiet=True)
        for stream in (torch.cuda.Stream(priority=-1), torch.cuda.current_stream()):
            assert stream.device.type == "cpu", stream.device
            x = torch.ones(2)
            x.record_stream(stream)
            with torch.cuda.stream(stream):
                stream.wait_stream(torch.cuda.current_stream())
            x.untyped_storage().resize_(0)
        megatron_adapt.revert()
        print("OK")
        """), env={"MEGATRON_ADAPT_AUTO": "0"})
    assert proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


def test_free_port_is_below_the_ephemeral_range_and_not_tied_to_the_global_seed():
    """Ports from bind(0) collided with gloo's listeners of a suite running alongside (EADDRINUSE)."""
    import random
    import socket

    from megatron_adapt.apps import ports

    low = ports._ephemeral_low()
    picks = set()
    for _ in range(5):
        random.seed(1234)  # Megatron seeds the global generator the same in every run
        port = ports.free_port()
        assert ports._FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        picks.add(port)
    assert len(picks) > 1

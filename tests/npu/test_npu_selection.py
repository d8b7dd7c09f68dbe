"""Backend selection: an explicit npu without torch_npu fails loudly and patches nothing; `auto`
never picks npu without an NPU; with the emulation, npu applies and reverts cleanly.
Subprocesses, so that no emulation and no patch leaks between cases."""
import json
import os
import subprocess
import sys
import textwrap

EMULATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulation")


def run(code, *, emulation=False, env=None):
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("MEGATRON_ADAPT_", "TORCH_NPU_EMULATION"))}
    path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and "emulation" not in p]
    if emulation:
        path.insert(0, EMULATION_DIR)
    environ["PYTHONPATH"] = os.pathsep.join(path)
    environ.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, timeout=120)


STATE = """
    import json, sys, torch
    import megatron_adapt
    from megatron_adapt import applier
    from megatron_adapt.backends.cpu import device as cpu_device
    from megatron_adapt.backends.npu import device as npu_device
    def state():
        return dict(active=megatron_adapt.active_backend() is not None, installed=len(applier.installed()),
                    cpu_device=cpu_device.installed(), npu_device=npu_device.installed(),
                    torch_npu="torch_npu" in sys.modules,
                    cuda_patched=getattr(torch.cuda.current_device, "__module__", "") != "torch.cuda")
"""


def test_explicit_npu_without_torch_npu_fails_clearly_and_patches_nothing():
    proc = run(STATE + """
    try:
        megatron_adapt.apply("npu")
    except megatron_adapt.BackendUnavailableError as exc:
        print(json.dumps(dict(error=str(exc), **state())))
    """, env={"MEGATRON_ADAPT_AUTO": "0"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "MEGATRON_ADAPT_BACKEND=npu needs torch_npu" in out["error"]
    assert "No module named 'torch_npu'" in out["error"]
    assert out == {**out, "active": False, "installed": 0, "cpu_device": False, "npu_device": False,
                   "torch_npu": False, "cuda_patched": False}


def test_env_npu_without_torch_npu_fails_at_import():
    proc = run("import megatron_adapt", env={"MEGATRON_ADAPT_BACKEND": "npu"})
    assert proc.returncode != 0
    assert "BackendUnavailableError" in proc.stderr and "needs torch_npu" in proc.stderr


def test_auto_never_picks_npu_without_a_device():
    code = """
    from megatron_adapt import backends
    print(backends.auto_select()[0])
    """
    assert run(code, env={"MEGATRON_ADAPT_AUTO": "0"}).stdout.split() == ["cpu"]            # no torch_npu
    zero = run(code, emulation=True, env={"MEGATRON_ADAPT_AUTO": "0", "TORCH_NPU_EMULATION_DEVICES": "0"})
    assert zero.stdout.split() == ["cpu"], zero.stderr                                       # torch_npu, no NPU
    one = run(code, emulation=True, env={"MEGATRON_ADAPT_AUTO": "0"})
    assert one.stdout.split() == ["npu"], one.stderr                                         # an (emulated) NPU


def test_explicit_npu_with_torch_npu_but_no_device_fails_clearly():
    proc = run(STATE + """
    try:
        megatron_adapt.apply("npu")
    except megatron_adapt.BackendUnavailableError as exc:
        print(json.dumps(dict(error=str(exc), **state())))
    """, emulation=True, env={"MEGATRON_ADAPT_AUTO": "0", "TORCH_NPU_EMULATION_DEVICES": "0"})
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "sees no NPU device" in out["error"]
    assert (out["active"], out["installed"], out["npu_device"], out["cpu_device"]) == (False, 0, False, False)


def test_npu_applies_under_emulation_and_reverts_everything():
    proc = run(STATE + """
    import megatron.core.models.gpt  # so that the op patches land
    before = state()
    backend = megatron_adapt.apply("npu")
    applied = state()
    from megatron.core.fusions import fused_bias_swiglu
    impl = fused_bias_swiglu.bias_swiglu_impl.__module__
    megatron_adapt.revert()
    print(json.dumps(dict(name=backend.name, before=before, applied=applied, after=state(), impl=impl,
                          describe=backend.describe())))
    """, emulation=True, env={"MEGATRON_ADAPT_AUTO": "0"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["name"] == "npu" and "emulation" in out["describe"]
    assert out["applied"]["active"] and out["applied"]["installed"] > 5
    assert out["applied"]["npu_device"] and out["applied"]["cpu_device"]   # emulated transfer_to_npu
    assert out["impl"] == "megatron_adapt.patches.activations"
    after = dict(out["after"], torch_npu=False)
    assert after == dict(out["before"], torch_npu=False) == {
        "active": False, "installed": 0, "cpu_device": False, "npu_device": False, "torch_npu": False,
        "cuda_patched": False}

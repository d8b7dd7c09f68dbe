"""The cpu device layer's oneDNN/AMX guard (needs megatron-core only, not a Megatron-LM checkout).

On machines whose CPU lists AMX but faults executing it, any bf16 matmul kills the process with
SIGILL; the device layer caps oneDNN below AMX after a forked probe. These run in subprocesses so
oneDNN's ISA choice starts fresh.
"""
import subprocess
import sys

CODE = """
import torch, megatron_adapt
megatron_adapt.apply("cpu")
from megatron_adapt.backends.cpu import device
x = torch.randn(128, 64, dtype=torch.bfloat16)
print("ok", tuple((x @ x.t()).shape), device.onednn_isa_note)
megatron_adapt.revert()
import os
print("after revert", os.environ.get("ONEDNN_MAX_CPU_ISA"))
"""


def _run(env_extra):
    import os

    env = {**os.environ, "MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_QUIET": "1", **env_extra}
    if "ONEDNN_MAX_CPU_ISA" not in env_extra:
        env.pop("ONEDNN_MAX_CPU_ISA", None)
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)


def test_bf16_matmul_survives_under_cpu_backend():
    proc = _run({})
    assert proc.returncode == 0, f"rc={proc.returncode} (-4 is SIGILL)\n{proc.stderr[-3000:]}"
    assert "ok (128, 128)" in proc.stdout
    assert "after revert None" in proc.stdout  # the cap we set is removed on revert


def test_user_isa_cap_is_respected():
    proc = _run({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "user cap ONEDNN_MAX_CPU_ISA=AVX2" in proc.stdout
    assert "after revert AVX2" in proc.stdout


def test_device_count_is_the_local_world_size():
    """One virtual device per local rank (as torchrun on a GPU node): Megatron's unit tests read
    torch.cuda.device_count() as the world size; revert gives torch's own answer back."""
    import os

    code = ("import torch, megatron_adapt\n"
            "stock = torch.cuda.device_count()\n"
            "megatron_adapt.apply('cpu')\n"
            "print('count', torch.cuda.device_count())\n"
            "megatron_adapt.revert()\n"
            "print('reverted', torch.cuda.device_count() == stock)\n")
    for local_world, expected in (("2", 2), (None, 1)):
        env = {**os.environ, "MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_QUIET": "1"}
        env.pop("LOCAL_WORLD_SIZE", None)
        if local_world:
            env["LOCAL_WORLD_SIZE"] = local_world
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"count {expected}" in proc.stdout and "reverted True" in proc.stdout, proc.stdout


def test_generator_on_the_accelerator_is_a_cpu_generator():
    """Megatron's inference sampling RNG is `torch.Generator(device=torch.cuda.current_device())`;
    on the cpu backend it is a CPU generator that draws like one, and every torch generator still
    passes isinstance(x, torch.Generator). revert gives torch's own class back."""
    import os

    code = ("import torch, megatron_adapt\n"
            "stock = torch.Generator\n"
            "megatron_adapt.apply('cpu')\n"
            "g = torch.Generator(device=torch.cuda.current_device()); g.manual_seed(3)\n"
            "h = torch.Generator(); h.manual_seed(3)\n"
            "print('device', g.device, torch.Generator(device='cuda:0').device)\n"
            "print('same', torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=h)))\n"
            "print('isinstance', isinstance(torch.default_generator, torch.Generator), isinstance(g, torch.Generator))\n"
            "megatron_adapt.revert()\n"
            "print('reverted', torch.Generator is stock)\n")
    env = {**os.environ, "MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_QUIET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device cpu cpu" in proc.stdout
    assert "same True" in proc.stdout
    assert "isinstance True True" in proc.stdout
    assert "reverted True" in proc.stdout

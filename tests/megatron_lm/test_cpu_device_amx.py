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


def _python(args, timeout=120, **env):
    """sys.executable with `args` under MEGATRON_ADAPT_AUTO=0 (the code applies itself); must succeed."""
    import os

    full_env = {**os.environ, "MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_QUIET": "1", **env}
    proc = subprocess.run([sys.executable, *args], env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


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
    code = ("import torch, megatron_adapt\n"
            "stock = torch.Generator\n"
            "megatron_adapt.apply('cpu')\n"
            "g = torch.Generator(device=torch.cuda.current_device()); g.manual_seed(3)\n"
            "h = torch.Generator(); h.manual_seed(3)\n"
            "print('device', g.device, torch.Generator(device='cuda:0').device)\n"
            "x = torch.ones(1, device='cuda')\n"
            "print('placed', x.device == torch.device(f'cuda:{torch.cuda.current_device()}') == torch.device('cuda', 0))\n"
            "print('same', torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=h)))\n"
            "print('isinstance', isinstance(torch.default_generator, torch.Generator), isinstance(g, torch.Generator))\n"
            "megatron_adapt.revert()\n"
            "print('reverted', torch.Generator is stock)\n")
    proc = _python(["-c", code])
    assert "device cpu cpu" in proc.stdout
    assert "placed True" in proc.stdout   # Megatron's engine asserts prompt.device == cuda:<current>
    assert "same True" in proc.stdout
    assert "isinstance True True" in proc.stdout
    assert "reverted True" in proc.stdout


def test_threads_map_the_accelerator_to_the_cpu_too():
    """A TorchFunctionMode is per thread; Megatron's inference engines run steps on executor threads.
    A tensor asked for on 'cuda' in such a thread is a CPU tensor, as in the main thread."""
    code = ("import concurrent.futures, threading, torch, megatron_adapt\n"
            "megatron_adapt.apply('cpu')\n"
            "def make(): return str(torch.ones(2, device='cuda').device)\n"
            "with concurrent.futures.ThreadPoolExecutor(1) as ex: print('pool', ex.submit(make).result())\n"
            "out = []; t = threading.Thread(target=lambda: out.append(make())); t.start(); t.join()\n"
            "print('thread', out[0])\n"
            "megatron_adapt.revert()\n"
            "print('reverted', threading.Thread._bootstrap_inner.__qualname__ == 'Thread._bootstrap_inner')\n")
    proc = _python(["-c", code])
    assert "pool cpu" in proc.stdout and "thread cpu" in proc.stdout, proc.stdout
    assert "reverted True" in proc.stdout, proc.stdout


def test_autograd_hooks_map_the_accelerator_to_the_cpu_too():
    """Autograd runs tensor hooks with an empty mode stack; Megatron-FSDP allocates its gradient
    buckets on 'cuda' in a post-accumulate-grad hook (on cpu: "Found no NVIDIA driver")."""
    code = ("import torch, megatron_adapt\n"
            "megatron_adapt.apply('cpu')\n"
            "p = torch.nn.Parameter(torch.ones(3)); x = torch.ones(3, requires_grad=True)\n"
            "seen = []\n"
            "p.register_post_accumulate_grad_hook(lambda t: seen.append(str(torch.zeros(1, device='cuda').device)))\n"
            "x.register_hook(lambda g: seen.append(str(torch.zeros(1, device='cuda').device)) or g * 2)\n"
            "(p * x).sum().backward()\n"
            "print('hooks', sorted(seen), x.grad.tolist())\n")
    proc = _python(["-c", code])
    assert "hooks ['cpu', 'cpu'] [2.0, 2.0, 2.0]" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_all_gather_into_tensor_takes_nccls_shapes_over_gloo(tmp_path):
    """NCCL gathers any input of output.numel() / world elements; gloo wanted one output chunk's
    shape (Megatron's MoE layer gathers [1, 1, s, h] into [2, s, h]: RuntimeError on gloo)."""
    from megatron_adapt.apps.ports import free_port

    script = tmp_path / "gather.py"
    script.write_text(
        "import torch, torch.distributed as dist, megatron_adapt\n"
        "megatron_adapt.apply('cpu')\n"
        "dist.init_process_group('nccl')\n"
        "r = dist.get_rank()\n"
        "out = torch.empty(2, 3, 4, device='cuda')\n"
        "dist.all_gather_into_tensor(out, torch.full((1, 1, 3, 4), float(r), device='cuda'))\n"
        "same = torch.empty(2, 3, 4); dist.all_gather_into_tensor(same, torch.full((1, 3, 4), float(r)))\n"
        # uneven parts (Megatron-FSDP's uneven DTensor shards): NCCL gathers them, gloo raised
        "parts = [torch.empty(3, 2), torch.empty(0, 2)]\n"
        "dist.all_gather(parts, torch.full((3, 2) if r == 0 else (0, 2), 5.0 + r))\n"
        "work = dist.all_gather(parts, torch.full((3, 2) if r == 0 else (0, 2), 7.0), async_op=True); work.wait()\n"
        f"open(r'{tmp_path}' + f'/rank{{r}}.txt', 'w').write("
        "f'gathered {r} {out[0].eq(0).all().item()} {out[1].eq(1).all().item()} {torch.equal(out, same)} '\n"
        "f'{parts[0].eq(7).all().item()} {parts[1].shape}')\n"
        "dist.destroy_process_group()\n")
    proc = _python(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                    str(script)], timeout=180, OMP_NUM_THREADS="1")
    for r in (0, 1):     # one file per rank: the two ranks' stdout interleave
        assert (tmp_path / f"rank{r}.txt").read_text() == f"gathered {r} True True True True torch.Size([0, 2])", \
            proc.stdout + proc.stderr[-3000:]

"""The CPU device layer: Megatron's CUDA assumptions, answered on a machine with no accelerator.

Megatron (core and training) has hundreds of `torch.cuda.*` calls, `device="cuda"` /
`current_device()` allocations, `.cuda()` moves, `'torch.cuda.FloatTensor'` type-string asserts,
nccl process groups and CUDA streams on its path. Rather than edit each site, this layer:

* replaces a small set of `torch.cuda` entry points (device queries, streams, events, synchronize,
  memory statistics, RNG, nvtx) with CPU answers;
* maps nccl process groups to gloo (`init_process_group`, `new_group`) and drops `device_id`s;
  gloo groups connect at their first collective, as NCCL's communicators do (TORCH_GLOO_LAZY_INIT);
* pushes one TorchFunctionMode that rewrites any CUDA device argument to the CPU, makes
  `Tensor.cuda()` / `pin_memory()` identities and `Tensor.type()` report `torch.cuda.*` names;
* keeps oneDNN off AMX where the CPU advertises AMX but executing it faults (some VMs, e.g.
  Firecracker guests, list amx_tile/amx_bf16 yet raise SIGILL on `tilezero`): every bf16 matmul
  would kill the process. A forked 20 ms probe decides; `ONEDNN_MAX_CPU_ISA` set by the user wins.

`install()` saves every original; `uninstall()` restores them and pops the mode. Only the cpu
backend installs it; it never changes behaviour on a machine that has CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_saved: list[tuple[object, str, object, bool]] = []
_mode: "CudaOnCpuMode | None" = None


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index always means "the accelerator" in Megatron's code
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _type_name(t: torch.Tensor) -> str:
    name = torch.Tensor.type(t)  # inside the mode's handler the mode is off
    return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name


_TO = torch.Tensor.to
_CPU = torch.device("cpu")
_CUDA = torch.Tensor.cuda
_TYPE = torch.Tensor.type
_PASSTHROUGH = {torch.Tensor.pin_memory, torch.Tensor.record_stream}


class CudaOnCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch function called under it."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _CUDA:
            return _own_memory(args[0])
        if func is torch.device and args and _is_cuda(args[0]) and not kwargs:
            # torch.device(torch.cuda.current_device()), torch.device(f"cuda:{i}"), ("cuda", i): every
            # tensor placed there is a CPU tensor, so the device they are compared with is the CPU
            return _CPU
        if func in _PASSTHROUGH:
            return args[0] if func is torch.Tensor.pin_memory else None
        if func is _TYPE:
            if len(args) == 1 and "dtype" not in kwargs:
                return _type_name(args[0])
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        to_cuda = func is _TO and ((len(args) > 1 and _is_cuda(args[1])) or _is_cuda(kwargs.get("device")))
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is _TO and len(args) > 1 and (_is_cuda(args[1])):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        return _own_memory(out) if to_cuda else out


def _own_memory(t):
    """A host-to-device copy gives every element its own memory; on the cpu backend `.cuda()` is the
    tensor itself, so a view whose elements share memory (`expand`) is materialized, as the copy
    would be: else a write to one row of `torch.arange(n).expand(b, n).cuda()` changes every row
    (Megatron's LLaVA test_preprocess_data)."""
    if isinstance(t, torch.Tensor) and torch._debug_has_internal_overlap(t) == 1:
        return t.contiguous()
    return t


class _Stream(torch.Stream):
    """A CUDA stream stand-in: work on the CPU is already ordered. A `torch.Stream` (the CPU's)
    so that `Tensor.record_stream(stream)` parses it (the argument parser refuses any other
    object before the mode sees the call; Megatron's EP-overlap schedule nodes record their
    inputs on their streams); `device` is the CPU."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, "cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _properties(device=None):
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(name="cpu (megatron-adapt)", major=0, minor=0, total_memory=total,
                                 multi_processor_count=os.cpu_count() or 1, gcnArchName="",
                                 L2_cache_size=0, is_integrated=False, uuid="cpu")


_DEFAULT_STREAM = _Stream()


def _returns(value):
    """A fresh function per name: torch._dynamo's trace rules refuse one object under two names."""
    return lambda *args, **kwargs: value



CUDA_API = {
    "set_device": _returns(None),
    "current_device": lambda: 0,
    # One virtual device per local process, as on a GPU node where torchrun starts one rank per GPU
    # (0 would make Megatron silently skip model-parallel initialisation). Megatron's unit tests
    # read it as the world size (`Utils.set_world_size()`, `skipif(device_count() < 2)`).
    "device_count": lambda: max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
    "synchronize": _returns(None),
    "Stream": _Stream,
    "Event": _Event,
    "stream": lambda s=None: contextlib.nullcontext(s),
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "get_device_properties": _properties,
    "get_device_capability": lambda device=None: (0, 0),
    "get_device_name": lambda device=None: "cpu (megatron-adapt)",
    "is_bf16_supported": lambda *a, **k: True,
    "memory_allocated": _returns(0),
    "max_memory_allocated": _returns(0),
    "memory_reserved": _returns(0),
    "max_memory_reserved": _returns(0),
    "reset_peak_memory_stats": _returns(None),
    "reset_max_memory_allocated": _returns(None),
    "memory_stats": lambda *a, **k: {},
    "mem_get_info": lambda device=None: (_properties().total_memory, _properties().total_memory),
    "empty_cache": _returns(None),
    "ipc_collect": _returns(None),
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    "get_rng_state_all": lambda: [torch.get_rng_state()],
    "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
    "manual_seed": lambda seed: torch.random.default_generator.manual_seed(int(seed)),
    "manual_seed_all": lambda seed: torch.random.default_generator.manual_seed(int(seed)),
    "seed": lambda: torch.random.default_generator.seed(),
    "initial_seed": lambda: torch.random.default_generator.initial_seed(),
}
_GENERATOR = torch._C.Generator


class _GeneratorType(type(_GENERATOR)):
    """isinstance / issubclass answer for every torch generator, not only those made here."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, _GENERATOR)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _GENERATOR)


class Generator(_GENERATOR, metaclass=_GeneratorType):
    """`torch.Generator(device=torch.cuda.current_device())` (Megatron's inference sampling RNG):
    a C constructor no TorchFunctionMode sees, so the CUDA device is mapped to the CPU here. What it
    returns is torch's own generator."""

    def __new__(cls, device="cpu"):
        return _GENERATOR(_CPU if _is_cuda(device) else device)


NVTX_API = {"range_push": _returns(0), "range_pop": _returns(0), "mark": _returns(None)}


def _gloo(backend):
    if backend is None:
        return None
    text = str(backend).lower()
    return "gloo" if "nccl" in text or "cuda" in text else backend


def _wrap_init_process_group(original):
    def init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)
        return original(_gloo(backend) or "gloo", *args, **kwargs)
    return init_process_group


def _wrap_new_group(original):
    def new_group(*args, **kwargs):
        if len(args) > 2:   # new_group(ranks, timeout, backend, ...)
            args = (*args[:2], _gloo(args[2]), *args[3:])
        if "backend" in kwargs:
            kwargs["backend"] = _gloo(kwargs["backend"])
        kwargs.pop("device_id", None)
        if kwargs.get("pg_options") is not None and kwargs.get("backend") in (None, "gloo"):
            kwargs["pg_options"] = None  # NCCL options mean nothing to gloo
        return original(*args, **kwargs)
    return new_group


_pending_sends: list = []  # (work, storage): storages of in-flight gloo sends, kept alive


def _wrap_isend(original):
    """Keep a send buffer's storage alive until gloo has sent it.

    Megatron frees a pipeline stage's output right after posting its send
    (`deallocate_output_tensor` swaps `out.data` for a 1-element tensor). On CUDA the caching
    allocator keeps the memory until NCCL's stream is done with it; gloo reads the raw pointer
    later, from freed memory, whenever the send is still in flight: the interleaved (VPP) schedule
    overlaps p2p and waits for sends late, and the next stage received garbage (NaN losses).
    """
    def isend(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        if work is not None:
            if len(_pending_sends) > 64:
                _pending_sends[:] = [(w, st) for w, st in _pending_sends if not w.is_completed()]
            _pending_sends.append((work, tensor.untyped_storage()))
        return work
    return isend


def _wrap_all_gather_into_tensor(original):
    """NCCL takes any input whose size is the output's over the world size; gloo wants the input
    shaped as one chunk of the output (Megatron's MoE layer gathers a [1, 1, s, h] input into a
    [n, s, h] output). Same storage, flat views: the gathered values land where NCCL puts them."""
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        world = dist.get_world_size(group)
        chunk = (output_tensor.shape[0] // world, *output_tensor.shape[1:]) if output_tensor.dim() else ()
        if (input_tensor.shape != chunk and input_tensor.numel() * world == output_tensor.numel()
                and output_tensor.is_contiguous() and input_tensor.is_contiguous()):
            return original(output_tensor.view(-1), input_tensor.view(-1), group=group, async_op=async_op)
        return original(output_tensor, input_tensor, group=group, async_op=async_op)
    return all_gather_into_tensor


def _wrap_all_gather(original):
    """NCCL gathers a list of tensors of different sizes (ProcessGroupNCCL falls back to broadcasts;
    Megatron-FSDP's uneven DTensor shards rely on it); gloo requires one size. An uneven list is
    gathered padded to its largest member, then each rank's part is copied to its own tensor."""
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) <= 1 or (group is not None and dist.get_rank(group) < 0):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        largest = max(sizes)
        padded = tensor.new_zeros(largest)
        padded[:tensor.numel()] = tensor.reshape(-1)
        gathered = [tensor.new_empty(largest) for _ in tensor_list]
        work = original(gathered, padded, group=group, async_op=async_op)
        if work is not None:
            work.wait()   # the copies below need the values; waiting again later is harmless
        for out, part, n in zip(tensor_list, gathered, sizes):
            out.copy_(part[:n].view(out.shape))
        return work
    return all_gather


def _wrap_barrier(original):
    def barrier(group=None, async_op=False, device_ids=None):
        return original(group=group, async_op=async_op)
    return barrier


ONEDNN_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_SAFE_ISA = "AVX512_CORE_FP16"  # the highest oneDNN ISA below AMX; a cap, never a floor
onednn_isa_note: str | None = None  # what _guard_amx decided, for the report / tests


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _amx_faults() -> bool:
    """Run a bf16 and an fp16 matmul in a forked child: True if it dies of SIGILL.

    oneDNN reads its ISA cap when it first dispatches a kernel, so the parent, which has not run
    one yet, can still be capped after the probe.
    """
    if not hasattr(os, "fork") or not _single_threaded():
        return _amx_faults_in_a_new_interpreter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        import faulthandler

        faulthandler.disable()  # the expected SIGILL is the answer, not a crash to report
        code = 0
        try:
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.ones(64, 64, dtype=dtype)
                torch.matmul(x, x).sum().item()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == getattr(__import__("signal"), "SIGILL", 4)


def _single_threaded() -> bool:
    """Forking is safe only from a process with one thread: a child forked from a process whose
    OpenMP / gloo threads exist can hang in its first matmul (seen: the cpu device layer installed
    inside a pytest process after two-process tests had run)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _amx_faults_in_a_new_interpreter() -> bool:
    """The same probe in a fresh Python (slower: it imports torch), for a process that already has
    threads. Its own megatron-adapt stays off."""
    import signal
    import subprocess
    import sys

    code = ("import torch\n"
            "for dtype in (torch.bfloat16, torch.float16):\n"
            "    x = torch.ones(64, 64, dtype=dtype)\n"
            "    torch.matmul(x, x).sum().item()\n")
    env = {**os.environ, "MEGATRON_ADAPT_AUTO": "0", "MEGATRON_ADAPT_AMX_PROBE": "0"}
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == -getattr(signal, "SIGILL", 4)


def _guard_amx() -> None:
    global onednn_isa_note
    if any(v in os.environ for v in ONEDNN_ISA_VARS):
        onednn_isa_note = f"user cap ONEDNN_MAX_CPU_ISA={os.environ.get(ONEDNN_ISA_VARS[0])}"
        return
    if not {"amx_tile", "amx_bf16"} & _cpu_flags() or os.environ.get("MEGATRON_ADAPT_AMX_PROBE") == "0":
        return
    if _amx_faults():
        os.environ[ONEDNN_ISA_VARS[0]] = ONEDNN_SAFE_ISA
        _saved.append((os.environ, ONEDNN_ISA_VARS[0], None, False))
        onednn_isa_note = (f"AMX faults on this machine (SIGILL): oneDNN capped at {ONEDNN_SAFE_ISA}")
        try:
            from megatron_adapt import report

            report.ran("onednn_cpu_isa", f"{ONEDNN_SAFE_ISA} (AMX faults here)")
        except Exception:  # the report is informative only
            pass


def _wrap_backward_apply(original):
    """Autograd runs Function.backward with an empty torch-function-mode stack; Megatron's backward
    passes allocate on `torch.cuda.current_device()` too, so re-enter the mode there."""
    def apply(self, *args):
        return _in_the_mode(original, self, *args)
    return apply


def _in_the_mode(fn, *args, **kwargs):
    """fn under the layer's mode where autograd left the mode stack empty."""
    if _mode is None or torch._C._len_torch_function_stack() > 0:
        return fn(*args, **kwargs)
    with _mode:
        return fn(*args, **kwargs)


def _wrap_hook_registration(original):
    """Autograd runs tensor hooks with an empty torch-function-mode stack too (Megatron-FSDP fetches
    its gradient buffers with `device="cuda"` in a post-accumulate-grad hook): each hook registered
    while the layer is installed runs under the mode."""
    def register(self, hook):
        if not callable(hook):
            return original(self, hook)
        return original(self, functools.wraps(hook)(functools.partial(_in_the_mode, hook)))
    return register


def _wrap_thread_bootstrap(original):
    """A TorchFunctionMode is active in the thread that entered it only. Megatron runs work on
    other Python threads too (the static inference engine's `run_in_executor`, the dynamic engine's
    ThreadPoolExecutor): each thread started while the layer is installed runs under a mode of its
    own, so a `device="cuda"` there is the CPU as well instead of initialising CUDA."""
    def _bootstrap_inner(self):
        if _mode is None:
            return original(self)
        with CudaOnCpuMode():
            return original(self)
    return _bootstrap_inner


def _set(owner, name, value):
    had = name in vars(owner)
    _saved.append((owner, name, getattr(owner, name, None), had))
    setattr(owner, name, value)


def installed() -> bool:
    return _mode is not None


def install() -> None:
    """Idempotent."""
    global _mode
    if _mode is not None:
        return
    for name, fn in CUDA_API.items():
        _set(torch.cuda, name, fn)
    for name, fn in NVTX_API.items():
        _set(torch.cuda.nvtx, name, fn)
    _set(torch, "Generator", Generator)
    _set(threading.Thread, "_bootstrap_inner", _wrap_thread_bootstrap(threading.Thread._bootstrap_inner))
    if dist.is_available():
        from torch.distributed import distributed_c10d

        for name, wrap in (("init_process_group", _wrap_init_process_group),
                           ("new_group", _wrap_new_group), ("barrier", _wrap_barrier)):
            wrapped = wrap(getattr(dist, name))
            _set(dist, name, wrapped)
            # new_subgroups_by_enumeration (Megatron's HyperCommGrid) calls distributed_c10d's own
            # `new_group` global, with backend="nccl"
            if name == "new_group" and distributed_c10d is not dist:
                _set(distributed_c10d, name, wrapped)
        # Both names: P2POp validates its op against distributed_c10d's own `isend` global, and
        # callers reach the gathers through either module.
        for name, wrap in (("all_gather_into_tensor", _wrap_all_gather_into_tensor),
                           ("all_gather", _wrap_all_gather), ("isend", _wrap_isend)):
            wrapped = wrap(getattr(distributed_c10d, name))
            _set(dist, name, wrapped)
            if distributed_c10d is not dist:
                _set(distributed_c10d, name, wrapped)
    from torch.autograd.function import BackwardCFunction

    _set(BackwardCFunction, "apply", _wrap_backward_apply(BackwardCFunction.apply))
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        _set(torch.Tensor, name, _wrap_hook_registration(getattr(torch.Tensor, name)))
    # Megatron requires this with TP > 1 on pre-Blackwell "devices"; the CPU has no connections.
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        _saved.append((os.environ, "CUDA_DEVICE_MAX_CONNECTIONS", None, False))
    # NCCL makes a group's communicator at the group's first collective; gloo connects every member
    # inside new_group unless told to wait. Megatron's code is written against NCCL's way: its own
    # tests create groups with rank lists that differ between ranks (test_schedules.py's embedding
    # groups, one pipeline per data-parallel rank) and gloo's eager connect hangs on them. A user's
    # own TORCH_GLOO_LAZY_INIT wins.
    if "TORCH_GLOO_LAZY_INIT" not in os.environ:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        _saved.append((os.environ, "TORCH_GLOO_LAZY_INIT", None, False))
    _guard_amx()
    _mode = CudaOnCpuMode()
    _mode.__enter__()


def uninstall() -> None:
    global _mode
    if _mode is None:
        return
    try:
        _mode.__exit__(None, None, None)
    finally:
        _mode = None
        while _saved:
            owner, name, original, had = _saved.pop()
            if owner is os.environ:
                os.environ.pop(name, None)
            elif had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

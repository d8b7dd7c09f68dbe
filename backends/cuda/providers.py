"""Other libraries' kernels (Liger-Kernel, apex, FlashAttention-4) for an op, used only where they
measure faster.

With one of them installed, the first call of an op with a new input signature (shapes, dtypes,
which inputs need gradients) is a small tournament on the GPU: ours and each candidate that can
serve the call run forward and backward on copies of the call's inputs (a random output
gradient), their GPU time measured with CUDA events; a candidate that raises, or whose output
or input gradients disagree with ours, is out. A candidate wins only when it is more than
MARGIN faster, so near-ties stay on ours. The ranks of Megatron's tensor-parallel group decide
together (the slowest timing of each counts), so replicated values stay identical across them.
Every decision, with its timings, goes to the report (`selections`), and every call reports
the implementation that ran.

MEGATRON_ADAPT_EXTERNAL (config.external):
  auto   (default) measure as above when a candidate library is importable;
  off    ours only;
  liger, apex, flash_attn   that library wherever it can serve, without measuring (ours elsewhere).

Transformer Engine is not a candidate here: when it is installed, Megatron builds its layers
from TE's modules and megatron-adapt's layer-spec, optimizer and wgrad patches step aside
(their report lines say so).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_adapt import report

MARGIN = 0.05   # a candidate must be this much faster than ours to be chosen
WARMUP, REPS = 2, 10
# agreement with ours: max |a - b| <= TOL * max |ours| per output and input gradient
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Candidate:
    library: str
    impl: str                                  # report name
    module: str                                # imported to tell whether it is installed
    serves: Callable[..., str | None]          # (*op args) -> None, or why it cannot serve them
    run: Callable                              # the op's signature, autograd included


# ---- the candidates, written against each library's public functions --------------------------

def _same_float_dtype(*tensors):
    dtypes = {t.dtype for t in tensors if t is not None}
    return None if len(dtypes) == 1 else f"mixed dtypes {sorted(map(str, dtypes))}"


def _liger_rms_norm(x, weight, eps):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    # "gemma" casting: everything in fp32, one rounding at the end, as ours and Megatron's.
    # in_place=False: Megatron's residual branch still reads dY after the norm's backward.
    return LigerRMSNormFunction.apply(x, weight, float(eps), 0.0, "gemma", False)


def _liger_layer_norm(x, weight, bias, eps):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    return LigerLayerNormFunction.apply(x, weight, bias, float(eps))


def _liger_cross_entropy(logits, target, label_smoothing=0.0, tp_group=None):
    from liger_kernel.transformers.functional import liger_cross_entropy
    v = logits.size(-1)
    loss = liger_cross_entropy(logits.reshape(-1, v), target.reshape(-1), reduction="none")
    return loss.float().view(target.shape)


def _liger_swiglu(x):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    a, b = torch.chunk(x, 2, dim=-1)
    return LigerSiLUMulFunction.apply(a, b)


def _apex_rms_norm(x, weight, eps):
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
    return fused_rms_norm_affine(x, weight, weight.shape, float(eps))


def _apex_layer_norm(x, weight, bias, eps):
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine
    return fused_layer_norm_affine(x, weight, bias, weight.shape, float(eps))


def _fa4_serves(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    """FlashAttention-4 (flash-attn-4, CuTe DSL, compiled at run time) has no dropout and no mask
    tensor; its causal diagonal is bottom-right aligned, SDPA's top-left: equal only when sq == sk."""
    if dropout_p:
        return "attention dropout (FlashAttention-4 has none)"
    if attn_mask is not None or window_size is not None:
        return "an explicit mask or sliding window"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if q.size(-1) % 8 or q.size(-1) > 256 or v.size(-1) != q.size(-1):
        return f"head dim {q.size(-1)}"
    if q.size(1) % k.size(1):
        return f"{q.size(1)} query heads over {k.size(1)} key/value heads"
    if causal and q.size(-2) != k.size(-2):
        return "causal with sq != sk (diagonal alignment differs)"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] < 9:
        return "needs a Hopper or newer GPU"
    return None


def _fa4_attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    from flash_attn.cute import flash_attn_func
    # our op's [b, h, s, d] views -> FA's [b, s, h, d] (views: no copy; FA takes the strides)
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          softmax_scale=scale, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def _ce_serves(logits, target, label_smoothing=0.0, tp_group=None):
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        return "vocab split over tensor parallelism (the candidate needs the whole vocabulary)"
    if label_smoothing:
        return "label smoothing (Megatron's formula differs from the candidate's)"
    return None


CANDIDATES: dict[str, list[Candidate]] = {
    "rms_norm": [
        Candidate("liger", "liger.LigerRMSNormFunction", "liger_kernel",
                  lambda x, w, eps: _same_float_dtype(x, w), _liger_rms_norm),
        Candidate("apex", "apex.fused_rms_norm_affine", "fused_layer_norm_cuda",
                  lambda x, w, eps: _same_float_dtype(x, w), _apex_rms_norm),
    ],
    "layer_norm": [
        Candidate("liger", "liger.LigerLayerNormFunction", "liger_kernel",
                  lambda x, w, b, eps: "no bias" if b is None else _same_float_dtype(x, w, b),
                  _liger_layer_norm),
        Candidate("apex", "apex.fused_layer_norm_affine", "fused_layer_norm_cuda",
                  lambda x, w, b, eps: "no bias" if b is None else _same_float_dtype(x, w, b),
                  _apex_layer_norm),
    ],
    "vocab_parallel_cross_entropy": [
        Candidate("liger", "liger.LigerCrossEntropyFunction", "liger_kernel", _ce_serves,
                  _liger_cross_entropy),
    ],
    "swiglu": [
        Candidate("liger", "liger.LigerSiLUMulFunction", "liger_kernel",
                  lambda x: None if x.size(-1) % 2 == 0 else "odd last dim", _liger_swiglu),
    ],
    "attention": [
        Candidate("flash_attn", "flash_attn_4.flash_attn_func", "flash_attn.cute", _fa4_serves,
                  _fa4_attention),
    ],
}
LIBRARIES = ("liger", "apex", "flash_attn")


@functools.lru_cache(maxsize=None)
def installed(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # not installed, or installed without its compiled parts
        return False


def library_installed(library: str) -> bool:
    return any(installed(c.module) for cands in CANDIDATES.values() for c in cands
               if c.library == library)


_core = None


def _mode() -> str:
    global _core
    if _core is None:       # imported on first use: megatron_adapt.core imports the backends
        from megatron_adapt import core as _c
        _core = _c
    return _core.active_config().external


# ---- the tournament ---------------------------------------------------------------------------

_decisions: dict[tuple, Candidate | None] = {}   # signature -> winner (None: ours)
MAX_SIGNATURES = 32   # per op: beyond this (shapes that change every step), ours, unmeasured
_over_cap: set = set()
_libs_present: dict[str, bool] = {}   # op -> any of its candidate libraries importable


def _signature(op, args):
    sig = [op]
    for a in args:
        if isinstance(a, torch.Tensor):     # torch.Size is a tuple: hashable as it is
            sig.append((a.shape, a.dtype, a.requires_grad, a.is_contiguous()))
        elif isinstance(a, (int, float, bool, str)) or a is None:
            sig.append(a)
        else:  # process groups and the like
            sig.append(type(a).__name__)
    return tuple(sig)


def _clone(inputs):
    """Copies of the call's inputs: floats as new leaves (kernels may write into their input)."""
    return [a.detach().clone().requires_grad_(a.requires_grad)
            if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in inputs]


def _fwd_bwd(fn, inputs, dy):
    """One call on copies of `inputs` (kernels may write into their input): (out, input grads)."""
    xs = _clone(inputs)
    out = fn(*xs)
    leaves = [a for a in xs if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(out, leaves, dy, allow_unused=True) if leaves else ()
    return out, grads


def _time_ms(fn, inputs, dy) -> float:
    """Milliseconds of one fwd+bwd call: GPU time on a GPU, the wall clock elsewhere.

    On a GPU the calls are queued behind a GPU sleep (torch.cuda._sleep) long enough for the CPU
    to enqueue all of them, then run back to back between two events: what is measured is the
    kernels' time, not Python's and autograd's launch cost (which training hides by running
    ahead of the GPU). The copies of the inputs each call makes are timed alone and subtracted.
    """
    for _ in range(WARMUP):
        _fwd_bwd(fn, inputs, dy)
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in inputs):
        times = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            _fwd_bwd(fn, inputs, dy)
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    return max(_queued_ms(lambda: _fwd_bwd(fn, inputs, dy)) - _queued_ms(lambda: _clone(inputs)), 1e-4)


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_ms(device) -> float:
    torch.cuda._sleep(1000)            # loads the kernel: its first launch is slow
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def _queued_ms(run) -> float:
    """GPU ms per call of `run`, REPS calls queued behind a GPU sleep. If the sleep ended before
    the CPU had queued them all (the start event already done), the GPU may have idled between
    calls: sleep longer and measure again."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    sleep_ms = 2 * REPS * (time.perf_counter() - t0) * 1e3 + 1
    cycles = _sleep_cycles_per_ms(torch.cuda.current_device())
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(cycles * sleep_ms))
        start.record()
        for _ in range(REPS):
            run()
        queued = not start.query()
        end.record()
        end.synchronize()
        if queued:
            break
        sleep_ms *= 4   # (a call that synchronises with the host never queues: its last try stands)
    return start.elapsed_time(end) / REPS


def _disagreement(ref, got, dtype):
    """None when `got` (out, grads) matches `ref` within TOL, else what differs."""
    (ro, rg), (go, gg) = ref, got
    for name, r, g in [("output", ro, go)] + [(f"gradient {i}", a, b) for i, (a, b) in enumerate(zip(rg, gg))]:
        if r is None or g is None or r.shape != g.shape:
            return f"{name}: shape {None if g is None else tuple(g.shape)} != {tuple(r.shape)}"
        r, g = r.detach().float(), g.detach().float()
        err, scale = (r - g).abs().max().item(), r.abs().max().item()
        if not err <= TOL.get(dtype, 1e-4) * max(scale, 1e-6):
            return f"{name} differs from ours by {err:.3g} (max |ours| {scale:.3g})"
    return None


def measure(ours, candidates, args):
    """Time ours and each candidate on copies of `args`; return (winner or None, notes).

    The ranks of the replica group (ops.replica_group(): Megatron's tensor-parallel group) take
    the slowest of their timings, a rejection on one rank counting as infinitely slow, so that
    they all choose the same kernel: replicated values (a norm's output and weight gradient
    without sequence parallelism) stay bit-identical across them.
    """
    notes = {}
    try:
        times = _measure_here(ours, candidates, args, notes)
    except torch.cuda.OutOfMemoryError:   # every rank still reaches agree(): no rank waits alone
        torch.cuda.empty_cache()
        times = [float("inf")] * (1 + len(candidates))
        notes["ours_ms"] = "not measured: out of GPU memory"
    agreed, ranks = agree(times)
    if ranks > 1:
        notes["agreed_ms"] = [round(t, 4) for t in agreed]
        notes["agreed_over_ranks"] = ranks
    return winner(candidates, agreed), notes


def _measure_here(ours, candidates, args, notes):
    """This rank's timings: ours first, then each candidate (inf when rejected, why in notes)."""
    with torch.enable_grad(), report.uncounted():
        # the call's own data (cloned per run): agreement is checked on what training feeds
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                  and a.is_floating_point() else a for a in args]
        dtype = next(a.dtype for a in inputs if isinstance(a, torch.Tensor) and a.is_floating_point())
        dy = _dy(ours, inputs)
        ref = _fwd_bwd(ours, inputs, dy)
        times = [_time_ms(ours, inputs, dy)]
        notes["ours_ms"] = round(times[0], 4)
        for cand in candidates:
            times.append(float("inf"))
            try:
                why = _disagreement(ref, _fwd_bwd(cand.run, inputs, dy), dtype)
                if why:
                    notes[cand.impl] = f"rejected: {why}"
                    continue
                times[-1] = _time_ms(cand.run, inputs, dy)
            except Exception as exc:  # a library version with another API, an unsupported shape
                notes[cand.impl] = f"rejected: raised {type(exc).__name__}: {str(exc)[:160]}"
                continue
            notes[cand.impl] = round(times[-1], 4)
    return times


def winner(candidates, times):
    """The fastest candidate more than MARGIN faster than ours (times[0]), or None."""
    best, best_ms = None, times[0]
    if not math.isfinite(best_ms):   # ours unmeasured: no basis for a choice
        return None
    for cand, ms in zip(candidates, times[1:]):
        if ms < best_ms and ms < times[0] * (1.0 - MARGIN):
            best, best_ms = cand, ms
    return best


def agree(times):
    """The elementwise max of `times` over the replica group (and its size): every rank of it
    then decides the same. Alone (no group, one rank), the times themselves."""
    from megatron_adapt.ops import replica_group
    group = replica_group()
    if group is None or not torch.distributed.is_initialized():
        return times, 1
    ranks = torch.distributed.get_world_size(group)
    if ranks == 1:
        return times, 1
    device = (torch.device("cuda", torch.cuda.current_device())
              if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu"))
    t = torch.tensor(times, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t.tolist(), ranks


def _dy(fn, inputs):
    with torch.no_grad():
        out = fn(*_clone(inputs))
    return torch.randn_like(out)


def choose(op, ours, args, mode):
    """The candidate that serves this call (None: ours), deciding on the signature's first call."""
    key = _signature(op, args)
    if key in _decisions:      # the hot path: decided on this signature's first call
        return _decisions[key]
    cands = [c for c in CANDIDATES.get(op, ()) if (mode == "auto" or c.library == mode)
             and installed(c.module)]
    if not cands:
        return None
    if sum(k[0] == op for k in _decisions) >= MAX_SIGNATURES:
        if op not in _over_cap:   # said once; every rank of a TP group sees the same shapes
            _over_cap.add(op)
            report.selected(op, "any further signature", "ours", f"more than {MAX_SIGNATURES} "
                            "input signatures (shapes change from call to call): not measured", {})
        return None
    serving, notes = [], {}
    for c in cands:
        why = c.serves(*args)
        if why:
            notes[c.impl] = f"cannot serve: {why}"
        else:
            serving.append(c)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if mode != "auto":      # forced: the library wherever it can serve, unmeasured
        winner = serving[0] if serving else None
        how = (f"{mode} requested (MEGATRON_ADAPT_EXTERNAL={mode}), not measured" if winner else
               f"{mode} requested (MEGATRON_ADAPT_EXTERNAL={mode}) but cannot serve this call")
    elif not serving:
        winner, how = None, "no candidate can serve this call"
    elif not all(t.is_cuda for t in tensors):
        return None         # the Triton interpreter on CPU: timings would mean nothing; ours
    elif torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return None         # cannot time inside a CUDA graph capture or a compiled region
    else:
        winner, timed = measure(ours, serving, args)
        notes.update(timed)
        how = "measured (GPU ms per fwd+bwd on this GPU)"
    _decisions[key] = winner
    report.selected(op, _describe(key), winner.impl if winner else "ours", how, notes)
    return winner


def _describe(key):
    parts = []
    for k in key[1:]:
        if isinstance(k, tuple) and len(k) == 4:
            shape, dtype, grad, _ = k
            parts.append(f"{list(shape)} {str(dtype).replace('torch.', '')}{' grad' if grad else ''}")
    return ", ".join(parts)


def selectable(op):
    """Wrap our op `op`: calls go to a faster installed library's kernel where one was chosen."""
    def wrap(ours):
        libs = {c.module for c in CANDIDATES.get(op, ())}

        params = inspect.signature(ours)

        @functools.wraps(ours)
        def call(*args, **kwargs):
            if kwargs:   # every argument positional, defaults included (args stops at a gap)
                bound = params.bind(*args, **kwargs)
                bound.apply_defaults()
                args = tuple(bound.args)
            mode = _mode()
            if mode != "off":
                if mode in LIBRARIES and not library_installed(mode):
                    from megatron_adapt.errors import ConfigError
                    raise ConfigError(f"MEGATRON_ADAPT_EXTERNAL={mode}, but {mode} is not installed "
                                      f"(or lacks its compiled parts): install it, or use auto / off")
                present = _libs_present.get(op)
                if present is None:   # once: the libraries do not come and go in a run
                    present = _libs_present[op] = any(installed(m) for m in libs)
                if present:
                    winner = choose(op, ours, args, mode)
                    if winner is not None:
                        report.ran(op, winner.impl)
                        return winner.run(*args)
            return ours(*args)
        call.ours = ours
        return call
    return wrap


def reset() -> None:
    """Forget the decisions (tests; a new configuration)."""
    _decisions.clear()
    _over_cap.clear()
    _libs_present.clear()
    installed.cache_clear()

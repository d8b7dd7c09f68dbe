"""Where the host's wall time goes in a training run's steady steps: a stack sampler.

Put this folder on PYTHONPATH (after megatron-adapt's bootstrap, which chains to it) with
HOST_SAMPLER_OUT=FILE.json set; every process then samples its main thread's Python stack every
HOST_SAMPLER_MS (0.5) ms from a daemon thread. A sample counts once Megatron's `train` loop has
reached iteration HOST_SAMPLER_FROM (6), so graph captures and warm-up stay out; it is weighted by
the wall time since the previous sample, so a frame holding the GIL through a long native call
(a kernel launch, a sync) still gets that time. At exit it writes, per rank (FILE with the rank
before .json): the sampled seconds, iterations covered, and the top frames by self time (the
innermost Python line) and by inclusive time (every function on the stack, once per sample).

A profiler of our own, not py-spy, because the GPU machines have no network to install one.
"""
import atexit
import collections
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("HOST_SAMPLER_OUT")


def _train_iteration(frame):
    """Megatron's `train` loop iteration on this stack, or None outside it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "train" and code.co_filename.endswith("training/training.py"):
            return frame.f_locals.get("iteration")
        frame = frame.f_back
    return None


def _label(frame, line=True):
    code = frame.f_code
    parts = code.co_filename.rsplit("/", 3)
    name = "/".join(parts[-2:])
    return f"{name}:{frame.f_lineno if line else code.co_firstlineno} {code.co_name}"


def _start():
    main = threading.main_thread().ident
    every = float(os.environ.get("HOST_SAMPLER_MS", "0.5")) / 1000
    start_at = int(os.environ.get("HOST_SAMPLER_FROM", "6"))
    self_time, incl_time = collections.Counter(), collections.Counter()
    state = {"seconds": 0.0, "first": None, "last": None}

    def sample():
        last = time.perf_counter()
        while True:
            time.sleep(every)
            now = time.perf_counter()
            dt, last = now - last, now
            frame = sys._current_frames().get(main)
            if frame is None:
                continue
            it = _train_iteration(frame)
            if it is None or it < start_at:
                continue
            state["first"] = it if state["first"] is None else state["first"]
            state["last"] = it
            state["seconds"] += dt
            self_time[_label(frame)] += dt
            seen = set()
            while frame is not None:
                key = _label(frame, line=False)
                if key not in seen:
                    seen.add(key)
                    incl_time[key] += dt
                frame = frame.f_back

    def dump():
        if state["first"] is None:   # not a training process (torchrun's agent), or no steady step
            return
        rank = os.environ.get("RANK", "0")
        out = _OUT[:-5] if _OUT.endswith(".json") else _OUT
        steps = state["last"] - state["first"]
        ms = lambda c: [(k, round(v * 1e3, 2)) for k, v in c.most_common(60)]  # noqa: E731
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"sampled_s": round(state["seconds"], 3), "iterations": [state["first"], state["last"]],
                       "steps_covered": steps, "self_ms": ms(self_time), "inclusive_ms": ms(incl_time)},
                      f, indent=1)

    threading.Thread(target=sample, daemon=True, name="host-sampler").start()
    atexit.register(dump)


if _OUT:
    _start()

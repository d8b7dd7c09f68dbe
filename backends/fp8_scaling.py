"""fp8 scaling: the recipe and one linear's scaling state, as Transformer Engine defines them.

Backend-neutral (plain PyTorch on whatever device the state lives on); the backends' fp8 GEMMs
read scales from it and record amaxes into it. Never imports Megatron.

Formats: `e4m3` casts every tensor to float8_e4m3fn; `hybrid` casts forward tensors (input, weight)
to e4m3 and gradients to float8_e5m2.

Recipes (a tensor x is cast as `saturate(x * scale)` and the GEMM multiplies by `1 / scale`):
- `tensorwise` (TE's Float8CurrentScaling): scale = fp8_max / amax(x) of the tensor being cast
  (amax 0 or not finite: scale 1; an infinite scale: the largest fp32).
- `delayed` (TE's DelayedScaling): the scale comes from earlier steps. Each cast records its amax in
  the current row, `amax_history[0]`; after the step, `update()` takes amax = max over the history
  (`max`) or `amax_history[0]` (`most_recent`), rolls the history one row back (row 0 moves to the
  end) and zeroes row 0, then sets scale = fp8_max / amax / 2^margin where amax is finite and > 0
  (otherwise the scale is kept; an infinite one becomes the largest fp32). `interval` > 1
  recomputes the scale every `interval`-th update only (the history rolls every update).
  With an amax reduction group (Megatron's `get_amax_reduction_group`, which its fp8 context hands
  TE as `fp8_group`), each update first all-reduces the current row (MAX) over that group, as TE's
  `DelayedScaling(reduce_amax=True)` does, so every rank of a layer's tensor-, data- and
  context-parallel group casts with the same scales and saves the same state.

- `blockwise` (TE's Float8BlockScaling, DeepSeek-V3's): current scaling per block, a scale for
  every 1 x 128 run of an activation or gradient along the GEMM's reduction dimension and for every
  128 x 128 block of a weight. No state between calls.

Slots: forward 0 = input, 1 = weight; backward 0 = output gradient.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_adapt import report

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "blockwise")
_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Fp8Recipe:
    format: str = "hybrid"
    recipe: str = "tensorwise"
    margin: int = 0
    interval: int = 1
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True          # the weight-gradient GEMM in fp8 too (Megatron's --fp8-wgrad)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"fp8 format {self.format!r}: one of {FORMATS}")
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r}: one of {RECIPES}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo {self.amax_compute_algo!r}: 'max' or 'most_recent'")
        if self.amax_history_len < 1 or self.interval < 1:
            raise ValueError("amax_history_len and interval must be >= 1")

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


def current_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """tensorwise: fp8_max / amax (fp32), 1 where amax is 0 or not finite, fp32 max where infinite."""
    amax = amax.float()
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, fp8_max / torch.where(ok, amax, torch.ones_like(amax)), torch.ones_like(amax))
    return torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)


def delayed_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """TE's delayed-scaling scale: fp8_max / amax / 2^margin where amax is finite and > 0, else the
    previous `scale`; an infinite result becomes the largest fp32."""
    sf = (fp8_max / amax) / (2.0 ** margin)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    return torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)


class Fp8Scaling:
    """One linear's fp8 scaling state (delayed scaling keeps amax histories and scales; tensorwise
    keeps nothing between calls). Its tensors live on `device`, fp32."""

    def __init__(self, recipe: Fp8Recipe, device=None):
        self.recipe = recipe
        n = recipe.amax_history_len
        self.amax_history = {"fwd": torch.zeros(n, 2, device=device), "bwd": torch.zeros(n, 1, device=device)}
        self.scale = {"fwd": torch.ones(2, device=device), "bwd": torch.ones(1, device=device)}
        self.updates = {"fwd": 0, "bwd": 0}
        self.recomputing = False
        self.amax_group = None    # a torch.distributed group to all-reduce amaxes over (delayed)

    def recomputed(self, fwd_scale: torch.Tensor) -> "Fp8Scaling":
        """This state as a recomputed forward sees it (TE's checkpoint rule): forward scales
        `fwd_scale` (what the original forward cast with), its amaxes recorded into a scratch row,
        no forward update; the backward's history, scales and counters are this state's own."""
        view = Fp8Scaling.__new__(Fp8Scaling)
        view.recipe, view.updates, view.recomputing = self.recipe, self.updates, True
        view.amax_group = self.amax_group
        view.amax_history = {"fwd": torch.zeros_like(self.amax_history["fwd"]), "bwd": self.amax_history["bwd"]}
        view.scale = {"fwd": fwd_scale, "bwd": self.scale["bwd"]}
        return view

    def to(self, device) -> "Fp8Scaling":
        """Move the state's tensors (a module's `.cuda()` does not move them: they are no buffers)."""
        for d in ("fwd", "bwd"):
            self.amax_history[d] = self.amax_history[d].to(device)
            self.scale[d] = self.scale[d].to(device)
        return self

    def fp8_max(self, direction: str) -> float:
        return FP8_MAX[self.recipe.fwd_dtype if direction == "fwd" else self.recipe.bwd_dtype]

    def record(self, direction: str, slot: int, amax: torch.Tensor) -> None:
        """Delayed scaling: this step's amax of slot (max with what the step recorded already)."""
        row = self.amax_history[direction][0, slot:slot + 1]
        torch.maximum(row, amax.float().reshape(1), out=row)

    def reduce_amax(self, direction: str) -> None:
        """The current row's amaxes, all-reduced (MAX) over `amax_group` (TE's reduce_amax); the
        first step of every update, so each rank calls it in the same order (the group's ranks hold
        the same layers). The group is None where there is nothing to reduce (patches/fp8.py's
        amax_reduction_group gives no 1-rank groups)."""
        group = self.amax_group
        if group is None:
            return
        dist.all_reduce(self.amax_history[direction][0], op=dist.ReduceOp.MAX, group=group)
        report.ran("fp8_amax_reduction",
                   f"all_reduce(MAX) over {dist.get_world_size(group)} ranks (Megatron's amax reduction group)")

    def update(self, direction: str) -> None:
        """Delayed scaling, after a step: amax reduction over the group, amax from the history,
        roll, new scales (TE's order). A recomputed forward makes none (recomputed())."""
        if direction == "fwd" and self.recomputing:
            return
        self.reduce_amax(direction)
        hist, scale, r = self.amax_history[direction], self.scale[direction], self.recipe
        amax = hist.max(dim=0).values if r.amax_compute_algo == "max" else hist[0].clone()
        if hist.shape[0] > 1:
            hist.copy_(torch.roll(hist, -1, 0))
        hist[0].zero_()
        self.updates[direction] += 1
        if (self.updates[direction] - 1) % r.interval == 0:
            scale.copy_(delayed_scale(amax, scale, self.fp8_max(direction), r.margin))

    # ---- checkpoint (TE's idea: the scaling state travels in the module's `_extra_state`)
    def state_dict(self) -> dict:
        return {"recipe": self.recipe.recipe, "format": self.recipe.format,
                "amax_history_fwd": self.amax_history["fwd"].cpu(), "scale_fwd": self.scale["fwd"].cpu(),
                "amax_history_bwd": self.amax_history["bwd"].cpu(), "scale_bwd": self.scale["bwd"].cpu(),
                "updates_fwd": self.updates["fwd"], "updates_bwd": self.updates["bwd"]}

    def load_state_dict(self, state: dict) -> None:
        """Scales and histories from a checkpoint; a history of another length is cut or padded at
        its oldest end (TE's way of loading a different --fp8-amax-history-len)."""
        for d in ("fwd", "bwd"):
            self.scale[d].copy_(state[f"scale_{d}"])
            saved, mine = state[f"amax_history_{d}"], self.amax_history[d]
            n = min(saved.shape[0], mine.shape[0])
            mine.zero_()
            mine[:n].copy_(saved[:n])
            self.updates[d] = int(state.get(f"updates_{d}", 0))

    def to_bytes(self) -> torch.Tensor:
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    @staticmethod
    def from_bytes(t) -> dict | None:
        """The state dict a `to_bytes` tensor holds (None for an empty / absent extra state)."""
        if t is None:
            return None
        if isinstance(t, io.BytesIO):
            t.seek(0)
            return torch.load(t, weights_only=True)
        if isinstance(t, torch.Tensor):
            if t.numel() == 0:
                return None
            return torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=True)
        raise TypeError(f"fp8 extra state: expected a uint8 tensor, got {type(t).__name__}")


class Fp8WeightCache:
    """One linear's fp8 weight copies, kept across the micro-batches of a step as TE keeps them.
    Megatron marks each step's first micro-batch (`set_is_first_microbatch`); the weight is cast
    there and reused until the next one. `skip` tells the next forward what to do: False (cast
    into the cache), True (use it as it is, unless the weight's storage or version changed), or a
    one-element device tensor that the cast kernel reads (nonzero: keep the cache) -- what a CUDA
    graph records, since Megatron replays one graph for first and later micro-batches alike.
    `tensors` is the backend's (w8, w8^T or None, 1/scale); `key` what they were cast from."""

    __slots__ = ("tensors", "key", "skip")

    def __init__(self):
        self.tensors, self.key, self.skip = None, None, False

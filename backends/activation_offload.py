"""Layer-wise activation offloading (Megatron's `--cpu-offloading-num-layers`) without Transformer
Engine: the tensors autograd saves inside the first N transformer layers go to host memory in the
forward and come back in the backward (backend-neutral; the device layer answers `torch.cuda.*`,
which transfer_to_npu points at `torch.npu` on Ascend).

Megatron's transformer block asks TE's `get_cpu_offload_context(...)` for a pair: a context it
enters around every layer's forward, and a function it applies to every layer's output. Here the
context installs `saved_tensors_hooks`, and the function is an autograd identity whose backward
runs just before that layer's backward:

  forward   pack: a saved device tensor of an offloaded layer (not a parameter, not a tensor that
            Megatron or TE marked do-not-offload, at least MIN_BYTES) is copied to pinned host
            memory on a side stream that first waits for the compute stream; the device memory
            is returned to the allocator once that copy has run (`record_stream`).
            The layer-output function records the layer's "offloaded" event.
  backward  the layer-output function of layer i starts the reload of layer i - lookahead (on a
            second side stream, after that layer's "offloaded" event), lookahead = the layers
            kept on the device - 1: the copies overlap that many layers' backward, and the live
            activations never exceed the forward's peak. It also makes sure layer i's own tensors
            are on their way back. unpack makes the
            compute stream wait for the tensor's reload; a tensor whose layer was not prefetched
            is reloaded there and then.

Layers are counted by entries of the context, modulo the model's layer count: Megatron refuses CPU
offloading with pipeline parallelism and with recomputation, so one forward enters each layer
once, in order. Without streams (the cpu backend) the copies are synchronous host-to-host copies:
nothing is saved there, but the path and its numerics are the same.
"""
from __future__ import annotations

import torch

MIN_BYTES = 64 * 1024   # smaller saved tensors (norm statistics, scales) stay where they are


class _Offloaded:
    """One saved tensor in host memory; `device_copy` once it is back (or on its way back)."""
    __slots__ = ("host", "device", "layer", "device_copy", "ready")

    def __init__(self, host, device, layer):
        self.host, self.device, self.layer = host, device, layer
        self.device_copy, self.ready = None, None


class ActivationOffload:
    """The context, and the state shared with the layer-output function.

    `inside_context` stays False: Megatron's linears read it to mark their inputs for TE's
    offload checker (and assert that TE is present when it is true); here every eligible saved
    tensor is offloaded, marked or not."""

    inside_context = False

    def __init__(self, num_layers: int, model_layers: int, streams: bool, on_offload=None):
        self.num_layers, self.model_layers = num_layers, model_layers
        # Reload layer j when the backward reaches layer j + lookahead: as early as possible while
        # the backward's live activations stay under the forward's peak (the model_layers -
        # num_layers layers kept on the device), so the copies overlap that many layers' backward.
        self.lookahead = max(1, model_layers - num_layers - 1)
        self.layer = -1
        self.on_offload = on_offload or (lambda: None)   # called once per offloaded tensor
        self._pending: dict[int, list[_Offloaded]] = {}      # layer -> tensors in host memory
        self._offloaded_event: dict[int, object] = {}
        self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if streams else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.tensors = self.bytes = 0         # totals, for the report and tests
        self.forward_bytes = 0                # offloaded by the current (or last) forward
        self.announced = False

    # ---- the context Megatron enters around each layer
    def __enter__(self):
        self.layer = (self.layer + 1) % self.model_layers
        if self.layer == 0:
            self.forward_bytes = 0
        self._pending.pop(self.layer, None)        # a forward that had no backward (kept nothing)
        self._offloaded_event.pop(self.layer, None)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False

    # ---- saved-tensor hooks
    def _eligible(self, t: torch.Tensor) -> bool:
        if self.layer >= self.num_layers:
            return False
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return False
        if getattr(t, "_do_not_offload", False) or getattr(t, "_TE_do_not_offload", False):
            return False
        if self._streams is not None and t.device.type == "cpu":
            return False
        return t.nbytes >= MIN_BYTES

    def _pack(self, t: torch.Tensor):
        if not self._eligible(t):
            return t
        pin = self._streams is not None
        # torch.empty (not empty_like, which may hand back pageable memory: a device-to-pageable
        # copy blocks the host); contiguous: backward formulas read values, not strides
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if pin:
            d2h = self._streams[0]
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                host.copy_(t, non_blocking=True)
            t.record_stream(d2h)
        else:
            host.copy_(t)
        item = _Offloaded(host, t.device, self.layer)
        self._pending.setdefault(self.layer, []).append(item)
        self.tensors += 1
        self.bytes += t.nbytes
        self.forward_bytes += t.nbytes
        self.on_offload()
        return item

    def _unpack(self, item):
        if not isinstance(item, _Offloaded):
            return item
        if item.device_copy is None:
            self._reload(item)
        if item.ready is not None:
            torch.cuda.current_stream().wait_event(item.ready)
            item.ready = None
        return item.device_copy

    # ---- moving a layer's tensors back
    def _reload(self, item: _Offloaded):
        if self._streams is None:
            item.device_copy = item.host.to(item.device, copy=True)
            return
        h2d = self._streams[1]
        offloaded = self._offloaded_event.get(item.layer)
        h2d.wait_stream(torch.cuda.current_stream())
        if offloaded is not None:
            h2d.wait_event(offloaded)
        else:
            h2d.wait_stream(self._streams[0])
        # allocated from the compute stream's pool (memory the backward frees is reused; an
        # allocation on the side stream would come from a pool of its own, and the reserved
        # memory would grow by what offloading saves); kept until the copy has run
        device_copy = torch.empty(item.host.shape, dtype=item.host.dtype, device=item.device)
        with torch.cuda.stream(h2d):
            device_copy.copy_(item.host, non_blocking=True)
            item.ready = h2d.record_event()
        device_copy.record_stream(h2d)
        item.device_copy = device_copy

    def prefetch(self, layer: int):
        if layer < 0:
            return
        for item in self._pending.pop(layer, ()):
            if item.device_copy is None:
                self._reload(item)
        self._offloaded_event.pop(layer, None)

    def announce(self):
        """Once per process (rank 0): what one forward offloads, so a user can weigh it against the
        host link's bandwidth."""
        from megatron_adapt import report
        if report._rank() == 0:
            print(f"megatron-adapt: activation offloading: layers 0-{self.num_layers - 1} of "
                  f"{self.model_layers} per model chunk, {self.forward_bytes / 1e9:.2f} GB to host "
                  f"memory and back per micro-batch", flush=True)

    def committed(self, layer: int):
        """The layer's forward is done: its tensors' copies are all queued on the d2h stream."""
        if self._streams is not None and layer in self._pending:
            self._offloaded_event[layer] = self._streams[0].record_event()


class _LayerBoundary(torch.autograd.Function):
    """Identity on a layer's output; its backward (just before the layer's own) starts reloads."""

    @staticmethod
    def forward(ctx, hidden_states, offload: ActivationOffload):
        ctx.offload, ctx.layer = offload, offload.layer
        offload.committed(offload.layer)
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):
        offload, layer = ctx.offload, ctx.layer
        offload.prefetch(layer)
        offload.prefetch(layer - offload.lookahead)
        if layer == 0 and not offload.announced:
            offload.announced = True
            offload.announce()
        return grad, None


def offload_context(num_layers: int, model_layers: int, streams: bool, on_offload=None):
    """TE's `get_cpu_offload_context` pair: (context entered around each layer, the function
    Megatron applies to each layer's output)."""
    offload = ActivationOffload(num_layers, model_layers, streams, on_offload)
    return offload, lambda hidden_states: _LayerBoundary.apply(hidden_states, offload)

"""A tiny GPT trained through megatron-core's public API, in parallel over the selected backend.

Used by `megatron-adapt demo` (the README's main job) and by the parity tests. Every run starts
from the same weights: the single-process reference saves its initial weights as a
dist-checkpoint, and each parallel configuration loads them (Megatron reshards TP/PP on load), so
loss curves are comparable step for step.
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch


@dataclass(frozen=True)
class RunConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    steps: int = 20
    backend: str = "cpu"
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    vocab: int = 128
    seq: int = 32
    micro_batch: int = 2
    global_batch: int = 4          # sequences per step, split over dp ranks and micro-batches
    lr: float = 1e-2
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False             # with Megatron's dynamic loss scaler from initial_loss_scale
    initial_loss_scale: float = 2.0 ** 32
    swiglu: bool = False
    normalization: str = "LayerNorm"
    position_embedding: str = "learned_absolute"
    spec: str = "local"            # layer spec: "local" or "te" (TE-named, served by layer_specs)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    patched: bool = True           # False: only the device layer (+rng, jit), Megatron's own ops
    disable: tuple = ()            # patch areas to switch off
    init_from: str | None = None   # dist-checkpoint to load before step 1
    save_init_to: str | None = None
    save_final_to: str | None = None
    print_every: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


OP_AREAS = ("cross_entropy", "norms", "softmax", "attention", "rope", "activations", "optimizer",
            "multi_tensor")


def _batch(step: int, cfg: RunConfig) -> torch.Tensor:
    """Deterministic learnable sequences: t[i+1] = (5 t[i] + 3) mod vocab from a random start."""
    g = torch.Generator().manual_seed(10_000 + step)
    seq = [torch.randint(0, cfg.vocab, (cfg.global_batch, 1), generator=g)]
    for _ in range(cfg.seq):
        seq.append((seq[-1] * 5 + 3) % cfg.vocab)
    return torch.cat(seq, dim=1)  # [n, seq + 1]


def _worker(rank: int, cfg: RunConfig, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # "apex / TE not installed" notices
    import megatron_adapt

    megatron_adapt.revert()
    disable = set(cfg.disable) | (set(OP_AREAS) if not cfg.patched else set())
    megatron_adapt.apply(cfg.backend, disable=disable, quiet=True)
    try:
        queue.put((rank, _train(rank, cfg)))
    except BaseException as exc:  # the parent reports it; never hang the queue
        import traceback

        queue.put((rank, RuntimeError(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")))
        raise


def _train(rank: int, cfg: RunConfig):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_adapt import report

    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) \
        if cfg.backend == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(cfg.tp, cfg.pp)
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        ffn_hidden_size=cfg.ffn,
        use_cpu_initialization=True, pipeline_dtype=dtype, params_dtype=dtype, bf16=cfg.bf16, fp16=cfg.fp16,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        sequence_parallel=cfg.sequence_parallel, normalization=cfg.normalization,
        gated_linear_unit=cfg.swiglu, activation_func=torch.nn.functional.silu if cfg.swiglu else
        torch.nn.functional.gelu, bias_activation_fusion=cfg.swiglu, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=not cfg.swiglu,
        # Megatron's defaults need our patches; unpatched Megatron needs them off (no apex / TE).
        masked_softmax_fusion=cfg.patched, persist_layer_norm=cfg.patched,
        apply_rope_fusion=cfg.patched and cfg.position_embedding == "rope")
    if cfg.spec not in ("local", "te"):
        raise ValueError(f"RunConfig.spec={cfg.spec!r}: expected 'local' or 'te'")
    layer_spec = get_gpt_layer_local_spec(normalization=cfg.normalization) if cfg.spec == "local" \
        else get_gpt_layer_with_transformer_engine_spec()
    model = GPTModel(config, transformer_layer_spec=layer_spec,
                     vocab_size=cfg.vocab, max_sequence_length=cfg.seq,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False,
                     position_embedding_type=cfg.position_embedding).to(device)
    if cfg.bf16 or cfg.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if cfg.init_from:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), cfg.init_from))
    if cfg.save_init_to:
        os.makedirs(cfg.save_init_to, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), cfg.save_init_to)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=cfg.distributed_optimizer)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=0.01, clip_grad=1.0, bf16=cfg.bf16,
                        fp16=cfg.fp16, initial_loss_scale=cfg.initial_loss_scale,
                        params_dtype=dtype, use_distributed_optimizer=cfg.distributed_optimizer),
        [model])
    config.grad_scale_func = optimizer.scale_loss  # as megatron.training does: fp16 loss scaling
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = cfg.global_batch // cfg.dp
    num_micro = per_rank // cfg.micro_batch

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place

    def forward_step(data_iterator, model):
        tokens = next(data_iterator).to(device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        position_ids = torch.arange(cfg.seq, device=device).unsqueeze(0).expand_as(inputs)
        output = model(inputs, position_ids, None, labels=labels)
        return output, partial(loss_func, torch.ones_like(labels, dtype=torch.float32))

    forward_backward = get_forward_backward_func()
    losses, grad_norms, skipped, loss_scales = [], [], [], []
    for step in range(cfg.steps):
        batch = _batch(step, cfg)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        micro = iter(batch.split(cfg.micro_batch))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=micro, model=model,
                               num_microbatches=num_micro, seq_length=cfg.seq,
                               micro_batch_size=cfg.micro_batch, forward_only=False)
        loss_scales.append(float(optimizer.get_loss_scale()))
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            assert cfg.fp16, "optimizer step skipped without a loss scaler"
            skipped.append(step + 1)  # an overflow: the scaler skips the step and backs off
        loss = torch.zeros(1, dtype=torch.float32, device=device)
        if parallel_state.is_pipeline_last_stage():
            loss += sum(o["lm loss"] for o in out) / len(out)
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss /= cfg.dp
        losses.append(float(loss))
        grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        if cfg.print_every and rank == cfg.world - 1 and (step + 1) % cfg.print_every == 0:
            print(f"  [tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}] step {step + 1:3d}  loss {losses[-1]:.4f}"
                  f"  grad-norm {grad_norms[-1]:.3f}" + ("  (skipped: overflow)" if not ok else ""), flush=True)
    if cfg.save_final_to:
        os.makedirs(cfg.save_final_to, exist_ok=True)
        dist_checkpointing.save(model.module.sharded_state_dict(), cfg.save_final_to)
    state = {k: v.detach().float().cpu().numpy() for k, v in model.module.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    result = {"losses": losses, "grad_norms": grad_norms, "skipped": skipped, "loss_scales": loss_scales,
              "last_stage": parallel_state.is_pipeline_last_stage(),
              "ops": report.op_counts(), "patches": report.as_dict()["patches"],
              "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "state": state}
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def _free_port() -> int:
    from megatron_adapt.apps.ports import free_port

    return free_port()


PORT_TRIES = 3


def run(cfg: RunConfig) -> list[dict]:
    """Train `cfg` in cfg.world fresh processes; return each rank's result, ordered by rank.

    A worker that dies before it reports (killed, or failing before `_worker` runs, e.g. at import)
    ends the run at once: the others are stopped and the error names the rank and its exit code
    (its traceback is on stderr above). The rendezvous port is picked free and then released, so
    another process can take it before rank 0 binds it; that run is started again on a new port,
    up to PORT_TRIES times."""
    for attempt in range(1, PORT_TRIES):
        try:
            return _run_on(cfg, _free_port())
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            print(f"megatron-adapt demo: the rendezvous port was taken before rank 0 bound it; "
                  f"starting again on another port ({attempt}/{PORT_TRIES - 1})", file=sys.stderr)
    return _run_on(cfg, _free_port())


def _run_on(cfg: RunConfig, port: int) -> list[dict]:
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, queue)) for r in range(cfg.world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < cfg.world:
            if queue.empty():
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in results and p.exitcode is not None]
                if dead and queue.empty():  # a result put just before exiting is read first
                    rank, code = dead[0]
                    raise RuntimeError(f"demo worker rank {rank} exited with code {code} before it reported "
                                       "a result (its error is printed above)")
                wait([p.sentinel for p in procs], timeout=0.2)  # wakes at once when a worker exits
                continue
            rank, res = queue.get()
            results[rank] = res
            if isinstance(res, BaseException):
                raise res
    finally:
        if len(results) < cfg.world or any(isinstance(r, BaseException) for r in results.values()):
            for p in procs:
                p.terminate()
    for p in procs:
        p.join()
    return [results[r] for r in range(cfg.world)]


def losses_of(results: list[dict]) -> list[float]:
    return next(r["losses"] for r in results if r["last_stage"])


def main(steps: int = 20, backend: str | None = None) -> int:
    """`megatron-adapt demo`: TP=2 then PP=2 over 2 processes, the loss every step, the report."""
    import megatron_adapt
    from megatron_adapt import backends

    name = backend or os.environ.get("MEGATRON_ADAPT_BACKEND", "auto")
    if name == "auto":
        name, why = backends.auto_select()
    backends.load(name)
    print(f"megatron-adapt demo: tiny GPT (2 layers, hidden 64, vocab 128, seq 32) on backend {name}")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        base = RunConfig(steps=steps, backend=name, print_every=1)
        print("reference: 1 process (saves the initial weights every run loads)")
        ref = losses_of(run(replace(base, save_init_to=init, print_every=0)))
        curves = {}
        for label, cfg in (("TP=2", replace(base, tp=2, init_from=init)),
                           ("PP=2", replace(base, pp=2, init_from=init))):
            print(f"{label}: 2 processes")
            results = run(cfg)
            curves[label] = losses_of(results)
        last = results
    ok = True
    for label, curve in curves.items():
        diff = max(abs(a - b) for a, b in zip(curve, ref))
        falling = curve[-1] < 0.7 * curve[0]
        ok &= falling and diff < 1e-3
        print(f"{label}: loss {curve[0]:.4f} -> {curve[-1]:.4f} ({'falling' if falling else 'NOT FALLING'}); "
              f"max |diff| vs 1 process {diff:.2e}")
    report_rank = next(r for r in last if r["last_stage"])
    from megatron_adapt import report

    data = {**report.as_dict(), "patches": report_rank["patches"],
            "ops": [{"op": op, "implementation": impl, "calls": n, "fallback_reason": ""}
                    for op, impls in report_rank["ops"].items() for impl, n in impls.items()]}
    data.update(backend=name, backend_reason="demo", megatron_core=str(megatron_adapt.versions.megatron_core_version()),
                torch=torch.__version__)
    print(report.format_table(data))
    return 0 if ok else 1

"""fp8 checkpoints through Megatron's dist_checkpointing (torch_dist), in a fresh interpreter;
prints PROBE-JSON findings. GPTModel from Megatron's TE layer spec (megatron-adapt's linears), bf16
parameters, fp8 `hybrid` with delayed scaling.

    python fp8_ckpt_worker.py save DIR     train 3 steps in fp8, save DIR/fp8; the uninterrupted 4th
                                           step's loss; a run without fp8 saves DIR/bf16
    python fp8_ckpt_worker.py resume DIR   a fresh fp8 model loads DIR/fp8 (scaling state, next loss)
                                           and DIR/bf16 (fresh scaling state, said once); an e4m3
                                           model loads DIR/fp8 (fresh: other format, said once)
    python fp8_ckpt_worker.py plain DIR    the cpu backend as it is (no fp8 GEMM) loads DIR/fp8 into
                                           a model without fp8, re-saves it as DIR/plain, one step

`save` and `resume` lend the cpu backend the cuda backend's `fp8_linear`, as fp8_worker.py's
`train` does (torch's CPU build has `torch._scaled_mm` for float8); `plain` does not.
"""
import json
import logging
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"


from single_rank import one_rank_env  # noqa: E402

one_rank_env()

import torch


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


said = Said()

out = {}
BASE = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
FP8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
LR = 0.05


def model(seed=0, **kw):
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(**BASE, **kw)
    return Float16Module(config, GPTModel(config, get_gpt_layer_with_transformer_engine_spec(),
                                          vocab_size=128, max_sequence_length=32))


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    return tokens, torch.arange(32).unsqueeze(0).expand(2, -1), torch.randint(0, 128, (2, 32), generator=g)


def step(m, i, update=True):
    """Training step i (SGD: no optimizer state to checkpoint); returns the loss."""
    m.zero_grad(set_to_none=True)
    tokens, pos, labels = batch(i)
    loss = m(tokens, pos, None, labels=labels).float().mean()
    if update:
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
    return loss.item()


def scalings(m):
    return {n: mod.fp8_scaling for n, mod in m.named_modules() if hasattr(mod, "fp8_scaling")}


def scaling_state(m):
    return {n: {k: v for k, v in s.state_dict().items() if k.startswith(("scale", "amax", "updates"))}
            for n, s in scalings(m).items()}


def save(m, name):
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(m.sharded_state_dict(), path)


def load(m, name):
    m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), os.path.join(root, name)))


def fp8_calls():
    return sum(report.op_counts().get("fp8_linear", {}).values())


def run_save():
    m = model(**FP8)
    out["losses"] = [step(m, i) for i in range(3)]
    save(m, "fp8")
    torch.save(scaling_state(m), os.path.join(root, "scaling.pt"))
    out["next_loss"] = step(m, 3)     # the uninterrupted run's 4th step
    out["fp8_calls"] = fp8_calls()
    b = model()
    step(b, 0)
    save(b, "bf16")


def equal_states(a, b):
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(torch.as_tensor(a[n][k]), torch.as_tensor(b[n][k]))
                                           for k in a[n]) for n in a)


def all_fresh(m):
    """Every linear's scaling state as built: scales 1, amax histories 0, no updates."""
    return all(bool(all((s.scale[d] == 1).all() and not s.amax_history[d].any() and s.updates[d] == 0
                        for d in ("fwd", "bwd"))) for s in scalings(m).values())


def run_resume():
    saved = torch.load(os.path.join(root, "scaling.pt"), weights_only=True)
    m = model(seed=7, **FP8)     # other initial weights: they must come from the checkpoint
    load(m, "fp8")
    out["linears"] = len(scalings(m))
    out["scaling_equal"] = equal_states(scaling_state(m), saved)
    out["scale_nontrivial"] = all(bool((s["scale_fwd"] != 1).all()) for s in saved.values())
    out["history_nonzero"] = all(bool(s["amax_history_fwd"].any()) for s in saved.values())
    out["messages_after_fp8_load"] = list(said.messages)
    before = fp8_calls()
    out["next_loss"] = step(m, 3)
    out["fp8_calls"] = fp8_calls() - before
    # control: the same weights with fresh scaling state give another loss (the state matters)
    c = model(seed=7, **FP8)
    load(c, "fp8")
    for s in scalings(c).values():
        s.load_state_dict(type(s)(s.recipe).state_dict())
    out["fresh_scaling_loss"] = step(c, 3, update=False)
    # a checkpoint saved without fp8 into the fp8 model: fresh scaling state, said once
    said.messages.clear()
    f = model(seed=7, **FP8)
    for s in scalings(f).values():   # not fresh before the load, to see the load's effect
        s.scale["fwd"].fill_(3.0)
    load(f, "bf16")
    out["bf16_into_fp8_fresh"] = all_fresh(f)
    out["bf16_into_fp8_messages"] = list(said.messages)
    out["bf16_into_fp8_loss"] = step(f, 0)
    # the fp8 checkpoint (hybrid, delayed) into an e4m3 model: other fp8 maxima, fresh state, said once
    said.messages.clear()
    e = model(seed=7, **{**FP8, "fp8": "e4m3"})
    load(e, "fp8")
    out["into_e4m3_fresh"] = all_fresh(e)
    out["into_e4m3_messages"] = list(said.messages)


def run_plain():
    from megatron_adapt.backends import cpu as cpu_backend

    m = model(seed=7)
    out["classes"] = sorted({type(mod).__name__ for n, mod in m.named_modules() if n.endswith(("linear_qkv", "linear_fc2"))})
    load(m, "fp8")
    out["messages"] = list(said.messages)
    save(m, "plain")   # what it loaded, re-saved before any step (the test compares the weights)
    # a checkpoint saved without fp8 into a model without fp8: nothing to say (the notes re-armed)
    from megatron_adapt.patches import fp8 as fp8_area
    fp8_area._said.clear()
    n = len(said.messages)
    load(model(seed=7), "bf16")
    out["plain_from_bf16_messages"] = said.messages[n:]
    out["loss"] = step(m, 3)
    out["fp8_calls"] = fp8_calls()
    out["cpu_has_fp8_op"] = "fp8_linear" in cpu_backend.BACKEND.ops


def main():
    """Under __main__ only: dist_checkpointing.save starts a process that imports this file."""
    global scenario, root
    scenario, root = sys.argv[1], sys.argv[2]
    import megatron_adapt

    if scenario in ("save", "resume"):
        from megatron_adapt.backends import cpu as cpu_backend

        cpu_backend.BACKEND.ops["fp8_linear"] = "megatron_adapt.backends.cuda.fp8:fp8_linear"
        cpu_backend.BACKEND._loaded["fp8_unavailable"] = lambda: None

    megatron_adapt.apply("cpu", quiet=True)

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_adapt import report

    globals().update(megatron_adapt=megatron_adapt, dist_checkpointing=dist_checkpointing,
                     GPTModel=GPTModel, get_gpt_layer_with_transformer_engine_spec=get_gpt_layer_with_transformer_engine_spec,
                     model_parallel_cuda_manual_seed=model_parallel_cuda_manual_seed,
                     TransformerConfig=TransformerConfig, Float16Module=Float16Module, report=report)
    logging.getLogger("megatron_adapt").addHandler(said)
    dist.init_process_group("nccl")  # the device layer maps it to gloo
    parallel_state.initialize_model_parallel(1, 1)
    {"save": run_save, "resume": run_resume, "plain": run_plain}[scenario]()
    print("PROBE-JSON:" + json.dumps(out))


if __name__ == "__main__":
    main()

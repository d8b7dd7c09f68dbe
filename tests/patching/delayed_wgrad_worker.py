"""--delay-wgrad-compute at the module level, in a fresh interpreter (one rank): each linear the TE
spec gets under megatron-adapt (the provider's column / row / norm+column linears, MLA's duplicated
linear, the grouped expert fc1 / fc2 on core_v0.17+), built with config.delay_wgrad_compute, against
the same module built without it (same weights, same inputs), over two micro-batches.

Per case: input and bias gradients after each backward equal the eager ones while the weight
gradient is not there yet; after backward_dw the weight gradients equal the eager ones, in .grad
(no fusion) or main_grad (gradient-accumulation fusion, Megatron's DDP protocol: dummy .grad,
grad_added_to_main_grad); the hook registered through register_wgrad_accumulation_and_reduce_hooks
fired once per backward_dw; weights (not biases) carry skip_backward_post_hook. A control skips
backward_dw: its weight gradients differ from the eager ones. Prints PROBE-JSON."""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import one_rank_env  # noqa: E402

TP = int(os.environ.get("DELAYED_WGRAD_TP", "1"))  # 2: under torchrun, TP=2 with sequence parallelism
if TP == 1:
    one_rank_env()
import torch  # noqa: E402

import megatron_adapt  # noqa: E402
from megatron_adapt import report  # noqa: E402

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "cpu"
megatron_adapt.apply(BACKEND, quiet=True)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_adapt.patches import layer_specs, moe  # noqa: E402

torch.distributed.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
model_parallel_cuda_manual_seed(0)
DEVICE = "cuda" if BACKEND == "cuda" else "cpu"
H, OUT, TOKENS, EXPERTS = 16, 24, 12, 3


def config(delay: bool, fuse: bool, dtype=torch.float32):
    c = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                          tensor_model_parallel_size=TP, sequence_parallel=TP > 1,
                          normalization="RMSNorm", add_bias_linear=True, params_dtype=dtype,
                          gradient_accumulation_fusion=fuse)
    c.delay_wgrad_compute = delay  # set after __post_init__: its EP-overlap requirements are the schedule's
    return c


def builders():
    provider = gpt_layer_specs.TESpecProvider()
    init = torch.nn.init.normal_
    common = dict(init_method=init, bias=True, skip_bias_add=False, is_expert=False)
    out = {
        "column": lambda c: provider.column_parallel_linear()(H, OUT, config=c, gather_output=False, **common),
        "row": lambda c: provider.row_parallel_linear()(H, OUT, config=c, input_is_parallel=True, **common),
        "norm_column": lambda c: provider.column_parallel_layer_norm_linear()(
            H, OUT, config=c, gather_output=False, **common),
        "duplicated": lambda c: provider.linear()(
            H, OUT, parallel_mode="duplicated", config=c, init_method=init, bias=True, skip_bias_add=False,
            skip_weight_param_allocation=False),
    }
    if hasattr(moe, "grouped_linear_classes"):
        try:
            column, row = moe.grouped_linear_classes(megatron_adapt.core.active_backend())
        except ImportError:  # core_v0.16: no TE-style grouped linears (legacy GroupedMLP)
            column = row = None
        if column is not None:
            out["grouped_fc1"] = lambda c: column(EXPERTS, H, OUT, config=c, init_method=init, bias=True,
                                                 skip_bias_add=False)
            out["grouped_fc2"] = lambda c: row(EXPERTS, H, OUT, config=c, init_method=init, bias=True,
                                              skip_bias_add=False)
    return out


def run(build, delay, fuse, call_dw=True, dtype=torch.float32):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)  # the duplicated linear initialises under the tracker's RNG
    m = build(config(delay, fuse, dtype)).to(DEVICE)
    weights = [p for n, p in m.named_parameters() if n.startswith("weight")]
    if fuse:  # what Megatron's DDP gives each parameter
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=DEVICE)
            p.grad_added_to_main_grad = False
    fired = []
    if delay:
        m.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(1))
    g = torch.Generator().manual_seed(1)
    mid, dgrads = [], []
    grouped = hasattr(m, "num_gemms")
    for mb in range(2):
        main_sums = [w.main_grad.abs().sum().item() if fuse else 0 for w in weights]
        # a row linear's input is split over TP (Megatron's and the grouped one's)
        width = getattr(m, "input_size_per_partition", None) or getattr(m, "in_features", None) or H
        x = torch.randn(TOKENS, width, generator=g).to(DEVICE, dtype).requires_grad_()
        if grouped:
            y, _ = m(x, [4, 0, TOKENS - 4] if mb else [3, 5, TOKENS - 8])
        else:
            y, _ = m(x.view(TOKENS // 2, 2, width))
        before = [None if w.grad is None else w.grad.clone() for w in weights]
        (y.float() * torch.randn(y.shape, generator=g).to(DEVICE)).sum().backward()
        dgrads.append(x.grad.float())
        # did this backward give the weights a gradient (.grad or main_grad changed)?
        mid.append(any((w.grad is not None and (b is None or not torch.equal(w.grad, b)))
                       or (fuse and w.main_grad.abs().sum().item() != main_before)
                       for w, b, main_before in zip(weights, before, main_sums)))
        if delay and call_dw:
            m.backward_dw()
        if fuse:  # what DDP's hook does after each backward: fold .grad into main_grad, clear it
            for p in m.parameters():
                if p.grad is not None and not p.grad_added_to_main_grad:
                    p.main_grad.add_(p.grad.float())
                p.grad = None
    grads = {n: (p.main_grad if fuse else (p.grad if p.grad is not None else torch.zeros_like(p))).float()
             for n, p in m.named_parameters()}
    skip = {n: bool(getattr(p, "skip_backward_post_hook", False)) for n, p in m.named_parameters()}
    return dict(grads=grads, dgrads=dgrads, mid=mid, fired=len(fired), skip=skip)


def diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


res = {}
for name, build in builders().items():
    for fuse in (False, True):
        eager = run(build, False, fuse)
        dl = run(build, True, fuse)
        ctl = run(build, True, fuse, call_dw=False)
        weights = [k for k in eager["grads"] if k.startswith("weight")]
        res[f"{name}/{'fused' if fuse else 'grad'}"] = dict(
            grad_diff=diff(eager["grads"], dl["grads"]),
            dgrad_diff=max((a - b).abs().max().item() for a, b in zip(eager["dgrads"], dl["dgrads"])),
            weight_grad_in_backward=dl["mid"],
            eager_weight_grad_in_backward=eager["mid"],
            control_weight_diff=diff({k: eager["grads"][k] for k in weights}, {k: ctl["grads"][k] for k in weights}),
            control_other_diff=diff({k: eager["grads"][k] for k in eager["grads"] if k not in weights},
                                    {k: ctl["grads"][k] for k in ctl["grads"] if k not in weights}),
            hooks_fired=dl["fired"], skip=dl["skip"], eager_skip=eager["skip"],
            type=type(build(config(True, fuse))).__name__, eager_type=type(build(config(False, fuse))).__name__)
res["report"] = {f"{op}|{impl}": n for (op, impl), n in report._op_counts.items() if op == "delayed_wgrad"}
if torch.distributed.get_rank() == 0:
    print("PROBE-JSON:" + json.dumps(res))
torch.distributed.barrier()

"""`--moe-latent-size` through Megatron's MoELayer (cpu backend, one process): the latent projections
on the provider's duplicated linear, against Megatron's own MoELayer without them. Prints PROBE-JSON.

With moe_latent_size = hidden_size and both projections set to the identity, a latent MoE layer
computes what Megatron's path without latent projections computes on the same weights (router and
shared expert see the hidden states in both; the experts run in the latent space, here the same
space; the reference run sets config.moe_latent_size to None, which MoELayer.forward reads):
outputs and gradients must agree. With a smaller latent size: classes, shapes, the gradients reaching the
projections, their checkpoint keys, and three SGD steps.
"""
import functools
import json
import os
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"
from single_rank import one_rank_env  # noqa: E402

one_rank_env()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import megatron_adapt  # noqa: E402

megatron_adapt.apply("cpu", quiet=True)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

H, E = 32, 4
out = {}


def layer(latent, grouped=True):
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                            moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=40, moe_router_topk=2,
                            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                            moe_aux_loss_coeff=1e-2, moe_grouped_gemm=grouped, add_bias_linear=False,
                            gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True,
                            hidden_dropout=0.0, moe_latent_size=latent)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=E, moe_grouped_gemm=grouped)
    from megatron.core.process_groups_config import ProcessGroupCollection
    mlp, pgs = spec.submodules.mlp, ProcessGroupCollection.use_mpu_process_groups()
    if isinstance(mlp, functools.partial):   # core 0.19's specs: partial(MoELayer, submodules=...)
        return mlp(config=cfg, pg_collection=pgs)
    return build_module(mlp, config=cfg, pg_collection=pgs)


def run(moe, x):
    x = x.clone().requires_grad_(True)
    y, _ = moe(x)
    (y.float() ** 2).mean().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def main():
    if "moe_latent_size" not in TransformerConfig.__dataclass_fields__:
        out["absent"] = True
        return
    dist.init_process_group("nccl")   # the device layer maps it to gloo
    parallel_state.initialize_model_parallel(1, 1)
    x = torch.randn(16, 2, H, generator=torch.Generator().manual_seed(1))
    for grouped in (True, False):
        key = "grouped" if grouped else "sequential"
        moe = layer(H, grouped)
        with torch.no_grad():
            moe.fc1_latent_proj.weight.copy_(torch.eye(H))
            moe.fc2_latent_proj.weight.copy_(torch.eye(H))
        y1, dx1, g1 = run(moe, x)
        moe.zero_grad()
        moe.config.moe_latent_size = None      # Megatron's path without the projections, same weights
        y0, dx0, g0 = run(moe, x)
        moe.config.moe_latent_size = H
        out[f"identity_{key}"] = {
            "experts": type(moe.experts).__name__,
            "out_rel": rel(y1, y0), "dx_rel": rel(dx1, dx0),
            "grad_rel_max": max(rel(g1[n], g0[n]) for n in g0), "grads_compared": len(g0),
            "latent_grads": sorted(n for n in g1 if "latent" in n),
        }
    moe = layer(16)
    p1, p2 = moe.fc1_latent_proj, moe.fc2_latent_proj
    y, dx, grads = run(moe, x * 100)
    experts_fc1 = [p for n, p in moe.experts.named_parameters() if "linear_fc1" in n]
    sd = moe.sharded_state_dict(prefix="mlp.")
    losses = []
    target = torch.randn(16, 2, H, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(moe.parameters(), lr=0.5)
    for _ in range(4):
        opt.zero_grad()
        y, _ = moe(x)
        loss = F.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["latent16"] = {
        "classes": sorted({type(p1).__name__, type(p2).__name__}),
        "shapes": [list(p1.weight.shape), list(p2.weight.shape)],
        "expert_fc1_in": sorted({p.shape[-1] for p in experts_fc1}),
        "shared_fc1_in": moe.shared_experts.linear_fc1.weight.shape[-1],
        "router_in": moe.router.weight.shape[-1],
        "out_shape": list(y.shape), "dx_shape": list(dx.shape),
        "latent_grad_norms": [float(grads["fc1_latent_proj.weight"].norm()), float(grads["fc2_latent_proj.weight"].norm())],
        "latent_keys": sorted(k for k in sd if "latent" in k),
        "losses": losses,
    }


main()
print("PROBE-JSON:" + json.dumps(out))

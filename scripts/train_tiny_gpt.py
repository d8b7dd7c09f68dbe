"""Train the demo's tiny GPT on one backend, patched and with Megatron's own ops, and print both
loss curves and which implementation served each op.

    python scripts/train_tiny_gpt.py --backend cuda --steps 20 [--bf16] [--llama] [--world 1]
"""
import argparse
import json
import os
import tempfile
from dataclasses import replace

os.environ.setdefault("MEGATRON_ADAPT_AUTO", "0")

from megatron_adapt.apps.demo import RunConfig, losses_of, run  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--llama", action="store_true", help="RMSNorm + SwiGLU + RoPE")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--json", default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    cfg = RunConfig(backend=a.backend, steps=a.steps, bf16=a.bf16, hidden=a.hidden, heads=8, ffn=4 * a.hidden, lr=a.lr,
                    vocab=1024, seq=128, num_layers=2,
                    **(dict(normalization="RMSNorm", swiglu=True, position_embedding="rope") if a.llama else {}))
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        ours = run(replace(cfg, save_init_to=init))
        stock = run(replace(cfg, init_from=init, patched=False))
    a_curve, b_curve = losses_of(ours), losses_of(stock)
    print("step  megatron-adapt  megatron-own-ops")
    for i, (x, y) in enumerate(zip(a_curve, b_curve)):
        print(f"{i + 1:4d}  {x:14.4f}  {y:16.4f}")
    print(f"max |diff| {max(abs(x - y) for x, y in zip(a_curve, b_curve)):.3e}")
    print("ops that ran (megatron-adapt):", json.dumps(ours[0]["ops"], indent=1))
    print("patches:", json.dumps({p["target"]: p["status"] + (f" ({p['reason']})" if p["reason"] else "")
                                  for p in ours[0]["patches"]}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ours": a_curve, "megatron_own_ops": b_curve, "ops": ours[0]["ops"],
                       "patches": ours[0]["patches"]}, f, indent=1)


if __name__ == "__main__":
    main()

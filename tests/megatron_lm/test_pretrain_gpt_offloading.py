"""Stock pretrain_gpt.py with Megatron's activation offloading under megatron-adapt-run, cpu backend,
2 processes: `--cpu-offloading-num-layers 1` (patches/offloading: TE's get_cpu_offload_context served)
and `--fine-grained-activation-offloading --offload-modules core_attn` (Megatron's own manager, TE's
cpu_offload flag and the GPU-affinity call served). Both train exactly as without offloading (the
offloaded copies are read back bit for bit); the report names what ran. On the cpu backend the
copies are host to host: the GPU figures (memory, ms/iteration) are in docs/model-families.md."""
from __future__ import annotations

from test_pretrain_gpt import NEEDS_CHECKOUT, TINY_GPT, launch_reported, pytestmark  # noqa: F401

ITERS = 4


def run(tmp_path, name, *flags):
    return launch_reported("pretrain_gpt.py", [*TINY_GPT, "--train-iters", str(ITERS), *flags], tmp_path, name)


def test_offloading_trains_as_without_it(tmp_path):
    base = run(tmp_path, "base")
    layers = run(tmp_path, "layers", "--cpu-offloading-num-layers", "1")
    fine = run(tmp_path, "fine", "--fine-grained-activation-offloading", "--offload-modules", "core_attn")
    assert sorted(base.losses) == list(range(1, ITERS + 1))
    assert layers.losses == base.losses, (layers.losses, base.losses)
    assert fine.losses == base.losses, (fine.losses, base.losses)
    # 1 layer of 2, 4 micro-batches per iteration on this rank: every iteration offloads
    assert layers.ops["activation_offload"]["implementation"] == "cpu.host_copy"
    assert layers.ops["activation_offload"]["calls"] >= ITERS * 4
    assert "activation offloading: layers 0-0 of 2 per model chunk" in layers.out
    assert "activation_offload" not in base.ops and "activation_offload" not in fine.ops
    assert fine.ops["device_affinity"]["implementation"] == "cpu.unchanged"
    assert "TE CPU offload is not available" not in fine.out

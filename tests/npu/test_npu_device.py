"""The npu device layer under the EMULATION: install() imports torch_npu's transfer_to_npu (here:
the CPU device layer) and maps nccl -> hccl; uninstall() restores everything; a second install
works again. Two ranks create "nccl" groups that arrive as (emulated) HCCL."""
import os
import sys

import torch
import torch.distributed as dist

EMULATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulation")


def test_install_uninstall_is_reversible_and_repeatable(torch_npu):
    from megatron_adapt.backends.cpu import device as cpu_device
    from megatron_adapt.backends.npu import device

    originals = (dist.init_process_group, dist.new_group, torch.cuda.current_device, torch.cuda.synchronize)
    for _ in range(2):
        device.install()
        device.install()  # idempotent
        assert device.installed() and cpu_device.installed()
        assert dist.init_process_group is not originals[0] and dist.new_group is not originals[1]
        assert dist.init_process_group.__wrapped__.__module__ == "megatron_adapt.backends.cpu.device"
        assert torch.cuda.current_device() == 0
        assert torch.zeros(2, device="cuda").device.type == "cpu"   # 'cuda' -> the (emulated) NPU
        device.uninstall()
        device.uninstall()
        assert not device.installed() and not cpu_device.installed()
        assert (dist.init_process_group, dist.new_group, torch.cuda.current_device,
                torch.cuda.synchronize) == originals


def test_nccl_names_map_to_hccl():
    from megatron_adapt.backends.npu.device import _hccl

    assert _hccl("nccl") == "hccl" and _hccl("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:hccl"
    assert _hccl("gloo") == "gloo" and _hccl(None) is None


def _free_port():
    from megatron_adapt.apps.ports import free_port

    return free_port()


def _rank(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      MEGATRON_ADAPT_AUTO="0")
    try:
        from megatron_adapt.backends.npu import device

        device.install()
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        group = dist.new_group([0, 1], None, "nccl")
        # Megatron's HyperCommGrid: new_subgroups_by_enumeration calls distributed_c10d's new_group
        subgroup, _ = dist.new_subgroups_by_enumeration([[0, 1]], backend="nccl")
        t = torch.full((3,), float(rank + 1), device="cuda")
        dist.all_reduce(t, group=group)
        dist.all_reduce(t, group=subgroup)
        queue.put((rank, dist.get_backend(), dist.get_backend(group), dist.get_backend(subgroup), t.tolist()))
        dist.destroy_process_group()
        device.uninstall()
    except BaseException as exc:  # report, never hang the parent
        queue.put((rank, repr(exc), None, None, None))


def test_nccl_groups_arrive_as_hccl_over_two_ranks():
    import torch.multiprocessing as mp

    sys.path.insert(0, EMULATION_DIR)
    try:
        ctx = mp.get_context("spawn")
        queue, port = ctx.SimpleQueue(), _free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(queue.get() for _ in procs)
        for p in procs:
            p.join(60)
    finally:
        sys.path.remove(EMULATION_DIR)
    assert results == [(0, "hccl", "hccl", "hccl", [6.0] * 3), (1, "hccl", "hccl", "hccl", [6.0] * 3)]

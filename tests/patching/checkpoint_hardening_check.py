"""MEGATRON_ADAPT_CHECKPOINT_HARDEN=1 through megatron-core's real checkpoint code, one process
over gloo, process umask 0000: dist_checkpointing.save of a small GPTModel (sync and async), the
modes of everything written, load of the hardened checkpoint, refusal of a world-writable file,
and weights_only=True on common.pt even where torch's default would not ask for it.

    python checkpoint_hardening_check.py DIR     (prints PROBE-JSON: {...})
"""
import json
import os
import stat
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["MEGATRON_ADAPT_AUTO"] = "0"


from single_rank import one_rank_env  # noqa: E402

one_rank_env()

import torch  # noqa: E402

import megatron_adapt  # noqa: E402
import megatron_adapt.core  # noqa: E402

megatron_adapt.apply("cpu", quiet=True)  # the switch comes from the environment

import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_adapt.patches.checkpoint_hardening import CheckpointSecurityError  # noqa: E402


class NotAllowListed:
    """A type torch's weights_only unpickler does not know: common.pt holding one cannot load."""

    def __init__(self, value):
        self.value = value


def modes(root):
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        out[os.path.relpath(dirpath, root)] = stat.S_IMODE(os.stat(dirpath).st_mode)
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def main(tmp):
    os.umask(0)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    res = {"hardened": megatron_adapt.core.active_config().checkpoint_harden}

    sync_dir = os.path.join(tmp, "sync")
    os.makedirs(sync_dir)  # created by the caller, under umask 0000: 0777, hardened by the save
    state = model.sharded_state_dict()
    state["extra"] = {"note": "x"}
    dist_checkpointing.save(state, sync_dir)
    res["sync_modes"] = modes(sync_dir)

    async_dir = os.path.join(tmp, "async")
    os.makedirs(async_dir)
    try:   # megatron-core 0.19 defaults async saves to nvidia-resiliency-ext ("nvrx"); ours is "mcore"
        request = dist_checkpointing.save(model.sharded_state_dict(), async_dir, async_sharded_save=True,
                                          async_strategy="mcore")
    except TypeError:   # releases without async_strategy
        request = dist_checkpointing.save(model.sharded_state_dict(), async_dir, async_sharded_save=True)
    request.execute_sync()  # runs the writer, then every finalize function (Megatron's, then ours)
    res["async_modes"] = modes(async_dir)

    loaded = dist_checkpointing.load(model.sharded_state_dict(), sync_dir)
    res["loaded_identical"] = all(torch.equal(loaded[k], v) for k, v in model.state_dict().items()
                                  if isinstance(v, torch.Tensor) and not k.endswith("_extra_state"))

    victim = os.path.join(sync_dir, "common.pt")
    os.chmod(victim, 0o666)
    try:
        dist_checkpointing.load(model.sharded_state_dict(), sync_dir)
        res["world_writable"] = "loaded"
    except CheckpointSecurityError as e:
        res["world_writable"] = str(e)
    try:
        dist_checkpointing.load_common_state_dict(sync_dir)
        res["world_writable_common"] = "loaded"
    except CheckpointSecurityError as e:
        res["world_writable_common"] = str(e)
    os.chmod(victim, 0o640)

    # weights_only: simulate torch < 2.6, whose torch.load defaults to weights_only=False.
    torch.serialization._default_to_weights_only = lambda pickle_module: False
    pickled = os.path.join(tmp, "pickled")
    os.makedirs(pickled)
    state = model.sharded_state_dict()
    state["extra"] = NotAllowListed(3)
    dist_checkpointing.save(state, pickled)
    try:
        common = dist_checkpointing.load_common_state_dict(pickled)
        res["weights_only"] = f"loaded {type(common.get('extra')).__name__}"
    except Exception as e:  # torch's UnpicklingError: "Weights only load failed ..."
        res["weights_only"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("PROBE-JSON:" + json.dumps(res), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

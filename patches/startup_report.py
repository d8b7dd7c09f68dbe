"""Print the patch table on rank 0 once Megatron has set up model parallelism, and name the
tensor-parallel group to the backends (`ops.set_replica_group`): a kernel chosen at run time
among libraries must be the same on all its ranks.

By then Megatron's modules are imported and every post-import hook has fired, so the table shows
what is really in place (at `import megatron_adapt` most rows would still be pending).
"""
from megatron_adapt import report
from megatron_adapt.ops import set_replica_group
from megatron_adapt.spec import WRAP, PatchSpec

_printed = []


def build(backend, original):
    def initialize_model_parallel(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        from megatron.core import parallel_state

        set_replica_group(lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False))
        if not _printed:
            _printed.append(True)
            from megatron_adapt.core import _state

            config = _state.get("config")
            report.print_startup_table(quiet=bool(config and config.quiet))
        return result
    return initialize_model_parallel


SPECS = [
    PatchSpec("megatron.core.parallel_state:initialize_model_parallel", area="startup_report",
              mode=WRAP, build=build),
]

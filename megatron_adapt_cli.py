"""Entry points of the `megatron-adapt` and `megatron-adapt-run` console scripts.

They live outside the `megatron_adapt` package on purpose: importing any part of that package runs
its `__init__`, which applies the patches (unless MEGATRON_ADAPT_AUTO=0). A command must not patch
its own process just by starting (`megatron-adapt report` then refused to apply the configuration
it was asked for), so the package is imported inert here, and the environment is restored at once:
what the commands start (demo workers, the launcher's command) sees the user's settings unchanged.
"""
import os
import sys


def _import_inert(module: str):
    import importlib

    before = os.environ.get("MEGATRON_ADAPT_AUTO")
    os.environ["MEGATRON_ADAPT_AUTO"] = "0"
    try:
        return importlib.import_module(module)
    finally:
        if before is None:
            del os.environ["MEGATRON_ADAPT_AUTO"]
        else:
            os.environ["MEGATRON_ADAPT_AUTO"] = before


def main() -> int:
    """`megatron-adapt report | demo | run`."""
    return _import_inert("megatron_adapt.cli").main()


def run() -> int:
    """`megatron-adapt-run <command ...>`."""
    return _import_inert("megatron_adapt.launcher").main()


if __name__ == "__main__":
    sys.exit(main())

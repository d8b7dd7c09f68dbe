"""`megatron-adapt-run <command ...>`: run any command with the patches applied in every Python
process it starts (torchrun's workers included), with no edit of the script.

It prepends megatron_adapt/bootstrap to PYTHONPATH, where a `sitecustomize` imports megatron_adapt
at interpreter start-up (then chains to any other sitecustomize on the path), and execs the
command. Every rank inherits the environment, so MEGATRON_ADAPT_* settings reach all of them.
"""
from __future__ import annotations

import os
import shutil
import sys

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    env = os.environ
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP] + paths)
    lm = env.get("MEGATRON_LM_PATH")
    if lm and lm not in paths:  # Megatron-LM's training code is not on PyPI: put the checkout on the path
        env["PYTHONPATH"] += os.pathsep + lm
    env["MEGATRON_ADAPT_LAUNCHER"] = "1"
    exe = shutil.which(argv[0])
    if exe is None:
        print(f"megatron-adapt-run: command not found: {argv[0]}", file=sys.stderr)
        return 127
    os.execv(exe, argv)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

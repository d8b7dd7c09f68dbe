"""Summarise the stock Megatron-LM runs that tests/megatron_lm made: one markdown row per launch.

    MEGATRON_LM_PATH=... pytest tests/megatron_lm --basetemp DIR
    python scripts/stock_run_table.py DIR

Each launch's log (written by the tests next to its checkpoints) starts with the command line; the
row gives the parallel layout and precision read from it, the iterations that printed an `lm loss`,
and the first and last loss.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.]+E[+-]\d+)")
SIMPLE_RE = re.compile(r"Iteration (\d+): Losses reduced: \[\{'lm loss': tensor\(([0-9.]+)")
FLAGS = {"--tensor-model-parallel-size": "TP", "--pipeline-model-parallel-size": "PP",
         "--num-layers-per-virtual-pipeline-stage": "VPP-layers"}
SWITCHES = {"--sequence-parallel": "SP", "--use-distributed-optimizer": "dist-opt", "--bf16": "bf16",
            "--fp16": "fp16", "--swiglu": "llama-like", "--load": "resumed"}


def describe(command: str) -> str:
    args = command.split()
    parts = []
    if "run_simple_mcore_train_loop.py" in command:
        return "examples/run_simple_mcore_train_loop.py (TP=2)"
    for flag, name in FLAGS.items():
        if flag in args:
            value = args[args.index(flag) + 1]
            if value != "1" or name == "VPP-layers":
                parts.append(f"{name}={value}")
    parts += [name for flag, name in SWITCHES.items() if flag in args]
    if "--transformer-impl" in args:
        parts.append(f"impl={args[args.index('--transformer-impl') + 1]}")
    return ", ".join(parts) or "DP=2, fp32"


def rows(root: Path):
    for log in sorted(root.rglob("*.log")):
        text = log.read_text(errors="replace")
        command = text.splitlines()[0] if text else ""
        losses = {int(i): float(v) for i, _, v in ITER_RE.findall(text)}
        losses = losses or {int(i): float(v) for i, v in SIMPLE_RE.findall(text)}
        if not losses:
            continue
        first, last = min(losses), max(losses)
        yield (log.parent.name.rstrip("0123456789"), log.stem, describe(command),
               f"{first}-{last}", f"{losses[first]:.4f}", f"{losses[last]:.4f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("basetemp", type=Path)
    args = parser.parse_args(argv)
    table = list(rows(args.basetemp))
    if not table:
        print(f"no launch logs with losses under {args.basetemp}", file=sys.stderr)
        return 1
    print("| test | launch | layout | iterations | first loss | last loss |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

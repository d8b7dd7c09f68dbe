"""`megatron-adapt report | demo | run`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def _report(args) -> int:
    import megatron_adapt
    from megatron_adapt.core import all_specs

    # The console script imports the package inert (megatron_adapt_cli); `python -m megatron_adapt.cli`
    # cannot, so whatever its import applied is undone first: the table is for the backend asked here.
    megatron_adapt.revert()
    megatron_adapt.apply(args.backend, quiet=True)
    # Import every patched Megatron module so each hook fires; modules this environment lacks
    # (megatron.training without a Megatron-LM checkout) are reported as such.
    from megatron_adapt import report

    for module in sorted({s.module for s in all_specs()}):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            for s in all_specs():
                rec = report.patch_record(s)
                if s.module == module and rec.status == report.PENDING:
                    rec.status, rec.reason = report.SKIPPED, f"module not importable here: {exc}"
    if args.json:
        import json

        print(json.dumps(megatron_adapt.report(as_json=True), indent=1))
    else:
        print(megatron_adapt.report())
    failed = [p for p in megatron_adapt.report(as_json=True)["patches"] if p["status"] == report.FAILED]
    return 1 if failed else 0


def _demo(args) -> int:
    os.environ.setdefault("MEGATRON_ADAPT_AUTO", "0")
    from megatron_adapt.apps import demo

    return demo.main(steps=args.steps, backend=args.backend)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-adapt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="print the patch table for this environment")
    p.add_argument("--backend", default=None, help="auto|cuda|npu|cpu (default: MEGATRON_ADAPT_BACKEND)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_report)
    p = sub.add_parser("demo", help="train a tiny GPT with TP=2 then PP=2 on 2 processes")
    p.add_argument("--backend", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.set_defaults(func=_demo)
    p = sub.add_parser("run", help="same as megatron-adapt-run: run a command with the patches applied")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: __import__("megatron_adapt.launcher").launcher.main(a.cmd))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:
        from megatron_adapt.errors import MegatronAdaptError

        if isinstance(exc, MegatronAdaptError):
            print(f"megatron-adapt: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

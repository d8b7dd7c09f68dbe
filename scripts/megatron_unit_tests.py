"""Run Megatron-LM's own unit tests under megatron-adapt and print per-file / per-directory counts.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python scripts/megatron_unit_tests.py \
        --backend cpu --nproc 2 --out /tmp/ut [--set core16] [--dirs dist_checkpointing data ...]

Runs, from the checkout's root (it must match the installed megatron-core: tag core_v<version>),

    megatron-adapt-run python -m torch.distributed.run --nproc-per-node N -m pytest \
        -p megatron_adapt.apps.pytest_plugin --megatron-adapt-json OUT/<run>/rank{rank}.json FILES

once for the 16 files of issue 11 (`--set core16`), once per extra directory (`--dirs`), each with
`--run-timeout` seconds. Counts come from the plugin's per-rank JSON (rank 0's; a test whose
outcome differs between ranks is listed). Writes OUT/summary.json and OUT/<run>/pytest.log; the
exit status is 1 when a test failed or errored, or a run produced no report.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

from megatron_adapt.apps.ports import free_port

UT = "tests/unit_tests/"
CORE16 = [UT + f for f in (
    "tensor_parallel/test_cross_entropy.py", "tensor_parallel/test_random.py",
    "tensor_parallel/test_layers.py", "fusions/test_torch_softmax.py",
    "fusions/test_bias_dropout_fusion.py", "fusions/test_swiglu_fusion.py",
    "transformer/test_attention.py", "transformer/test_core_attention.py", "transformer/test_mlp.py",
    "transformer/test_rope.py", "transformer/test_transformer_layer.py",
    "transformer/test_transformer_block.py", "models/test_gpt_model.py",
    "pipeline_parallel/test_schedules.py", "test_optimizer.py", "test_local_multi_tensor_fns.py")]
OUTCOMES = ("passed", "failed", "skipped", "error")
# Megatron's CI (tests/unit_tests/run_ci_test.sh, ENVIRONMENT=dev) leaves out the tests it marks flaky
# in that environment; its LTS environment leaves out `flaky` ones instead.
MEGATRON_CI_MARKER = "not flaky_in_dev"
# Some tests skip themselves "for LTS test" unless NVIDIA_PYTORCH_VERSION (the NGC PyTorch container's
# release, which Megatron's CI images set) is above 25.05 (test_layer_wise_optimizer.py,
# test_emerging_optimizers.py, core_v0.16.1's test_muon_optimizer.py). Megatron reads it nowhere else.
# With the dev selection above, the runs say they are the dev environment, unless the caller set it.
DEV_NGC_RELEASE = "25.09"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def run_environment(args, lm) -> dict:
    env = dict(os.environ, MEGATRON_LM_PATH=lm, MEGATRON_ADAPT_BACKEND=args.backend,
               MEGATRON_ADAPT_QUIET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("MEGATRON_ADAPT_AUTO", None)  # these runs are under megatron-adapt by definition
    if args.marker == MEGATRON_CI_MARKER:
        env.setdefault("NVIDIA_PYTORCH_VERSION", DEV_NGC_RELEASE)
    return env


def run(name, targets, args, lm):
    out = os.path.join(os.path.abspath(args.out), name)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        if f.startswith("rank") and f.endswith(".json"):
            os.remove(os.path.join(out, f))
    launcher = next((p for p in (os.path.join(sysconfig.get_path("scripts"), "megatron-adapt-run"),
                                 shutil.which("megatron-adapt-run")) if p and os.path.exists(p)), None)
    if launcher is None:
        raise SystemExit("megatron-adapt-run not found: pip install megatron-adapt into this Python")
    cmd = [launcher, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-port", str(args.master_port or free_port()), "--tee", "3",
           "-m", "pytest", "-q", "-rs", "--maxfail=1000000", "--continue-on-collection-errors", "-p", "no:cacheprovider", "-p", "megatron_adapt.apps.pytest_plugin",
           "--megatron-adapt-json", os.path.join(out, "rank{rank}.json"),
           "--megatron-adapt-test-timeout", str(args.test_timeout),
           *(["-m", args.marker] if args.marker else []), *args.pytest_args, *targets]
    env = run_environment(args, lm)
    # Megatron's conftest puts checkpoints in <pytest's temp root>/tmp_dist_ckpt, one folder for
    # every pytest session of the user: runs side by side overwrote each other's checkpoints
    # (FileNotFoundError on .metadata.tmp). Each run gets its own temp root, shared by its ranks.
    env["TMPDIR"] = tempfile.mkdtemp(prefix=f"megatron-unit-tests-{name}-")
    t0 = time.time()
    with open(os.path.join(out, "pytest.log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, cwd=lm, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    elapsed = time.time() - t0
    reports, deselected = {}, []
    for rank in range(args.nproc):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            reports[rank] = data["tests"]
            if rank == 0:
                deselected = data.get("deselected", [])
            for nodeid, rec in data["tests"].items():  # the test the run stopped in
                if rec["outcome"] == "running":
                    rec.update(outcome="error", message=f"still running when the run ended (rc={rc})")
            if not data.get("finished"):
                print(f"   rank {rank}: the run stopped before the session finished (rc={rc}); "
                      "counts are of the tests that ran")
    return {"name": name, "command": " ".join(cmd), "rc": rc, "seconds": round(elapsed, 1),
            "reports": reports, "deselected": deselected}


def counts(tests: dict, key) -> dict:
    """Outcome counts per key(nodeid): one row per file or directory."""
    table = collections.defaultdict(lambda: dict.fromkeys(OUTCOMES, 0))
    for nodeid, rec in tests.items():
        table[key(nodeid)][rec["outcome"]] += 1
    return dict(table)


def print_table(title, table):
    print(f"\n{title}")
    print(f"  {'':70s} " + " ".join(f"{o:>7s}" for o in OUTCOMES))
    total = dict.fromkeys(OUTCOMES, 0)
    for name in sorted(table):
        row = table[name]
        print(f"  {name:70s} " + " ".join(f"{row[o]:7d}" for o in OUTCOMES))
        for o in OUTCOMES:
            total[o] += row[o]
    print(f"  {'total':70s} " + " ".join(f"{total[o]:7d}" for o in OUTCOMES))
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "npu"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--set", choices=("core16", "none"), default="core16")
    p.add_argument("--files", nargs="*", default=[], help="more test files or node ids (relative to the checkout)")
    p.add_argument("--dirs", nargs="*", default=[], help="tests/unit_tests subdirectories, one run each")
    p.add_argument("--run-timeout", type=int, default=3600)
    p.add_argument("--test-timeout", type=float, default=600, help="seconds a test may run (0: no limit)")
    p.add_argument("--master-port", type=int, default=None, help="default: a free port")
    p.add_argument("--pytest-args", nargs="*", default=[])
    p.add_argument("--marker", default=MEGATRON_CI_MARKER,
                   help=f"pytest -m expression (default {MEGATRON_CI_MARKER!r}: what Megatron's own CI runs "
                        "in its dev environment, tests/unit_tests/run_ci_test.sh; '' runs every test)")
    args = p.parse_args(argv)
    lm = os.environ.get("MEGATRON_LM_PATH")
    if not lm or not os.path.isdir(os.path.join(lm, UT)):
        p.error("MEGATRON_LM_PATH must point at a Megatron-LM checkout (with tests/unit_tests)")
    lm = os.path.abspath(lm)

    runs = []
    if args.set == "core16" or args.files:
        runs.append(("core16" if args.set == "core16" else "files",
                     (CORE16 if args.set == "core16" else []) + args.files))
    for d in args.dirs:
        target = d if d.startswith("tests/") else UT + d.strip("/")
        if not os.path.exists(os.path.join(lm, target)):
            p.error(f"{target} does not exist in {lm}")
        runs.append((target.replace("/", "_"), [target]))
    if not runs:
        p.error("nothing to run: --set core16, --files or --dirs")

    results, bad = [], False
    for name, targets in runs:
        res = run(name, targets, args, lm)
        results.append(res)
        print(f"\n== {name}: rc={res['rc']} in {res['seconds']} s\n   {res['command']}")
        if res["deselected"]:
            print(f"   deselected by -m {args.marker!r} (Megatron CI's selection): {len(res['deselected'])} tests")
        if 0 not in res["reports"]:
            print(f"   NO REPORT from rank 0: see {os.path.join(args.out, name, 'pytest.log')}")
            bad = True
            continue
        tests = res["reports"][0]
        for rank, other in res["reports"].items():
            diff = sorted(n for n in set(tests) | set(other)
                          if tests.get(n, {}).get("outcome") != other.get(n, {}).get("outcome"))
            if diff:
                print(f"   rank {rank} disagrees with rank 0 on {len(diff)} tests: {diff[:5]}")
        missing = [r for r in range(args.nproc) if r not in res["reports"]]
        if missing:
            print(f"   no report from ranks {missing}")
        res["per_file"] = counts(tests, file_of)
        for t in targets:  # a file that collected no test (e.g. all commented out) is shown as 0
            if t.endswith(".py") and t not in res["per_file"]:
                res["per_file"][t] = dict.fromkeys(OUTCOMES, 0)
        total = print_table(f"{name} per file", res["per_file"])
        res["per_dir"] = counts(tests, lambda n: os.path.dirname(file_of(n)))
        print_table(f"{name} per directory", res["per_dir"])
        res["total"] = total
        bad |= bool(total["failed"] or total["error"])
        for nodeid, rec in sorted(tests.items()):
            if rec["outcome"] in ("failed", "error"):
                msg = rec.get("message", "").strip().splitlines()
                print(f"   {rec['outcome'].upper()} {nodeid}: {msg[-1] if msg else ''}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"backend": args.backend, "nproc": args.nproc, "megatron_lm": lm, "runs": results}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

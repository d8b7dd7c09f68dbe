"""Sweep Megatron-LM's whole `tests/unit_tests` tree under megatron-adapt, for several tags and
backends at once, on every GPU and CPU of the machine, and report it per directory.

    python scripts/megatron_unit_tests_sweep.py run --checkout core_v0.19.0=/path/mlm-0.19.0 \
        --checkout core_v0.16.1=/path/mlm-0.16.1 --backend cuda cpu --out /tmp/sweep \
        [--deadline 3000] [--done done.txt] [--cpu-runs 8 --threads 3] [--runs-per-gpu 2]
    python scripts/megatron_unit_tests_sweep.py run ... --backend cuda:2 --only-files files.txt
    python scripts/megatron_unit_tests_sweep.py report --out /tmp/sweep [/more/sweep/dirs] \
        --checkout ... [--json sweep.json]

`run` splits each tag's tree into chunks (the files of one directory, `--files-per-run` at a time)
and runs each chunk through scripts/megatron_unit_tests.py: the cuda backend with 1 process on one
GPU (`CUDA_VISIBLE_DEVICES`), the cpu backend with 2 processes over gloo and no GPU visible, the
largest chunks first. Lanes: `--runs-per-gpu` per GPU, `--cpu-runs` cpu lanes. `cuda:2` runs the
cuda backend with 2 processes, one a GPU, each lane on its own pair of GPUs (reported as
`cuda:2`): the tests that the one-GPU runs skip as `[ranks]`. `--only-files` limits a sweep to the
files listed (one path under tests/unit_tests a line, e.g. the files with such skips). A chunk that cannot
finish before `--deadline` is not started; one that is running then is stopped, and its counts are
those of the tests that ran. Each chunk leaves OUT/<tag>/<backend>/<chunk>/chunk.json; a chunk
listed in a `--done` file (one chunk id a line, as `report --done-list` writes) is not run again,
so a sweep can go on over several calls of a time-limited machine.

`report` merges any number of such OUT folders (the newest complete result of each chunk wins) and
prints per tag and backend, per directory: passed / failed / skipped / errors, tests stopped by a
time limit, chunks not run, and the skips by category. Every failure and error is listed.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
UT = "tests/unit_tests"
TOP = "(top-level files)"
NPROC = {"cpu": 2, "cuda": 1, "npu": 1}
# a rough cost per byte of test file, by directory and backend, to start the long chunks first
SLOW = {("cpu", "dist_checkpointing"): 4, ("cpu", "inference"): 2, ("cpu", "ssm"): 3,
        ("cpu", "transformer"): 2, ("cuda", "inference"): 2, ("cuda", "dist_checkpointing"): 2,
        ("cuda", "ssm"): 3}


def backend_ranks(spec: str) -> tuple[str, int]:
    """'cuda' -> ('cuda', 1); 'cuda:2' -> ('cuda', 2): the backend and its processes a run."""
    backend, _, n = spec.partition(":")
    if backend not in NPROC or (n and not n.isdigit()):
        raise argparse.ArgumentTypeError(f"backend {spec!r}: expected one of {sorted(NPROC)}, optionally :N processes")
    return backend, int(n) if n else NPROC[backend]


def chunks_of(tag: str, lm: str, backend: str, per_run: int, only: set | None = None) -> list[dict]:
    """`backend` is a --backend spec ('cpu', 'cuda', 'cuda:2'); `only`: the files to keep (paths
    under tests/unit_tests), None for all."""
    by_dir = collections.defaultdict(list)
    root = os.path.join(lm, UT)
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.startswith("test_") and n.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, n), root)
                if only is not None and rel not in only:
                    continue
                by_dir[rel.split(os.sep)[0] if os.sep in rel else TOP].append(rel)
    out = []
    for d, files in sorted(by_dir.items()):
        files.sort()
        for i in range(0, len(files), per_run):
            part = files[i:i + per_run]
            size = sum(os.path.getsize(os.path.join(root, f)) for f in part)
            name = ("top" if d == TOP else d) + f"-{i // per_run:02d}"
            out.append({"id": f"{tag}/{backend}/{name}", "tag": tag, "lm": lm, "backend": backend,
                        "dir": d, "name": name, "files": [f"{UT}/{f}" for f in part],
                        "weight": size * SLOW.get((backend_ranks(backend)[0], d), 1)})
    return out


def run_chunk(c: dict, args, env_extra: dict, deadline: float) -> None:
    out = os.path.join(args.out, c["tag"], c["backend"], c["name"])
    os.makedirs(out, exist_ok=True)
    left = int(deadline - time.time()) - 10
    backend, nproc = backend_ranks(c["backend"])
    cmd = [sys.executable, os.path.join(HERE, "megatron_unit_tests.py"), "--backend", backend,
           "--nproc", str(nproc), "--set", "none", "--out", out,
           "--run-timeout", str(min(left, args.run_timeout)), "--test-timeout", str(args.test_timeout),
           "--files", *c["files"]]
    env = dict(os.environ, MEGATRON_LM_PATH=c["lm"], OMP_NUM_THREADS=str(args.threads), **env_extra)
    t0 = time.time()
    with open(os.path.join(out, "sweep.log"), "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    ranks = []
    for r in range(nproc):
        p = os.path.join(out, "files", f"rank{r}.json")
        ranks.append(json.load(open(p)).get("finished", False) if os.path.exists(p) else False)
    rec = dict(c, rc=rc, seconds=round(time.time() - t0, 1), started=t0, complete=all(ranks),
               env={k: v for k, v in env_extra.items()})
    with open(os.path.join(out, "chunk.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(f"[{time.strftime('%H:%M:%S')}] {c['id']}: rc={rc} {rec['seconds']} s "
          f"{'complete' if rec['complete'] else 'INCOMPLETE'} {env_extra}", flush=True)


def cmd_run(args) -> int:
    deadline = time.time() + args.deadline
    done = set()
    for path in args.done or []:
        done |= {line.strip() for line in open(path) if line.strip()}
    only = read_only_files(args.only_files)
    todo = {b: [] for b in args.backend}
    for spec in args.checkout:
        tag, lm = spec.split("=", 1)
        for b in args.backend:
            todo[b] += [c for c in chunks_of(tag, os.path.abspath(lm), b, args.files_per_run, only)
                        if c["id"] not in done and (not args.dirs or c["dir"] in args.dirs)]
    queues = {}
    for b, cs in todo.items():
        queues[b] = queue.Queue()
        for c in sorted(cs, key=lambda c: -c["weight"]):
            queues[b].put(c)
        print(f"{b}: {len(cs)} chunks to run ({len(done)} listed done)", flush=True)

    lanes = []
    gpus = args.gpus
    for b in queues:
        backend, nproc = backend_ranks(b)
        if backend == "cpu":
            lanes += [(b, {"CUDA_VISIBLE_DEVICES": ""}) for _ in range(args.cpu_runs)]
            continue
        if gpus is None:
            import torch
            gpus = torch.cuda.device_count()
        groups = gpu_groups(gpus, nproc)
        if not groups:
            print(f"{b}: needs {nproc} GPUs a run, this machine has {gpus}; not run", flush=True)
        lanes += [(b, {"CUDA_VISIBLE_DEVICES": g}) for g in groups for _ in range(args.runs_per_gpu)]

    def lane(backend, env_extra):
        while time.time() < deadline - args.min_start:
            try:
                c = queues[backend].get_nowait()
            except queue.Empty:
                return
            run_chunk(c, args, env_extra, deadline)

    threads = [threading.Thread(target=lane, args=lane_args, daemon=True) for lane_args in lanes]
    for t in threads:
        t.start()
        time.sleep(2)  # the runs' free ports are picked at start: stagger them
    for t in threads:
        t.join()
    left = {b: q.qsize() for b, q in queues.items()}
    print(f"sweep ended; chunks not started: {left}", flush=True)
    return 0


def gpu_groups(gpus: int, nproc: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each run: disjoint sets of `nproc` GPUs ('0,1', '2,3'; a spare one idles)."""
    return [",".join(map(str, range(g, g + nproc))) for g in range(0, gpus - nproc + 1, nproc)]


def read_only_files(path: str | None) -> set | None:
    if not path:
        return None
    return {line.strip().removeprefix(UT + "/") for line in open(path) if line.strip() and not line.startswith("#")}


def _category(reason: str) -> str:
    m = re.match(r"\[(\w+)\]", reason or "")
    return m.group(1) if m else "megatron"  # Megatron's own skip / skipif, with its reason


def cmd_report(args) -> int:
    best = {}
    for root in args.out_dirs:
        for dirpath, _, names in os.walk(root):
            if "chunk.json" not in names:
                continue
            rec = json.load(open(os.path.join(dirpath, "chunk.json")))
            rec["path"] = dirpath
            old = best.get(rec["id"])
            if old is None or (rec["complete"], rec["started"]) > (old["complete"], old["started"]):
                best[rec["id"]] = rec
    every = {}
    only = read_only_files(args.only_files)
    for spec in args.checkout:
        tag, lm = spec.split("=", 1)
        for b in args.backend:
            for c in chunks_of(tag, os.path.abspath(lm), b, args.files_per_run, only):
                every[c["id"]] = c
    table = collections.defaultdict(lambda: collections.Counter())
    skips = collections.defaultdict(collections.Counter)
    problems = []
    for cid, c in sorted(every.items()):
        key = (c["tag"], c["backend"], c["dir"])
        rec = best.get(cid)
        if rec is None:
            if c["backend"] in args.backend:
                table[key]["chunks not run"] += 1
            continue
        table[key]["chunks run"] += 1
        p = os.path.join(rec["path"], "files", "rank0.json")
        if not os.path.exists(p):
            table[key]["chunks without report"] += 1
            problems.append((cid, "NO REPORT", f"rc={rec['rc']}, see {rec['path']}/files/pytest.log"))
            continue
        for nodeid, t in json.load(open(p))["tests"].items():
            o = t["outcome"]
            if o == "running":
                o = "stopped"
            table[key][o] += 1
            if o == "skipped":
                skips[key[:2]][_category(t.get("reason", ""))] += 1
            if o in ("failed", "error", "stopped"):
                problems.append((cid, o.upper(), nodeid + ": " + (t.get("message", "").strip().splitlines() or [""])[-1][:300]))
    cols = ("passed", "failed", "skipped", "error", "stopped", "chunks run", "chunks not run")
    result = {"rows": [], "skips": {}, "problems": problems}
    for tb in sorted({k[:2] for k in table}):
        print(f"\n== {tb[0]}, {tb[1]}")
        print(f"  {'directory':32s}" + "".join(f"{c:>15s}" for c in cols))
        tot = collections.Counter()
        for key in sorted(k for k in table if k[:2] == tb):
            row = table[key]
            tot.update(row)
            print(f"  {key[2]:32s}" + "".join(f"{row[c]:15d}" for c in cols))
            result["rows"].append({"tag": tb[0], "backend": tb[1], "dir": key[2], **{c: row[c] for c in cols}})
        print(f"  {'total':32s}" + "".join(f"{tot[c]:15d}" for c in cols))
        print("  skips by category: " + ", ".join(f"{k} {v}" for k, v in skips[tb].most_common()))
        result["skips"][f"{tb[0]}|{tb[1]}"] = dict(skips[tb])
    for cid, what, text in problems:
        print(f"  {what} [{cid}] {text}")
    if args.done_list:
        with open(args.done_list, "w") as f:
            f.writelines(cid + "\n" for cid, rec in sorted(best.items()) if rec["complete"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(result))
    return 0


def markdown_table(result: dict) -> str:
    """One row per directory, one column per tag and backend: passed / failed / skipped / errors
    (+ stopped, chunks not run, where any)."""
    combos = sorted({(r["tag"], r["backend"]) for r in result["rows"]}, key=lambda c: (c[0], c[1]), reverse=True)
    cells, totals = collections.defaultdict(dict), collections.defaultdict(collections.Counter)
    for r in result["rows"]:
        cells[r["dir"]][(r["tag"], r["backend"])] = r
        totals[(r["tag"], r["backend"])].update({k: v for k, v in r.items() if isinstance(v, int)})

    def cell(r):
        if not r or not (r["chunks run"] or r["chunks not run"]):
            return "—"
        text = f"{r['passed']} / {r['failed']} / {r['skipped']} / {r['error']}"
        if r.get("stopped"):
            text += f" ({r['stopped']} stopped)"
        if r.get("chunks not run"):
            text += f" ({r['chunks not run']} chunks not run)"
        return text

    lines = ["| directory | " + " | ".join(f"{t} {b}" for t, b in combos) + " |",
             "|---" * (len(combos) + 1) + "|"]
    for d in sorted(cells):
        lines.append(f"| `{d}` | " + " | ".join(cell(cells[d].get(c)) for c in combos) + " |")
    lines.append("| **total** | " + " | ".join(f"**{cell(totals[c])}**" for c in combos) + " |")
    return "\n".join(lines) + "\n"


def _backend_spec(spec: str) -> str:
    backend, nproc = backend_ranks(spec)
    return backend if nproc == NPROC[backend] else f"{backend}:{nproc}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--checkout", action="append", required=True, help="TAG=PATH of a Megatron-LM checkout")
    r.add_argument("--backend", nargs="+", default=["cuda", "cpu"], type=_backend_spec,
                   help="cpu, cuda, npu; BACKEND:N for N processes a run (cuda:2: one GPU each)")
    r.add_argument("--out", required=True)
    r.add_argument("--deadline", type=float, default=3600, help="seconds from now")
    r.add_argument("--min-start", type=float, default=60, help="start no chunk with less time left")
    r.add_argument("--run-timeout", type=int, default=3600)  # a chunk with SLOW tests (pytest_plugin) outlasts 1800 s
    r.add_argument("--test-timeout", type=float, default=150)
    r.add_argument("--files-per-run", type=int, default=6)
    r.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    r.add_argument("--runs-per-gpu", type=int, default=1)
    r.add_argument("--cpu-runs", type=int, default=max(1, (os.cpu_count() or 2) // 6))
    r.add_argument("--threads", type=int, default=2, help="OMP threads a process")
    r.add_argument("--done", nargs="*", help="files of chunk ids not to run again")
    r.add_argument("--dirs", nargs="*", help="only these tests/unit_tests directories ('(top-level files)')")
    r.add_argument("--only-files", help="only the files listed here (paths under tests/unit_tests, one a line)")
    q = sub.add_parser("report")
    q.add_argument("out_dirs", nargs="+")
    q.add_argument("--checkout", action="append", required=True)
    q.add_argument("--backend", nargs="+", default=["cuda", "cpu"], type=_backend_spec)
    q.add_argument("--files-per-run", type=int, default=6)
    q.add_argument("--only-files", help="the file list the sweep ran with (for its chunks not run)")
    q.add_argument("--json")
    q.add_argument("--done-list", help="write the ids of the complete chunks here")
    q.add_argument("--markdown", help="write the per-directory table (one column per tag and backend) here")
    args = p.parse_args(argv)
    return cmd_run(args) if args.what == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())

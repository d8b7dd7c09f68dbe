"""LAMBADA evaluation of ONE checkpoint on several backends and TP/PP layouts, compared.

No data set can be downloaded here, so this builds everything (tests/lambada_corpus.py): a
synthetic cloze corpus in LAMBADA's jsonl format, a byte-level GPT-2 BPE tokenizer (vocab.json +
merges.txt) trained on it, a Megatron indexed dataset made from it by Megatron-LM's own
tools/preprocess_data.py; then trains a tiny GPT with tests_gpt/pretrain_gpt_distributed.sh (stock
pretrain_gpt.py, cpu backend, 1 process, torch_dist checkpoint), evaluates that checkpoint with
tests_gpt/evaluate_lambada.sh in each requested configuration, and checks that every run's accuracy
is identical (same correct count) and its perplexity within 1e-3 (relative; --ppl-rtol) of the
first run's.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python scripts/lambada_compare.py --workdir DIR \\
        [--configs cpu:tp1,cpu:tp2,cpu:pp2,npu:tp1,cuda:tp1] [--iters 800] [--ppl-rtol 1e-3] [--out results.json]

A configuration is BACKEND:LAYOUT[:OPTION...]: LAYOUT tp1 | tp2 | pp2 | dp2 | tp2pp2, options bsh
(--shape_order BSH), bf16 / fp16. `npu` runs the npu backend against the torch_npu EMULATION
(tests/npu/emulation on PYTHONPATH: no Ascend NPU here). cpu and npu runs hide GPUs
(CUDA_VISIBLE_DEVICES=""). The first configuration is the reference. Exit status 1 on a mismatch
(unless --report-only).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import lambada_corpus  # noqa: E402

EMULATION = REPO / "tests" / "npu" / "emulation"
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 2), "pp2": (1, 2, 2), "dp2": (1, 1, 2), "tp2pp2": (2, 2, 4)}
PPL_RTOL = 1e-3
TRAIN = dict(NPROC="1", ITERS="800", MBS="4", GBS="16", LR="3e-3")


def _env(backend: str, **extra) -> dict:
    env = dict(os.environ)
    for var in ("MEGATRON_ADAPT_AUTO", "MEGATRON_ADAPT_QUIET", "MEGATRON_ADAPT_DISABLE",
                "MEGATRON_ADAPT_ATTENTION_LAYOUT", "MEGATRON_ADAPT_REPORT", "MEGATRON_ADAPT_STRICT"):
        env.pop(var, None)
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1",
               MEGATRON_ADAPT_BACKEND=backend)
    if backend in ("cpu", "npu"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    if backend == "npu":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EMULATION), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict, log: Path, cwd: Path, timeout: int = 600) -> str:
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    log.write_text(" ".join(cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} after {time.time() - t0:.0f} s; "
                           f"log {log}:\n{proc.stdout[-4000:]}")
    return proc.stdout


def prepare(workdir: Path, lm: str) -> dict:
    """Corpus, cloze file, tokenizer and the indexed training set (Megatron's preprocess_data.py)."""
    paths = lambada_corpus.build(str(workdir / "data"))
    prefix = workdir / "data" / "train"
    _run([sys.executable, os.path.join(lm, "tools", "preprocess_data.py"), "--input", paths["train"],
          "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--legacy-tokenizer",
          "--vocab-file", paths["vocab"], "--merge-file", paths["merges"], "--append-eod",
          "--workers", "1"], _env("cpu"), workdir / "preprocess.log", workdir)
    paths["data_path"] = f"{prefix}_text_document"
    return paths


def train(workdir: Path, paths: dict, iters: int) -> tuple[Path, str]:
    """Stock pretrain_gpt.py through tests_gpt/pretrain_gpt_distributed.sh; returns (checkpoint, log)."""
    ckpt = workdir / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    env = _env("cpu", **{**TRAIN, "ITERS": str(iters)}, DATA_PATH=paths["data_path"],
               VOCAB_FILE=paths["vocab"], MERGE_FILE=paths["merges"], SAVE=str(ckpt))
    out = _run(["bash", str(REPO / "tests_gpt" / "pretrain_gpt_distributed.sh")], env,
               workdir / "train.log", workdir)
    if not (ckpt / "latest_checkpointed_iteration.txt").is_file():
        raise RuntimeError(f"no checkpoint written in {ckpt}; see {workdir / 'train.log'}")
    return ckpt, out


def parse_config(config: str) -> dict:
    backend, layout, *opts = config.split(":")
    if backend not in ("cpu", "npu", "cuda") or layout not in LAYOUTS:
        raise ValueError(f"bad configuration {config!r}: BACKEND (cpu|npu|cuda):LAYOUT "
                         f"({'|'.join(LAYOUTS)})[:bsh][:bf16|:fp16]")
    unknown = set(opts) - {"bsh", "bf16", "fp16"}
    if unknown:
        raise ValueError(f"bad options {sorted(unknown)} in {config!r}: bsh, bf16, fp16")
    tp, pp, nproc = LAYOUTS[layout]
    precision = "bf16" if "bf16" in opts else "fp16" if "fp16" in opts else "fp32"
    return dict(name=config, backend=backend, tp=tp, pp=pp, nproc=nproc, precision=precision,
                shape_order="BSH" if "bsh" in opts else "SBH")


def evaluate(workdir: Path, paths: dict, ckpt: Path, config: str) -> dict:
    c = parse_config(config)
    tag = config.replace(":", "_")
    results, report = workdir / f"eval_{tag}.json", workdir / f"report_{tag}.json"
    env = _env(c["backend"], LOAD=str(ckpt), LAMBADA_DATA=paths["lambada"], VOCAB_FILE=paths["vocab"],
               MERGE_FILE=paths["merges"], NPROC=str(c["nproc"]), TP=str(c["tp"]), PP=str(c["pp"]),
               PRECISION=c["precision"], RESULTS_JSON=str(results), MEGATRON_ADAPT_REPORT=str(report))
    t0 = time.time()
    out = _run(["bash", str(REPO / "tests_gpt" / "evaluate_lambada.sh"), "--shape_order", c["shape_order"]],
               env, workdir / f"eval_{tag}.log", workdir)
    res = json.loads(results.read_text())
    ops = json.loads(report.read_text())["ops"]
    res.update(config=config, seconds=round(time.time() - t0, 1), log=str(workdir / f"eval_{tag}.log"),
               ops=sorted({f"{o['op']}={o['implementation']}" for o in ops}),
               printed=[l for l in out.splitlines() if l.startswith("LAMBADA strict")])
    return res


def compare(results: list[dict], ppl_rtol: float = PPL_RTOL) -> list[str]:
    """Mismatches of each result against the first (same correct count; perplexity within ppl_rtol)."""
    ref, problems = results[0], []
    for r in results[1:]:
        if (r["correct"], r["examples"], r["target_tokens"]) != (ref["correct"], ref["examples"], ref["target_tokens"]):
            problems.append(f"{r['config']}: {r['correct']}/{r['examples']} correct over "
                            f"{r['target_tokens']} tokens vs {ref['config']}: {ref['correct']}/"
                            f"{ref['examples']} over {ref['target_tokens']}")
        rel = abs(r["perplexity"] - ref["perplexity"]) / ref["perplexity"]
        if not rel <= ppl_rtol:
            problems.append(f"{r['config']}: perplexity {r['perplexity']:.6f} vs {ref['perplexity']:.6f} "
                            f"({ref['config']}), relative difference {rel:.2e} > {ppl_rtol}")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--configs", default="cpu:tp1,cpu:tp2,cpu:pp2,npu:tp1,npu:tp2:bsh")
    p.add_argument("--iters", type=int, default=int(TRAIN["ITERS"]))
    p.add_argument("--ppl-rtol", type=float, default=PPL_RTOL,
                   help="allowed relative perplexity difference from the first configuration")
    p.add_argument("--report-only", action="store_true",
                   help="print and record the differences but exit 0 (bf16/fp16: see docs/evaluation.md)")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default WORKDIR/results.json)")
    a = p.parse_args(argv)
    lm = os.environ.get("MEGATRON_LM_PATH")
    if not lm or not os.path.isfile(os.path.join(lm, "pretrain_gpt.py")):
        p.error("set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v<megatron-core version>)")
    for tool in ("megatron-adapt-run", "torchrun"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not on PATH (pip install -e . in this Python's environment)")
    configs = [c for c in a.configs.split(",") if c]
    for c in configs:
        parse_config(c)
    a.workdir.mkdir(parents=True, exist_ok=True)
    paths = prepare(a.workdir, lm)
    ckpt, train_log = train(a.workdir, paths, a.iters)
    losses = [l for l in train_log.splitlines() if "lm loss:" in l and "iteration" in l]
    results = []
    for c in configs:
        r = evaluate(a.workdir, paths, ckpt, c)
        print(f"{c:18s} accuracy {r['accuracy']:.4f} ({r['correct']}/{r['examples']})  perplexity "
              f"{r['perplexity']:.6f}  ({r['seconds']} s)", flush=True)
        results.append(r)
    problems = compare(results, a.ppl_rtol)
    ref = results[0]["perplexity"]
    for r in results:
        r["ppl_rel_diff"] = abs(r["perplexity"] - ref) / ref
    summary = {"results": results, "problems": problems, "train_first_last": [losses[0], losses[-1]],
               "ppl_rtol": a.ppl_rtol, "python": sys.version.split()[0]}
    out = a.out or a.workdir / "results.json"
    out.write_text(json.dumps(summary, indent=1))
    print("\n".join(problems) if problems else f"all {len(results)} configurations agree "
          f"(accuracy identical, perplexity within {a.ppl_rtol} relative; largest "
          f"{max(r['ppl_rel_diff'] for r in results):.2e})")
    print(f"results: {out}")
    return 1 if problems and not a.report_only else 0


if __name__ == "__main__":
    sys.exit(main())

"""Context parallelism in stock pretrain_gpt.py (unmodified) under megatron-adapt-run, cpu backend,
gloo, 2 processes, fp32, the default --transformer-impl (TE spec served by megatron-adapt):
--context-parallel-size 2 with --cp-comm-type p2p and a2a against CP=1 (DP=2, the same global
batch), 10 steps, max |Δloss| <= 2e-3; the same with core_v0.19's --dataloader-inter-document-masking
(packed documents, split per sequence at CP=2) on a dataset of short documents; and the refusals at
start: a sequence length 2·CP does not divide (Megatron's own message), a cp-comm-type the backend
cannot serve for these heads (a2a with one key/value head: ours, from the arguments, naming the flag
and the backend), the area switched off (Megatron's assertion comes back), inter-document masking at
CP=2 with unfused RoPE; Megatron's default dropout at CP=2 trains. And with 4 processes: TP=2 + --sequence-parallel + CP=2 (p2p) against TP=2
(DP=2). Dropout off: CP and DP draw different dropout masks. Each launch ~20-30 s on two CPU
cores; the file ~3.5 minutes. Needs MEGATRON_LM_PATH."""
from __future__ import annotations

import json

import pytest

import os
import subprocess

from test_pretrain_gpt import (LLAMA, LM, NEEDS_CHECKOUT, NOT_IMPORTED_BY_GPT, TINY_GPT, Run,  # noqa: F401
                               _env, _free_port, assert_loss_falls, assert_patched, launch, pretrain)

pytestmark = pytest.mark.skipif(not LM, reason="MEGATRON_LM_PATH is not set (a Megatron-LM checkout)")

CP_ARGS = [*LLAMA, "--attention-dropout", "0", "--hidden-dropout", "0"]
_runs = {}


def run(name, tmp_path_factory, *extra):
    if name not in _runs:
        tmp = tmp_path_factory.mktemp(name)
        report = tmp / "report.json"
        _runs[name] = pretrain([*CP_ARGS, *extra], tmp, name, env={"MEGATRON_ADAPT_REPORT": str(report)})
        _runs[name].report = report
    return _runs[name]


def impls(run, op):
    return {o["implementation"] for o in json.loads(run.report.read_text())["ops"] if o["op"] == op}


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_cp2_matches_cp1(tmp_path_factory, comm):
    base = run("cp1", tmp_path_factory).check()
    cp = run(f"cp2_{comm}", tmp_path_factory, "--context-parallel-size", "2", "--cp-comm-type", comm).check()
    assert sorted(cp.losses) == sorted(base.losses) == list(range(1, 11))
    diffs = [abs(cp.losses[i] - base.losses[i]) for i in base.losses]
    assert max(diffs) <= 2e-3, (comm, base.losses, cp.losses)
    assert_loss_falls(cp)
    # (pretrain_gpt.py never imports the Mamba modules: their patches wait)
    assert_patched(cp, may_wait=(*NOT_IMPORTED_BY_GPT, "megatron.core.ssm.", "megatron.core.models.mamba."))
    assert "megatron.core.utils:get_thd_batch_on_this_cp_rank" in cp.out
    assert impls(cp, "attention_cp") == {f"cpu.torch.{comm}"}
    assert not impls(base, "attention_cp")


def test_cp2_with_megatrons_default_dropout_trains(tmp_path):
    """--attention-dropout 0.1 / --hidden-dropout 0.1 (Megatron's defaults) at CP=2: the masks
    differ from CP=1's, so no parity, but it runs and learns."""
    run_ = pretrain([*LLAMA, "--context-parallel-size", "2"], tmp_path, "cp2_dropout").check()
    assert sorted(run_.losses) == list(range(1, 11))
    assert_loss_falls(run_)


def test_sequence_length_not_divisible_by_2cp_is_refused(tmp_path):
    bad = pretrain([*CP_ARGS, "--context-parallel-size", "2", "--seq-length", "62"], tmp_path, "badseq", iters=1)
    assert bad.rc != 0
    assert "seq-length should be a multiple of 2 * context-parallel-size" in bad.out


def test_a2a_with_heads_the_group_cannot_split_is_refused(tmp_path):
    bad = pretrain([*CP_ARGS, "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention",
                    "--num-query-groups", "1"], tmp_path, "a2a_heads", iters=1)
    assert bad.rc != 0
    assert ("UnsupportedFeatureError: --cp-comm-type a2a with --context-parallel-size 2: the cpu backend cannot "
            "serve it: cp_comm_type a2a: 4 query and 1 key/value heads per tensor-parallel rank must both divide by "
            "the all-to-all group size 2") in bad.out     # at start (start_checks), before any model is built
    assert "number of parameters on" not in bad.out     # (Megatron prints it once the model is built)


def test_area_switched_off_gives_megatrons_assertion(tmp_path):
    off = pretrain([*CP_ARGS, "--context-parallel-size", "2"], tmp_path, "cp_off", iters=1,
                   env={"MEGATRON_ADAPT_DISABLE": "context_parallel"})
    assert off.rc != 0 and "Context parallelism is only supported by TEDotProductAttention!" in off.out


def launch4(args, tmp, name):
    """pretrain_gpt.py on 4 processes (launch() in test_pretrain_gpt uses 2)."""
    cmd = ["megatron-adapt-run", "torchrun", "--nproc-per-node", "4", "--master-port", str(_free_port()),
           os.path.join(LM, "pretrain_gpt.py"), *TINY_GPT, "--train-iters", "10", *CP_ARGS, *args]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    log = tmp / f"{name}.log"
    log.write_text(" ".join(cmd) + "\n" + proc.stdout)
    return Run(proc, log)


def test_tp2_sp_cp2_matches_tp2(tmp_path):
    base = launch4(["--tensor-model-parallel-size", "2"], tmp_path, "tp2").check()
    cp = launch4(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                  "--cp-comm-type", "p2p"], tmp_path, "tp2_sp_cp2").check()
    assert sorted(cp.losses) == sorted(base.losses) == list(range(1, 11))
    assert max(abs(cp.losses[i] - base.losses[i]) for i in base.losses) <= 2e-3, (base.losses, cp.losses)


def _has_inter_document_masking() -> bool:
    path = os.path.join(LM or "", "megatron", "training", "arguments.py")
    return os.path.isfile(path) and "--dataloader-inter-document-masking" in open(path).read()


def short_document_data(directory):
    """An indexed dataset (Megatron's .bin/.idx) of 400 documents of 3-40 tokens, so that each
    64-token sample holds several documents whose boundaries fall anywhere (the mock data's
    documents are 1-4095 tokens long: most samples would hold one). A document counts from a
    random start by a random step (mod 127): its next token follows from its previous two, so
    what attention sees (its own document, or the one before too) shows in the loss; 127 (the
    NullTokenizer's end of document) ends each."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(str(directory), "short_docs")
    rng = numpy.random.default_rng(5)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(400):
        n = int(rng.integers(3, 41))
        start, step = rng.integers(0, 127), rng.integers(1, 12)
        doc = numpy.append((start + step * numpy.arange(n - 1)) % 127, 127)
        builder.add_document(torch.from_numpy(doc), [n])
    builder.finalize(prefix + ".idx")
    return prefix


def idm_run(name, tmp_path_factory, *extra, masking=True):
    """pretrain_gpt.py on short_document_data (TINY_GPT's --mock-data replaced by --data-path)."""
    if name not in _runs:
        tmp = tmp_path_factory.mktemp(name)
        if "data" not in _runs:
            _runs["data"] = short_document_data(tmp_path_factory.mktemp("data"))
        report = tmp / "report.json"
        # (TINY_GPT's --split 949,50,1 would give the test split no document of these 400)
        args = ["90,8,2" if a == "949,50,1" else a for a in TINY_GPT if a != "--mock-data"]
        args += ["--data-path", _runs["data"], "--train-iters", "10", *CP_ARGS, *extra]
        args += ["--dataloader-inter-document-masking"] if masking else []
        _runs[name] = launch("pretrain_gpt.py", args, tmp, name, env={"MEGATRON_ADAPT_REPORT": str(report)})
        _runs[name].report = report
    return _runs[name]


needs_idm = pytest.mark.skipif(not _has_inter_document_masking(), reason="this Megatron-LM checkout has no "
                               "--dataloader-inter-document-masking (core_v0.19+)")


@needs_idm
def test_inter_document_masking_cp1_runs_thd_and_masks(tmp_path_factory):
    """core_v0.19: --dataloader-inter-document-masking packs each micro-batch's documents (thd):
    served by attention_thd at CP=1. Control: the same data without the flag (one causal sequence
    per sample) gives losses that differ by more than the CP parity bound below, so that parity
    tells a run that masks documents from one that does not."""
    base = idm_run("idm_cp1", tmp_path_factory).check()
    assert impls(base, "attention_thd") == {"cpu.torch.sdpa.per_sequence"}
    assert not impls(base, "attention") and not impls(base, "attention_cp")
    plain = idm_run("plain_cp1", tmp_path_factory, masking=False).check()
    # (0.034 measured at step 10)
    assert max(abs(plain.losses[i] - base.losses[i]) for i in base.losses) > 2e-2, (base.losses, plain.losses)


@needs_idm
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_inter_document_masking_cp2_matches_cp1(tmp_path_factory, comm):
    """At CP=2 Megatron splits these batches per sequence (the whole packed micro-batch in 4
    chunks, documents cut anywhere; use_per_sequence_balancing): attention_cp is told each token's
    document and position, the fused packed RoPE its position. fp32, 10 steps, max |dloss| <= 2e-3
    against CP=1 (DP=2, same global batch)."""
    base = idm_run("idm_cp1", tmp_path_factory).check()
    cp = idm_run(f"idm_cp2_{comm}", tmp_path_factory, "--context-parallel-size", "2", "--cp-comm-type", comm).check()
    assert sorted(cp.losses) == sorted(base.losses) == list(range(1, 11))
    diffs = [abs(cp.losses[i] - base.losses[i]) for i in base.losses]
    assert max(diffs) <= 2e-3, (comm, base.losses, cp.losses)
    assert_loss_falls(cp, by=0.1)      # (0.145 measured: these documents are harder than the mock data)
    assert impls(cp, "attention_cp") == {f"cpu.torch.{comm}"}
    assert not impls(cp, "attention_thd")


@needs_idm
def test_inter_document_masking_cp2_refuses_unfused_rope(tmp_path):
    bad = launch("pretrain_gpt.py", [*TINY_GPT, "--train-iters", "1", *CP_ARGS, "--dataloader-inter-document-masking",
                                     "--context-parallel-size", "2", "--no-rope-fusion"], tmp_path, "idm_unfused")
    assert bad.rc != 0
    assert ("--dataloader-inter-document-masking with --context-parallel-size 2 on the cpu backend and "
            "--position-embedding-type rope without RoPE fusion") in bad.out

"""Context parallelism in stock pretrain_gpt.py (unmodified) under megatron-adapt-run, cpu backend,
gloo, 2 processes, fp32, the default --transformer-impl (TE spec served by megatron-adapt):
--context-parallel-size 2 with --cp-comm-type p2p and a2a against CP=1 (DP=2, the same global
batch), 10 steps, max |Δloss| <= 2e-3; and the refusals at start: a sequence length 2·CP does not
divide (Megatron's own message), a cp-comm-type the backend cannot serve for these heads (a2a with
one key/value head: ours, naming the flag and the backend), the area switched off (Megatron's
assertion comes back); Megatron's default dropout at CP=2 trains. And with 4 processes: TP=2 + --sequence-parallel + CP=2 (p2p) against TP=2
(DP=2). Dropout off: CP and DP draw different dropout masks. Each launch ~20-30 s on two CPU
cores; the file ~3.5 minutes. Needs MEGATRON_LM_PATH."""
from __future__ import annotations

import json

import pytest

import os
import subprocess

from test_pretrain_gpt import (LLAMA, LM, NEEDS_CHECKOUT, NOT_IMPORTED_BY_GPT, TINY_GPT, Run,  # noqa: F401
                               _env, _free_port, assert_loss_falls, assert_patched, pretrain)

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
    assert ("--cp-comm-type a2a with --context-parallel-size 2: the cpu backend cannot serve it: cp_comm_type a2a: "
            "4 query and 1 key/value heads per tensor-parallel rank must both divide by the all-to-all group "
            "size 2") in bad.out


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


@pytest.mark.skipif(not _has_inter_document_masking(),
                    reason="this Megatron-LM checkout has no --dataloader-inter-document-masking (core_v0.19+)")
def test_inter_document_masking_runs_thd_and_refuses_cp(tmp_path):
    """core_v0.19: --dataloader-inter-document-masking packs each sample's documents (thd): served
    by attention_thd at CP=1; at CP=2 Megatron splits those batches per sequence, which is refused
    naming the flags and the backend."""
    report = tmp_path / "report.json"
    run_ = pretrain([*CP_ARGS, "--dataloader-inter-document-masking"], tmp_path, "idm", iters=5,
                    env={"MEGATRON_ADAPT_REPORT": str(report)}).check()
    run_.report = report
    assert impls(run_, "attention_thd") == {"cpu.torch.sdpa.per_sequence"}
    assert not impls(run_, "attention")
    bad = pretrain([*CP_ARGS, "--dataloader-inter-document-masking", "--context-parallel-size", "2"], tmp_path,
                   "idm_cp2", iters=1)
    assert bad.rc != 0 and ("--dataloader-inter-document-masking with --context-parallel-size 2: megatron-adapt's "
                            "context-parallel attention on the cpu backend") in bad.out

"""Stock `pretrain_gpt.py --sft` (unmodified) under megatron-adapt-run, cpu backend, gloo, fp32.

`--sft` makes Megatron read a jsonl of conversations (SFTDataset), tokenize them with an HF
tokenizer through SFTTokenizer (`--tokenizer-type SFTTokenizer --tokenizer-model DIR`, Megatron's
default `--sft-tokenizer-prompt-format nemotron-h-aligned`: system and user turns masked out of
the loss), and pack them into THD batches with cu_seqlens (PackedSeqParams), which megatron-adapt
serves through its `attention_thd` op (CP=1) and `attention_cp` op (CP=2, each conversation split
per document as TE's thd_get_partitioned_indices does). The tokenizer and the data are made here
(sft_data.py): no network, no download.

Flags beyond the tiny model's, all Megatron's own:
- `--no-create-attention-mask-in-dataloader`: SFTDataset asserts the dataloader makes no mask.
- `--calculate-per-token-loss`: without it Megatron divides each CP rank's loss by that rank's
  own loss-token count, so CP=2's gradients differ from CP=1's wherever the ranks hold different
  numbers of answer tokens (SFT masks prompts); with it both normalise by the global count.
- `--eval-iters 0`: Megatron's SFT validation loss is a mean of per-rank, per-micro-batch means
  (core_v0.16.1 gives NaN when a CP rank holds no answer token, core_v0.19 counts it 0), so it is
  not comparable between CP sizes.
- core_v0.16.1 only: `--legacy-tokenizer` (its new tokenizer builder has no SFTTokenizer).

One process at CP=1, two at CP=2 (p2p and a2a): the same global batch of 8 packs, 10 steps,
max |Δloss| <= 2e-3. TP=2 (core_v0.19 only) trains. Each launch ~20-40 s on two CPU cores. Needs MEGATRON_LM_PATH (a checkout with
--sft: core_v0.16.1 or core_v0.19.0), transformers (< 5 for core_v0.16.1), tokenizers, datasets.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import math
import os

import pytest
from packaging.version import Version

import test_pretrain_gpt as base
from megatron_checkout import checkout_version
from sft_data import write_conversations, write_tokenizer
from test_pretrain_gpt import LLAMA, LM, NEEDS_CHECKOUT, NOT_IMPORTED_BY_GPT, assert_loss_falls, assert_patched  # noqa: F401


def _read(*parts) -> str:
    path = os.path.join(LM or "", *parts)
    return open(path, encoding="utf-8").read() if os.path.isfile(path) else ""


HAS_SFT = "'--sft'" in _read("megatron", "training", "arguments.py")
# core_v0.16's new tokenizer builder has no SFTTokenizer: --legacy-tokenizer builds it
SFT_IN_CORE_BUILDER = any("SFTTokenizer" in open(f, encoding="utf-8").read() for f in
                          glob.glob(os.path.join(LM or "", "megatron", "core", "tokenizers", "**", "build_tokenizer.py"),
                                    recursive=True))
MISSING = [m for m in ("transformers", "tokenizers", "datasets") if importlib.util.find_spec(m) is None]


def _transformers_too_new() -> str | None:
    """core_v0.16's legacy SFTTokenizer indexes apply_chat_template's return as transformers 4's
    array; transformers 5 returns a BatchEncoding (core_v0.19's tokenizer reads both)."""
    if MISSING or SFT_IN_CORE_BUILDER or "_extract_token_ids" in _read("megatron", "training", "tokenizer",
                                                                         "sft_tokenizer.py"):
        return None
    installed = importlib.metadata.version("transformers")
    if Version(installed).major >= 5:
        return f"this Megatron-LM checkout's SFTTokenizer needs transformers < 5 (installed: {installed})"
    return None


pytestmark = [
    *base.pytestmark,
    pytest.mark.skipif(bool(LM) and not HAS_SFT, reason=f"MEGATRON_LM_PATH={LM} has no --sft (core_v0.16+)"),
    pytest.mark.skipif(bool(MISSING), reason=f"--sft needs {', '.join(MISSING)} (pip install -e .[test,sft])"),
    pytest.mark.skipif(_transformers_too_new() is not None, reason=str(_transformers_too_new())),
]

LAYERS, ITERS, GLOBAL_BATCH = 2, 10, 8


def sft_args(inputs) -> list[str]:
    tok, data = inputs
    return [
        "--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH),   # packing: micro-batch 1
        "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", str(tok), "--data-path", str(data),
        "--split", "100,0,0", "--no-create-attention-mask-in-dataloader", "--calculate-per-token-loss",
        *([] if SFT_IN_CORE_BUILDER else ["--legacy-tokenizer"]),
        "--attention-backend", "auto", "--attention-dropout", "0", "--hidden-dropout", "0", *LLAMA,
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", "20",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--train-iters", str(ITERS),
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_inputs")
    return write_tokenizer(tmp / "tokenizer"), write_conversations(tmp / "conversations.jsonl")


_runs = {}


def run(name, inputs, tmp_path_factory, cp=1, *extra, nproc=None):
    if name not in _runs:
        tmp = tmp_path_factory.mktemp(name)
        env = {"MEGATRON_ADAPT_REPORT": str(tmp / "report.json"), "HF_HOME": str(tmp / "hf"),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        r = base.launch("pretrain_gpt.py", [*sft_args(inputs), "--context-parallel-size", str(cp), *extra], tmp,
                        name, env=env, nproc=nproc or cp)
        r.report = tmp / "report.json"
        _runs[name] = r
    return _runs[name]


def ops(run_) -> dict:
    """op -> {implementation: calls} from the report rank 0 wrote."""
    out = {}
    for o in json.loads(run_.report.read_text())["ops"]:
        out.setdefault(o["op"], {})[o["implementation"]] = o["calls"]
    return out


def applied(run_) -> set:
    return {p["target"] for p in json.loads(run_.report.read_text())["patches"] if p["status"] == "applied"}


def test_sft_trains_on_attention_thd(inputs, tmp_path_factory):
    r = run("sft_cp1", inputs, tmp_path_factory).check()
    assert sorted(r.losses) == list(range(1, ITERS + 1)), r.losses
    assert all(math.isfinite(v) for v in r.losses.values()), r.losses
    assert_loss_falls(r)
    assert_patched(r, may_wait=(*NOT_IMPORTED_BY_GPT, "megatron.core.ssm.", "megatron.core.models.mamba."))
    got = ops(r)
    # every layer of every micro-batch (ITERS x GLOBAL_BATCH packs, one process) went through the op
    assert got.get("attention_thd") == {"cpu.torch.sdpa.per_sequence": LAYERS * ITERS * GLOBAL_BATCH}, got
    assert "attention" not in got and "attention_cp" not in got, got


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_sft_cp2_matches_cp1(inputs, tmp_path_factory, comm):
    base_run = run("sft_cp1", inputs, tmp_path_factory).check()
    cp = run(f"sft_cp2_{comm}", inputs, tmp_path_factory, 2, "--cp-comm-type", comm).check()
    assert sorted(cp.losses) == sorted(base_run.losses) == list(range(1, ITERS + 1))
    diffs = [abs(cp.losses[i] - base_run.losses[i]) for i in base_run.losses]
    assert max(diffs) <= 2e-3, (comm, base_run.losses, cp.losses)
    got = ops(cp)
    # rank 0's calls: its half of every pack, every layer
    assert got.get("attention_cp") == {f"cpu.torch.{comm}": LAYERS * ITERS * GLOBAL_BATCH}, got
    assert "attention_thd" not in got, got
    # the THD split under CP, without TE: core 0.16-0.17's function, 0.18's or 0.19's
    splits = {"megatron.core.utils:get_thd_batch_on_this_cp_rank",
              "megatron.core.utils:get_sft_batch_on_this_cp_rank",
              "megatron.core.utils:_get_batch_on_this_cp_rank_per_document_balancing"}
    assert len(splits & applied(cp)) == 1, applied(cp)


def test_sft_tp2_trains_on_attention_thd(inputs, tmp_path_factory):
    """TP=2 (2 processes): the packed batch and its cu_seqlens reach the second TP rank through
    Megatron's broadcast. Not compared with TP=1: the vocabulary pads to 256 instead of 128 and the
    weights are drawn per partition, so the runs start from different models."""
    version = checkout_version(LM)
    if version is None or version < Version("0.18"):
        pytest.skip(f"Megatron-LM {version}: core_v0.16.1's get_batch_on_this_tp_rank breaks --sft at TP > 1 "
                    "(the receiving ranks broadcast cu_seqlens twice and drop max_seqlen), on any hardware "
                    "(0.17 not checked); run on core_v0.18 or later")
    r = run("sft_tp2", inputs, tmp_path_factory, 1, "--tensor-model-parallel-size", "2", nproc=2).check()
    assert sorted(r.losses) == list(range(1, ITERS + 1)), r.losses
    assert all(math.isfinite(v) for v in r.losses.values()), r.losses
    assert_loss_falls(r)
    got = ops(r)
    assert got.get("attention_thd") == {"cpu.torch.sdpa.per_sequence": LAYERS * ITERS * GLOBAL_BATCH}, got

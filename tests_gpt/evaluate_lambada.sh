#!/usr/bin/env bash
# LAMBADA cloze evaluation (strict last-word accuracy and perplexity) of a checkpoint written by
# stock Megatron-LM pretrain_gpt.py, on any megatron-adapt backend, any TP/PP:
#   megatron-adapt-run torchrun --nproc-per-node $NPROC -m megatron_adapt.apps.evaluate_lambada ...
# The model's shape comes from the checkpoint (--use-checkpoint-args); the checkpoint is torch_dist
# and is resharded to this run's TP/PP.
#
# Usage:
#   MEGATRON_LM_PATH=/path/to/Megatron-LM LOAD=ckpt_dir LAMBADA_DATA=lambada.jsonl \
#   VOCAB_FILE=vocab.json MERGE_FILE=merges.txt [VAR=value ...] tests_gpt/evaluate_lambada.sh \
#       [--shape_order SBH|BSH] [--pre=N] [--next=N] [extra arguments ...]
#
# Arguments (as tests_gpt/pretrain_gpt_distributed.sh):
#   --shape_order SBH|BSH  attention kernel's q/k/v memory order (MEGATRON_ADAPT_ATTENTION_LAYOUT
#                       sbhd|bshd); the scores do not depend on it
#   --pre=N --next=N    sliding-window attention, Megatron's --window-size PRE,NEXT: use the
#                       window the model was trained with
#   anything else       passed to megatron_adapt.apps.evaluate_lambada / Megatron after the defaults
#                       below (a later flag wins), e.g. another tokenizer:
#                       --tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME
#
# Environment (defaults in brackets):
#   MEGATRON_LM_PATH       Megatron-LM checkout matching the installed megatron-core (required)
#   LOAD                   checkpoint directory written by pretrain_gpt.py --save (required)
#   LAMBADA_DATA           LAMBADA jsonl, one {"text": passage} per line (required)
#   VOCAB_FILE, MERGE_FILE GPT-2 BPE files (--tokenizer-type GPT2BPETokenizer); leave both unset to
#                       give the tokenizer as extra arguments instead
#   RESULTS_JSON [unset]   also write the scores to this JSON file
#   MEGATRON_ADAPT_BACKEND auto|cpu|cuda|npu [auto]
#   NPROC [1]  TP [1]  PP [1]  (data parallel = NPROC / (TP*PP): passages are split across it)
#   PRECISION [fp32] fp32|bf16|fp16   MBS [8] micro-batch size
#   MASTER_PORT [random free port]   OMP_NUM_THREADS [1]   LAUNCHER [megatron-adapt-run]
set -euo pipefail

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v<megatron-core version>)}"
: "${LOAD:?set LOAD to the checkpoint directory (pretrain_gpt.py --save)}"
: "${LAMBADA_DATA:?set LAMBADA_DATA to the LAMBADA jsonl file}"
NPROC=${NPROC:-1}; TP=${TP:-1}; PP=${PP:-1}; PRECISION=${PRECISION:-fp32}; MBS=${MBS:-8}
LAUNCHER=${LAUNCHER:-megatron-adapt-run}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

source "$(dirname "${BASH_SOURCE[0]}")/common_args.sh"

ARGS=(
    --load "$LOAD" --use-checkpoint-args --lambada-data "$LAMBADA_DATA"
    --micro-batch-size "$MBS"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
)
if [[ -n "${VOCAB_FILE:-}" || -n "${MERGE_FILE:-}" ]]; then
    ARGS+=(--tokenizer-type GPT2BPETokenizer --legacy-tokenizer
           --vocab-file "${VOCAB_FILE:?VOCAB_FILE and MERGE_FILE go together}"
           --merge-file "${MERGE_FILE:?VOCAB_FILE and MERGE_FILE go together}")
fi
case "$PRECISION" in
    fp32) ;;
    bf16) ARGS+=(--bf16) ;;
    fp16) ARGS+=(--fp16) ;;
    *) echo "PRECISION must be fp32, bf16 or fp16, got '$PRECISION'" >&2; exit 2 ;;
esac
if [[ -n "$PRE" || -n "$NEXT" ]]; then
    ARGS+=(--window-size "${PRE:--1},${NEXT:-0}")
fi
[[ -n "${RESULTS_JSON:-}" ]] && ARGS+=(--lambada-results-json "$RESULTS_JSON")

CMD=(torchrun --nproc-per-node "$NPROC" --master-port "$MASTER_PORT"
     -m megatron_adapt.apps.evaluate_lambada "${ARGS[@]}" "${EXTRA[@]}")
[[ -n "$LAUNCHER" ]] && CMD=("$LAUNCHER" "${CMD[@]}")
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"

#!/usr/bin/env bash
# evaluate_lambada.sh in bf16 (PRECISION=bf16). Same arguments (--shape_order SBH|BSH, --pre=N,
# --next=N, extra flags) and environment (LOAD, LAMBADA_DATA, VOCAB_FILE, MERGE_FILE, NPROC, TP, PP,
# MEGATRON_ADAPT_BACKEND, ...); see evaluate_lambada.sh's header.
#
# Example: a checkpoint of pretrain_gpt_bf16.sh, evaluated at TP=2:
#   MEGATRON_LM_PATH=/work/mlm LOAD=/tmp/ck LAMBADA_DATA=lambada.jsonl VOCAB_FILE=vocab.json \
#     MERGE_FILE=merges.txt NPROC=2 TP=2 tests_gpt/evaluate_lambada_bf16.sh
exec env PRECISION=bf16 "$(dirname "$0")/evaluate_lambada.sh" "$@"

#!/usr/bin/env bash
# evaluate_lambada.sh in fp16 (PRECISION=fp16). Same arguments (--shape_order SBH|BSH, --pre=N,
# --next=N, extra flags) and environment (LOAD, LAMBADA_DATA, VOCAB_FILE, MERGE_FILE, NPROC, TP, PP,
# MEGATRON_ADAPT_BACKEND, ...); see evaluate_lambada.sh's header. No loss scaling is involved
# (forward only).
#
# Example: PP=2 on the npu backend:
#   MEGATRON_LM_PATH=/work/mlm LOAD=/tmp/ck LAMBADA_DATA=lambada.jsonl VOCAB_FILE=vocab.json \
#     MERGE_FILE=merges.txt MEGATRON_ADAPT_BACKEND=npu NPROC=2 PP=2 tests_gpt/evaluate_lambada_fp16.sh
exec env PRECISION=fp16 "$(dirname "$0")/evaluate_lambada.sh" "$@"

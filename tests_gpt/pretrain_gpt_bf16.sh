#!/usr/bin/env bash
# pretrain_gpt_distributed.sh in bf16 (PRECISION=bf16): stock Megatron-LM pretrain_gpt.py, unmodified,
# under megatron-adapt-run torchrun. Takes the same arguments (--shape_order SBH|BSH, --pre=N,
# --next=N, extra pretrain_gpt.py flags) and environment (NPROC, TP, PP, SP, DISTOPT, LLAMA, ITERS,
# SAVE, LOAD, MEGATRON_ADAPT_BACKEND, ...); see pretrain_gpt_distributed.sh's header.
#
# Example: TP=2 with sequence parallelism, then resume to 20 iterations:
#   MEGATRON_LM_PATH=/work/mlm TP=2 SP=1 SAVE=/tmp/ck tests_gpt/pretrain_gpt_bf16.sh
#   MEGATRON_LM_PATH=/work/mlm TP=2 SP=1 SAVE=/tmp/ck LOAD=/tmp/ck ITERS=20 tests_gpt/pretrain_gpt_bf16.sh
exec env PRECISION=bf16 "$(dirname "$0")/pretrain_gpt_distributed.sh" "$@"

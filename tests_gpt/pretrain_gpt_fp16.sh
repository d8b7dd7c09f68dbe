#!/usr/bin/env bash
# pretrain_gpt_distributed.sh in fp16 (PRECISION=fp16): stock Megatron-LM pretrain_gpt.py, unmodified,
# under megatron-adapt-run torchrun. Takes the same arguments (--shape_order SBH|BSH, --pre=N,
# --next=N, extra pretrain_gpt.py flags) and environment (NPROC, TP, PP, SP, DISTOPT, LLAMA, ITERS,
# SAVE, LOAD, MEGATRON_ADAPT_BACKEND, ...); see pretrain_gpt_distributed.sh's header.
# fp16 uses dynamic loss scaling from INITIAL_LOSS_SCALE (default 4096 here; Megatron's own default
# 2^32 skips the first ~20 iterations while it backs off, on any hardware).
#
# Example: PP=2 with the llama-like model:
#   MEGATRON_LM_PATH=/work/mlm PP=2 LLAMA=1 tests_gpt/pretrain_gpt_fp16.sh
exec env PRECISION=fp16 "$(dirname "$0")/pretrain_gpt_distributed.sh" "$@"

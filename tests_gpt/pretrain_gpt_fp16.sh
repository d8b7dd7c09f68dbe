#!/usr/bin/env bash
# pretrain_gpt_distributed.sh in fp16 (PRECISION=fp16): stock Megatron-LM pretrain_gpt.py, unmodified,
# under megatron-adapt-run torchrun. Takes the same arguments (--shape_order SBH|BSH, --pre=N,
# --next=N, extra pretrain_gpt.py flags) and environment (NPROC, TP, PP, SP, DISTOPT, LLAMA, ITERS,
# SAVE, LOAD, MEGATRON_ADAPT_BACKEND, ...); see pretrain_gpt_distributed.sh's header.
# fp16 uses Megatron's dynamic loss scaling from its default initial scale 2^32 (INITIAL_LOSS_SCALE
# overrides it): the first steps overflow, are skipped ("number of skipped iterations: 1") and
# halve the scale, then training goes on (the tiny model settles at 2^18 after ~15 skipped steps
# on the cpu backend). Hence ITERS defaults to 30 here.
#
# Example: PP=2 with the llama-like model:
#   MEGATRON_LM_PATH=/work/mlm PP=2 LLAMA=1 tests_gpt/pretrain_gpt_fp16.sh
exec env PRECISION=fp16 ITERS="${ITERS:-30}" "$(dirname "$0")/pretrain_gpt_distributed.sh" "$@"

#!/usr/bin/env bash
# Stock Megatron-LM pretrain_gpt.py, unmodified, on any megatron-adapt backend: a tiny GPT on mock
# data, launched as `megatron-adapt-run torchrun --nproc-per-node $NPROC pretrain_gpt.py ...`.
#
# Usage:
#   MEGATRON_LM_PATH=/path/to/Megatron-LM [VAR=value ...] tests_gpt/pretrain_gpt_distributed.sh \
#       [--shape_order SBH|BSH] [--pre=N] [--next=N] [extra pretrain_gpt.py arguments ...]
#
# Arguments:
#   --shape_order SBH|BSH  the memory order the attention kernel reads q/k/v in. SBH (default):
#                       Megatron's own [seq, batch, head, dim], no copy. BSH: batch-first copies
#                       (MEGATRON_ADAPT_ATTENTION_LAYOUT=bshd; npu: npu_fusion_attention's "BSH"
#                       layout). The rest of the model stays [seq, batch, hidden], which is the
#                       only activation layout Megatron's transformer has.
#   --pre=N --next=N    sliding-window attention: each token attends to N tokens before it and N
#                       after it; mapped to Megatron's `--window-size PRE,NEXT` (causal GPT: next=0,
#                       the default when only --pre is given). Off when neither is given.
#   anything else       passed to pretrain_gpt.py after the defaults below (a later flag wins).
#
# Environment (defaults in brackets):
#   MEGATRON_LM_PATH       Megatron-LM checkout matching the installed megatron-core (required)
#   MEGATRON_ADAPT_BACKEND auto|cpu|cuda|npu [auto], read by megatron-adapt in every rank
#   NPROC [2]  TP [1]  PP [1]  SP [0] (1: --sequence-parallel)  DISTOPT [0] (1: --use-distributed-optimizer)
#   PRECISION [fp32] fp32|bf16|fp16     INITIAL_LOSS_SCALE [unset: Megatron's 2^32] (fp16 only;
#                                       dynamic loss scaling skips the steps that overflow and
#                                       halves the scale each time, then trains on)
#   LLAMA [0]  1: --swiglu --position-embedding-type rope --normalization RMSNorm
#                 --untie-embeddings-and-output-weights --disable-bias-linear
#   NLAYERS [2] HIDDEN [64] HEADS [4] SEQ [64] VOCAB [128] MBS [2] GBS [8] ITERS [10] LR [1e-3]
#   DATA_PATH [unset: --mock-data]  a Megatron indexed dataset prefix (tools/preprocess_data.py's
#                       output, e.g. /d/train_text_document) trained on instead of mock data
#   VOCAB_FILE, MERGE_FILE [unset: NullTokenizer of VOCAB tokens]  GPT-2 BPE files: --tokenizer-type
#                       GPT2BPETokenizer (Megatron's legacy tokenizer system, no transformers needed)
#   SAVE, LOAD [unset]  checkpoint directories (--save / --load); SAVE_INTERVAL [ITERS]
#   OVERRIDE_SCHEDULER [auto]  1: --override-opt_param-scheduler. auto: on when LOAD is set, because
#                       Megatron asserts the checkpointed scheduler equals the new one and its
#                       weight-decay horizon is train_iters*global_batch (so more --train-iters
#                       after a resume always needs it; not a backend issue)
#   TRANSFORMER_IMPL [unset]  unset: Megatron's default (transformer_engine, served by megatron-adapt's
#                       backend-native layer spec when TE is absent); local: --transformer-impl local
#   ATTENTION_BACKEND [auto]  --attention-backend (auto|flash|fused|unfused|local)
#   GRAD_ACCUM_FUSION [1]  1: Megatron's default --gradient-accumulation-fusion (weight gradients
#                       accumulated into main_grad by the backend's wgrad op); 0: --no-gradient-accumulation-fusion
#   MASTER_PORT [random free port]   OMP_NUM_THREADS [1]   LAUNCHER [megatron-adapt-run]
#
# Every fused-kernel flag stays at Megatron's default (persist-layer-norm, masked-softmax-fusion,
# rope-fusion, bias-gelu/swiglu fusion, gradient-accumulation fusion) and so does
# --transformer-impl (transformer_engine): megatron-adapt serves them on each backend.
set -euo pipefail

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v<megatron-core version>)}"
NPROC=${NPROC:-2}; TP=${TP:-1}; PP=${PP:-1}; SP=${SP:-0}; DISTOPT=${DISTOPT:-0}
PRECISION=${PRECISION:-fp32}; INITIAL_LOSS_SCALE=${INITIAL_LOSS_SCALE:-}; LLAMA=${LLAMA:-0}
NLAYERS=${NLAYERS:-2}; HIDDEN=${HIDDEN:-64}; HEADS=${HEADS:-4}; SEQ=${SEQ:-64}; VOCAB=${VOCAB:-128}
MBS=${MBS:-2}; GBS=${GBS:-8}; ITERS=${ITERS:-10}; LR=${LR:-1e-3}
GRAD_ACCUM_FUSION=${GRAD_ACCUM_FUSION:-1}; ATTENTION_BACKEND=${ATTENTION_BACKEND:-auto}; LAUNCHER=${LAUNCHER:-megatron-adapt-run}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# As Megatron-LM's own example scripts do: Megatron asserts it for tensor/context parallelism on
# GPUs (ordering of communication and compute kernels). The cpu backend sets it itself.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

source "$(dirname "${BASH_SOURCE[0]}")/common_args.sh"

ARGS=(
    --num-layers "$NLAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
    --split 949,50,1
    --attention-backend "$ATTENTION_BACKEND"
    --lr "$LR" --min-lr "$(python3 -c "print($LR / 10)")" --lr-decay-style cosine
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234
    --log-interval 1 --eval-interval 1000 --eval-iters 1
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
)
if [[ -n "${DATA_PATH:-}" ]]; then ARGS+=(--data-path "$DATA_PATH"); else ARGS+=(--mock-data); fi
if [[ -n "${VOCAB_FILE:-}" || -n "${MERGE_FILE:-}" ]]; then
    ARGS+=(--tokenizer-type GPT2BPETokenizer --legacy-tokenizer
           --vocab-file "${VOCAB_FILE:?VOCAB_FILE and MERGE_FILE go together}"
           --merge-file "${MERGE_FILE:?VOCAB_FILE and MERGE_FILE go together}")
else
    ARGS+=(--tokenizer-type NullTokenizer --vocab-size "$VOCAB")
fi
[[ "$SP" == 1 ]] && ARGS+=(--sequence-parallel)
[[ "$DISTOPT" == 1 ]] && ARGS+=(--use-distributed-optimizer)
case "$PRECISION" in
    fp32) ;;
    bf16) ARGS+=(--bf16) ;;
    fp16) ARGS+=(--fp16); [[ -n "$INITIAL_LOSS_SCALE" ]] && ARGS+=(--initial-loss-scale "$INITIAL_LOSS_SCALE") ;;
    *) echo "PRECISION must be fp32, bf16 or fp16, got '$PRECISION'" >&2; exit 2 ;;
esac
[[ "$LLAMA" == 1 ]] && ARGS+=(--swiglu --position-embedding-type rope --normalization RMSNorm
                              --untie-embeddings-and-output-weights --disable-bias-linear)
[[ "$GRAD_ACCUM_FUSION" == 1 ]] || ARGS+=(--no-gradient-accumulation-fusion)
[[ -n "${TRANSFORMER_IMPL:-}" ]] && ARGS+=(--transformer-impl "$TRANSFORMER_IMPL")
if [[ -n "$PRE" || -n "$NEXT" ]]; then
    ARGS+=(--window-size "${PRE:--1},${NEXT:-0}")
fi
[[ -n "${SAVE:-}" ]] && ARGS+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-$ITERS}")
if [[ -n "${LOAD:-}" ]]; then
    ARGS+=(--load "$LOAD")
    [[ "${OVERRIDE_SCHEDULER:-auto}" != 0 ]] && ARGS+=(--override-opt_param-scheduler)
elif [[ "${OVERRIDE_SCHEDULER:-auto}" == 1 ]]; then
    ARGS+=(--override-opt_param-scheduler)
fi

CMD=(torchrun --nproc-per-node "$NPROC" --master-port "$MASTER_PORT"
     "$MEGATRON_LM_PATH/pretrain_gpt.py" "${ARGS[@]}" "${EXTRA[@]}")
[[ -n "$LAUNCHER" ]] && CMD=("$LAUNCHER" "${CMD[@]}")
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"

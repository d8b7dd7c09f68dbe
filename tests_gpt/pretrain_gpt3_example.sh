#!/usr/bin/env bash
# Megatron-LM's own examples/gpt3/train_gpt3_175b_distributed.sh arguments, scaled down to a tiny
# model on mock data, launched under megatron-adapt-run: the example's model and training flags are
# read from the checkout's script at run time (GPT_MODEL_ARGS and TRAINING_ARGS: default
# --transformer-impl, --attention-backend auto, fp16 with Megatron's dynamic loss scaler from 2^32,
# batch-size ramp-up, cosine schedule, every fusion flag at its default), then only sizes, the
# parallel layout and the data source are overridden (argparse: a later flag wins).
#
# One change of kind, not of size: the example gives a batch-size ramp-up together with --train-iters,
# which stock Megatron-LM core_v0.16.1 rejects on any hardware ("expected no batch-size rampup for
# iteration-based training", megatron/training/arguments.py). The run is made sample-based instead
# (--train-samples / --lr-decay-samples for the example's --train-iters / --lr-decay-iters), so the
# ramp-up itself is kept and exercised.
#
# Usage: MEGATRON_LM_PATH=/path/to/Megatron-LM [NPROC=2] [TP=2] [ITERS=30] [CKPT=dir] \
#            tests_gpt/pretrain_gpt3_example.sh [extra pretrain_gpt.py arguments ...]
set -euo pipefail

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v<megatron-core version>)}"
EXAMPLE="$MEGATRON_LM_PATH/examples/gpt3/train_gpt3_175b_distributed.sh"
[[ -f "$EXAMPLE" ]] || { echo "no $EXAMPLE" >&2; exit 2; }
NPROC=${NPROC:-2}; TP=${TP:-2}; ITERS=${ITERS:-30}; LAUNCHER=${LAUNCHER:-megatron-adapt-run}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # as the example does

# The example's own argument arrays (definitions only; the script itself is not run).
eval "$(sed -n '/^GPT_MODEL_ARGS=(/,/^)/p; /^TRAINING_ARGS=(/,/^)/p' "$EXAMPLE")"
[[ ${#GPT_MODEL_ARGS[@]} -gt 0 && ${#TRAINING_ARGS[@]} -gt 0 ]] || {
    echo "could not read GPT_MODEL_ARGS / TRAINING_ARGS from $EXAMPLE" >&2; exit 2; }

# The batch-size ramp-up: --rampup-batch-size (core_v0.16, 0.17) or, from core_v0.18, a token-based
# --step-batch-size-schedule. The 0.18 / 0.19 example gives that schedule together with
# --global-batch-size, which their own argument check rejects on any hardware ("Cannot specify both
# --step-batch-size-schedule and --global-batch-size"): the schedule is kept (scaled: 4 sequences,
# then 8 after 1280 tokens) and the example's global batch size is dropped.
STEP_SCHEDULE=0
for a in "${TRAINING_ARGS[@]}"; do [[ "$a" == --step-batch-size-schedule ]] && STEP_SCHEDULE=1; done

# Drop the example's iteration counts (flag + value); the sample-based equivalents follow.
KEEP=(); skip=0
for a in "${TRAINING_ARGS[@]}"; do
    if [[ $skip == 1 ]]; then skip=0; continue; fi
    case "$a" in --train-iters|--lr-decay-iters) skip=1; continue ;; esac
    if [[ $STEP_SCHEDULE == 1 ]]; then
        case "$a" in --global-batch-size|--step-batch-size-schedule) skip=1; continue ;; esac
    fi
    KEEP+=("$a")
done
TRAINING_ARGS=("${KEEP[@]}")
if [[ $STEP_SCHEDULE == 1 ]]; then
    RAMPUP=(--step-batch-size-schedule "0:4 1280:8")
else
    RAMPUP=(--global-batch-size 8 --rampup-batch-size 4 4 64)
fi

SCALE_DOWN=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
    --micro-batch-size 1 "${RAMPUP[@]}"
    --train-samples "$((ITERS * 8))" --lr-decay-samples "$((ITERS * 8))" --init-method-std 0.02
    --lr 1e-3 --min-lr 1e-4
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size 1
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 949,50,1
    --log-interval 1 --eval-interval 1000 --eval-iters 1
)
[[ -n "${CKPT:-}" ]] && SCALE_DOWN+=(--save "$CKPT" --load "$CKPT" --save-interval 10)

if [[ -z "${MASTER_PORT:-}" ]]; then
    MASTER_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
CMD=(torchrun --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" "$MEGATRON_LM_PATH/pretrain_gpt.py"
     "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${SCALE_DOWN[@]}" "$@")
[[ -n "$LAUNCHER" ]] && CMD=("$LAUNCHER" "${CMD[@]}")
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"

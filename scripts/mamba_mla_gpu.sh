#!/usr/bin/env bash
# Mamba hybrid (M*M-M*M-, 8 layers) and MLA + MoE (DeepSeek-V3 style, 8 layers, 8 experts top-2 with a
# shared expert) through the stock Megatron-LM scripts under megatron-adapt-run on one GPU (cuda backend):
# bf16, hidden 1024, seq 1024, global batch 16, mock data, 10 iterations saved at 10, then resumed to 20.
# The two families run at the same time on the one GPU: a functional check (loss falls, no NaN, resume,
# which backend ops served them, from each run's MEGATRON_ADAPT_REPORT json), not a timing.
# Mamba: core_v0.18+ pretrain_hybrid.py --hybrid-layer-pattern, earlier pretrain_mamba.py --hybrid-override-pattern.
# Usage: MEGATRON_LM_PATH=/path/to/Megatron-LM scripts/mamba_mla_gpu.sh OUTDIR
set -euo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout matching megatron-core}"
OUT=${1:?usage: scripts/mamba_mla_gpu.sh OUTDIR}; mkdir -p "$OUT"; CK="$OUT/ckpt"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
C="--hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4
   --global-batch-size 16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 949,50,1 --bf16
   --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --seed 1234
   --init-method-std 0.02 --log-interval 1 --eval-iters 0 --eval-interval 100000 --attention-dropout 0
   --hidden-dropout 0 --save-interval 10 --override-opt_param-scheduler"
M="--mamba-state-dim 64 --mamba-head-dim 64 --mamba-num-groups 8 --normalization RMSNorm --position-embedding-type none
   --disable-bias-linear --untie-embeddings-and-output-weights --num-layers 8"
if [ -f "$MEGATRON_LM_PATH/pretrain_hybrid.py" ]; then
    MS="$MEGATRON_LM_PATH/pretrain_hybrid.py --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec --hybrid-layer-pattern M*M-M*M-"
else
    MS="$MEGATRON_LM_PATH/pretrain_mamba.py --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --hybrid-override-pattern M*M-M*M-"
fi
L="--num-layers 8 --multi-latent-attention --q-lora-rank 384 --kv-lora-rank 256 --qk-head-dim 64 --qk-pos-emb-head-dim 32
   --v-head-dim 64 --qk-layernorm --position-embedding-type rope --rotary-scaling-factor 40 --mscale 1.0
   --mscale-all-dim 1.0 --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --num-experts 8
   --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type
   seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
   --moe-shared-expert-intermediate-size 1024 --moe-ffn-hidden-size 1024 --disable-bias-linear --moe-layer-freq [0]+[1]*7"
run() {  # name port iters script-and-args...
    local n=$1 p=$2 it=$3; shift 3
    MEGATRON_ADAPT_REPORT="$OUT/$n.json" megatron-adapt-run torchrun --nproc-per-node 1 --master-port "$p" "$@" \
        --train-iters "$it" > "$OUT/$n.log" 2>&1 && echo "$n: ok" || echo "$n: FAILED (see $OUT/$n.log)"
}
# shellcheck disable=SC2086
{ run mamba 29751 10 $MS $C $M --save "$CK/m" & run mla 29752 10 "$MEGATRON_LM_PATH/pretrain_gpt.py" $C $L --save "$CK/l" & wait; }
# shellcheck disable=SC2086
{ run mamba_resume 29753 20 $MS $C $M --save "$CK/m" --load "$CK/m" &
  run mla_resume 29754 20 "$MEGATRON_LM_PATH/pretrain_gpt.py" $C $L --save "$CK/l" --load "$CK/l" & wait; }
for n in mamba mla mamba_resume mla_resume; do
    echo "== $n: iteration ms loss"
    grep -E "iteration +[0-9]+/" "$OUT/$n.log" | sed -E 's/.*iteration +([0-9]+).*elapsed time per iteration \(ms\): ([0-9.]+).*lm loss: ([0-9.E+-]+).*/\1 \2 \3/' | tr '\n' ';'; echo
    grep -E "successfully loaded checkpoint" "$OUT/$n.log" | head -1 || true
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sorted({(o['op'], o['implementation'], o['fallback_reason']) for o in r['ops']}))" "$OUT/$n.json"
done

#!/usr/bin/env bash
# MoE end-to-end: stock Megatron-LM pretrain_gpt.py on one GPU, same model, seed and mock data.
#   (a) stock:  --transformer-impl local (SequentialMLP: one ColumnParallel/RowParallel pair per
#               expert, no grouped GEMM), the flags it needs without apex / TE (as scripts/bench_e2e.sh),
#               Megatron's unfused permutation and router. megatron-core 0.16.1 cannot route at
#               all without TE (moe_utils.RouterGatingLinearFunction names te_general_gemm, unbound
#               without TE: NameError), so (a) runs under megatron-adapt with every area disabled
#               but `moe`, whose only effect with these flags is binding that name (fused=False
#               calls pass straight to Megatron's code; GroupedMLP is not built).
#   (b) adapt:  megatron-adapt-run, Megatron's default arguments plus --moe-grouped-gemm
#               --moe-permute-fusion --moe-router-fusion.
#   (c) adapt_capacity (not in the default RUNS): (b) with capacity-padded dispatch,
#               --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity: every expert
#               gets exactly capacity = tokens x top-k / experts rows (1024 here), tokens over it
#               dropped, the rest padded; the same expert GEMM rows as dropless, so the same FLOPs.
#   (d) adapt_graphs (not in the default RUNS): (c) with MEGATRON_ADAPT_CUDA_GRAPHS=local, which
#               turns on Megatron's --cuda-graph-impl local: every transformer layer, MoE included,
#               captured whole (docs/moe.md "CUDA graphs": dropless MoE cannot be, and the partial
#               MoE scopes build no graph on GPT's layer under the local implementation).
#   (e) stock_capacity (not in the default RUNS): (a) with (c)'s two capacity flags.
#   (f) adapt_fp8 (not in the default RUNS): (b) plus --fp8-format $FP8_FORMAT --fp8-recipe
#               $FP8_RECIPE: dense linears and the grouped experts in fp8 (docs/fp8.md). No stock fp8
#               run: stock Megatron without TE refuses MoE in fp8 ("requires TE").
#   (g) adapt_fp8_graphs (not in the default RUNS): (d) in fp8, as (f).
# Model (issue 13): 16 layers, hidden 2048, 16 heads, 8 experts top-2, expert ffn 2816, alltoall
# dispatcher, aux loss 1e-2, seq 2048, micro-batch 2, global batch 8, vocab 32000, bf16, RMSNorm,
# SwiGLU, RoPE, untied embeddings, no linear biases.
# Usage: MEGATRON_LM_PATH=/path/to/Megatron-LM scripts/bench_moe.sh OUTDIR
# Env: ITERS [30] WARMUP [10] PEAK_TFLOPS [989] RUNS ["stock adapt"] EXTRA_ARGS [""] (every run)
#      FP8_FORMAT [hybrid] FP8_RECIPE [tensorwise] for the fp8 runs
#      RUN_TIMEOUT [0: none] seconds per run; a run that fails or times out is reported and left
#      out of the summary, the other runs still count
#      NPROC [1] GPUs (torchrun --nproc-per-node), EP [1] --expert-model-parallel-size (e.g. NPROC=2
#      EP=2 on two GPUs over NCCL; nvidia-smi's peak is GPU 0's)
set -euo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1)}"
OUTDIR=${1:?usage: scripts/bench_moe.sh OUTDIR}; mkdir -p "$OUTDIR"
ITERS=${ITERS:-30}; WARMUP=${WARMUP:-10}; NPROC=${NPROC:-1}; EP=${EP:-1}; PEAK_TFLOPS=${PEAK_TFLOPS:-989}; RUNS=${RUNS:-"stock adapt"}
RUN_TIMEOUT=${RUN_TIMEOUT:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1

MODEL=(
    --num-layers 16 --hidden-size 2048 --num-attention-heads 16
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2816 --ffn-hidden-size 2816
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 8
    --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --split 949,50,1
    --bf16 --normalization RMSNorm --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --init-method-std 0.02
    --log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000
    --expert-model-parallel-size "$EP"
)
read -r -d "" -a EXTRA <<< "${EXTRA_ARGS:-}" || true   # every line (a plain read stops at the first newline)
MODEL+=("${EXTRA[@]}")
STOCK_FLAGS=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
             --no-masked-softmax-fusion --no-gradient-accumulation-fusion)
ADAPT_FLAGS=(--moe-grouped-gemm --moe-permute-fusion --moe-router-fusion)
CAPACITY=(--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity)
FP8=(--fp8-format "${FP8_FORMAT:-hybrid}" --fp8-recipe "${FP8_RECIPE:-tensorwise}")
ALL_BUT_MOE=cuda_graphs,jit,rng,training,cross_entropy,norms,softmax,attention,rope,activations,optimizer,checkpointing,multi_tensor,grad_accum_fusion,layer_specs,startup_report,device
if command -v megatron-adapt-run >/dev/null; then ADAPT=(megatron-adapt-run); else ADAPT=(python3 -m megatron_adapt.launcher); fi
TORCHRUN=(timeout "$RUN_TIMEOUT" python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port 29561)

echo "$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc --all) vCPU" > "$OUTDIR/host_cpu.txt" || true
nvidia-smi --query-gpu=name --format=csv,noheader -i 0 > "$OUTDIR/gpu.txt" 2>/dev/null || true
echo "moe (issue 13: 16 x 2048, 8 experts top-2)" > "$OUTDIR/preset.txt"

peak_smi() {  # sample nvidia-smi's used memory while the command runs; peak MiB into $1.smi_peak_mib
    local log=$1; shift; local peak=0
    "$@" > "$log" 2>&1 & local pid=$!
    while kill -0 $pid 2>/dev/null; do
        local used; used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 || echo 0)
        (( used > peak )) && peak=$used; sleep 0.5
    done
    wait $pid; local rc=$?; echo "$peak" > "$log.smi_peak_mib"; return $rc
}

stock_run() {  # $1: run name, then extra flags
    local name=$1; shift
    make -s -C "$MEGATRON_LM_PATH/megatron/core/datasets" \
        LIBEXT="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" || true
    peak_smi "$OUTDIR/$name.log" env MEGATRON_ADAPT_DISABLE=$ALL_BUT_MOE \
        MEGATRON_ADAPT_REPORT="$OUTDIR/${name}_report.json" \
        "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${STOCK_FLAGS[@]}" "$@"
}
adapt_run() {  # $1: run name, then extra environment assignments, --, then extra flags
    local name=$1; shift; local envs=()
    while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done; shift
    peak_smi "$OUTDIR/$name.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/${name}_report.json" ${envs[@]+"${envs[@]}"} \
        "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${ADAPT_FLAGS[@]}" "$@"
}

DONE=()
for run in $RUNS; do
    echo "== $run $(date +%T)"
    case $run in
        stock)          stock_run stock ;;
        stock_capacity) stock_run stock_capacity "${CAPACITY[@]}" ;;
        adapt)          adapt_run adapt -- ;;
        adapt_capacity) adapt_run adapt_capacity MEGATRON_ADAPT_CUDA_GRAPHS=off -- "${CAPACITY[@]}" ;;
        adapt_graphs)   adapt_run adapt_graphs MEGATRON_ADAPT_CUDA_GRAPHS=local -- "${CAPACITY[@]}" ;;
        adapt_fp8)      adapt_run adapt_fp8 MEGATRON_ADAPT_CUDA_GRAPHS=off -- "${FP8[@]}" ;;
        adapt_fp8_graphs) adapt_run adapt_fp8_graphs MEGATRON_ADAPT_CUDA_GRAPHS=local -- "${CAPACITY[@]}" "${FP8[@]}" ;;
        *) echo "unknown run $run" >&2; exit 2 ;;
    esac && DONE+=("$run") || echo "run $run failed (rc $?): tail of $OUTDIR/$run.log" >&2
    [[ " ${DONE[*]} " == *" $run "* ]] || tail -30 "$OUTDIR/$run.log" >&2
done
[[ ${#DONE[@]} -gt 0 ]] || exit 1
python3 "$HERE/e2e_summary.py" --outdir "$OUTDIR" --warmup "$WARMUP" --peak-tflops "$PEAK_TFLOPS" "${DONE[@]}"

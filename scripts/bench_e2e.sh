#!/usr/bin/env bash
# End-to-end: stock Megatron-LM pretrain_gpt.py twice on one GPU, same model, same seed, mock data.
#   (a) stock:  unpatched, --transformer-impl local plus the flags it needs without apex / TE
#               (--no-rope-fusion --no-persist-layer-norm --no-masked-softmax-fusion
#               --no-gradient-accumulation-fusion) and the dataset helpers built with Megatron's Makefile;
#   (b) adapt:  megatron-adapt-run, Megatron's default arguments (transformer_engine impl, every fusion on).
#               From 2026-11-27 on that includes MEGATRON_ADAPT_CUDA_GRAPHS' default, auto:
#               on one GPU Megatron's layer graphs are on, as in (c), and the report says so.
#   (b') adapt_eager (not in the default RUNS): (b) with MEGATRON_ADAPT_CUDA_GRAPHS=off: no graphs,
#               the default step before that commit.
#   (c) adapt_graphs: (b) plus Megatron's own CUDA graphs (--cuda-graph-impl local; default scope:
#               each transformer layer's forward and backward captured once, replayed after).
#   (d) adapt_full_graph (not in the default RUNS): (b) plus --cuda-graph-impl local
#               --cuda-graph-scope full_iteration --no-check-for-nan-in-loss-and-grad: the whole
#               forward-backward of an iteration (every micro-batch) in one graph; Megatron refuses
#               that scope unless its per-micro-batch NaN/Inf loss check (a host sync) is off.
#   (e) stock_full_graph (not in the default RUNS): (a) with the same three flags.
#   (f) adapt_fp8 (not in the default RUNS): (b') plus --fp8-format $FP8_FORMAT --fp8-recipe
#               $FP8_RECIPE (fp8 linears without TE, docs/fp8.md). No stock fp8 run: stock Megatron
#               without TE ignores the fp8 flags (a silent bf16 run).
#   (g) adapt_fp8_graphs (not in the default RUNS): (f) plus --cuda-graph-impl local.
#   (h) adapt_fp8_full_graph (not in the default RUNS): (f) plus (d)'s three full-iteration flags.
# Per run also: the GPU's busy fraction (nvidia-smi dmon SM %, median over the steady samples) and
# the host's CPU model (lscpu), since a step that waits on the host shows there.
# Model (PRESET, default llama-0.95b): 0.95B llama-like (16 layers, hidden 2048, ffn 5632, 16 heads, seq 2048, micro-batch 4, global
# batch 16, vocab 32000, bf16, RMSNorm, SwiGLU, RoPE, untied embeddings); small presets for the
# host-bound regime: llama-350m / llama-125m (24 x 1024 / 12 x 768, seq 1024, micro-batch 8, global
# batch 32, the same llama choices) and gpt2-350m / gpt2-125m (the same sizes GPT-2 style: LayerNorm,
# GeLU, biases, learned positions, tied embeddings, vocab 50257); llama-3b (24 x 3072, ffn 8192, 24 heads,
# seq 2048, micro-batch 2, global batch 16; 2.9B parameters) and llama-2.7b-h4096 (12 x 4096, ffn 11008,
# 32 heads, the same sequence and batches; 2.7B) for the GEMM-bound regime. Prints ms/iteration
# (median of iterations WARMUP+1..ITERS), TFLOP/s per GPU (Megatron's --log-throughput count), MFU
# against PEAK_TFLOPS, peak memory (the largest of Megatron's max allocated / max reserved reports, and
# nvidia-smi's peak used) and both loss curves with their largest difference.
#
# Usage: MEGATRON_LM_PATH=/path/to/Megatron-LM scripts/bench_e2e.sh OUTDIR
# Env: PRESET [llama-0.95b] ITERS [50] WARMUP [10] PEAK_TFLOPS [989: H100/H200 SXM dense bf16] RUNS ["stock adapt adapt_graphs"]
#      EXTRA_ARGS [""]: appended to both runs (e.g. "--attention-dropout 0 --hidden-dropout 0": with
#      dropout on, the two runs draw different dropout masks -- Megatron's RNG tracker in (a), the
#      fused attention kernel's own Philox stream in (b), as with TE -- so their curves part ways
#      in the steep first iterations)
#      FP8_RECIPE [tensorwise]: tensorwise | delayed | blockwise, FP8_FORMAT [hybrid]: hybrid | e4m3, for the fp8 runs;
#      MASTER_PORT [29561]: torchrun's port (two runs at once on two GPUs need two)
#      MAX_CONNECTIONS [1]: CUDA_DEVICE_MAX_CONNECTIONS for every run (Megatron's examples set 1; activation
#      offloading hides its copies only with more than one hardware queue: docs/model-families.md)
#      NPROC [1]: GPUs (processes); with EXTRA_ARGS="--tensor-model-parallel-size 2" etc. for model parallelism
#      FP8_ARGS [""]: more fp8 flags for them (e.g. "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max")
#      e.g. RUNS="adapt adapt_fp8" FP8_RECIPE=delayed scripts/bench_e2e.sh OUT
set -euo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1)}"
OUTDIR=${1:?usage: scripts/bench_e2e.sh OUTDIR}; mkdir -p "$OUTDIR"
ITERS=${ITERS:-50}; WARMUP=${WARMUP:-10}; PEAK_TFLOPS=${PEAK_TFLOPS:-989}; RUNS=${RUNS:-"stock adapt adapt_graphs"}; PRESET=${PRESET:-llama-0.95b}
HERE=$(cd "$(dirname "$0")" && pwd)
export CUDA_DEVICE_MAX_CONNECTIONS=${MAX_CONNECTIONS:-1} PYTHONUNBUFFERED=1

COMMON=(
    --tokenizer-type NullTokenizer --mock-data --split 949,50,1 --bf16
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --init-method-std 0.02
    --log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000
)
LLAMA=(--normalization RMSNorm --swiglu --position-embedding-type rope
       --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000)
GPT2=(--normalization LayerNorm --position-embedding-type learned_absolute --vocab-size 50257)
case $PRESET in  # model shapes; every preset keeps Megatron's default dropout unless EXTRA_ARGS says otherwise
    llama-0.95b) MODEL=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
                        --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4
                        --global-batch-size 16 "${LLAMA[@]}") ;;
    llama-3b)    MODEL=(--num-layers 24 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24
                        --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2
                        --global-batch-size 16 "${LLAMA[@]}") ;;
    llama-2.7b-h4096) MODEL=(--num-layers 12 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
                        --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2
                        --global-batch-size 16 "${LLAMA[@]}") ;;
    llama-350m)  MODEL=(--num-layers 24 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
                        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8
                        --global-batch-size 32 "${LLAMA[@]}") ;;
    llama-125m)  MODEL=(--num-layers 12 --hidden-size 768 --ffn-hidden-size 2048 --num-attention-heads 12
                        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8
                        --global-batch-size 32 "${LLAMA[@]}") ;;
    gpt2-350m)   MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16
                        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8
                        --global-batch-size 32 "${GPT2[@]}") ;;
    gpt2-125m)   MODEL=(--num-layers 12 --hidden-size 768 --num-attention-heads 12
                        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8
                        --global-batch-size 32 "${GPT2[@]}") ;;
    *) echo "unknown PRESET $PRESET (llama-0.95b llama-3b llama-2.7b-h4096 llama-350m llama-125m gpt2-350m gpt2-125m)" >&2; exit 2 ;;
esac
MODEL+=("${COMMON[@]}")
echo "$PRESET" > "$OUTDIR/preset.txt"
read -r -d "" -a EXTRA <<< "${EXTRA_ARGS:-}" || true   # every line (a plain read stops at the first newline)
MODEL+=("${EXTRA[@]}")
STOCK_FLAGS=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
             --no-masked-softmax-fusion --no-gradient-accumulation-fusion)
FULL_GRAPH=(--cuda-graph-impl local --cuda-graph-scope full_iteration --no-check-for-nan-in-loss-and-grad)
read -r -d "" -a FP8_EXTRA <<< "${FP8_ARGS:-}" || true   # every line (a plain read stops at the first newline)
FP8=(--fp8-format "${FP8_FORMAT:-hybrid}" --fp8-recipe "${FP8_RECIPE:-tensorwise}" "${FP8_EXTRA[@]}")
if command -v megatron-adapt-run >/dev/null; then ADAPT=(megatron-adapt-run); else ADAPT=(python3 -m megatron_adapt.launcher); fi
TORCHRUN=(python3 -m torch.distributed.run --nproc-per-node "${NPROC:-1}" --master-port "${MASTER_PORT:-29561}")

echo "$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc --all) vCPU" > "$OUTDIR/host_cpu.txt" || true
nvidia-smi --query-gpu=name --format=csv,noheader -i 0 > "$OUTDIR/gpu.txt" 2>/dev/null || true

peak_smi() {  # sample nvidia-smi's used memory (and SM busy %, dmon) while $1 runs; print the peak (MiB)
    local log=$1; shift; local peak=0
    nvidia-smi dmon -s u -d 1 -i 0 > "$log.dmon" 2>/dev/null & local dmon=$!
    "$@" > "$log" 2>&1 & local pid=$!
    while kill -0 $pid 2>/dev/null; do
        local used; used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 || echo 0)
        (( used > peak )) && peak=$used; sleep 0.5
    done
    wait $pid; local rc=$?; kill $dmon 2>/dev/null || true; echo "$peak" > "$log.smi_peak_mib"; return $rc
}

build_dataset_helpers() {  # Megatron's own step for its dataset helpers (the checkout has none built)
    make -s -C "$MEGATRON_LM_PATH/megatron/core/datasets" \
        LIBEXT="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" || true
}

for run in $RUNS; do
    case $run in
        stock)  build_dataset_helpers
                peak_smi "$OUTDIR/stock.log" env MEGATRON_ADAPT_DISABLE=all \
                    "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${STOCK_FLAGS[@]}" ;;
        adapt)  peak_smi "$OUTDIR/adapt.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_report.json" \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" ;;
        adapt_eager)
                peak_smi "$OUTDIR/adapt_eager.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_eager_report.json" \
                    MEGATRON_ADAPT_CUDA_GRAPHS=off \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" ;;
        adapt_graphs)
                peak_smi "$OUTDIR/adapt_graphs.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_graphs_report.json" \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" \
                    --cuda-graph-impl local ;;
        adapt_switch)  # (c) through MEGATRON_ADAPT_CUDA_GRAPHS=local instead of the flag
                peak_smi "$OUTDIR/adapt_switch.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_switch_report.json" \
                    MEGATRON_ADAPT_CUDA_GRAPHS=local \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" ;;
        adapt_full_graph)
                peak_smi "$OUTDIR/adapt_full_graph.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_full_graph_report.json" \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" \
                    "${FULL_GRAPH[@]}" ;;
        adapt_fp8)
                peak_smi "$OUTDIR/adapt_fp8.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_fp8_report.json" \
                    MEGATRON_ADAPT_CUDA_GRAPHS=off \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${FP8[@]}" ;;
        adapt_fp8_graphs)
                peak_smi "$OUTDIR/adapt_fp8_graphs.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_fp8_graphs_report.json" \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${FP8[@]}" \
                    --cuda-graph-impl local ;;
        adapt_fp8_full_graph)
                peak_smi "$OUTDIR/adapt_fp8_full_graph.log" env MEGATRON_ADAPT_REPORT="$OUTDIR/adapt_fp8_full_graph_report.json" \
                    "${ADAPT[@]}" "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${FP8[@]}" \
                    "${FULL_GRAPH[@]}" ;;
        stock_full_graph)
                build_dataset_helpers
                peak_smi "$OUTDIR/stock_full_graph.log" env MEGATRON_ADAPT_DISABLE=all \
                    "${TORCHRUN[@]}" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "${STOCK_FLAGS[@]}" \
                    "${FULL_GRAPH[@]}" --logging-level 20 ;;
        *) echo "unknown run $run" >&2; exit 2 ;;
    esac
done
python3 "$HERE/e2e_summary.py" --outdir "$OUTDIR" --warmup "$WARMUP" --peak-tflops "$PEAK_TFLOPS" $RUNS

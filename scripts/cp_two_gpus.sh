#!/usr/bin/env bash
# Context parallelism on two GPUs: stock Megatron-LM pretrain_gpt.py under megatron-adapt-run, cuda
# backend, NCCL, fp32, dropout off, the same seed, mock data and global batch:
#   cp1             --context-parallel-size 1 (DP=2): the baseline
#   cp2_<type>      --context-parallel-size 2 --cp-comm-type <type> for each of CP_TYPES
#                   (a2a+p2p adds --hierarchical-context-parallel-sizes 2 1)
# and prints, per CP run, the largest |Δ lm loss| against cp1 over the ITERS steps (PASS at <= TOL)
# and which attention_cp implementation ran (from the run's MEGATRON_ADAPT_REPORT json).
# In fp32 (the default here) the CP blocks run in torch math (the flash kernels take bf16 / fp16),
# reported as a fallback; with EXTRA_ARGS="--bf16" (and a looser TOL) they run as flash pieces
# (cuda.flash_blocks.<type>). This checks correctness over NCCL, it is not a speed run.
# tests/megatron_lm/test_pretrain_gpt_cp.py is the same comparison on the cpu backend over gloo.
# Usage: MEGATRON_LM_PATH=/path/to/Megatron-LM scripts/cp_two_gpus.sh OUTDIR
# Env: ITERS [10] SEQ [4096] TOL [2e-3] CP_TYPES ["p2p a2a allgather a2a+p2p"] EXTRA_ARGS [""]
set -euo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout matching megatron-core}"
OUTDIR=${1:?usage: scripts/cp_two_gpus.sh OUTDIR}; mkdir -p "$OUTDIR"
ITERS=${ITERS:-10}; SEQ=${SEQ:-4096}; TOL=${TOL:-2e-3}; CP_TYPES=${CP_TYPES:-"p2p a2a allgather a2a+p2p"}
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 MEGATRON_ADAPT_BACKEND=cuda
unset MEGATRON_ADAPT_STRICT
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] || { echo "needs 2 GPUs"; exit 2; }

MODEL=(
    --num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 4
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --micro-batch-size 1 --global-batch-size 4
    --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --split 949,50,1
    --normalization RMSNorm --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights
    --disable-bias-linear --attention-dropout 0 --hidden-dropout 0
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --init-method-std 0.02
    --log-interval 1 --eval-iters 0 --eval-interval 100000
)
read -r -d "" -a EXTRA <<< "${EXTRA_ARGS:-}" || true   # every line (a plain read stops at the first newline)
MODEL+=("${EXTRA[@]}")
if command -v megatron-adapt-run >/dev/null; then ADAPT=(megatron-adapt-run); else ADAPT=(python3 -m megatron_adapt.launcher); fi

run() {  # name, extra args...
    local name=$1; shift
    echo "== $name: $*"
    MEGATRON_ADAPT_REPORT="$OUTDIR/$name.report.json" "${ADAPT[@]}" python3 -m torch.distributed.run \
        --nproc-per-node 2 --master-port 29571 "$MEGATRON_LM_PATH/pretrain_gpt.py" "${MODEL[@]}" "$@" \
        > "$OUTDIR/$name.log" 2>&1 || { echo "$name FAILED: tail of $OUTDIR/$name.log"; tail -20 "$OUTDIR/$name.log"; return 1; }
}

run cp1
status=0
for t in $CP_TYPES; do
    hier=(); [ "$t" = "a2a+p2p" ] && hier=(--hierarchical-context-parallel-sizes 2 1)
    run "cp2_$t" --context-parallel-size 2 --cp-comm-type "$t" "${hier[@]}" || { status=1; continue; }
    python3 - "$OUTDIR" "$t" "$TOL" <<'PY' || status=1
import json, re, sys
out, t, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
pat = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.]+E[+-]\d+)")
def losses(name):
    return {int(i): float(l) for i, l in pat.findall(open(f"{out}/{name}.log").read())}
base, cp = losses("cp1"), losses(f"cp2_{t}")
assert base and sorted(base) == sorted(cp), (sorted(base), sorted(cp))
worst = max(abs(base[i] - cp[i]) for i in base)
impls = sorted({o["implementation"] for o in json.load(open(f"{out}/cp2_{t}.report.json"))["ops"]
                if o["op"] == "attention_cp"})
print(f"cp2_{t}: max |dloss| vs cp1 over {len(base)} steps = {worst:.3g} "
      f"({'PASS' if worst <= tol else 'FAIL'} at {tol}); attention_cp ran {impls}")
sys.exit(0 if worst <= tol else 1)
PY
done
exit $status

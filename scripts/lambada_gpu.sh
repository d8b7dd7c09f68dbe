#!/usr/bin/env bash
# LAMBADA evaluation on one GPU: the same checkpoint on cuda, cpu and npu (emulated), compared.
# scripts/lambada_compare.py builds the synthetic cloze data, tokenizer and indexed dataset, trains
# a tiny GPT with stock pretrain_gpt.py (cpu backend, GPUs hidden), then evaluates that checkpoint:
#   fp32: cpu TP=1 (reference), cpu TP=2, cpu PP=2, npu TP=1 (torch_npu emulation), cuda TP=1,
#         cuda TP=1 --shape_order BSH  -> accuracy identical, perplexity within 1e-3 relative
#   bf16: cpu TP=1 (reference), cpu TP=2, cuda TP=1, cuda TP=1 BSH -> reported, not asserted: bf16
#         logits are rounded to 2^-8 relative, so near-tied candidates can flip between kernels or
#         TP splits (measured on CPU: 23/64 at TP=1 vs 21/64 at TP=2; see docs/evaluation.md)
# (one GPU: cuda runs are TP=1; NCCL cannot put two ranks on one GPU).
#
# Usage: MEGATRON_LM_PATH=/path/to/Megatron-LM(core_v0.16.1) OUT=/some/dir scripts/lambada_gpu.sh
# Writes $OUT/lambada_fp32.json, $OUT/lambada_bf16.json, $OUT/lambada_gpu.txt and the logs.
set -euo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout matching the installed megatron-core}"
: "${OUT:?set OUT to the output directory}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
WORK=${WORK:-$(mktemp -d /tmp/lambada_gpu.XXXX)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import megatron_adapt" 2>/dev/null; then
    echo "megatron_adapt is not installed for $PY: installing this checkout (pip install -e . --no-deps)" >&2
    "$PY" -m pip install -q -e . --no-deps --no-build-isolation
fi
"$PY" -c "import regex" || { echo "the 'regex' package is needed (pip install regex)" >&2; exit 1; }
SHIMS=$(mktemp -d)   # torchrun / megatron-adapt-run for this Python when they are not on PATH
command -v torchrun >/dev/null || printf '#!/bin/sh\nexec %s -m torch.distributed.run "$@"\n' "$PY" > "$SHIMS/torchrun"
command -v megatron-adapt-run >/dev/null || printf '#!/bin/sh\nexec %s -m megatron_adapt.launcher "$@"\n' "$PY" > "$SHIMS/megatron-adapt-run"
chmod +x "$SHIMS"/* 2>/dev/null || true
export PATH="$SHIMS:$PATH"
nvidia-smi --query-gpu=name --format=csv,noheader -i 0 > "$OUT/gpu.txt" 2>/dev/null || true

rc=0
"$PY" scripts/lambada_compare.py --workdir "$WORK/fp32" --out "$OUT/lambada_fp32.json" \
    --configs cpu:tp1,cpu:tp2,cpu:pp2,npu:tp1,cuda:tp1,cuda:tp1:bsh 2>&1 | tee "$OUT/lambada_gpu.txt" || rc=1
"$PY" scripts/lambada_compare.py --workdir "$WORK/bf16" --out "$OUT/lambada_bf16.json" \
    --report-only --configs cpu:tp1:bf16,cpu:tp2:bf16,cuda:tp1:bf16,cuda:tp1:bsh:bf16 2>&1 | tee -a "$OUT/lambada_gpu.txt" || rc=1
mkdir -p "$OUT/logs"
for d in fp32 bf16; do for f in "$WORK/$d"/*.log; do cp "$f" "$OUT/logs/${d}_$(basename "$f")"; done; done
exit $rc

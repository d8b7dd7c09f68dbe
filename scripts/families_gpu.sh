#!/usr/bin/env bash
# Stock pretrain_bert.py, pretrain_t5.py and pretrain_vlm.py (core_v0.16.1's top-level scripts) under
# megatron-adapt-run on one GPU, --bf16, 30 iterations each, the three at once on the same GPU (a
# functional check: the ms/iteration are not benchmarks). BERT / T5 read an offline WordPiece vocab and
# indexed dataset (tests/megatron_lm/wordpiece_data.py); the VLM runs on its --mock-data.
#   MEGATRON_LM_PATH=<core_v0.16.1 checkout> bash scripts/families_gpu.sh OUTDIR
# Writes OUTDIR/<family>.log and OUTDIR/<family>.json (megatron-adapt's report) and prints, per run,
# the losses every 5 iterations and the ops that served attention, layer norm and cross entropy.
set -u
OUT=${1:?usage: families_gpu.sh OUTDIR}; mkdir -p "$OUT"
LM=${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a core_v0.16.1 checkout}
HERE=$(cd "$(dirname "$0")/.." && pwd)
echo "host: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc --all) vCPU"; nvidia-smi -L
D=$(mktemp -d)
PYTHONPATH=${PYTHONPATH:-}:$HERE/tests/megatron_lm python3 -c "
from pathlib import Path; import wordpiece_data as w
w.write_vocab(Path('$D/vocab.txt')); w.write_dataset(Path('$D/docs'), documents=1000)"
C="--hidden-size 256 --num-attention-heads 4 --max-position-embeddings 512 --micro-batch-size 8 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-decay-iters 30 --train-iters 30 --seed 1234 --log-interval 5 --eval-interval 1000 --eval-iters 1 --bf16"
W="--tokenizer-type BertWordPieceLowerCase --legacy-tokenizer --vocab-file $D/vocab.txt --data-path $D/docs --split 90,10,0"
run() { n=$1; p=$2; shift 2; ( MEGATRON_ADAPT_REPORT=$OUT/$n.json timeout 200 megatron-adapt-run torchrun --nproc-per-node 1 --master-port $p "$LM/$@" > "$OUT/$n.log" 2>&1; echo "$n rc=$?" ) ; }
run bert 29701 pretrain_bert.py $C $W --num-layers 4 --seq-length 128 &
run t5 29702 pretrain_t5.py $C $W --encoder-num-layers 4 --decoder-num-layers 4 --kv-channels 64 --ffn-hidden-size 1024 --encoder-seq-length 128 --decoder-seq-length 64 --vocab-extra-ids 10 &
run vlm 29703 pretrain_vlm.py $C --num-layers 4 --seq-length 128 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 949,50,1 --img-h 64 --img-w 64 --patch-dim 16 --ckpt-format torch &
wait
for n in bert t5 vlm; do
  echo "== $n"
  grep -E "iteration +[0-9]+/" "$OUT/$n.log" | sed -E 's/.*iteration +([0-9]+).*elapsed time per iteration \(ms\): ([0-9.]+).*lm loss: ([0-9.E+-]+).*/it \1 ms \2 loss \3/'
  python3 -c "
import json; r=json.load(open('$OUT/$n.json'))
print([(o['op'], o['implementation'], o['calls'], o['fallback_reason']) for o in r['ops']
       if o['op'] in ('attention', 'layer_norm', 'vocab_parallel_cross_entropy')])"
done

#!/usr/bin/env bash
# The quickstart: set up, build a real dataset (this Python's standard library source),
# train a tokenizer, and pretrain a tiny Llama at TP=2 x PP=2 (4 processes) on CPU with SNIP
# adaptive precision (75% of linear-layer FLOPs in NVFP4, re-planned at every checkpoint),
# stop as a preempted job would, and resume. Outputs under runs/quickstart/ (OUT=... to move).
# Parameters in fp32, not --bf16: on this 2-core CPU bf16 GEMMs are ~10x slower than fp32 (5.1 vs
# 0.54 s per iteration here); on a GPU add --bf16. SNIP=0 runs the same without SNIP (every linear
# GEMM unquantized), docs/quickstart.md's comparison: SNIP=0 OUT=runs/quickstart-nosnip bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
. .venv/bin/activate

OUT=${OUT:-runs/quickstart}
SNIP=${SNIP:-1}
DATA=$OUT/data
mkdir -p "$DATA"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
  python tools/build_corpus.py --output "$DATA/corpus.jsonl" --exclude-tests
  python tools/train_tokenizer.py --input "$DATA/corpus.jsonl" --model-prefix "$DATA/tokenizer" \
    --vocab-size 4096 --seed 1234
  python tools/preprocess_data.py --input "$DATA/corpus.jsonl" --output-prefix "$DATA/stdlib" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model" --append-eod --workers 2
fi

rm -rf "$OUT/checkpoints" "$OUT/tensorboard"  # each quickstart run starts fresh
TRAIN_ITERS=${TRAIN_ITERS:-300}
ARGS=(
  --model-preset tiny
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  --micro-batch-size 8 --global-batch-size 16
  --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 30
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  --data-path "$DATA/stdlib_text_document" --split 98,2,0
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model"
  --log-interval 10 --eval-interval 100 --eval-iters 4
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 100
  --tensorboard-dir "$OUT/tensorboard"
)
if [ "$SNIP" != 0 ]; then
  ARGS+=(--snip --snip-fp4-target 0.75)
fi
echo "== training to iteration $((TRAIN_ITERS / 2)), then stopping (as a preempted job would) =="
torchrun --nproc-per-node 4 pretrain_llama.py "${ARGS[@]}" --exit-interval $((TRAIN_ITERS / 2))
echo "== resuming from $OUT/checkpoints =="
torchrun --nproc-per-node 4 pretrain_llama.py "${ARGS[@]}"
if compgen -G "$OUT/checkpoints/snip/snip_iter_*.json" > /dev/null; then
  python tools/snip_report.py "$OUT/checkpoints/snip" --out "$OUT/snip_report"
fi
echo "== done: TensorBoard logs in $OUT/tensorboard (tensorboard --logdir $OUT/tensorboard);"
echo "   SNIP statistics in $OUT/checkpoints/snip, plots in $OUT/snip_report =="

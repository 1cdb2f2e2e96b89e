#!/usr/bin/env bash
# The layer ablations of results/qs8-layer-ablations trained again (seed 2, another CPU), then taken apart:
# each ablation's final state evaluated in BF16, the BF16 branch's final state evaluated with one layer in
# MXFP4, and SNIP's terms and the per-module forward truth on that state.
#   bash results/qs8-layer-decomposition/run.sh OUT        (OUT: a new folder, e.g. runs/abl2d; ~45 min on 2 cores)
set -euo pipefail
OUT=$1 R=results/qs8-layer-decomposition SEED=2
FLAGS="--model-preset tiny --num-layers 8 --micro-batch-size 8 --global-batch-size 16 --lr 3e-3 --min-lr 3e-4
  --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  --data-path runs/quickstart/data/stdlib_text_document --split 98,2,0 --tokenizer-type SentencePieceTokenizer
  --tokenizer-model runs/quickstart/data/tokenizer.model --log-interval 10"
S=$OUT/seed$SEED
python tools/lab/compare_precision.py --out "$OUT" --trunk-iters 100 --train-iters 300 --formats bf16 fp8 mxfp4 \
  --fp4-targets 0.75 --seeds $SEED --jobs 2 --policies --ablations layers -- $FLAGS --eval-interval 50 --eval-iters 24
# the validation loss at 300 of a final state under another plan: the branches' evaluation flags, which also
# decide the validation samples (how many are built), so that it is their 24 batches
val() { OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 1 pretrain_llama.py $FLAGS --eval-interval 50 --eval-iters 24 \
          --seed $SEED --train-iters 300 --skip-train "$@" 2>&1 |
          sed -n 's/.*validation loss at iteration 300 | lm loss value: \([0-9.E+-]*\).*/\1/p'; }
for l in 0 1 2 3 4 5 6 7; do
  echo "layer$l state_in_bf16 $(val --load "$S/ablate-layer$l/ckpt" --precision bf16)"
  echo "layer$l bf16_state_in_plan $(val --load "$S/bf16/ckpt" --precision-plan "$S/plans/ablate-layer$l.json")"
done > "$OUT/evals.txt"
python - "$OUT" <<'PY'
import json, sys
rows = {r["arm"]: r for r in json.load(open(f"{sys.argv[1]}/results.json"))["rows"]}
groups = {a: r["gap"] for a, r in rows.items() if a.startswith("ablate-layer")}
json.dump({"groups": groups}, open(f"{sys.argv[1]}/ablations_layers.json", "w"), indent=1)
PY
# SNIP's terms per layer at the branch point and at the BF16 branch's end; the forward truth per module at the end
for spec in "100 $S/trunk/ckpt" "300 $S/bf16/ckpt"; do
  set -- $spec
  torchrun --nproc-per-node 1 tools/lab/term_shares.py $FLAGS --eval-iters 0 --seed $SEED --load "$2" \
    --train-iters "$1" --snip --snip-interval 1000 --snip-formats bf16 fp8 mxfp4 --format mxfp4 \
    --ablation-costs "$OUT/ablations_layers.json" --json "$OUT/shares_$1.json"
done
torchrun --nproc-per-node 1 tools/lab/snip_validate.py $FLAGS --eval-iters 0 --seed $SEED --load "$S/bf16/ckpt" \
  --train-iters 300 --snip --snip-interval 1000 --snip-formats bf16 mxfp4 --validate-batches 4 --validate-seeds 1 \
  --output "$OUT/validate_300.json"
python $R/summarize.py "$OUT" results/objective-timing/ablations/qs8_seed2_layers.json

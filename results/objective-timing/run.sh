#!/bin/bash
# SNIP's objective measured at the branch point (iteration 100: the trunk) and at iterations 200 and 300 (the
# BF16 branch's checkpoints) of each trunk of a comparison, each ranked against layer and type ablations.
#   bash results/objective-timing/run.sh RUNS COSTS OUT DATA_FLAGS...
# RUNS: a comparison's folder (seed<N>/trunk/ckpt, seed<N>/bf16/ckpt/iter_0000200 and _300); COSTS: ablation costs
# ({"groups": {"ablate-layer0": gap, ...}}); OUT: where the shares go (OUT/s<seed>_<iteration>.json). SEEDS: the
# trunks (default 1 2 3 4 5).
set -euo pipefail
RUNS=$1 COSTS=$2 OUT=$3; shift 3
FLAGS="--model-preset tiny --num-layers 8 --micro-batch-size 8 --global-batch-size 16 --lr 3e-3 --min-lr 3e-4
  --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  --tokenizer-type SentencePieceTokenizer --log-interval 10 --eval-iters 0"
mkdir -p "$OUT"
for seed in ${SEEDS:-1 2 3 4 5}; do
  for it in 100 200 300; do
    if [ "$it" = 100 ]; then ckpt=$RUNS/seed$seed/trunk/ckpt; else
      # --load reads the tracker file: a folder whose tracker names the branch's checkpoint at $it
      ckpt=$OUT/ckpt_s${seed}_$it; mkdir -p "$ckpt"
      ln -sfn "$(realpath "$RUNS/seed$seed/bf16/ckpt/iter_0000$it")" "$ckpt/iter_0000$it"
      echo "$it" > "$ckpt/latest_checkpointed_iteration.txt"
    fi
    torchrun --nproc-per-node 1 tools/lab/term_shares.py $FLAGS "$@" --seed "$seed" --load "$ckpt" \
      --train-iters "$it" --snip --snip-interval 1000 --snip-formats bf16 fp8 mxfp4 --format mxfp4 \
      --ablation-costs "$COSTS" --json "$OUT/s${seed}_$it.json" | grep "^objective.*Spearman" | sed "s/^/trunk $seed, $it: /"
  done
done

#!/usr/bin/env bash
# Continue pretraining TinyLlama 1.1B with SNIP (the paper's headline experiment), from a local
# Hugging Face directory, and export the result for lm-evaluation-harness. Nothing is downloaded:
# fetch the model yourself first, e.g.
#   huggingface-cli download TinyLlama/TinyLlama_v1.1 --local-dir /models/TinyLlama_v1.1
# Set HF_DIR (that directory), CORPUS (JSONL with a "text" field, or plain text) and OUT.
#
#   1. tools/convert_hf_llama.py import: HF_DIR -> $OUT/imported (iteration 0, fp32 master weights)
#   2. tools/preprocess_data.py with the model's own tokenizer (BOS + document + EOS, as HF tokenizes)
#   3. torchrun pretrain_llama.py --pretrained-checkpoint $OUT/imported --snip --snip-fp4-target 0.75
#      (the model shape and --seq-length 2048 come from the checkpoint; one 8-GPU node, DP=8, BF16)
#   4. tools/convert_hf_llama.py export: the newest checkpoint -> $OUT/hf (config, safetensors,
#      tokenizer, megatron_snip.json with the SNIP plan), then for example
#      lm_eval --model hf --model_args pretrained=$OUT/hf --tasks hellaswag,arc_easy,piqa
set -euo pipefail
HF_DIR=${HF_DIR:?set HF_DIR to a local Hugging Face TinyLlama directory (config.json, safetensors, tokenizer)}
CORPUS=${CORPUS:?set CORPUS to the JSONL corpus to continue pretraining on}
OUT=${OUT:-runs/tinyllama-continued}
GPUS=${GPUS:-8}
PYTHON=${PYTHON:-python}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron-core overlaps TP communication with compute

if [ ! -f "$OUT/imported/latest_checkpointed_iteration.txt" ]; then
  "$PYTHON" tools/convert_hf_llama.py import --load-dir "$HF_DIR" --save-dir "$OUT/imported"
fi
if [ ! -f "$OUT/data/corpus_text_document.idx" ]; then
  mkdir -p "$OUT/data"
  "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/data/corpus" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR" --append-eod --workers 8
fi

# Start from the import (weights only, iteration 0) while $OUT/checkpoints holds no checkpoint; once the
# continued run has one, rerunning this script (a requeue) resumes that run instead.
torchrun --nproc-per-node "$GPUS" pretrain_llama.py --pretrained-checkpoint "$OUT/imported" \
  --load "$OUT/checkpoints" \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-distributed-optimizer \
  --micro-batch-size 8 --global-batch-size 512 --bf16 \
  --train-iters 5000 --lr 4e-5 --min-lr 4e-6 --lr-decay-style cosine --lr-warmup-iters 100 \
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 \
  --data-path "$OUT/data/corpus_text_document" --split 989,10,1 \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR" \
  --log-interval 10 --eval-interval 500 --eval-iters 20 \
  --save "$OUT/checkpoints" --save-interval 500 \
  --snip --snip-fp4-target 0.75 \
  --tensorboard-dir "$OUT/tensorboard" "$@"

"$PYTHON" tools/convert_hf_llama.py export --load-dir "$OUT/checkpoints" --save-dir "$OUT/hf" --dtype bf16

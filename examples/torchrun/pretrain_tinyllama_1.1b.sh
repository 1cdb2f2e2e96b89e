#!/usr/bin/env bash
# TinyLlama-1.1B shape on one 8-GPU node: TP=1, PP=1, DP=8, BF16, with SNIP re-planning the
# linear layers' precision at every checkpoint (75% of their FLOPs in NVFP4).
# Set DATA_PATH (prefix from tools/preprocess_data.py), TOKENIZER_MODEL and CKPT_DIR.
set -euo pipefail
DATA_PATH=${DATA_PATH:?set DATA_PATH to the dataset prefix, e.g. /data/starcoder_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a sentencepiece .model}
CKPT_DIR=${CKPT_DIR:-checkpoints/tinyllama-1.1b}
GPUS=${GPUS:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron-core overlaps TP communication with compute

torchrun --nproc-per-node "$GPUS" pretrain_llama.py \
  --model-preset tinyllama-1.1b \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-distributed-optimizer \
  --micro-batch-size 8 --global-batch-size 512 --bf16 \
  --train-iters 100000 --lr 4e-4 --min-lr 4e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 \
  --data-path "$DATA_PATH" --split 989,10,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
  --log-interval 10 --eval-interval 1000 --eval-iters 20 \
  --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 \
  --snip --snip-fp4-target 0.75 \
  --tensorboard-dir "$CKPT_DIR/tensorboard" "$@"

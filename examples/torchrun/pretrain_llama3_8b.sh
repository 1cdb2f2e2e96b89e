#!/usr/bin/env bash
# Llama-3-8B shape on one 8-GPU node: TP=4, PP=1, DP=2, BF16, sequence parallel,
# selective recompute. Set DATA_PATH, TOKENIZER_MODEL and CKPT_DIR. Sequence parallelism runs
# with the local layers (no apex needed) and with --snip.
# Llama 3's tokenizer is a Hugging Face tokenizer.json (BPE, 128256 ids), not a sentencepiece
# model: TOKENIZER_MODEL is a Llama 3 snapshot directory or its tokenizer.json, and DATA_PATH was
# preprocessed with the same one (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer).
set -euo pipefail
DATA_PATH=${DATA_PATH:?set DATA_PATH to the dataset prefix}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a Llama 3 directory or its tokenizer.json}
CKPT_DIR=${CKPT_DIR:-checkpoints/llama3-8b}
GPUS=${GPUS:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron-core overlaps TP communication with compute

torchrun --nproc-per-node "$GPUS" pretrain_llama.py \
  --model-preset llama3-8b --seq-length 4096 \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --recompute-granularity selective \
  --micro-batch-size 1 --global-batch-size 256 --bf16 \
  --train-iters 50000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 \
  --data-path "$DATA_PATH" --split 989,10,1 \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
  --log-interval 10 --eval-interval 1000 --eval-iters 20 \
  --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500 \
  --tensorboard-dir "$CKPT_DIR/tensorboard" "$@"

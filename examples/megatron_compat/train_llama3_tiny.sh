#!/bin/bash
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, run by this program: the same flags
# with Megatron-LM's meanings, pretrain_llama.py in place of pretrain_gpt.py, and a Llama small
# enough to train on two CPU processes (2 layers, hidden 64, a 4096-id vocabulary). Arguments as
# in Megatron-LM's script: CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER (or MOCK) DATA (or MOCK).
#
# Every flag keeps Megatron-LM's meaning or the start-up log says, in one "notice:" line, what runs
# instead and how to get Megatron-LM's behaviour (docs/megatron_compat.md): FP8 runs this program's
# default recipe, tensorwise (current) scaling, where Megatron-LM's default is delayed scaling (add
# --fp8-recipe delayed for it); --fp8-param-gather saves nothing without Transformer Engine; --profile
# marks an nsys range only on CUDA.
# Added: --save-retain-interval (Megatron-LM's checkpoint retention).
#
#   bash examples/megatron_compat/train_llama3_tiny.sh    # from the repository root, mock data

OUT=${OUT:-runs/megatron_compat}  # the default paths' directory (Megatron-LM's script uses ./)
CHECKPOINT_PATH=${1:-"$OUT/checkpoints/llama3_tiny"}
TENSORBOARD_LOGS_PATH=${2:-"$OUT/tensorboard_logs/llama3_tiny"}
TOKENIZER_ARG=${3:-"MOCK"} # Path to tokenizer model, or "MOCK"
DATA_ARG=${4:-"MOCK"}     # Data prefix, or "MOCK"

mkdir -p "$(dirname "$CHECKPOINT_PATH")"
mkdir -p "$(dirname "$TENSORBOARD_LOGS_PATH")"

# Distributed training setup (CPU processes over gloo here; GPUs with CUDA)
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NUM_NODES=1
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-0}

PRETRAIN_SCRIPT_PATH="pretrain_llama.py"

# Fixed model and training parameters (the 8B script: 32 layers, hidden 4096, batch 128 x 8192)
TP_SIZE=1
CP_SIZE=1
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-4}
NUM_LAYERS=2
DTYPE=${DTYPE:-"fp8"}
SEQ_LENGTH=64
MAX_POSITION_EMBEDDINGS=64
TRAIN_SAMPLES=${TRAIN_SAMPLES:-16}

DATA_CACHE_PATH="$OUT/benchmark_cache_llama3_tiny"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --apply-layernorm-1p
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples $TRAIN_SAMPLES
    --lr-decay-samples $TRAIN_SAMPLES
    --lr-warmup-samples $GLOBAL_BATCH_SIZE
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        --fp8-format hybrid
        --fp8-amax-history-len 1024
        --fp8-amax-compute-algo max
        --fp8-param-gather
    )
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel  # off at TP 1, as in Megatron-LM
)

DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST+=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 4096
        --data-cache-path "$DATA_CACHE_PATH"
        --tiktoken-pattern v2
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
else
    DATA_ARGS_LIST+=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --data-cache-path "$DATA_CACHE_PATH"
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --profile
    --profile-step-start 2
    --profile-step-end 3
    --eval-iters 2
    --eval-interval 100
    --save-interval 1
    --save-retain-interval 2
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then
    echo "Error: $PRETRAIN_SCRIPT_PATH not found; run this script from the repository root."
    exit 1
fi

torchrun "${DISTRIBUTED_ARGS[@]}" \
    "$PRETRAIN_SCRIPT_PATH" \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DTYPE_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS_LIST[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"

"""The name of every scalar, image and text panel the trainer writes to TensorBoard (and W&B).

Megatron-LM's scalars carry Megatron-LM's names (``megatron/training/training.py``: ``training_log``
and ``evaluate_and_print_results``), so a Megatron-LM baseline's event files overlay this program's
in one TensorBoard. This program's own scalars sit beside them in groups (``precision/``, ``snip/``,
``quant-health/``, ``perf/``, ``safety/``, ``memory/``, ``data/``). docs/logging.md lists them all
with the flag that gates each; everything that writes or reads a tag takes its name from here.
"""

from __future__ import annotations

# -- Megatron-LM's, every --tensorboard-log-interval iterations -----------------------------------
LM_LOSS = "lm loss"                    # the iteration's training loss (mean over micro-batches and DP)
LEARNING_RATE = "learning-rate"
BATCH_SIZE = "batch-size"              # samples per iteration (the global batch)
LOSS_SCALE = "loss-scale"              # --log-loss-scale-to-tensorboard (1.0: bf16 needs no loss scaling)
WORLD_SIZE = "world-size"              # --log-world-size-to-tensorboard
GRAD_NORM = "grad-norm"                # global L2 norm before clipping
NUM_ZEROS = "num-zeros"                # --log-num-zeros-in-grad
PARAMS_NORM = "params-norm"            # --log-params-norm
MEM_RESERVED = "mem-reserved-bytes"    # --log-memory-to-tensorboard, CUDA only (torch.cuda.memory_stats)
MEM_ALLOCATED = "mem-allocated-bytes"
MEM_MAX_ALLOCATED = "mem-max-allocated-bytes"
MEM_ALLOCATED_COUNT = "mem-allocated-count"
SAMPLES_VS_STEPS = "samples vs steps"  # W&B only: consumed samples, the x-axis of the ``vs samples`` plots

# -- Megatron-LM's, every --log-interval iterations (--log-timers-to-tensorboard) --------------------
ITERATION_TIME = "iteration-time"      # seconds per iteration, mean over the interval
THROUGHPUT = "throughput"              # model TFLOP/s per GPU (per process on CPU); also --log-throughput

# -- Megatron-LM's, at each evaluation -------------------------------------------------------------
LM_LOSS_VALIDATION = "lm loss validation"
LM_LOSS_VALIDATION_PPL = "lm loss validation ppl"  # --log-validation-ppl-to-tensorboard


def vs_samples(tag: str) -> str:
    """Megatron-LM's twin of ``tag`` whose x-axis is consumed samples (TensorBoard only)."""
    return f"{tag} vs samples"


def timer(name: str) -> str:
    """Megatron-LM's tag of timer ``name`` (``forward-backward`` -> ``forward-backward-time``): seconds
    per iteration, the maximum over ranks (--log-timers-to-tensorboard, --timing-log-level >= 1)."""
    return f"{name}-time"


# -- this program's, every --tensorboard-log-interval iterations -----------------------------------
FP4_FRACTION = "precision/fp4 flops fraction"  # share of linear-layer FLOPs in FP4 under the plan in force
FP8_FRACTION = "precision/fp8 flops fraction"
GEMM_TIME = "precision/estimated gemm time vs bf16"  # the GEMM speed model's estimate for the plan in force
SKIPPED_ITERATIONS = "safety/skipped iterations"  # in the run so far (--check-for-nan-in-loss-and-grad)
SPIKY_LOSSES = "safety/spiky losses"              # in the run so far (--check-for-spiky-loss)

# -- this program's, every --log-interval iterations -----------------------------------------------
TOKENS_PER_SECOND = "perf/tokens per second"
MFU = "perf/MFU"                       # throughput / peak dense BF16 TFLOP/s (GPU, or --peak-tflops)
RSS = "memory/rss-bytes"               # --log-memory-to-tensorboard without CUDA: the logging process's RSS
PLAN_IMAGE = "precision/plan"          # image, when the plan in force changes
QUANT_HEALTH = "quant-health"          # --quant-health: QUANT_HEALTH/STAT/MODULE_TYPE.OPERAND
QUANT_HEALTH_PER_LAYER = "quant-health-per-layer"  # QUANT_HEALTH_PER_LAYER/STAT/LAYER.OPERAND


def quant_health(stat: str, module: str, operand: str, per_layer: bool = False) -> str:
    """Tag of one quantization-health statistic (``relative mse``, ``saturated``, ...) of one GEMM
    operand (``fprop.x``) of a module type (``mlp.linear_fc1``) or, ``per_layer``, a layer (``003``)."""
    return f"{QUANT_HEALTH_PER_LAYER if per_layer else QUANT_HEALTH}/{stat}/{module}.{operand}"


# -- this program's, at each evaluation ------------------------------------------------------------
UNIGRAM_ENTROPY = "data/unigram entropy"  # nats/token of the training data: what no model can beat without context

# -- this program's, at each SNIP cycle (--snip) ---------------------------------------------------
SNIP = "snip"  # SNIP/<name>: fp4 flops fraction, estimated gemm time vs bf16, objective, loss divergence,
               # update divergence, solve seconds, cycle seconds, cycle iterations (the cycle's seconds over
               # the median recent iteration's), unresolved curvature fraction;
               # SNIP/layer divergence/LLL
SNIP_PLAN_IMAGE = "snip/plan"
SNIP_DECISIONS = "snip/decisions"  # text


def snip(name: str) -> str:
    """Tag of SNIP cycle scalar ``name`` (``snip/objective``)."""
    return f"{SNIP}/{name}"


def snip_layer_divergence(layer: int) -> str:
    return f"{SNIP}/layer divergence/{layer:03d}"


# -- text ------------------------------------------------------------------------------------------
CONFIG = "config"  # the run's resolved flags (YAML), at the start

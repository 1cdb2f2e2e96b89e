"""Command line of ``pretrain_llama.py``: Megatron-LM's flag names, validated once into a typed configuration.

Flags that exist in Megatron-LM keep its names and meanings. Model-shape flags
default to ``None`` so a ``--model-preset`` (or a loaded checkpoint) can fill them
and explicit flags win. :func:`resolve` checks everything that can be checked
before any process-group work, raising :class:`ArgumentError` naming the flag and
the fix, and returns the frozen :class:`~megatron_snip.training.config.RunConfig`.
This module is the edge: nothing below it reads an argparse ``Namespace``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from typing import TYPE_CHECKING

from megatron_snip.model import checkpoint_shape
from megatron_snip.model.presets import PRESETS
from megatron_snip.precision.gemm_speed import SPEED_MODELS
from megatron_snip.precision.registry import FP4_NAMES, PRECISION_NAMES

if TYPE_CHECKING:  # imported where used: --help and flag errors need no megatron-core (seconds of imports)
    from megatron_snip.training.config import RunConfig


class ArgumentError(ValueError):
    """A bad command-line value; the message names the flag and what would be right."""


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Shard the norm/dropout activations along the sequence over TP ranks (needs TP > 1).")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Interleaved pipeline schedule: layers per virtual stage (model chunk); each pipeline "
                        "rank holds num-layers / (PP x this) chunks.")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="Interleaved pipeline schedule: model chunks per pipeline rank (instead of "
                        "--num-layers-per-virtual-pipeline-stage).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Accepted for Megatron scripts; only 1 (no context parallelism) is supported.")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="Default: nccl with CUDA, gloo without.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (defaults come from --model-preset)")
    g.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="Named Llama shape (default tiny, or with --load the checkpoint's shape); explicit shape "
                        "flags override its fields.")
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
                 "num-query-groups", "seq-length", "max-position-embeddings", "rotary-base"):
        g.add_argument(f"--{name}", type=int, default=None)
    g.add_argument("--norm-epsilon", type=float, default=None)
    g.add_argument("--group-query-attention", action="store_true",
                   help="Accepted for Megatron compatibility; GQA follows --num-query-groups.")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="Layer implementation: megatron-core's own modules or Transformer Engine's.")
    g.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"], default="auto",
                   help="Core attention. With --transformer-impl local: unfused and local keep megatron-core's "
                        "DotProductAttention (materialises the scores); auto, flash and fused use torch's "
                        "scaled_dot_product_attention (torch chooses its flash or memory-efficient kernel on "
                        "GPU). With transformer_engine: passed to megatron-core's TransformerConfig "
                        "attention_backend (Transformer Engine chooses). Not part of a checkpoint's shape.")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    # Llama fixes these; Megatron scripts pass them, so accept them.
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
        g.add_argument(flag, action="store_true", help="Always on for Llama (accepted).")
    g.add_argument("--normalization", choices=["RMSNorm"], default="RMSNorm")
    g.add_argument("--position-embedding-type", choices=["rope"], default="rope")


def _rope_scaling(p: argparse.ArgumentParser) -> None:
    """Llama 3.1 rope scaling (Megatron-LM's flags) and the fields only checkpoints set."""
    g = p.add_argument_group("rope scaling (Llama 3.1 / 3.2; set by imported checkpoints)")
    g.add_argument("--use-rope-scaling", action="store_true", default=None,
                   help="Llama 3.1's rope frequency scaling (megatron-core's: low/high frequency factors "
                        "1 and 4, original context 8192).")
    g.add_argument("--rope-scaling-factor", type=float, default=None, help="Its factor (default 8).")
    # Set from a checkpoint: the model's real vocabulary, its padded size (the embedding rows,
    # fixed at import so the checkpoint loads at any TP size dividing it), tied output layer,
    # and the Hugging Face files (tokenizer, generation config) an import kept.
    p.set_defaults(**{key: None for key in checkpoint_shape.CARRIED})


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default: micro-batch-size x data-parallel size.")
    g.add_argument("--train-iters", type=int, default=None,
                   help="Iterations (global batches) to train; required unless --train-samples is given.")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Save (if --save) and exit after an iteration divisible by this value.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Save (if --save) and exit once the run's wall time since start-up passes this many minutes "
                        "(fractions accepted). Checked at every iteration; all ranks agree (an all-reduce) and stop "
                        "one iteration after it passes. The run's exit record (SAVE/exit_record.json) then asks the "
                        "SLURM script for a requeue (python -m megatron_snip.training.requeue).")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="Accepted for Megatron-LM scripts: here the handler is always on. SIGTERM or SIGUSR1 make "
                        "every rank finish its iteration, save (if --save) and exit 0.")
    g.add_argument("--skip-train", action="store_true",
                   help="Bypass the training loop: only evaluate the (loaded) model on the validation data.")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential", "minus_sqrt"],
                   default="linear")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def _precision(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision of the linear layers (docs/numerics.md)")
    g.add_argument("--precision", choices=[*PRECISION_NAMES, "fp4"], default=None,
                   help="Uniform precision of every linear module's GEMMs (default bf16, or on resume the "
                        "checkpoint's plan; given, it replaces the checkpoint's plan; fp4 means --fp4-recipe). "
                        "Embedding, output layer, norms and attention stay high precision.")
    # The recipe flags default to None: on resume the checkpoint's values are kept unless a flag is
    # given (then it wins, and the start-up log says so); otherwise the defaults in RECIPE_DEFAULTS.
    g.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "blockwise", "mxfp8"], default=None,
                   help="How fp8 is scaled (default tensorwise: stateless, so a module that switches to fp8 "
                        "mid-run is scaled right from its first step).")
    g.add_argument("--fp8-format", choices=["hybrid", "e4m3"], default=None,
                   help="E4M3 forward / E5M2 gradients (hybrid, default) or E4M3 everywhere. As in "
                        "Megatron, giving it without --precision selects --precision fp8.")
    g.add_argument("--fp8-amax-history-len", type=int, default=None,
                   help="Delayed scaling: amaxes kept per operand (default 1, as in Megatron-LM).")
    g.add_argument("--fp8-amax-compute-algo", choices=["max", "most_recent"], default=None,
                   help="Delayed scaling: the scale follows the history's max or its most recent amax "
                        "(default most_recent, as in Megatron-LM).")
    g.add_argument("--fp8-margin", type=int, default=None, help="Delayed scaling headroom in binades (default 0).")
    g.add_argument("--fp4-recipe", choices=list(FP4_NAMES), default=None,
                   help="The 4-bit format that --precision fp4 and SNIP use (default nvfp4). Given on resume, the "
                        "checkpoint plan's FP4 modules run in it.")
    g.add_argument("--fp4-format", choices=["e2m1"], default=None,
                   help="Megatron-LM's FP4 switch: as --precision fp4 (the format --fp4-recipe names); not with "
                        "--fp8-format.")
    # Transformer Engine's NVFP4 switches (NVTE_NVFP4_DISABLE_*), honoured by every backend and by
    # SNIP's probes, which measure each candidate format exactly as it will run.
    g.add_argument("--fp4-disable-stochastic-rounding", action=argparse.BooleanOptionalAction, default=None,
                   help="Round FP4 gradients (dY) to nearest instead of stochastically (TE: "
                        "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1). Default: stochastic, as TE's recipe.")
    g.add_argument("--nvfp4-disable-rht", action=argparse.BooleanOptionalAction, default=None,
                   help="No random Hadamard transform of the NVFP4 wgrad operands (TE: NVTE_NVFP4_DISABLE_RHT=1).")
    g.add_argument("--nvfp4-disable-2d-quantization", action=argparse.BooleanOptionalAction, default=None,
                   help="1x16 NVFP4 weight blocks along each GEMM's reduction dim instead of 16x16 tiles "
                        "(TE: NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1).")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="Keep the first/last layers' linear modules in bf16 (see the next two flags); with --snip "
                        "they are pins SNIP never re-plans, counted in its budgets.")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="Layers at the start kept in bf16 by --first-last-layers-bf16.")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="Layers at the end kept in bf16 by --first-last-layers-bf16.")
    g.add_argument("--precision-plan", default=None,
                   help="JSON plan: precision per module (replaces a checkpoint's plan; not with --precision).")
    g.add_argument("--te-precision-config-file", default=None, metavar="FILE.yaml",
                   help="Megatron-LM's per-module precision config (megatron-core quantization/quant_config.py: "
                        "glob matchers over stage-local module paths -> Transformer Engine recipes; docs/snip.md). "
                        "Read by megatron-core's parser on either --transformer-impl. Without --snip it sets the plan "
                        "(not with --precision-plan) over --precision (default bf16) and --first-last-layers-bf16, "
                        "as in Megatron-LM; with --snip the modules it sets are pins SNIP never re-plans.")
    g.add_argument("--precision-schedule", nargs="+", default=None, metavar="PASSES=PRECISION@START",
                   help="From a step on, fix some GEMMs of every module, e.g. fwd=bf16@0.82 (the NVFP4 recipe's "
                        "last 18%% of training with bf16 forward GEMMs), all=fp8@9000, bwd=fp8@90%%. PASSES: fwd, "
                        "bwd or all; START: a step or a fraction of --train-iters. Overrides the plan for those "
                        "passes; SNIP plans the rest. Saved in checkpoints (given on resume, it replaces theirs).")
    g.add_argument("--quant-kernels", choices=["auto", "triton", "torch"], default="auto",
                   help="Who quantizes the GEMM operands: fused Triton kernels (bit-identical to the torch "
                        "reference) or the torch reference; auto = triton on CUDA when it imports.")
    g.add_argument("--fp8-gemm", choices=["auto", "scaled_mm", "emulated"], default="auto",
                   help="Per-tensor FP8 GEMMs on the FP8 bytes with torch._scaled_mm (tensor cores) or "
                        "emulated in fp32; auto = scaled_mm on GPUs with FP8 tensor cores (sm_89+).")
    g.add_argument("--gemm-speed-model", choices=list(SPEED_MODELS), default="auto",
                   help="GEMM throughput of each format relative to bf16, for the estimated GEMM time that logs "
                        "report and --snip-time-target budgets: published dense peaks of hopper (FP8 2x, FP4 "
                        "emulated 1x), blackwell (FP8 2x, FP4 4x), ada (FP8 2x), ampere (1x), or measured at the "
                        "model's shapes on this device at start-up. auto: from the GPU; blackwell without one.")


def _snip(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SNIP adaptive precision (docs/snip.md)")
    g.add_argument("--snip", action="store_true",
                   help="Re-plan the precision of every linear module at intervals from measured divergences.")
    g.add_argument("--snip-fp4-target", type=float, default=None,
                   help="Fraction of linear-layer FLOPs to run in FP4 (the paper's budget; default 0.75, or 0 "
                        "with --snip-time-target). Without --snip-time-target the plan's estimated GEMM time is "
                        "also held to that of the baselines at this share (FP4 + FP8 remainder), so the non-FP4 "
                        "modules run in FP8 unless BF16 pays for itself.")
    g.add_argument("--snip-time-target", type=float, default=None,
                   help="Budget in time: estimated linear-GEMM time / all-BF16 time <= T under "
                        "--gemm-speed-model (per pipeline stage with --snip-budget per-stage).")
    g.add_argument("--snip-interval", type=int, default=None,
                   help="Iterations between re-plans (default: --save-interval).")
    g.add_argument("--snip-warmup-plan", default=None,
                   help="Plan before the first cycle: a precision name or a plan JSON file (default bf16; on resume "
                        "the checkpoint's plan).")
    g.add_argument("--snip-solver", choices=["auto", "gurobi", "highs"], default="auto")
    g.add_argument("--snip-formats", nargs="+", default=None,
                   help="Candidate precisions (default: bf16 fp8 and --fp4-recipe).")
    g.add_argument("--snip-budget", choices=["per-stage", "global"], default="per-stage",
                   help="FP4 and time budgets for each pipeline stage (no stage becomes the bottleneck) or only "
                        "overall.")
    g.add_argument("--snip-split-passes", action="store_true",
                   help="Choose the forward GEMM's and the backward GEMMs' precision separately.")
    g.add_argument("--snip-loss-weight", type=float, default=1.0, help="Weight of the loss divergence (alpha).")
    g.add_argument("--snip-update-weight", type=float, default=1.0,
                   help="Weight of the update divergence (beta; 1 as in the paper). 0 plans by the loss divergence "
                        "alone, which trained better at 90%% FP4 and worse at 50%% in the CPU-scale comparisons "
                        "(docs/quality.md).")
    g.add_argument("--snip-switch-penalty", type=float, default=0.0,
                   help="Objective penalty per module whose precision changes from the current plan.")
    g.add_argument("--snip-probe-passes", type=int, default=3,
                   help="Noise draws per estimator, each one pass differenced against the clean pass "
                        "(default 3: a cycle runs 1 gradient + 1 clean + 3 curvature + 3 perturbation passes, 8 "
                        "in all; 2 + 2K).")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="Prefix of a .bin/.idx pair, or a blend 'W1 PREFIX1 W2 PREFIX2 ...'.")
    g.add_argument("--split", default="969,30,1",
                   help="Train,valid,test proportions. A validation share of 0 turns evaluation off (as in "
                        "Megatron-LM: --eval-iters is then 0).")
    g.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"],
                   default="SentencePieceTokenizer",
                   help="SentencePieceTokenizer (a .model file: TinyLlama, Llama 2) or HuggingFaceTokenizer (a "
                        "tokenizer.json, or the model directory holding it: Llama 3).")
    g.add_argument("--tokenizer-model", default=None,
                   help="The tokenizer file (or, for HuggingFaceTokenizer, a model directory).")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=None,
                   help="Data-loader worker processes per rank (0: load in the training process). Default: 2 "
                        "with CUDA (as Megatron); 0 without, where workers would compete with training for cores.")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false")


def _checkpoint_and_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None,
                   help="Checkpoint directory to resume from. If it equals --save and holds no "
                        "checkpoint yet, training starts fresh (the resume-or-start pattern).")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="Load model weights only and start at iteration 0.")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="Peak dense TFLOP/s per GPU for MFU (default: looked up from the GPU name).")


def _numerical_safety(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("faults and numerical safety (README: Faults and numerical safety)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="Before every optimizer step, all ranks check the loss and every gradient for NaN/Inf "
                        "and act together by --non-finite-grad-policy (default on, as in Megatron-LM).")
    g.add_argument("--non-finite-grad-policy", choices=["fail", "skip"], default="fail",
                   help="fail: every rank raises at that iteration, naming the parameters and ranks; nothing "
                        "is applied or saved. skip: the update is skipped (weights, optimizer state and LR "
                        "schedule untouched, the batch consumed) and counted.")
    g.add_argument("--max-consecutive-skips", type=int, default=10,
                   help="With --non-finite-grad-policy skip: raise after this many skipped iterations in a row.")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="Report a loss above --spiky-loss-factor x the median of the last "
                        "--spiky-loss-window applied losses (not fatal, as in Megatron-LM).")
    g.add_argument("--spiky-loss-factor", type=float, default=2.0)
    g.add_argument("--spiky-loss-window", type=int, default=10)
    g.add_argument("--quant-health", action=argparse.BooleanOptionalAction, default=True,
                   help="Quantized linears keep per-operand health scalars on the device (non-finite count, amax, "
                        "saturated and flushed-to-zero fractions, relative quantization MSE), logged to TensorBoard "
                        "every --log-interval and used to name the modules behind a non-finite step or a spike "
                        "(--transformer-impl local only).")
    g.add_argument("--promote-on-fault", action=argparse.BooleanOptionalAction, default=None,
                   help="On a non-finite step or a loss spike, raise the precision of the quantized module the "
                        "health numbers name (FP4 -> FP8 -> BF16) until the next SNIP cycle (for the rest of the "
                        "run without --snip); a non-finite step is then skipped instead of failing. Default: on "
                        "with --snip. Needs --quant-health.")


def _validate_safety(args: argparse.Namespace) -> None:
    _require(args.max_consecutive_skips >= 0, "--max-consecutive-skips must be >= 0")
    _require(args.spiky_loss_factor > 1.0, f"--spiky-loss-factor {args.spiky_loss_factor} must be > 1")
    _require(args.spiky_loss_window >= 3, f"--spiky-loss-window {args.spiky_loss_window} must be >= 3")
    _require(args.check_for_nan_in_loss_and_grad or args.non_finite_grad_policy == "fail",
             "--non-finite-grad-policy skip needs the check: drop --no-check-for-nan-in-loss-and-grad")
    if args.transformer_impl != "local":
        args.quant_health = False  # Transformer Engine's GEMMs keep no health numbers of ours
    if args.promote_on_fault is None:
        args.promote_on_fault = args.snip and args.quant_health
    _require(not args.promote_on_fault or args.quant_health,
             "--promote-on-fault needs --quant-health (with --transformer-impl local) to know which module to promote")


def _megatron_lm(p: argparse.ArgumentParser) -> None:
    """Flags of Megatron-LM's Llama scripts: implemented with its meaning, or refused with the reason."""
    g = p.add_argument_group("Megatron-LM script flags")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Train for this many samples instead of --train-iters: iterations = samples / "
                        "--global-batch-size (a multiple of it).")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="With --train-samples: --lr-decay-iters in samples (a multiple of --global-batch-size).")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="With --train-samples: --lr-warmup-iters in samples (a multiple of --global-batch-size).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Per-head dimension; accepted when it equals --hidden-size / --num-attention-heads.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's dimension rotary embeddings rotate; only 1.0 (Llama).")
    g.add_argument("--recompute-activations", action="store_true",
                   help="As in Megatron-LM: --recompute-granularity selective.")
    g.add_argument("--manual-gc", action="store_true",
                   help="Disable Python's automatic garbage collector (collections then happen at the same "
                        "iterations on every rank): collect every --manual-gc-interval iterations and around "
                        "evaluations.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: iterations between collections (0: only around evaluations).")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="With --manual-gc: no collection before and after each evaluation.")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
                   default="torch_dist", help="Only torch_dist (megatron-core dist_checkpointing) is written and read.")
    g.add_argument("--async-save", action="store_true", help="Refused: checkpoints are saved synchronously.")
    g.add_argument("--no-save-optim", action="store_true",
                   help="Save no optimizer or LR-scheduler state (a run resuming from it starts them afresh, as "
                        "with --no-load-optim).")
    g.add_argument("--no-save-rng", action="store_true",
                   help="Save no RNG or quantization state (a run resuming from it keeps its own).")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="With --load: refuse a directory that holds no checkpoint even when it equals --save "
                        "(no fresh start).")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Accepted: the model's shape always comes from the checkpoint in --load.")
    g.add_argument("--no-fp8-wgrad", action="store_true", help="Refused: wgrad runs in the backward's precision.")
    g.add_argument("--fp8-param-gather", action="store_true", help="Refused: parameters are never stored in fp8.")


# Megatron-LM flags refused with the reason and what to do instead (flag -> message).
_REFUSED = {
    "async_save": "--async-save: checkpoints are saved synchronously (written to iter_N.tmp and renamed once every "
                  "rank has finished, so a crash never leaves a partial one); drop the flag",
    "no_fp8_wgrad": "--no-fp8-wgrad: a plan gives each module one precision for both backward GEMMs (dgrad and "
                    "wgrad); keep the backward out of fp8 with --precision-schedule bwd=bf16@1, or drop the flag",
    "fp8_param_gather": "--fp8-param-gather: parameters stay in bf16/fp32 and are quantized at each GEMM, so there "
                        "are no fp8 parameters to all-gather; drop the flag",
}


def _samples_to_iters(flag: str, samples: int, global_batch_size: int) -> int:
    """Megatron-LM's sample-based length ``samples`` in iterations of ``global_batch_size`` samples."""
    _require(samples >= 0 and samples % global_batch_size == 0,
             f"{flag} {samples} is not a multiple of --global-batch-size {global_batch_size}; use a multiple "
             f"(iterations = {flag} / --global-batch-size), or give the length in iterations")
    return samples // global_batch_size


def _validate_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's flags: sample counts become iterations, the rest is accepted or refused with the reason."""
    for key, message in _REFUSED.items():
        _require(not getattr(args, key), message)
    _require(args.ckpt_format == "torch_dist", f"--ckpt-format {args.ckpt_format}: checkpoints are megatron-core "
             "dist_checkpointing (torch_dist) only; use --ckpt-format torch_dist (Megatron-LM's default)")
    head_dim = args.hidden_size // args.num_attention_heads
    _require(args.kv_channels in (None, head_dim),
             f"--kv-channels {args.kv_channels} differs from --hidden-size {args.hidden_size} / "
             f"--num-attention-heads {args.num_attention_heads} = {head_dim}, the only head dimension the Llama "
             f"model here has; drop --kv-channels or pass {head_dim}")
    _require(args.rotary_percent == 1.0, f"--rotary-percent {args.rotary_percent}: Llama rotates every head "
             "dimension; only --rotary-percent 1.0 is supported")
    if args.recompute_activations:
        args.recompute_granularity = "selective"  # Megatron-LM's meaning, whatever --recompute-granularity says
    _require(args.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
    if args.train_samples is None:
        _require(args.train_iters is not None, "--train-iters N (or Megatron-LM's --train-samples N) is required")
        _require(args.lr_decay_samples is None and args.lr_warmup_samples == 0,
                 "--lr-decay-samples and --lr-warmup-samples go with --train-samples; with --train-iters use "
                 "--lr-decay-iters and --lr-warmup-iters")
        return
    _require(args.train_iters is None, "give --train-iters or --train-samples, not both")
    _require(args.lr_decay_iters is None and args.lr_warmup_iters == 0,
             "with --train-samples give the LR schedule in samples (--lr-decay-samples, --lr-warmup-samples), as "
             "Megatron-LM expects, not --lr-decay-iters / --lr-warmup-iters")
    gbs = args.global_batch_size
    args.train_iters = _samples_to_iters("--train-samples", args.train_samples, gbs)
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _samples_to_iters("--lr-decay-samples", args.lr_decay_samples, gbs)
    args.lr_warmup_iters = _samples_to_iters("--lr-warmup-samples", args.lr_warmup_samples, gbs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_llama.py",
        description="Pretrain a Llama-family model with megatron-core (TP x PP x DP).",
        allow_abbrev=False,
    )
    for add in (_parallel, _model, _rope_scaling, _training, _precision, _snip, _data,
                _checkpoint_and_logging, _numerical_safety, _megatron_lm):
        add(p)
    return p


def _apply_preset(args: argparse.Namespace) -> None:
    """Fill unset model-shape fields from ``--model-preset`` (default tiny; a loaded checkpoint's
    label, e.g. hf-import, names no preset: its shape is complete)."""
    args.model_preset = args.model_preset or "tiny"
    for key, value in (PRESETS[args.model_preset].as_args() if args.model_preset in PRESETS else {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.use_rope_scaling is None:
        args.use_rope_scaling = False
    if args.rope_scaling_factor is None:
        args.rope_scaling_factor = 8.0


def _apply_checkpoint_shape(args: argparse.Namespace) -> None:
    """With ``--load`` of a checkpoint (not an empty resume-or-start directory), its model shape
    fills the shape flags; flags or a ``--model-preset`` that disagree are refused."""
    if args.load is None:
        return
    from megatron_snip.training.checkpointing import CheckpointError, read_common_state

    try:
        common = read_common_state(args.load)
        if common is not None:
            _fill_from_checkpoint(args, common.get("args", {}), args.load)
        else:
            _refuse_hf_directory(args.load)
    except (CheckpointError, ValueError) as e:
        raise ArgumentError(str(e)) from e


def _fill_from_checkpoint(args: argparse.Namespace, saved: dict, where: str) -> None:
    """Fill the shape flags from ``saved`` (a checkpoint's arguments, :mod:`checkpoint_shape`);
    ValueError on a disagreement, naming both values."""
    preset = PRESETS[args.model_preset].as_args() if args.model_preset else {}
    for key in checkpoint_shape.FIXED:
        if saved.get(key) is None:
            continue
        flag = "--" + key.replace("_", "-")
        given = getattr(args, key)
        if given is not None and given != saved[key]:
            raise ValueError(f"{flag} {given} disagrees with the checkpoint in {where}, which has {saved[key]}; "
                             f"drop {flag} (the checkpoint defines the model's shape)")
        if given is None and key in preset and preset[key] != saved[key]:
            raise ValueError(f"--model-preset {args.model_preset} sets {flag} {preset[key]} but the checkpoint in "
                             f"{where} has {saved[key]}; drop --model-preset (the checkpoint defines the shape)")
        setattr(args, key, saved[key])
    for key in checkpoint_shape.DEFAULTS:
        if getattr(args, key) is None and saved.get(key) is not None:
            setattr(args, key, saved[key])
    for key in checkpoint_shape.CARRIED:
        if saved.get(key) is not None:
            setattr(args, key, saved[key])
    if args.model_preset is None:
        args.model_preset = saved.get("model_preset") or "checkpoint"


def checkpoint_config(saved: dict, *, bf16: bool, tokenizer: tuple[str | None, str | None] = (None, None)) -> RunConfig:
    """A one-process configuration of the model a checkpoint's saved arguments describe (no data, no
    training: for the Hugging Face converters). ``tokenizer``: (type, model) to record, if known."""
    args = build_parser().parse_args(["--train-iters", "0"])
    _fill_from_checkpoint(args, saved, "the conversion")
    args.bf16 = bf16
    args.tokenizer_type = tokenizer[0] or args.tokenizer_type
    args.tokenizer_model = tokenizer[1]
    return resolve(args, world_size=1, cuda=False, check_files=False)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ArgumentError(message)


def resolve(parsed: argparse.Namespace, world_size: int | None = None, cuda: bool | None = None,
            check_files: bool = True) -> RunConfig:
    """Check the parsed flags against each other and the launch, derive the dependent values and
    build the run's configuration; ``parsed`` is left as it is.

    ``world_size`` defaults to ``$WORLD_SIZE``, ``cuda`` to whether torch sees a GPU.
    ``check_files=False`` skips the data/tokenizer/checkpoint paths and the optional
    packages the flags need (for checking launch scripts on a machine without their
    data or GPU software).

    Derived: the data-parallel size, ``global_batch_size`` (if unset), the number of
    micro-batches, ``train_iters`` / ``lr_decay_iters`` / ``lr_warmup_iters`` (also from Megatron-LM's
    sample counts), the virtual pipeline size, ``eval_iters`` 0 for a ``--split`` without validation,
    the recipe values a resumed checkpoint keeps, SNIP's defaults and the distributed backend.
    """

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda is None:
        from megatron_snip.compat.device import has_cuda

        cuda = has_cuda()
    args = argparse.Namespace(**vars(parsed))  # the working copy the checks fill in
    if check_files:
        _apply_checkpoint_shape(args)
    _apply_preset(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} "
             f"processes (e.g. torchrun --nproc-per-node {tp * pp}) or change the parallel sizes")
    args.data_parallel_size = dp = world_size // (tp * pp)
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}; choose a TP size that divides the head count")
    _require(args.num_attention_heads % args.num_query_groups == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--num-query-groups {args.num_query_groups}")
    _require(args.num_query_groups % tp == 0,
             f"--num-query-groups {args.num_query_groups} is not divisible by "
             f"--tensor-model-parallel-size {tp}; choose a TP size that divides the query-group count")
    _require(args.padded_vocab_size is None or args.padded_vocab_size % tp == 0,
             f"the checkpoint's vocabulary of {args.padded_vocab_size} rows (padded) is not divisible by "
             f"--tensor-model-parallel-size {tp}; re-import it with --make-vocab-size-divisible-by a multiple "
             f"of {tp}, or choose a TP size that divides {args.padded_vocab_size}")
    _require(args.num_layers % pp == 0,
             f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
             f"choose a PP size that divides the layer count")
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    _require(args.micro_batch_size >= 1, "--micro-batch-size must be >= 1")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    _require(args.global_batch_size % per_step == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}; use a multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    _validate_virtual_pipeline(args)
    _validate_megatron_lm(args)
    _require(not args.overlap_param_gather or args.use_distributed_optimizer,
             "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the all-gather of the "
             "optimizer's parameter shards); add it, or drop --overlap-param-gather")
    _require(args.context_parallel_size == 1,
             f"--context-parallel-size {args.context_parallel_size}: context parallelism is not supported (the local "
             "layers' attention has no ring attention, and SNIP's probes measure whole sequences per rank); "
             "use --sequence-parallel to split activations over TP, or --context-parallel-size 1")
    _require(args.train_iters >= 0, "--train-iters must be >= 0")
    _require(args.sequence_parallel is False or tp > 1,
             "--sequence-parallel needs --tensor-model-parallel-size > 1")
    _require(args.transformer_impl == "local" or cuda,
             "--transformer-impl transformer_engine needs a GPU with Transformer Engine; use --transformer-impl local")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None,
                 "--recompute-granularity full needs --recompute-method uniform|block")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(0.0 <= args.lr_warmup_fraction <= 1.0, "--lr-warmup-fraction must lie in [0, 1]")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _require(args.train_iters == 0 or args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
             f"{args.lr_decay_iters} (default: --train-iters)")
    _require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    for flag in ("log_interval", "eval_interval"):
        _require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    if args.num_workers is None:
        args.num_workers = 2 if cuda else 0
    _require(args.num_workers >= 0, "--num-workers must be >= 0")
    _require(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
             f"--exit-duration-in-mins {args.exit_duration_in_mins} must be > 0 (minutes of wall time)")
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval must be >= 1")
        _require(args.save is not None, "--save-interval needs --save DIR")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    resumed = _resumed_state(args) if check_files else None
    _validate_precision(args, cuda, resumed)
    _validate_snip(args)
    _validate_safety(args)
    _validate_split(args)
    if check_files:
        _validate_solver(args)
        _validate_files(args, resumed)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    _require(args.distributed_backend == "gloo" or cuda,
             "--distributed-backend nccl needs CUDA; use --distributed-backend gloo on CPU")
    args.precision_notes = tuple(args.precision_notes)
    from megatron_snip.training.config import RunConfig

    config = RunConfig.from_flags(vars(args))
    _check_plans(config, resumed, check_files)
    return config


def _check_plans(config: RunConfig, resumed: dict | None, check_files: bool) -> None:
    """Budgets no plan can meet, a bad plan file or schedule, or conflicting plan flags fail here,
    before any process group."""
    from megatron_snip.precision.plan import PlanError
    from megatron_snip.training.precision import check_snip_budgets, initial_plan, initial_schedule

    try:
        if config.snip.enabled:
            check_snip_budgets(config)
        if check_files:
            initial_plan(config, resumed)
            initial_schedule(config, resumed)
    except (FileNotFoundError, PlanError) as e:
        raise ArgumentError(str(e)) from e


def _validate_virtual_pipeline(args: argparse.Namespace) -> None:
    """Set ``virtual_pipeline_model_parallel_size`` (None: no interleaving) from either flag."""
    layers, vpp = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size
    if layers is None and vpp is None:
        return
    pp = args.pipeline_model_parallel_size
    _require(layers is None or vpp is None, "give --num-layers-per-virtual-pipeline-stage or "
             "--virtual-pipeline-model-parallel-size, not both")
    _require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if layers is not None:
        _require(layers >= 1 and args.num_layers % (pp * layers) == 0,
                 f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                 f"--num-layers-per-virtual-pipeline-stage {layers}")
        vpp = args.num_layers // (pp * layers)
    _require(vpp >= 1 and args.num_layers % (pp * vpp) == 0,
             f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--virtual-pipeline-model-parallel-size {vpp}")
    _require(args.num_microbatches % pp == 0,
             f"the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size {pp}, "
             f"but there are {args.num_microbatches} per step; make --global-batch-size / (--micro-batch-size x "
             f"data-parallel size) a multiple of {pp}")
    args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None


# Defaults of the flags that say how each precision is realised; on resume the checkpoint's
# values stand in for flags that are not given.
RECIPE_DEFAULTS = {"fp8_recipe": "tensorwise", "fp8_format": "hybrid", "fp8_amax_history_len": 1,
                   "fp8_amax_compute_algo": "most_recent", "fp8_margin": 0, "fp4_recipe": "nvfp4",
                   "fp4_disable_stochastic_rounding": False, "nvfp4_disable_rht": False,
                   "nvfp4_disable_2d_quantization": False}


def _validate_precision(args: argparse.Namespace, cuda: bool, resumed: dict | None) -> None:
    """Fill the recipe flags (given > the resumed checkpoint's > defaults), noting for the start-up
    log where a given flag replaces the checkpoint's value (``args.precision_notes``)."""
    _require(args.fp4_format is None or args.fp8_format is None,
             "--fp4-format and --fp8-format cannot be used together (as in Megatron-LM): choose one")
    if args.precision is None and args.fp8_format is not None:
        args.precision = "fp8"  # as in Megatron: --fp8-format alone turns fp8 on
    if args.fp4_format is not None:  # Megatron-LM's switch for NVFP4 (with --fp4-recipe)
        _require(args.precision in (None, "fp4", *FP4_NAMES),
                 f"--fp4-format {args.fp4_format} turns FP4 on but --precision is {args.precision}; drop one of them")
        args.precision = args.precision or "fp4"
    saved = (resumed or {}).get("args", {})
    args.precision_notes = []
    for key, default in RECIPE_DEFAULTS.items():
        given, kept = getattr(args, key), saved.get(key)
        if given is None:
            setattr(args, key, kept if kept is not None else default)
        elif kept is not None and kept != given:
            args.precision_notes.append(f"--{key.replace('_', '-')} {given} replaces the checkpoint's {kept}")
    for flag in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        _require(0 <= getattr(args, flag) <= args.num_layers,
                 f"--{flag.replace('_', '-')} must lie in [0, --num-layers {args.num_layers}]")
    _require(args.fp8_amax_history_len >= 1, "--fp8-amax-history-len must be >= 1")
    if args.quant_kernels == "triton":
        _require(importlib.util.find_spec("triton") is not None,
                 "--quant-kernels triton needs the triton package (pip install triton); use --quant-kernels torch")
        _require(cuda or os.environ.get("TRITON_INTERPRET") == "1",
                 "--quant-kernels triton needs CUDA (or TRITON_INTERPRET=1 to run the kernels in Triton's "
                 "slow CPU interpreter); use --quant-kernels torch or auto")


def _validate_snip(args: argparse.Namespace) -> None:
    if args.snip_formats is None:
        args.snip_formats = ["bf16", "fp8", args.fp4_recipe]
    if not args.snip:
        return
    if args.snip_fp4_target is None:
        args.snip_fp4_target = 0.0 if args.snip_time_target is not None else 0.75
    _require(0.0 <= args.snip_fp4_target <= 1.0, f"--snip-fp4-target {args.snip_fp4_target} must lie in [0, 1]")
    _require(args.snip_time_target is None or args.snip_time_target > 0,
             f"--snip-time-target {args.snip_time_target} must be > 0 (a ratio to the all-bf16 GEMM time)")
    if args.snip_interval is None:
        _require(args.save_interval is not None,
                 "--snip needs --snip-interval N or --save-interval N (SNIP re-plans at checkpoint intervals)")
        args.snip_interval = args.save_interval
    _require(args.snip_interval >= 1, "--snip-interval must be >= 1")
    bad = [f for f in args.snip_formats if f not in PRECISION_NAMES]
    _require(not bad, f"--snip-formats: unknown {bad}; choose from {list(PRECISION_NAMES)}")
    _require(any(f in FP4_NAMES for f in args.snip_formats) or args.snip_fp4_target == 0,
             "--snip-formats has no FP4 format (nvfp4 or mxfp4) but --snip-fp4-target is above 0")
    _require(args.snip_probe_passes >= 1, "--snip-probe-passes must be >= 1")
    for flag in ("snip_loss_weight", "snip_update_weight", "snip_switch_penalty"):
        value = getattr(args, flag)
        _require(math.isfinite(value) and value >= 0,
                 f"--{flag.replace('_', '-')} {value} must be a finite number >= 0 (a weight of the ILP's objective)")
    _require(args.snip_loss_weight > 0 or args.snip_update_weight > 0,
             "--snip-loss-weight and --snip-update-weight are both 0: the ILP would have nothing to minimise; "
             "keep one of them above 0 (defaults 1, 1)")
    if args.transformer_impl == "transformer_engine":
        _te_snip_candidates(args)


def _te_snip_candidates(args: argparse.Namespace) -> None:
    """SNIP on the te backend: candidates no TE recipe can run are dropped from the ILP, and forward
    and backward are planned together (one TE recipe covers a module's three GEMMs), each with a
    notice for the start-up log (``args.precision_notes``)."""
    from megatron_snip.precision.recipes import RecipeConfig
    from megatron_snip.precision.te_layers import te_runnable

    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    kept, dropped = te_runnable(args.snip_formats, RecipeConfig(fp8_recipe=args.fp8_recipe, fp8_format=args.fp8_format),
                                capability)
    for fmt, why in dropped.items():
        args.precision_notes.append(f"SNIP candidate {fmt} dropped on --transformer-impl transformer_engine ({why})")
    args.snip_formats = kept
    _require(any(f in FP4_NAMES for f in kept) or args.snip_fp4_target == 0,
             f"--snip-fp4-target {args.snip_fp4_target} needs an FP4 candidate, but Transformer Engine runs none of "
             f"--snip-formats {' '.join(dropped)}: use --fp4-recipe nvfp4 (or --transformer-impl local for mxfp4)")
    if args.snip_split_passes:
        args.snip_split_passes = False
        args.precision_notes.append("--snip-split-passes ignored on --transformer-impl transformer_engine (one TE "
                                    "recipe covers a module's forward and backward GEMMs): SNIP plans them together")


def _validate_split(args: argparse.Namespace) -> None:
    """``--split`` parsed as megatron-core parses it; as in Megatron-LM, no validation share means no
    evaluation (``--eval-iters`` becomes 0)."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        train, valid, _ = parse_and_normalize_split(args.split)
    except (AssertionError, ValueError, ZeroDivisionError) as e:
        raise ArgumentError(f"--split {args.split!r}: expected up to three shares >= 0, not all 0, "
                            f"train,valid,test (e.g. 969,30,1)") from e
    _require(train > 0 or args.skip_train or args.train_iters == 0,
             f"--split {args.split} gives training no documents; give its first field a share")
    if valid == 0:
        args.eval_iters = 0


def _validate_solver(args: argparse.Namespace) -> None:
    """``--snip-solver gurobi`` needs a Gurobi that starts (a bad license would fail at the first re-plan)."""
    if not (args.snip and args.snip_solver == "gurobi"):
        return
    from megatron_snip.snip.solvers import gurobi_unavailable

    reason = gurobi_unavailable()
    _require(reason is None, f"--snip-solver gurobi: {reason}; use --snip-solver highs, or auto (Gurobi when usable, "
             f"else HiGHS)")


def _resumed_state(args: argparse.Namespace) -> dict | None:
    """The replicated state of the checkpoint this run resumes (None: none, or --finetune)."""
    if args.load is None or args.finetune:
        return None
    from megatron_snip.training.checkpointing import CheckpointError, read_common_state

    try:
        return read_common_state(args.load)
    except CheckpointError as e:
        raise ArgumentError(str(e)) from e


def _validate_files(args: argparse.Namespace, resumed: dict | None) -> None:
    _require(args.data_path is not None,
             "--data-path is required: the prefix of a preprocessed dataset (tools/preprocess_data.py)")
    _require(args.tokenizer_model is not None,
             "--tokenizer-model is required: a sentencepiece .model file (tools/train_tokenizer.py) or, with "
             "--tokenizer-type HuggingFaceTokenizer, a tokenizer.json or the model directory holding it")
    from megatron_snip.data.datasets import (
        check_data_prefixes,
        check_splits_have_documents,
        check_vocab_covers_data,
        parse_data_path,
    )
    from megatron_snip.data.tokenizer import build_tokenizer
    from megatron_snip.training.checkpointing import CheckpointError, verify_latest

    try:
        prefixes = parse_data_path(args.data_path)[0]
        check_data_prefixes(prefixes)
        check_splits_have_documents(prefixes, args.split)
        tokens = build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
        check_vocab_covers_data(prefixes, tokens)
        _require(args.vocab_size is None or tokens <= args.vocab_size,
                 f"--tokenizer-model {args.tokenizer_model} has {tokens} ids but the model in --load {args.load} "
                 f"has a vocabulary of {args.vocab_size}; use the model's own tokenizer")
        latest = verify_latest(args.load) if args.load is not None else None
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        raise ArgumentError(str(e)) from e
    if args.load is not None and latest is None:
        _require(not args.exit_on_missing_checkpoint,
                 f"--load {args.load!r} holds no checkpoint (no latest_checkpointed_iteration.txt) and "
                 f"--exit-on-missing-checkpoint is given; fix the path, or drop the flag to start fresh")
        _require(os.path.abspath(args.load) == os.path.abspath(args.save or ""),
                 f"--load {args.load!r} holds no checkpoint (no latest_checkpointed_iteration.txt); "
                 f"fix the path, or pass the same directory to --save and --load to resume-or-start")


def _refuse_hf_directory(path: str) -> None:
    """A Hugging Face model directory given to --load (a common mistake) is named as such, with the converter."""
    import glob

    if os.path.isfile(os.path.join(path, "config.json")) or glob.glob(os.path.join(path, "*.safetensors")):
        raise ArgumentError(
            f"--load {path!r} is a Hugging Face model directory (config.json / *.safetensors), not a checkpoint; "
            f"convert it once with python tools/convert_hf_llama.py import --load-dir {path} --save-dir CKPT_DIR "
            f"and pass --load CKPT_DIR")


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 cuda: bool | None = None) -> RunConfig:
    """Parse ``argv`` (default: the command line), fill presets and checkpoint shapes, validate."""
    return resolve(build_parser().parse_args(argv), world_size, cuda)

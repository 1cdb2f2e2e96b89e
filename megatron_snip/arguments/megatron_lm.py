"""Flags of Megatron-LM's Llama scripts that configure nothing here by themselves: lengths in samples
(converted to iterations), architecture switches Llama fixes, and features refused with the reason.

They are parsed like every other flag (``flags.flag`` fields) so that a Megatron-LM script runs
unchanged, checked by :func:`validate_megatron_lm`, and not kept in the run's configuration.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_snip.flags import flag

from .errors import require


@dataclass(frozen=True)
class MegatronLMFlags:
    """What a Megatron-LM script passes that is implemented through other settings, or refused."""

    train_samples: int | None = flag(
        None, "Train for this many samples instead of --train-iters: iterations = samples / --global-batch-size (a "
        "multiple of it).")
    lr_decay_samples: int | None = flag(
        None, "With --train-samples: --lr-decay-iters in samples (a multiple of --global-batch-size).")
    lr_warmup_samples: int = flag(
        0, "With --train-samples: --lr-warmup-iters in samples (a multiple of --global-batch-size).")
    kv_channels: int | None = flag(
        None, "Per-head dimension; accepted when it equals --hidden-size / --num-attention-heads.")
    rotary_percent: float = flag(1.0, "Fraction of each head's dimension rotary embeddings rotate; only 1.0 "
                                 "(Llama).")
    recompute_activations: bool = flag(False, "As in Megatron-LM: --recompute-granularity selective.")
    group_query_attention: bool = flag(False, "Accepted for Megatron compatibility; GQA follows --num-query-groups.")
    swiglu: bool = flag(False, "Always on for Llama (accepted).")
    disable_bias_linear: bool = flag(False, "Always on for Llama (accepted).")
    untie_embeddings_and_output_weights: bool = flag(False, "Always on for Llama (accepted).")
    normalization: str = flag("RMSNorm", "Llama's RMSNorm (the only choice).", choices=("RMSNorm",))
    position_embedding_type: str = flag("rope", "Llama's rotary embeddings (the only choice).", choices=("rope",))
    exit_signal_handler: bool = flag(
        False, "Accepted for Megatron-LM scripts: here the handler is always on. SIGTERM or SIGUSR1 make every rank "
        "finish its iteration, save (if --save) and exit 0.")
    exit_on_missing_checkpoint: bool = flag(
        False, "With --load: refuse a directory that holds no checkpoint even when it equals --save (no fresh "
        "start).")
    use_checkpoint_args: bool = flag(False, "Accepted: the model's shape always comes from the checkpoint in --load.")
    ckpt_format: str = flag("torch_dist", "Only torch_dist (megatron-core dist_checkpointing) is written and read.",
                            choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"))
    async_save: bool = flag(False, "Refused: checkpoints are saved synchronously.")
    no_fp8_wgrad: bool = flag(False, "Refused: wgrad runs in the backward's precision.")
    fp8_param_gather: bool = flag(False, "Refused: parameters are never stored in fp8.")


# Megatron-LM flags refused with the reason and what to do instead (dest -> message).
_REFUSED = {
    "async_save": "--async-save: checkpoints are saved synchronously (written to iter_N.tmp and renamed once every "
                  "rank has finished, so a crash never leaves a partial one); drop the flag",
    "no_fp8_wgrad": "--no-fp8-wgrad: a plan gives each module one precision for both backward GEMMs (dgrad and "
                    "wgrad); keep the backward out of fp8 with --precision-schedule bwd=bf16@1, or drop the flag",
    "fp8_param_gather": "--fp8-param-gather: parameters stay in bf16/fp32 and are quantized at each GEMM, so there "
                        "are no fp8 parameters to all-gather; drop the flag",
}


def _samples_to_iters(option: str, samples: int, global_batch_size: int) -> int:
    """Megatron-LM's sample-based length ``samples`` in iterations of ``global_batch_size`` samples."""
    require(samples >= 0 and samples % global_batch_size == 0,
            f"{option} {samples} is not a multiple of --global-batch-size {global_batch_size}; use a multiple "
            f"(iterations = {option} / --global-batch-size), or give the length in iterations")
    return samples // global_batch_size


def validate_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's flags: sample counts become iterations, the rest is accepted or refused with the reason
    (``args``: the working namespace, shape and batch sizes already filled)."""
    for key, message in _REFUSED.items():
        require(not getattr(args, key), message)
    require(args.ckpt_format == "torch_dist", f"--ckpt-format {args.ckpt_format}: checkpoints are megatron-core "
            "dist_checkpointing (torch_dist) only; use --ckpt-format torch_dist (Megatron-LM's default)")
    head_dim = args.hidden_size // args.num_attention_heads
    require(args.kv_channels in (None, head_dim),
            f"--kv-channels {args.kv_channels} differs from --hidden-size {args.hidden_size} / "
            f"--num-attention-heads {args.num_attention_heads} = {head_dim}, the only head dimension the Llama "
            f"model here has; drop --kv-channels or pass {head_dim}")
    require(args.rotary_percent == 1.0, f"--rotary-percent {args.rotary_percent}: Llama rotates every head "
            "dimension; only --rotary-percent 1.0 is supported")
    if args.recompute_activations:
        args.recompute_granularity = "selective"  # Megatron-LM's meaning, whatever --recompute-granularity says
    require(args.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
    if args.train_samples is None:
        require(args.train_iters is not None, "--train-iters N (or Megatron-LM's --train-samples N) is required")
        require(args.lr_decay_samples is None and args.lr_warmup_samples == 0,
                "--lr-decay-samples and --lr-warmup-samples go with --train-samples; with --train-iters use "
                "--lr-decay-iters and --lr-warmup-iters")
        return
    require(args.train_iters is None, "give --train-iters or --train-samples, not both")
    require(args.lr_decay_iters is None and args.lr_warmup_iters == 0,
            "with --train-samples give the LR schedule in samples (--lr-decay-samples, --lr-warmup-samples), as "
            "Megatron-LM expects, not --lr-decay-iters / --lr-warmup-iters")
    gbs = args.global_batch_size
    args.train_iters = _samples_to_iters("--train-samples", args.train_samples, gbs)
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _samples_to_iters("--lr-decay-samples", args.lr_decay_samples, gbs)
    args.lr_warmup_iters = _samples_to_iters("--lr-warmup-samples", args.lr_warmup_samples, gbs)

"""Flags of Megatron-LM's Llama scripts that configure nothing here by themselves: lengths in samples
(converted to iterations), architecture switches Llama fixes, features that change only speed or memory
elsewhere (accepted with a start-up notice), and features refused with the reason.

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
    use_rotary_position_embeddings: bool = flag(False, "Megatron-LM's deprecated spelling of "
                                                "--position-embedding-type rope.")
    add_position_embedding: bool = flag(True, "Accepted with rotary embeddings (Megatron-LM's deprecated flag): "
                                        "there is no learned position embedding to drop.",
                                        option="--no-position-embedding")
    exit_signal_handler: bool = flag(
        False, "Accepted for Megatron-LM scripts: here the handler is always on. SIGTERM or SIGUSR1 make every rank "
        "finish its iteration, save (if --save) and exit 0.")
    exit_on_missing_checkpoint: bool = flag(
        False, "With --load: refuse a directory that holds no checkpoint even when it equals --save (no fresh "
        "start).")
    use_checkpoint_args: bool = flag(False, "Accepted: the model's shape always comes from the checkpoint in --load.")
    ckpt_format: str = flag("torch_dist", "Only torch_dist (megatron-core dist_checkpointing) is written and read.",
                            choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"))
    ckpt_fully_parallel_save_deprecated: bool = flag(
        False, "Megatron-LM's deprecated flag, without effect there and here: saves are spread over data-parallel "
        "ranks unless --no-ckpt-fully-parallel-save.", option="--ckpt-fully-parallel-save")
    use_mcore_models: bool = flag(False, "Accepted (deprecated in Megatron-LM): megatron-core models are the only "
                                  "ones, there and here.")
    use_flash_attn: bool = flag(False, "Accepted: Megatron-LM parses and ignores it; choose the kernel with "
                                "--attention-backend.")
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False, "Accepted: gradients accumulate and all-reduce in fp32 here (Megatron-LM's default with --bf16) unless "
        "--grad-reduce-in-bf16.")
    create_attention_mask_in_dataloader: bool = flag(
        True, "Accepted: the data loader builds an attention mask only for --reset-attention-mask (the attention "
        "kernels build the causal mask).", option="--no-create-attention-mask-in-dataloader")
    dataloader_type: str | None = flag(None, "single (Megatron-LM's default): each sample once per pass, in order of "
                                       "consumed samples; cyclic and external are refused.",
                                       choices=("single", "cyclic", "external"))
    tiktoken_pattern: str | None = flag(None, "Accepted, unused: only --tokenizer-type TikTokenizer (refused) reads "
                                        "it.", choices=("v1", "v2"))
    async_save: bool = flag(False, "Accepted with a start-up notice: checkpoints are saved synchronously here (the "
                            "same files; only the time training waits differs).")
    no_fp8_wgrad: bool = flag(False, "Refused: wgrad runs in the backward's precision.")
    fp8_param_gather: bool = flag(
        False, "Accepted with a start-up notice: parameters stay in their own dtype and each GEMM quantizes its weight "
        "(the values an FP8 parameter would hold); the memory and all-gather savings need Transformer Engine's FP8 "
        "parameters.")
    fp16: bool = flag(False, "Refused: fp16 needs loss scaling; use --bf16.")
    use_torch_fsdp2: bool = flag(False, "Refused: megatron-core DDP only.")
    use_megatron_fsdp: bool = flag(False, "Refused: megatron-core DDP only.")


# Megatron-LM flags that change only speed or memory on a backend this program does not run: accepted,
# with a start-up notice saying what they do here (dest -> notice).
_NOTICED = {
    "async_save": "--async-save: checkpoints are saved synchronously here (written to iter_N.tmp and renamed once "
                  "every rank has finished): the same checkpoints, training waits for each save",
    "fp8_param_gather": "--fp8-param-gather: parameters stay in their own dtype here and each FP8 GEMM quantizes its "
                        "weight, the values an FP8 parameter would hold; the memory and all-gather savings need "
                        "Transformer Engine's FP8 parameters, which this program does not use",
}


# Megatron-LM flags refused with the reason and what to do instead (dest -> message).
_REFUSED = {
    "no_fp8_wgrad": "--no-fp8-wgrad: a plan gives each module one precision for both backward GEMMs (dgrad and "
                    "wgrad); keep the backward out of fp8 with --precision-schedule bwd=bf16@1, or drop the flag",
    "fp16": "--fp16: fp16 training needs loss scaling, which this program does not set up; use --bf16",
    "use_torch_fsdp2": "--use-torch-fsdp2: FSDP is not supported (megatron-core DDP only); shard the optimizer state "
                       "with --use-distributed-optimizer instead",
    "use_megatron_fsdp": "--use-megatron-fsdp: FSDP is not supported (megatron-core DDP only); shard the optimizer "
                         "state with --use-distributed-optimizer instead",
}


def _samples_to_iters(option: str, samples: int, global_batch_size: int) -> int:
    """Megatron-LM's sample-based length ``samples`` in iterations of ``global_batch_size`` samples."""
    require(samples >= 0 and samples % global_batch_size == 0,
            f"{option} {samples} is not a multiple of --global-batch-size {global_batch_size}; use a multiple "
            f"(iterations = {option} / --global-batch-size), or give the length in iterations")
    return samples // global_batch_size


def refuse_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's flags that need nothing else resolved: each refusal a problem of its own, and a notice
    (``args.notices``) for each flag accepted that changes nothing here."""
    for key, message in _REFUSED.items():
        require(not getattr(args, key), message)
    args.notices += [notice for key, notice in _NOTICED.items() if getattr(args, key)]
    require(args.ckpt_format == "torch_dist", f"--ckpt-format {args.ckpt_format}: checkpoints are megatron-core "
            "dist_checkpointing (torch_dist) only; use --ckpt-format torch_dist (Megatron-LM's default)")
    require(args.dataloader_type in (None, "single"), f"--dataloader-type {args.dataloader_type}: samples are read "
            "once per pass in the order of consumed samples (Megatron-LM's single); use --dataloader-type single")
    require(args.create_attention_mask_in_dataloader or not args.reset_attention_mask,
            "--no-create-attention-mask-in-dataloader drops the mask --reset-attention-mask needs (attention across "
            "document boundaries); drop one of the two")
    require(not (args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16),
            "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 contradict each other; drop one")
    require(args.rotary_percent == 1.0, f"--rotary-percent {args.rotary_percent}: Llama rotates every head "
            "dimension; only --rotary-percent 1.0 is supported")
    require(args.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")


def validate_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's flags that need the shape and batch sizes (``args``: the working namespace, those
    filled): sample counts become iterations, --kv-channels is checked."""
    head_dim = args.hidden_size // args.num_attention_heads
    require(args.kv_channels in (None, head_dim),
            f"--kv-channels {args.kv_channels} differs from --hidden-size {args.hidden_size} / "
            f"--num-attention-heads {args.num_attention_heads} = {head_dim}, the only head dimension the Llama "
            f"model here has; drop --kv-channels or pass {head_dim}")
    if args.recompute_activations:
        args.recompute_granularity = "selective"  # Megatron-LM's meaning, whatever --recompute-granularity says
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

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
    profile_step_start: int = flag(10, "With --profile (refused).")
    profile_step_end: int = flag(12, "With --profile (refused).")
    async_save: bool = flag(False, "Refused: checkpoints are saved synchronously.")
    no_fp8_wgrad: bool = flag(False, "Refused: wgrad runs in the backward's precision.")
    fp8_param_gather: bool = flag(False, "Refused: parameters are never stored in fp8.")
    fp16: bool = flag(False, "Refused: fp16 needs loss scaling; use --bf16.")
    apply_layernorm_1p: bool = flag(False, "Refused: the norms store their scale, not scale - 1.")
    calculate_per_token_loss: bool = flag(False, "Refused: each micro-batch's loss is the mean over its tokens.")
    use_torch_fsdp2: bool = flag(False, "Refused: megatron-core DDP only.")
    use_megatron_fsdp: bool = flag(False, "Refused: megatron-core DDP only.")
    profile: bool = flag(False, "Refused: no nsys capture range is marked.")


# Megatron-LM flags refused with the reason and what to do instead (dest -> message).
_REFUSED = {
    "async_save": "--async-save: checkpoints are saved synchronously (written to iter_N.tmp and renamed once every "
                  "rank has finished, so a crash never leaves a partial one); drop the flag",
    "no_fp8_wgrad": "--no-fp8-wgrad: a plan gives each module one precision for both backward GEMMs (dgrad and "
                    "wgrad); keep the backward out of fp8 with --precision-schedule bwd=bf16@1, or drop the flag",
    "fp8_param_gather": "--fp8-param-gather: parameters stay in bf16/fp32 and are quantized at each GEMM, so there "
                        "are no fp8 parameters to all-gather; drop the flag",
    "fp16": "--fp16: fp16 training needs loss scaling, which this program does not set up; use --bf16",
    "apply_layernorm_1p": "--apply-layernorm-1p: the norms here store their scale, not scale - 1 (zero-centred); drop "
                          "the flag (norm weights get no weight decay, as in megatron-core, so training differs only "
                          "in rounding)",
    "calculate_per_token_loss": "--calculate-per-token-loss: each micro-batch's loss is the mean over its tokens "
                                "(Megatron-LM's default), not normalised over the global batch's tokens; drop the flag "
                                "(the two agree when every micro-batch has as many loss tokens, as without "
                                "--eod-mask-loss)",
    "use_torch_fsdp2": "--use-torch-fsdp2: FSDP is not supported (megatron-core DDP only); shard the optimizer state "
                       "with --use-distributed-optimizer instead",
    "use_megatron_fsdp": "--use-megatron-fsdp: FSDP is not supported (megatron-core DDP only); shard the optimizer "
                         "state with --use-distributed-optimizer instead",
    "profile": "--profile: no nsys capture range (cudaProfilerStart/Stop) is marked here; profile the whole run with "
               "nsys profile without --capture-range, or drop the flag",
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
    require(args.dataloader_type in (None, "single"), f"--dataloader-type {args.dataloader_type}: samples are read "
            "once per pass in the order of consumed samples (Megatron-LM's single); use --dataloader-type single")
    require(args.create_attention_mask_in_dataloader or not args.reset_attention_mask,
            "--no-create-attention-mask-in-dataloader drops the mask --reset-attention-mask needs (attention across "
            "document boundaries); drop one of the two")
    require(not (args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16),
            "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 contradict each other; drop one")
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

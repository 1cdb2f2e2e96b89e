"""Megatron-LM's flags that configure nothing here by themselves, and the answer to every other one.

:class:`MegatronLMFlags` holds the flags of Megatron-LM's Llama scripts that are implemented through other
settings (lengths in samples converted to iterations, deprecated spellings, switches Llama fixes) or checked
against them; they are parsed like every other flag (``flags.flag`` fields) and not kept in the run's
configuration. Megatron-LM's remaining options (:mod:`.megatron_lm_families`) are parsed too and answered by
:func:`refuse_megatron_lm`: accepted, accepted with a start-up notice, or refused with the reason.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron_snip.flags import flag

from .errors import ArgumentError, require
from .megatron_lm_families import GIVEN, answer


@dataclass(frozen=True)
class MegatronLMFlags:
    """What a Megatron-LM script passes that is implemented through other settings, or refused."""

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
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False, "Accepted: gradients accumulate and all-reduce in fp32 here (Megatron-LM's default with --bf16) unless "
        "--grad-reduce-in-bf16.")
    create_attention_mask_in_dataloader: bool = flag(
        True, "Accepted: the data loader builds an attention mask only for --reset-attention-mask (the attention "
        "kernels build the causal mask).", option="--no-create-attention-mask-in-dataloader")
    dataloader_type: str | None = flag(None, "single (Megatron-LM's default): each sample once per pass, in order of "
                                       "consumed samples; cyclic and external are refused.",
                                       choices=("single", "cyclic", "external"))
    encoder_seq_length: int | None = flag(None, "Megatron-LM's other spelling of --seq-length.")
    local_rank: int | None = flag(
        None, "The process's rank on its node, as torch.distributed.launch passes it (default: $LOCAL_RANK): the GPU "
        "it runs on.")


# Flags both programs have whose default here is not Megatron-LM's (dest -> why; docs/megatron_compat.md).
DIFFERENT_DEFAULTS = {
    "transformer_impl": "local here, transformer_engine there: SNIP, the precision plans and the quantization "
                        "health numbers are complete on megatron-core's local layers, which also run without a GPU; "
                        "a GPU launch that relies on the default gets a start-up notice",
    "fp8_recipe": "tensorwise here, delayed there: stateless scaling is right from the first step of a module a plan "
                  "switches to FP8; a launch whose FP8 flags mean delayed scaling there gets a start-up notice",
    "cp_comm_type": "all_gather here, p2p there: the SDPA attention all-gathers keys and values over the CP group "
                    "(Llama 3's scheme; Megatron-LM's p2p is Transformer Engine's ring attention); the same attention, "
                    "other communication; a CP launch that relies on the default gets a start-up notice",
    "micro_batch_size": "Megatron-LM has no default (it requires the flag); 4 here",
    "lr": "Megatron-LM has no default (its scheduler fails without one); 3e-4 here",
    "eval_interval": "Megatron-LM has no default (it fails without one when it evaluates); 1000 here",
    "tokenizer_type": "Megatron-LM has no default (it requires the flag); SentencePieceTokenizer here",
}
# Flags left None by the parser and filled by validation with Megatron-LM's default, or a preset's, a checkpoint's
# or the machine's where Megatron-LM's cannot apply (docs/megatron_compat.md says which).
FILLED_DEFAULTS = (
    "num_query_groups", "hidden_dropout", "attention_dropout", "norm_epsilon", "apply_layernorm_1p",
    "disable_bias_linear", "normalization", "group_query_attention", "position_embedding_type", "rotary_base",
    "use_rope_scaling", "rope_scaling_factor", "swiglu", "untie_embeddings_and_output_weights", "fp8_margin",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp4_recipe", "distributed_backend", "num_workers",
    "local_rank",
)


def refuse_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's flags that need nothing else resolved: each refusal a problem of its own, and a notice
    (``args.notices``) for each flag accepted that changes only speed, memory or diagnostics here."""
    for option, shown, value in (getattr(args, GIVEN) or {}).values():
        kind, line = answer(option, shown, value)
        require(kind != "refused", line)
        if kind == "notice":
            args.notices.append(line)
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
    if args.encoder_seq_length is not None:  # Megatron-LM's older spelling
        require(args.seq_length in (None, args.encoder_seq_length), f"--encoder-seq-length {args.encoder_seq_length} "
                f"and --seq-length {args.seq_length} disagree; give one of them")
        args.seq_length = args.encoder_seq_length
    launcher = os.environ.get("LOCAL_RANK")
    require(args.local_rank is None or launcher in (None, str(args.local_rank)),
            f"--local-rank {args.local_rank} differs from $LOCAL_RANK {launcher}, which the launcher set; drop "
            f"--local-rank (the launcher's value chooses the GPU)")


def validate_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's flags that need the shape and batch sizes (``args``: the working namespace, those
    filled): --train-samples gives the iterations (the LR schedule stays in samples), --kv-channels is checked."""
    head_dim = args.hidden_size // args.num_attention_heads
    require(args.kv_channels in (None, head_dim),
            f"--kv-channels {args.kv_channels} differs from --hidden-size {args.hidden_size} / "
            f"--num-attention-heads {args.num_attention_heads} = {head_dim}, the only head dimension the Llama "
            f"model here has; drop --kv-channels or pass {head_dim}")
    if args.recompute_activations:
        args.recompute_granularity = "selective"  # Megatron-LM's meaning, whatever --recompute-granularity says
    if args.train_samples is None:
        require(args.train_iters is not None, "--train-iters N (or Megatron-LM's --train-samples N) is required")
        require(args.lr_decay_samples is None and args.lr_warmup_samples == 0 and args.lr_wsd_decay_samples is None,
                "--lr-decay-samples, --lr-warmup-samples and --lr-wsd-decay-samples go with --train-samples; with "
                "--train-iters use --lr-decay-iters, --lr-warmup-iters and --lr-wsd-decay-iters")
        return
    require(args.train_iters is None, "give --train-iters or --train-samples, not both")
    require(args.lr_decay_iters is None and args.lr_warmup_iters == 0 and args.lr_wsd_decay_iters is None,
            "with --train-samples give the LR schedule in samples (--lr-decay-samples, --lr-warmup-samples, "
            "--lr-wsd-decay-samples), as Megatron-LM expects, not --lr-decay-iters / --lr-warmup-iters / "
            "--lr-wsd-decay-iters")
    if args.train_samples <= 0:
        raise ArgumentError(f"--train-samples {args.train_samples} must be > 0")
    # Megatron-LM's update_train_iters (no batch-size ramp-up): a partial last batch is not trained.
    args.train_iters = args.train_samples // args.global_batch_size
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples  # as Megatron-LM's get_optimizer_param_scheduler sets it
    warmup = args.lr_warmup_samples if args.lr_warmup_fraction is None else (
        args.lr_warmup_fraction * args.lr_decay_samples)
    require(warmup < args.lr_decay_samples,
            f"the warm-up ({warmup:g} samples) must be shorter than --lr-decay-samples {args.lr_decay_samples} "
            f"(default: --train-samples)")

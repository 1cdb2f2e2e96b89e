"""The model's architecture: from ``--model-preset``, from the checkpoint in ``--load``, or (neither)
from Megatron-LM's architecture flags with Megatron-LM's defaults, as a Megatron-LM script means them.

This program builds Llama: SwiGLU, RMSNorm, rotary embeddings, no biases, the output layer tied to
the embedding or not. A preset or a checkpoint implies all of that; a Megatron-LM script must say it
(``--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear``), since
without those flags Megatron-LM builds GELU, LayerNorm, learned positions and biases. What cannot be
built is refused with the flag that would fix it, never built silently as something else.
"""

from __future__ import annotations

import argparse

from megatron_snip.model.presets import PRESETS

from .errors import require

# Megatron-LM's required model flags (its validate_args checks the first four; a GPT needs --seq-length).
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "seq_length")
# Megatron-LM's defaults of the other shape flags.
_MEGATRON_DEFAULTS = {"rotary_base": 10000, "norm_epsilon": 1e-5, "use_rope_scaling": False, "rope_scaling_factor": 8.0}
# model_preset's label for an architecture the flags define (shown at start-up, saved with checkpoints;
# like a checkpoint's label it is no preset, so the configuration file leaves it out).
FROM_FLAGS = "megatron-flags"
# What a preset or a checkpoint implies (every model here is a Llama).
_LLAMA = {"swiglu": True, "disable_bias_linear": True, "normalization": "RMSNorm", "position_embedding_type": "rope"}
# Dropout: Megatron-LM's default for an architecture its flags describe (and checkpoints of one); a Llama named by
# a preset or imported from Hugging Face trains without dropout.
_MEGATRON_DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
_LLAMA_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def resolve_architecture(args: argparse.Namespace) -> None:
    """Fill every architecture field of ``args`` (a checkpoint's shape already filled, its label in
    ``model_preset``) and refuse what cannot be built. The resolved switches are set explicitly, so
    the configuration a run writes reads back to the same model without a preset."""
    if args.use_rotary_position_embeddings:  # Megatron-LM's deprecated spelling of rope
        args.position_embedding_type = "rope"
    if args.model_preset is None:
        _from_megatron_flags(args)
    else:
        _from_preset(args)
    _refuse_what_cannot_be_built(args)
    args.apply_layernorm_1p = bool(args.apply_layernorm_1p)
    args.group_query_attention = args.num_query_groups != args.num_attention_heads
    args.untie_embeddings_and_output_weights = not args.share_embeddings_and_output_weights


def _fill(args: argparse.Namespace, values: dict) -> None:
    """Set each unset (None or absent) field of ``args`` to its value in ``values``."""
    for key, value in values.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def checkpoint_flag(args: argparse.Namespace) -> str:
    """The flag and directory the run's checkpoint comes from, for messages: --load, or --pretrained-checkpoint
    where --load holds none."""
    from_pretrained = getattr(args, "from_pretrained", False)  # set by resolve, before the checkpoint is read
    return f"--pretrained-checkpoint {args.pretrained_checkpoint}" if from_pretrained else f"--load {args.load}"


def _from_preset(args: argparse.Namespace) -> None:
    """The preset's (or checkpoint's) architecture under the flags given. A checkpoint that does not say
    whether it is tied is untied: every run before the flag had Megatron-LM's meaning was."""
    _fill(args, PRESETS[args.model_preset].as_args() if args.model_preset in PRESETS else {})
    _fill(args, {**_MEGATRON_DEFAULTS, **_LLAMA, "share_embeddings_and_output_weights": False})
    _fill(args, _MEGATRON_DROPOUT if args.model_preset == FROM_FLAGS else _LLAMA_DROPOUT)
    require(not (args.untie_embeddings_and_output_weights and args.share_embeddings_and_output_weights),
            f"--untie-embeddings-and-output-weights: the checkpoint in {checkpoint_flag(args)} ties the output layer "
            f"to the embedding (one weight); drop the flag (the checkpoint defines the model)")


def _from_megatron_flags(args: argparse.Namespace) -> None:
    """The architecture a Megatron-LM script describes, with Megatron-LM's defaults."""
    for key in _REQUIRED:
        require(getattr(args, key) is not None,
                f"--{key.replace('_', '-')} is required (as in Megatron-LM), or give --model-preset NAME for a "
                f"named Llama architecture, or --load a checkpoint")
    _fill(args, {**_MEGATRON_DEFAULTS, **_MEGATRON_DROPOUT, "normalization": "LayerNorm",
                 "position_embedding_type": "learned_absolute"})
    if args.ffn_hidden_size is None:  # Megatron-LM's: SwiGLU keeps the parameter count of a 4h GELU MLP
        hidden = args.hidden_size
        args.ffn_hidden_size = int((4 * hidden * 2 / 3) / 64) * 64 if args.swiglu else 4 * hidden
    _megatron_query_groups(args)
    args.share_embeddings_and_output_weights = not args.untie_embeddings_and_output_weights
    args.model_preset = FROM_FLAGS


def _megatron_query_groups(args: argparse.Namespace) -> None:
    """Megatron-LM reads --num-query-groups (default 1) only with --group-query-attention; without it,
    attention is multi-head. A --num-query-groups it would ignore is refused rather than dropped."""
    heads = args.num_attention_heads
    if args.group_query_attention:
        _fill(args, {"num_query_groups": 1})
        return
    require(args.num_query_groups in (None, heads),
            f"--num-query-groups {args.num_query_groups} without --group-query-attention: Megatron-LM then ignores "
            f"it and builds multi-head attention ({heads} key/value heads); add --group-query-attention, or drop "
            f"--num-query-groups")
    args.num_query_groups = heads


def _refuse_what_cannot_be_built(args: argparse.Namespace) -> None:
    preset = ", or use --model-preset NAME" if args.model_preset == FROM_FLAGS else ""
    require(args.swiglu, "--swiglu is not given: Megatron-LM then builds a GELU MLP, which this program cannot build "
            f"(Llama's MLP is SwiGLU); add --swiglu{preset}")
    require(args.disable_bias_linear, "--disable-bias-linear is not given: Megatron-LM then adds biases to the linear "
            f"layers, which this program cannot build (Llama has none); add --disable-bias-linear{preset}")
    require(args.normalization == "RMSNorm", f"--normalization {args.normalization}: this program builds RMSNorm only "
            f"(Llama); pass --normalization RMSNorm (without the flag Megatron-LM uses LayerNorm){preset}")
    require(args.position_embedding_type == "rope",
            f"--position-embedding-type {args.position_embedding_type}: this program builds rotary embeddings only "
            f"(Llama); pass --position-embedding-type rope (without the flag Megatron-LM uses learned_absolute)"
            f"{preset}")

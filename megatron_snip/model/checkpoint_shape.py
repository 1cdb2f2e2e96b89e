"""A checkpoint defines its model's shape: fill the shape flags from it, refuse ones that disagree.

Every checkpoint saves its arguments; an imported Hugging Face model (tools/convert_hf_llama.py)
saves the shape its config.json implies. With ``--load`` the shape comes from there: unset
flags are filled, a given flag (or a ``--model-preset`` field) with another value is an error
naming both values, since the weights could not load or would mean something else.
"""

from __future__ import annotations

import argparse

from megatron_snip.model.presets import PRESETS

# Fields the weights fix: a different value cannot load or changes the model's function.
FIXED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
         "rotary_base", "norm_epsilon", "use_rope_scaling", "rope_scaling_factor")
# Fields taken from the checkpoint when not given, and free to change.
DEFAULTS = ("seq_length", "max_position_embeddings")
# Fields without flags, always the checkpoint's (see add_arguments).
CARRIED = ("vocab_size", "padded_vocab_size", "share_embeddings_and_output_weights", "hf_files")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Llama 3.1 rope scaling (Megatron-LM's flags) and the fields only checkpoints set."""
    g = p.add_argument_group("rope scaling (Llama 3.1 / 3.2; set by imported checkpoints)")
    g.add_argument("--use-rope-scaling", action="store_true", default=None,
                   help="Llama 3.1's rope frequency scaling (megatron-core's: low/high frequency factors "
                        "1 and 4, original context 8192).")
    g.add_argument("--rope-scaling-factor", type=float, default=None, help="Its factor (default 8).")
    # Set from a checkpoint: the model's real vocabulary, its padded size (the embedding rows,
    # fixed at import so the checkpoint loads at any TP size dividing it), tied output layer,
    # and the Hugging Face files (tokenizer, generation config) an import kept.
    p.set_defaults(**{key: None for key in CARRIED})


def apply_checkpoint_shape(args: argparse.Namespace, saved: dict, where: str) -> None:
    """Fill ``args`` from ``saved`` (a checkpoint's arguments); raise ValueError on a disagreement."""
    preset = PRESETS[args.model_preset].as_args() if args.model_preset else {}
    for key in FIXED:
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
    for key in DEFAULTS:
        if getattr(args, key) is None and saved.get(key) is not None:
            setattr(args, key, saved[key])
    for key in CARRIED:
        if saved.get(key) is not None:
            setattr(args, key, saved[key])
    if args.model_preset is None:
        args.model_preset = saved.get("model_preset") or "checkpoint"

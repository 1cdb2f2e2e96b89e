"""A checkpoint defines its model's shape: which saved arguments fix it, fill it, or travel with it.

Every checkpoint saves its arguments; an imported Hugging Face model (tools/convert_hf_llama.py)
saves the shape its config.json implies. With ``--load`` the shape comes from there
(``arguments.py`` applies these lists): unset flags are filled, a given flag (or a
``--model-preset`` field) with another value is an error naming both values, since the weights
could not load or would mean something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Fields the weights fix: a different value cannot load or changes the model's function.
FIXED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
         "rotary_base", "norm_epsilon", "use_rope_scaling", "rope_scaling_factor", "vocab_size",
         "apply_layernorm_1p")
# What a FIXED field absent from a checkpoint's arguments means (checkpoints written before it was saved,
# and imported Hugging Face models, store each norm's scale itself).
ABSENT = {"apply_layernorm_1p": False}
# Fields taken from the checkpoint when not given, and free to change.
DEFAULTS = ("seq_length", "max_position_embeddings")
# Fields without flags, always the checkpoint's (arguments.py gives them a None default).
# share_embeddings_and_output_weights is absent (None) in checkpoints written before it was saved: untied.
CARRIED = ("padded_vocab_size", "share_embeddings_and_output_weights", "hf_files")
# Saved fields besides FIXED whose difference changes the weights' shapes.
_SHAPED = ("share_embeddings_and_output_weights", "padded_vocab_size", "make_vocab_size_divisible_by",
           "ffn_hidden_size", "num_query_groups")


def differences(saved: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """The shape-defining flags whose value in a checkpoint's arguments (``saved``) differs from a run's
    (``run``), each as ``--flag SAVED (this run: RUN)``; fields either side leaves unset are not compared."""
    out = []
    for key in dict.fromkeys((*FIXED, *_SHAPED)):
        mine, theirs = saved.get(key, ABSENT.get(key)), run.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            out.append(f"--{key.replace('_', '-')} {mine} (this run: {theirs})")
    return out

"""A checkpoint defines its model's shape: which saved arguments fix it, fill it, or travel with it.

Every checkpoint saves its arguments; an imported Hugging Face model (tools/convert_hf_llama.py)
saves the shape its config.json implies. With ``--load`` the shape comes from there
(``arguments.py`` applies these lists): unset flags are filled, a given flag (or a
``--model-preset`` field) with another value is an error naming both values, since the weights
could not load or would mean something else.
"""

from __future__ import annotations

import argparse

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

"""Named Llama architectures. Explicit command-line flags override any shape field.

Each preset is the architecture of the model it names (SwiGLU, RMSNorm, rotary embeddings, no
biases, and the real model's embedding tying: TinyLlama, Llama 2 and Llama 3 8B set
``tie_word_embeddings: false``), so a run with ``--model-preset`` needs none of Megatron-LM's
architecture switches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LlamaShape:
    """The architecture fields of a Llama-family model (Megatron flag names, underscored)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    max_position_embeddings: int
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    share_embeddings_and_output_weights: bool = False  # every preset's model has its own output layer

    def as_args(self) -> dict:
        return asdict(self)


PRESETS: dict[str, LlamaShape] = {
    # Trains in minutes on 2 CPU cores at TP=2, PP=2 (the quickstart).
    "tiny": LlamaShape(
        num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
        num_query_groups=2, seq_length=128, max_position_embeddings=128,
    ),
    "tinyllama-1.1b": LlamaShape(
        num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32,
        num_query_groups=4, seq_length=2048, max_position_embeddings=2048,
    ),
    "llama2-7b": LlamaShape(
        num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
        num_query_groups=32, seq_length=4096, max_position_embeddings=4096,
    ),
    "llama3-8b": LlamaShape(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, seq_length=8192, max_position_embeddings=8192,
        rotary_base=500000,
    ),
    "llama2-70b": LlamaShape(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, seq_length=4096, max_position_embeddings=4096,
    ),
}

"""The model's shape and build options, and the parallel layout: validated once by ``arguments.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelConfig:
    """A Llama model (``--model-preset`` and the shape flags; a loaded checkpoint's shape wins)."""

    model_preset: str  # a preset name, or the label of a loaded checkpoint's shape
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int  # tokens per sample
    max_position_embeddings: int
    rotary_base: int
    norm_epsilon: float
    use_rope_scaling: bool
    rope_scaling_factor: float
    init_method_std: float
    attention_dropout: float
    hidden_dropout: float
    make_vocab_size_divisible_by: int
    transformer_impl: str  # "local" or "transformer_engine"
    # --attention-backend (flash, fused, unfused, local, auto): the core attention; not part of the
    # checkpoint's shape (it has no weights), so a run may resume with another.
    attention_backend: str
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    bf16: bool  # parameters, activations and pipeline messages in bf16 (masters stay fp32 in the optimizer)
    # Set only by a loaded checkpoint (an HF import): the real and padded vocabulary, tied output
    # layer, and the Hugging Face files (tokenizer, generation config) the import kept.
    vocab_size: int | None
    padded_vocab_size: int | None
    share_embeddings_and_output_weights: bool | None
    hf_files: str | None

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gated_linear_unit(self) -> bool:
        return True  # SwiGLU (so ``LlamaLinearDims.from_config`` reads this as it reads a TransformerConfig)


@dataclass(frozen=True)
class ParallelConfig:
    """How the processes split the model and the data (TP x PP x DP, Megatron's flags)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int  # derived: world size / (TP x PP)
    virtual_pipeline_model_parallel_size: int | None  # model chunks per pipeline rank; None: not interleaved
    sequence_parallel: bool
    context_parallel_size: int  # always 1 (validated)
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    distributed_backend: str  # "nccl" or "gloo"
    distributed_timeout_minutes: int

    @property
    def chunks_per_stage(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

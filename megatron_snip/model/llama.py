"""Llama (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, no biases) as a megatron-core GPTModel."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_snip.model.quantized_layers import precision_layer_spec


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the embedding rows split evenly over TP ranks."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """The megatron-core config of a Llama model from validated arguments."""
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.hidden_size // args.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        # On CPU, initialise the full weight and slice it, so every TP layout
        # starts from the same weights (TP parity); on GPU initialise in place.
        use_cpu_initialization=not cuda,
        # Fusions that need CUDA kernels (apex / TE) stay off without a GPU.
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deallocate_pipeline_outputs=True,
        cuda_graph_scope=[],  # megatron-core 0.16's default "full" only warns that it is deprecated
    )


def layer_spec(args: argparse.Namespace) -> ModuleSpec:
    """The transformer-layer spec: megatron-core's local modules (with quantized linears) or TE's."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "--transformer-impl transformer_engine needs Transformer Engine: "
                "pip install 'megatron-snip[te]' on a CUDA machine, or use --transformer-impl local"
            ) from e
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    # megatron-core's local layer with our quantized linears: per-module precision, bf16 = the parent's path.
    return precision_layer_spec(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"))


def build_model(args: argparse.Namespace, config: TransformerConfig, vocab_size: int) -> GPTModel:
    """This pipeline stage's part of the model (embedding on the first, head on the last)."""
    # A loaded checkpoint fixes the padded vocabulary (checkpoint_shape) so it loads at any TP.
    rows = args.padded_vocab_size or padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                                       args.tensor_model_parallel_size)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=rows,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Tied only for checkpoints imported from tied models (Llama 3.2 1B/3B).
        share_embeddings_and_output_weights=bool(args.share_embeddings_and_output_weights),
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )


def num_parameters(args: argparse.Namespace, vocab_size: int) -> int:
    """Total parameters of the full model (all stages and shards)."""
    h, f, L = args.hidden_size, args.ffn_hidden_size, args.num_layers
    kv = args.num_query_groups * (h // args.num_attention_heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return L * per_layer + 2 * vocab_size * h + h


def flops_per_token(args: argparse.Namespace, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), dense matmuls only.

    Linear layers: 6 FLOPs per weight per token; attention scores and values:
    12 * layers * hidden * seq (causal masking not discounted, as in Megatron).
    """
    h, f, L, s = args.hidden_size, args.ffn_hidden_size, args.num_layers, args.seq_length
    kv = args.num_query_groups * (h // args.num_attention_heads)
    linear_weights = L * (h * (h + 2 * kv) + h * h + 3 * h * f) + vocab_size * h
    return 6.0 * linear_weights + 12.0 * L * h * s

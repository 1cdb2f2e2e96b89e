"""Llama (RMSNorm, SwiGLU, RoPE, GQA, no biases; tied or untied embeddings) as a megatron-core GPTModel."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_snip.compat.device import has_cuda
from megatron_snip.model.attention import SDPAttention
from megatron_snip.model.compile import compile_layers
from megatron_snip.model.config import ModelConfig, ParallelConfig
from megatron_snip.model.fusions import enable_lean_rope, enable_rope_fusion, enable_wgrad_accumulation_fusion
from megatron_snip.model.norms import block_spec, with_torch_norms
from megatron_snip.model.quantized.layers import precision_layer_spec
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.plan import LINEAR_MODULES


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the embedding rows split evenly over TP ranks."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


# The compiled kernels behind megatron-core's fused masked softmax (apex, or a Megatron-LM build, provides them).
FUSED_SOFTMAX_MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")


def fused_softmax_available() -> bool:
    """Whether megatron-core's fused softmax can run: with the fusion on and these kernels absent,
    the first bf16 attention forward fails with ModuleNotFoundError instead of using torch's softmax."""
    return all(importlib.util.find_spec(name) is not None for name in FUSED_SOFTMAX_MODULES)


def wgrad_accumulation_fusion(model: ModelConfig) -> bool:
    """Whether the bf16 linears accumulate their weight gradients inside the GEMM (--no-gradient-accumulation-fusion
    turns it off; it needs CUDA and apex's kernel or this torch's fp32-output GEMM: model/fusions.py)."""
    if not (model.gradient_accumulation_fusion and has_cuda()):
        return False
    why_not = enable_wgrad_accumulation_fusion()
    if why_not is not None:
        logging.getLogger(__name__).warning("gradient accumulation fusion is off: %s", why_not)
    return why_not is None


def transformer_config(model: ModelConfig, parallel: ParallelConfig) -> TransformerConfig:
    """The megatron-core config of a Llama model in a parallel layout."""
    cuda = has_cuda()
    enable_lean_rope()  # where RoPE is not fused (model/fusions.py)
    interleaved = parallel.virtual_pipeline_model_parallel_size is not None
    same_peer = interleaved and parallel.pipeline_model_parallel_size == 2
    gloo = parallel.distributed_backend == "gloo"
    overlap_p2p = parallel.overlap_p2p_comm and interleaved and not (same_peer and gloo)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=bool(model.apply_layernorm_1p),
        calculate_per_token_loss=model.calculate_per_token_loss,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        init_method_std=model.init_method_std,
        embedding_init_method_std=model.embedding_init_method_std,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        # Transformer Engine's layers read the backend from here (GPTModel turns it into NVTE_* variables).
        # The local spec picks its core attention class instead (layer_spec) and keeps the default: GPTModel
        # asserts that NVTE_* variables already set agree, which a second model with another backend in
        # the same process would fail.
        attention_backend=AttnBackend[model.attention_backend] if model.transformer_impl == "transformer_engine"
        else AttnBackend.auto,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
        # Megatron-LM's: the interleaved schedule overlaps its p2p messages with computation unless
        # --no-overlap-p2p-communication, which batches them (PP > 2 then). At PP 2 the previous and the next
        # rank are one peer, and messages to it that are batched, or over gloo overlapped, can pair up wrongly
        # (an activation and a gradient of one shape, received in the other order from the one sent: no error);
        # there, over gloo, each send and receive completes before the next (a start-up notice says so).
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p and not same_peer,
        # Each rank holds S / CP tokens of every sequence: RoPE's tables are cut to its chunks by megatron-core,
        # the SDPA attention gathers the keys and values (model/context_parallel.py).
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        pipeline_dtype=model.params_dtype,
        params_dtype=model.params_dtype,
        bf16=model.bf16,
        # On CPU, initialise the full weight and slice it, so every TP layout
        # starts from the same weights (TP parity); on GPU in place unless --use-cpu-initialization.
        use_cpu_initialization=model.use_cpu_initialization or not cuda,
        deterministic_mode=model.deterministic_mode,
        # Fusions that need CUDA kernels stay off without a GPU; the softmax one also without its kernels.
        bias_dropout_fusion=model.bias_dropout_fusion and cuda,
        masked_softmax_fusion=model.masked_softmax_fusion and cuda and fused_softmax_available(),
        attention_softmax_in_fp32=model.attention_softmax_in_fp32,
        cross_entropy_loss_fusion=model.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl="native",  # Megatron-LM's default; megatron-core's TE one is off for instability
        bias_activation_fusion=model.bias_swiglu_fusion and cuda,
        gradient_accumulation_fusion=wgrad_accumulation_fusion(model),
        persist_layer_norm=False,
        apply_rope_fusion=model.apply_rope_fusion and cuda and enable_rope_fusion() is None,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        deallocate_pipeline_outputs=True,
        cuda_graph_scope=[],  # megatron-core 0.16's default "full" only warns that it is deprecated
    )


# --attention-backend -> the local spec's core attention: megatron-core's unfused DotProductAttention
# ("unfused", "local"), or torch's SDPA, which picks its flash or memory-efficient kernel (the others).
LOCAL_CORE_ATTENTION = {"unfused": DotProductAttention, "local": DotProductAttention,
                        "auto": SDPAttention, "flash": SDPAttention, "fused": SDPAttention}


def layer_spec(transformer_impl: str, attention_backend: str = "auto") -> ModuleSpec:
    """The transformer-layer spec: megatron-core's local modules (with quantized linears and the
    ``attention_backend``'s core attention, :data:`LOCAL_CORE_ATTENTION`) or TE's (which reads the
    backend from the TransformerConfig)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "--transformer-impl transformer_engine needs Transformer Engine: "
                "pip install 'megatron-snip[te]' on a CUDA machine, or use --transformer-impl local"
            ) from e
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    # megatron-core's local layer with our quantized linears (per-module precision, bf16 = the parent's
    # path) and torch norms that also run under sequence parallelism.
    layer = with_torch_norms(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"))
    return precision_layer_spec(_with_core_attention(layer, LOCAL_CORE_ATTENTION[attention_backend]))


def _with_core_attention(layer: ModuleSpec, core_attention: type) -> ModuleSpec:
    """A copy of a local transformer-layer spec whose self-attention uses ``core_attention``."""
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules,
                                                                              core_attention=core_attention))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))


def build_model(model: ModelConfig, parallel: ParallelConfig, config: TransformerConfig,
                vocab_size: int) -> list[GPTModel]:
    """This pipeline rank's model chunks: one, or one per virtual pipeline stage (interleaved
    schedule); the embedding sits in the first stage's first chunk, the head in the last's last."""
    spec = layer_spec(model.transformer_impl, model.attention_backend)
    vpp = parallel.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    # A loaded checkpoint fixes the padded vocabulary (checkpoint_shape) so it loads at any TP.
    rows = model.padded_vocab_size or padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by,
                                                        parallel.tensor_model_parallel_size)
    chunks = [GPTModel(
        config=config,
        transformer_layer_spec=spec if model.transformer_impl == "transformer_engine"
        else block_spec(spec, config, vp_stage),
        vocab_size=rows,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
        # Tied: the output layer uses the embedding's weight; with PP > 1 megatron-core keeps a copy on the
        # last stage, equal at start and kept equal by finalize_model_grads (the embedding group's all-reduce).
        share_embeddings_and_output_weights=bool(model.share_embeddings_and_output_weights),
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        vp_stage=vp_stage,
    ) for vp_stage in stages]
    if has_cuda():
        # As megatron.training's get_model: megatron-core creates its linear weights on the GPU, but the
        # torch norms (TorchNorm) start on the CPU, and the optimizer wants every parameter on the GPU.
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    if model.torch_compile:
        compile_layers(chunks, model.torch_compile_backend, fall_back=model.torch_compile_by_default)
    return chunks


def _linear_weights_per_layer(model: ModelConfig) -> int:
    dims = LlamaLinearDims.from_config(model)
    return sum(fan_in * fan_out for fan_in, fan_out in map(dims.in_out, LINEAR_MODULES))


def num_parameters(model: ModelConfig, vocab_size: int) -> int:
    """Total parameters of the full model (all stages and shards; a tied output layer counted once)."""
    h = model.hidden_size
    vocab_matrices = 1 if model.share_embeddings_and_output_weights else 2
    return model.num_layers * (_linear_weights_per_layer(model) + 2 * h) + vocab_matrices * vocab_size * h + h


def flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), dense matmuls only, as Megatron-LM's
    ``num_floating_point_operations`` counts them (its TFLOP/s and num_floating_point_operations_so_far).

    Linear layers: 6 FLOPs per weight per token (``vocab_size``: the output layer's rows, padded);
    attention scores and values (two GEMMs over the causal half of the sequence): 6 * layers * hidden * seq.
    """
    linear_weights = model.num_layers * _linear_weights_per_layer(model) + vocab_size * model.hidden_size
    return 6.0 * linear_weights + 6.0 * model.num_layers * model.hidden_size * model.seq_length

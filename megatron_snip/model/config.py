"""The model's shape and build options, and the parallel layout: their flags, validated once by
``megatron_snip.arguments``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_snip.flags import derived, flag
from megatron_snip.model.presets import PRESETS

if TYPE_CHECKING:  # it reads plans, which import torch; --help and flag errors import this module without it
    from megatron_snip.precision.pipeline_layout import PipelineLayout

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# --torch-compile's default, per device: on where compile pays (docs/benchmarks.md: bench/gpu_suite.py's compile step
# times our model eager and compiled on a GPU; bench/fwd_bwd_side_by_side.py on a CPU).
COMPILE_BY_DEFAULT = {"cuda": True, "cpu": False}
# --torch-compile-backend: inductor generates kernels; aot_eager traces and runs eager kernels (checks on a CPU)
COMPILE_BACKENDS = ("inductor", "aot_eager")
# --cp-comm-type: Megatron-LM's and Transformer Engine's names; the SDPA attention all-gathers whichever is given.
CP_COMM_TYPES = ("all_gather", "allgather", "p2p", "a2a", "a2a+p2p")
ALL_GATHER = ("all_gather", "allgather")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama model (``--model-preset`` and the shape flags; a loaded checkpoint's shape wins).

    The shape flags default to None: validation fills them from the preset (or the checkpoint),
    and explicit flags win."""

    model_preset: str | None = flag(
        None, "Named Llama architecture (with --load: the checkpoint's); explicit shape flags override its fields. "
        "Without a preset or checkpoint the architecture flags mean what they mean in Megatron-LM, with its "
        "defaults (docs/megatron_compat.md).", choices=sorted(PRESETS), ours=True)
    num_layers: int | None = flag(None, "Transformer layers.")
    hidden_size: int | None = flag(None, "Hidden size.")
    ffn_hidden_size: int | None = flag(None, "MLP hidden size (SwiGLU's inner width). Without a preset: Megatron-LM's "
                                       "default for SwiGLU, int(4 x hidden x 2/3 / 64) x 64.")
    num_attention_heads: int | None = flag(None, "Attention heads.")
    group_query_attention: bool | None = flag(
        None, "Grouped-query attention with --num-query-groups key/value heads. Without a preset, as in Megatron-LM, "
        "attention is multi-head unless this is given.")
    num_query_groups: int | None = flag(None, "Key/value heads (with --group-query-attention; Megatron-LM's default "
                                        "1 there).")
    seq_length: int | None = flag(None, "Tokens per sample.")
    max_position_embeddings: int | None = flag(None, "Longest sequence the position embedding serves.")
    rotary_base: int | None = flag(None, "RoPE base.")
    norm_epsilon: float | None = flag(None, "RMSNorm epsilon.")
    use_rope_scaling: bool | None = flag(
        None, "Llama 3.1's rope frequency scaling (megatron-core's: low/high frequency factors 1 and 4, original "
        "context 8192).")
    rope_scaling_factor: float | None = flag(None, "Its factor (default 8).")
    # Megatron-LM's architecture switches. None: not given, so the preset's, the checkpoint's or (neither)
    # Megatron-LM's default; validation resolves them and refuses what this program cannot build.
    swiglu: bool | None = flag(None, "SwiGLU MLP. Without a preset or checkpoint it is required: Megatron-LM builds a "
                               "GELU MLP without it, which this program cannot build.")
    disable_bias_linear: bool | None = flag(
        None, "No biases in the linear layers. Without a preset or checkpoint it is required: Megatron-LM adds biases "
        "without it, which Llama has none of.")
    normalization: str | None = flag(None, "RMSNorm; Megatron-LM's default LayerNorm is refused (Llama).",
                                     choices=("LayerNorm", "RMSNorm"))
    apply_layernorm_1p: bool | None = flag(
        None, "Zero-centred RMSNorm scales (megatron-core's layernorm_zero_centered_gamma): each norm stores its scale "
        "minus 1 (zeros at start) and multiplies by 1 + weight, which bf16 holds more finely near 1. Given by a "
        "checkpoint: its norm weights mean one or the other.")
    position_embedding_type: str | None = flag(
        None, "rope; Megatron-LM's default learned_absolute and its other types are refused (Llama).",
        choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"))
    untie_embeddings_and_output_weights: bool | None = flag(
        None, "Give the output layer its own weight. Not given: as in Megatron-LM, the output layer shares the input "
        "embedding's weight (tied), except with --model-preset (every preset is untied, as the models it names) or "
        "--load (the checkpoint's; checkpoints that do not say are untied).")
    vocab_size: int | None = flag(
        None, "Vocabulary size before padding. Required with --tokenizer-type NullTokenizer (ids 0..N-1, then the "
        "end-of-document id N: N + 1 in all, as in Megatron-LM); with a tokenizer file it must equal the tokenizer's "
        "size (Megatron-LM ignores it there); with --load, the checkpoint's.")
    calculate_per_token_loss: bool = flag(
        False, "Normalise the loss by the number of loss tokens of the whole global batch (over every micro-batch "
        "and data-parallel rank) instead of averaging each micro-batch's per-token mean (megatron-core's "
        "calculate_per_token_loss): with --eod-mask-loss every token weighs the same.")
    init_method_std: float = flag(0.02, "Standard deviation of the weight initialisation.")
    embedding_init_method_std: float | None = flag(
        None, "Standard deviation of the input embedding's initialisation (default: --init-method-std).")
    use_cpu_initialization: bool = flag(
        False, "Initialise each full weight on the CPU and give every tensor-parallel rank its slice (the same "
        "weights at every TP size), then move it to the GPU; always so without CUDA.")
    deterministic_mode: bool = flag(
        False, "Deterministic kernels (torch.use_deterministic_algorithms, megatron-core's deterministic embedding "
        "backward): the same run gives the same bits. Not with --cross-entropy-loss-fusion; with NCCL, NCCL_ALGO "
        "must name a deterministic algorithm (Tree, Ring, ...), as in Megatron-LM.")
    attention_dropout: float | None = flag(
        None, "Dropout on the attention probabilities. Default: Megatron-LM's 0.1 for an architecture from its flags "
        "(or a checkpoint of one); 0 with --model-preset or --load of another checkpoint (Llama trains without "
        "dropout).")
    hidden_dropout: float | None = flag(None, "Dropout on the residual branches. Default: as --attention-dropout.")
    make_vocab_size_divisible_by: int = flag(128, "Pad the vocabulary (embedding rows) to a multiple of this x TP.")
    transformer_impl: str | None = flag(
        None, "Layer implementation: megatron-core's own modules or Transformer Engine's. Default: local "
        "(Megatron-LM's is transformer_engine; a GPU launch that relies on it gets a start-up notice): SNIP, the "
        "precision plans and the quantization health numbers are complete on the local layers.",
        choices=("local", "transformer_engine"))
    # Not part of the checkpoint's shape (no weights), so a run may resume with another.
    attention_backend: str = flag(
        "auto", "Core attention. With --transformer-impl local: unfused and local keep megatron-core's "
        "DotProductAttention (materialises the scores); auto, flash and fused use torch's "
        "scaled_dot_product_attention (torch chooses its flash or memory-efficient kernel on GPU). With "
        "transformer_engine: passed to megatron-core's TransformerConfig attention_backend (Transformer Engine "
        "chooses). Not part of a checkpoint's shape.", choices=ATTENTION_BACKENDS)
    recompute_granularity: str | None = flag(None, "Activation recomputation: full layers or the attention core.",
                                             choices=("full", "selective"))
    recompute_method: str | None = flag(None, "With --recompute-granularity full: how layers are chosen.",
                                        choices=("uniform", "block"))
    recompute_num_layers: int | None = flag(None, "With --recompute-granularity full: layers per recomputed group "
                                            "(default 1).")
    # Megatron-LM's kernel switches (no weights: a run may resume with others).
    masked_softmax_fusion: bool = flag(
        True, "Do not fuse scaling, masking and softmax of --attention-backend unfused/local (the fusion needs CUDA "
        "and megatron's compiled softmax kernels; without them it is off anyway).", option="--no-masked-softmax-fusion")
    bias_dropout_fusion: bool = flag(True, "Do not fuse the residual add with dropout (a CUDA fusion; off without "
                                     "CUDA).", option="--no-bias-dropout-fusion")
    apply_rope_fusion: bool = flag(
        True, "Do not fuse rotary embeddings (megatron-core's RoPE fusion: Transformer Engine's kernel where "
        "installed, else megatron-core's own RoPE compiled by torch.compile; a CUDA fusion here, off without "
        "CUDA).", option="--no-rope-fusion")
    bias_swiglu_fusion: bool = flag(
        True, "Do not fuse the SwiGLU activation (megatron-core's bias_swiglu: one compiled kernel forward and one "
        "backward, only its input kept for backward; a CUDA fusion here, off without CUDA, where compiling it "
        "would cost start-up time and change the last bits of CPU runs).", option="--no-bias-swiglu-fusion")
    gradient_accumulation_fusion: bool = flag(
        True, "Do not add the weight gradients of the unquantized (bf16 in the plan) linear layers into the fp32 "
        "gradient buffer inside their GEMM (apex's kernel where installed, else a cuBLAS GEMM with fp32 output "
        "through torch; without it every weight gradient is written in the parameters' dtype, then added in a "
        "second pass). CUDA only: off without CUDA, and off with a start-up warning where this torch cannot "
        "accumulate bf16 products in fp32.",
        option="--no-gradient-accumulation-fusion")
    torch_compile: bool | None = flag(
        None, "Compile every transformer layer with torch.compile into one graph, its linears inside (BF16 "
        "GEMMs traced, quantized ones as one custom operator reading the module's precision when it runs; the "
        "TP/CP collectives as functional ones): megatron-core's per-layer Python runs at compile time and the "
        "code between the GEMMs fuses. A re-plan compiles at most one graph per new pattern of BF16 and quantized "
        "linears in a layer; SNIP's probe passes run the layers eagerly. Default: on where it pays "
        "(model/config.py's COMPILE_BY_DEFAULT: with CUDA; not on a CPU, where the first step's compile costs "
        "more than short runs gain), given --transformer-impl local and no dropout, which it needs; a default "
        "compile that fails falls back to eager. The first step waits for the compile (tens of seconds), "
        "evaluation compiles once more.",
        negatable=True, ours=True)
    torch_compile_backend: str = flag(
        "inductor", "With --torch-compile: inductor (generated kernels) or aot_eager (traced graphs run by "
        "eager kernels: no speed-up, for checking the compiled path on a CPU).", choices=COMPILE_BACKENDS,
        ours=True)
    attention_softmax_in_fp32: bool = flag(
        False, "--attention-backend unfused/local: masking and softmax in fp32 under --bf16 (the fused backends "
        "accumulate in fp32 anyway).")
    cross_entropy_loss_fusion: bool = flag(
        False, "megatron-core's fused vocabulary-parallel cross entropy (its native implementation, which hands the "
        "logits a bf16 gradient, as in Megatron-LM).")
    bf16: bool = flag(False, "Parameters, activations and pipeline messages in bf16 (fp32 masters in the optimizer).")
    # Whether the output layer shares the embedding's weight: resolved by validation, saved in checkpoints.
    share_embeddings_and_output_weights: bool | None = derived()
    # Set only by a loaded checkpoint (an HF import): the padded vocabulary and the Hugging Face files
    # (tokenizer, generation config) the import kept.
    padded_vocab_size: int | None = derived()
    torch_compile_by_default: bool = derived(False)  # --torch-compile was not given and its default turned it on
    hf_files: str | None = derived()

    @property
    def params_dtype(self):
        import torch  # not at the top: --help and flag errors import no torch

        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gated_linear_unit(self) -> bool:
        return True  # SwiGLU (so ``LlamaLinearDims.from_config`` reads this as it reads a TransformerConfig)


@dataclass(frozen=True)
class ParallelConfig:
    """How the processes split the model and the data (TP x PP x CP x DP, Megatron's flags)."""

    tensor_model_parallel_size: int = flag(1, "Tensor-parallel size (TP).")
    pipeline_model_parallel_size: int = flag(1, "Pipeline-parallel size (PP).")
    data_parallel_size: int = derived(1)  # world size / (TP x PP x CP)
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "Uneven pipeline stages: the first stage's layers (the other stages share the rest evenly).")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "Uneven pipeline stages: the last stage's layers (the other stages share the rest evenly).")
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "Interleaved pipeline schedule: layers per virtual stage (model chunk); each pipeline rank holds "
        "num-layers / (PP x this) chunks.")
    # Model chunks per pipeline rank, from either flag; None: not interleaved.
    virtual_pipeline_model_parallel_size: int | None = flag(
        None, "Interleaved pipeline schedule: model chunks (virtual stages) per pipeline rank (instead of "
        "--num-layers-per-virtual-pipeline-stage; needed with uneven stages).",
        option="--num-virtual-stages-per-pipeline-rank", aliases=("--virtual-pipeline-model-parallel-size",))
    overlap_p2p_comm: bool = flag(
        True, "Interleaved schedule: send and receive pipeline messages in batches, waiting for each, instead of "
        "overlapping them with computation (then --pipeline-model-parallel-size must be > 2, as in Megatron-LM). At "
        "PP 2 over gloo they are neither overlapped nor batched (a start-up notice says so).",
        option="--no-overlap-p2p-communication")
    sequence_parallel: bool = flag(False, "Shard the norm/dropout activations along the sequence over TP ranks (off "
                                   "at TP 1, as in Megatron-LM).")
    context_parallel_size: int = flag(
        1, "Context-parallel size (CP): each sequence is cut into 2 x CP chunks and CP rank r computes chunks r and "
        "2 x CP - 1 - r (megatron-core's load balance); attention all-gathers keys and values over the CP group "
        "(docs/parallel.md). --seq-length must be a multiple of 2 x CP.")
    cp_comm_type: tuple[str, ...] | None = flag(
        None, "How CP ranks exchange keys and values (one value, or one per layer, as in Megatron-LM). The SDPA "
        "attention here all-gathers them (all_gather, Llama 3's scheme), the default; Megatron-LM's default p2p "
        "(Transformer Engine's ring attention), a2a and a2a+p2p are accepted with a start-up notice that the "
        "all-gather runs.", choices=CP_COMM_TYPES)
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = flag(
        None, "Megatron-LM's CP sub-group sizes for --cp-comm-type a2a+p2p: accepted when their product is "
        "--context-parallel-size; the all-gather does not use them.")
    use_distributed_optimizer: bool = flag(False, "Shard the optimizer state over data-parallel ranks (and "
                                           "context-parallel ones: megatron-core's DP x CP group).")
    overlap_grad_reduce: bool = flag(False, "Overlap the gradient reduce-scatter/all-reduce with the backward pass.")
    overlap_param_gather: bool = flag(False, "Overlap the parameter all-gather with the forward pass (needs "
                                      "--use-distributed-optimizer and --overlap-grad-reduce).")
    align_grad_reduce: bool = flag(
        True, "With --overlap-grad-reduce: let each chunk's buckets reduce as their gradients are ready, instead of "
        "launching the reductions of every pipeline stage together.", option="--no-align-grad-reduce")
    align_param_gather: bool = flag(
        True, "With --overlap-param-gather and the interleaved schedule: let each chunk's forward pass launch its "
        "own all-gathers instead of launching them together on every pipeline stage.",
        option="--no-align-param-gather")
    ddp_bucket_size: int | None = flag(
        None, "Parameters per gradient bucket with --overlap-grad-reduce. Default: megatron-core's, max(40M, 1M x "
        "data-parallel size); without --overlap-grad-reduce one bucket.")
    ddp_num_buckets: int | None = flag(
        None, "Instead of --ddp-bucket-size: this many buckets (bucket size = this rank's parameters / N).")
    ddp_pad_buckets_for_high_nccl_busbw: bool = flag(
        False, "Pad each bucket to a multiple of 2^16 parameters (NCCL's bus bandwidth at large data-parallel "
        "sizes).")
    ddp_reduce_scatter_with_fp32_accumulation: bool = flag(
        False, "With --use-distributed-optimizer: reduce-scatter the gradients in their own dtype but accumulate "
        "them in fp32 (megatron-core's all-to-all implementation).")
    ddp_average_in_collective: bool = flag(
        False, "Average the gradients inside the collective (ReduceOp.AVG, NCCL only) instead of dividing by the "
        "data-parallel size before summing.")
    grad_reduce_in_bf16: bool = flag(False, "With --bf16: accumulate and reduce gradients in bf16 (default: fp32, as "
                                     "Megatron-LM with --bf16).")
    distributed_backend: str | None = flag(None, "Default: nccl with CUDA, gloo without.", choices=("nccl", "gloo"))
    distributed_timeout_minutes: int = flag(10, "Timeout of collectives, in minutes.")

    @property
    def chunks_per_stage(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def uneven_stages(self) -> bool:
        """Whether --decoder-first/last-pipeline-num-layers give some stages other layer counts."""
        return self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None

    def pipeline_layout(self, num_layers: int) -> PipelineLayout:
        """Where megatron-core places each of the ``num_layers`` layers in this layout (stage, chunk)."""
        from megatron_snip.precision.pipeline_layout import PipelineLayout

        return PipelineLayout(num_layers, self.pipeline_model_parallel_size, self.chunks_per_stage,
                              self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)

"""How this program answers each Megatron-LM option that is not one of its own flags.

Megatron-LM 0.16.1's options are kept as data (:mod:`.megatron_lm_options`). Those with a flag here (a
configuration field, or :class:`~.megatron_lm.MegatronLMFlags`) are implemented with Megatron-LM's meaning.
Every other option is parsed all the same (with its values, so that it can be named) and answered once, by
exactly one rule of this module:

- :data:`ACCEPTED`: what it asks for is what runs here (a deprecated option without effect there too, a
  switch that turns off what does not run here, a setting read only by something this program has not);
  accepted without a word.
- :data:`NOTICED`: accepted with one start-up ``notice:`` line saying what runs instead. Only for options
  that change speed, memory or diagnostics, never what is computed.
- :data:`REFUSED`, and :data:`FAMILIES` for a whole family out of scope: refused, with every other problem of
  the launch, naming the option and what to do instead.

An option given with Megatron-LM's default value, or with a value in :data:`ACCEPTED_VALUES`, asks for nothing
this program lacks and is accepted without a word (``--expert-model-parallel-size 1``, ``--recompute-modules
core_attn``). Light on purpose: ``--help`` imports it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, NamedTuple

from .megatron_lm_options import OPTIONS


class MegatronOption(NamedTuple):
    """One option of Megatron-LM's parser (a row of :data:`.megatron_lm_options.OPTIONS`)."""

    spellings: tuple[str, ...]
    dest: str
    action: str  # store, store_true, store_false, boolean_optional
    nargs: Any  # None: one value; "+", "*", an int; 0 for the switches
    type: str | None  # the name of the function argparse converts each value with
    default: Any
    group: str

    def value(self, spelling: str, values: Any) -> Any:
        """What Megatron-LM's parser stores for ``spelling`` given ``values`` (the strings argparse
        collected), converted as it converts them where the type is int or float (else the strings)."""
        if self.action == "store_true":
            return True
        if self.action == "store_false":
            return False
        if self.action == "boolean_optional":
            return not spelling.startswith("--no-")
        convert = {"int": int, "float": float}.get(self.type, str)
        try:
            return [convert(v) for v in values] if isinstance(values, list) else convert(values)
        except ValueError:
            return values

    def shown(self, value: Any, spelling: str | None = None) -> str:
        """The option as a command line gives ``value`` (``--exit-signal SIGINT``); ``spelling``: the one used
        (default: the one that gives ``value``, a --no- one for False where there is one)."""
        if spelling is None:
            spelling = self.spellings[-1] if self.action == "boolean_optional" and value is False else self.spellings[0]
        if self.nargs == 0:
            return spelling
        return " ".join([spelling, *map(str, value if isinstance(value, list) else [value])])


MEGATRON_LM_OPTIONS = tuple(MegatronOption(*row) for row in OPTIONS)


@dataclass(frozen=True)
class Family:
    """Options refused together: those of Megatron-LM's help ``groups``, or whose dest starts with one of
    ``prefixes``, or is one of ``dests``."""

    name: str
    reason: str
    groups: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    dests: tuple[str, ...] = ()

    def holds(self, option: MegatronOption) -> bool:
        return option.group in self.groups or option.dest.startswith(self.prefixes) or option.dest in self.dests


_LLAMA = "this program builds Llama (SwiGLU, RMSNorm, rotary embeddings on half-split pairs, grouped-query " \
    "attention, no biases)"
_FSDP = "FSDP is not supported (megatron-core DDP only); shard the optimizer state with --use-distributed-optimizer " \
    "instead"

FAMILIES = (
    Family("mixture of experts", "mixture-of-experts layers are not built here (Llama is dense)",
           groups=("moe",), prefixes=("moe_",),
           dests=("expert_model_parallel_size", "expert_tensor_parallel_size", "overlap_moe_expert_parallel_comm",
                  "ep_overlap_early_attn_memory_release", "delay_wgrad_compute")),
    Family("multi-latent attention", "multi-latent attention (DeepSeek's MLA) is not built here; Llama uses "
           "grouped-query attention", groups=("mla",), dests=("multi_latent_attention",)),
    Family("experimental attention variants", "sparse, linear and other experimental attention variants are not "
           "built here", groups=("experimental_attention_variant",), prefixes=("dsa_", "linear_"),
           dests=("experimental_attention_variant",)),
    Family("multi-token prediction", "multi-token prediction layers are not built here", prefixes=("mtp_",)),
    Family("hybrid and Mamba models", "hybrid (Mamba) models are not built here", prefixes=("mamba_",),
           dests=("is_hybrid_model", "use_mamba_mem_eff_path", "hybrid_attention_ratio", "hybrid_mlp_ratio",
                  "hybrid_override_pattern")),
    Family("heterogeneous layers", "heterogeneous layer configurations are not built here (every layer is the "
           "same Llama layer)", groups=("heterogeneous architecture",)),
    Family("other architectures", _LLAMA,
           dests=("apply_residual_connection_post_layernorm", "add_qkv_bias", "fp32_residual_connection",
                  "rotary_interleaved", "qk_layernorm", "qk_l2_norm", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
                  "attention_output_gate", "window_size", "window_attn_skip_freq", "no_rope_freq", "openai_gelu",
                  "squared_relu", "quick_geglu", "activation_func_clamp_value", "glu_linear_offset", "softmax_type",
                  "apply_wd_to_qk_layernorm", "mrope_section", "rotary_seq_len_interpolation_factor", "rope_type",
                  "apply_query_key_layer_scaling", "use_fused_weighted_squared_relu")),
    Family("reinforcement learning", "RL / GRPO training is not supported (pretraining only)", groups=("rl",)),
    Family("inference", "inference and text generation are not part of this program (pretraining only)",
           prefixes=("inference_",),
           dests=("max_tokens_to_oom", "use_legacy_static_engine", "decode_only_cuda_graphs", "flash_decode",
                  "nccl_all_reduce_for_prefill", "disable_chunked_prefill", "mlp_chunks_for_prefill")),
    Family("vision", "vision models (ViT, Swin, DINO, inpainting) are not built here", groups=("vision",)),
    Family("BERT, T5 and retrieval", "BERT, T5 and retrieval (ICT, biencoder) models are not built here (Llama "
           "decoders only)", groups=("biencoder",),
           dests=("bert_binary_head", "encoder_num_layers", "decoder_num_layers", "decoder_seq_length",
                  "relative_attention_num_buckets", "relative_attention_max_distance", "mask_prob", "short_seq_prob",
                  "vocab_extra_ids", "output_bert_embeddings", "bert_embedder_type", "sample_rate")),
    Family("fill-in-the-middle data", "fill-in-the-middle (FIM) datasets are not built here; GPT documents only",
           prefixes=("fim_",)),
    Family("supervised fine-tuning", "supervised fine-tuning data is not supported (pretraining only)",
           groups=("sft",)),
    Family("FSDP", _FSDP,
           dests=("use_torch_fsdp2", "use_megatron_fsdp", "data_parallel_sharding_strategy",
                  "outer_dp_sharding_strategy", "fsdp_double_buffer", "suggested_communication_unit_size",
                  "keep_fp8_transpose_cache", "enable_full_sharding_in_hsdp", "torch_fsdp2_reshard_after_forward",
                  "fsdp_manual_registration", "gradient_reduce_div_fusion", "nccl_ub",
                  "disable_symmetric_registration", "init_model_with_meta_device")),
    Family("dynamic context parallelism", "context parallelism here cuts every sequence into 2 x CP equal chunks "
           "(--context-parallel-size); sequence packing with a per-rank length limit and the hybrid (per-batch) "
           "layout are not supported",
           dests=("max_seqlen_per_dp_cp_rank", "hybrid_context_parallel")),
    Family("tensor-parallel communication overlap", "Transformer Engine's userbuffer overlap of tensor-parallel "
           "communication is not used here",
           dests=("tp_comm_overlap", "tp_comm_overlap_rs_dgrad", "tp_comm_overlap_cfg", "tp_comm_bootstrap_backend")),
    Family("CUDA graphs", "CUDA graphs are not captured here",
           dests=("enable_cuda_graph", "cuda_graph_warmup_steps", "external_cuda_graph", "cuda_graph_impl",
                  "cuda_graph_scope")),
    Family("offloading", "activation and optimizer offloading to the CPU are not supported",
           dests=("cpu_offloading_num_layers", "fine_grained_activation_offloading", "offload_modules",
                  "min_offloaded_tensor_size", "optimizer_cpu_offload", "optimizer_offload_fraction",
                  "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d")),
    Family("non-persistent checkpoints", "non-persistent (local) checkpoints and their replication are not "
           "supported; every checkpoint goes to --save", prefixes=("non_persistent_",),
           dests=("replication", "replication_jump", "replication_factor")),
    Family("Muon optimizer", "the Muon optimizer is not supported (--optimizer adam or sgd)", prefixes=("muon_",)),
    Family("custom quantizers", "NVIDIA Kitchen and custom quantizer factories are not used; this program's own "
           "quantizers run the recipes (docs/numerics.md)",
           dests=("use_kitchen_attention", "kitchen_attention_backend", "fp8_quantizer_factory",
                  "fp4_quantizer_factory")),
    Family("resiliency packages", "NVIDIA's resiliency packages (in-process restart, fault tolerance, the rerun "
           "state machine's reruns) are not integrated; faults are handled as docs/faults.md describes",
           groups=("In-process restart", "ft_package"),
           dests=("error_injection_rate", "error_injection_type", "result_rejected_tracker_filename",
                  "adlr_autoresume", "adlr_autoresume_interval")),
)

_DIAGNOSTICS = "is not produced here; the run is otherwise the same"
_FP16_ONLY = "fp16's dynamic loss scaler: --fp16 is refused and bf16 and fp32 train without loss scaling, so it " \
    "does nothing here"
_TELEMETRY = "NVIDIA's telemetry is not collected here"
# What it asks for is what runs here (dest -> why; docs/megatron_compat.md lists them).
ACCEPTED = {
    "deprecated_use_mcore_models": "deprecated in Megatron-LM: megatron-core models are the only ones, there and here",
    "use_flash_attn": "Megatron-LM parses and ignores it; --attention-backend chooses the kernel",
    "ckpt_fully_parallel_save_deprecated": "deprecated in Megatron-LM, without effect there and here: saves are "
                                           "spread over data-parallel ranks unless --no-ckpt-fully-parallel-save",
    "tiktoken_pattern": "read only by TikTokenizer (refused)",
    "tiktoken_num_special_tokens": "read only by TikTokenizer (refused)",
    "tiktoken_special_tokens": "read only by TikTokenizer (refused)",
    "vocab_file": "read only by GPT2BPETokenizer and the BERT tokenizers (refused)",
    "merge_file": "read only by GPT2BPETokenizer (refused)",
    "legacy_tokenizer": "each tokenizer type read here has one implementation (its ids: Data and tokenizers, above)",
    "tokenizer_hf_use_fast": "the HuggingFaceTokenizer here is the tokenizers library's fast tokenizer",
    "trust_remote_code": "a tokenizer.json runs no code",
    "use_tokenizer_model_from_checkpoint_args": "the tokenizer always comes from --tokenizer-model here",
    "async_tensor_model_parallel_allreduce": "deprecated in megatron-core, which ignores it",
    "no_persist_layer_norm": "the persistent kernel is apex's LayerNorm's; the RMSNorm here never uses it",
    "bias_gelu_fusion": "there is no GELU to fuse (SwiGLU)",
    "fp8_interval": "deprecated in Megatron-LM, which ignores it",
    "onnx_safe": "only for ONNX export, which this program does not do",
    "scatter_gather_tensors_in_pipeline": "megatron-core 0.16.1 no longer reads it",
    "exit_signal_handler_for_dataloader": "the training loop's handler stops every rank; the data loader needs none",
    "enable_experimental": "there are no experimental features to enable here",
    "enable_msc": "the multi-storage client is not used here (local files only)",
    "enable_one_logger": "NVIDIA's telemetry is not collected here",
    "strict_fsdp_dtensor_load": "only the fsdp_dtensor checkpoint format reads it (refused)",
    # switches that turn off a part of something that does not run here
    "tp_comm_bulk_wgrad": "a part of tensor-parallel communication overlap, which does not run here",
    "tp_comm_bulk_dgrad": "a part of tensor-parallel communication overlap, which does not run here",
    "tp_comm_overlap_ag": "a part of tensor-parallel communication overlap, which does not run here",
    "tp_comm_overlap_rs": "a part of tensor-parallel communication overlap, which does not run here",
    "tp_comm_split_ag": "a part of tensor-parallel communication overlap, which does not run here",
    "tp_comm_split_rs": "a part of tensor-parallel communication overlap, which does not run here",
    "barrier_with_L1_time": "the timers here take no barrier (each rank times its own work)",
    "pin_cpu_grads": "only with optimizer offloading (refused)",
    "pin_cpu_params": "only with optimizer offloading (refused)",
}

# Accepted with a start-up line (dest -> what runs here instead). Speed, memory and diagnostics only.
NOTICED = {
    "async_save": "checkpoints are saved synchronously here (written to iter_N.tmp and renamed once every rank has "
                  "finished): the same checkpoints, training waits for each save",
    "use_persistent_ckpt_worker": "checkpoints are saved synchronously here, without a background worker",
    "fp8_param_gather": "parameters stay in their own dtype here and each FP8 GEMM quantizes its weight, the values "
                        "an FP8 parameter would hold; the memory and all-gather savings need Transformer Engine's FP8 "
                        "parameters, which this program does not use",
    "fp4_param": "parameters stay in their own dtype here and each FP4 GEMM quantizes its weight; the memory and "
                 "all-gather savings need Transformer Engine's FP4 parameters, which this program does not use",
    "reuse_grad_buf_for_mxfp8_param_ag": "only with Transformer Engine's FP8 parameters, which this program does "
                                         "not use",
    "use_dist_ckpt_deprecated": "deprecated in Megatron-LM and without effect there and here; --ckpt-format "
                                "selects the format (torch_dist)",
    "dist_ckpt_format_deprecated": "deprecated in Megatron-LM and without effect there and here; --ckpt-format "
                                   "selects the format (torch_dist)",
    "auto_detect_ckpt_format": "only torch_dist checkpoints are read here; another format in --load is refused",
    "ckpt_assume_constant_structure": "each save plans its shards anew (the same files, a little slower)",
    "initial_loss_scale": _FP16_ONLY,
    "min_loss_scale": _FP16_ONLY,
    "loss_scale_window": _FP16_ONLY,
    "hysteresis": _FP16_ONLY,
    "fp16_lm_cross_entropy": "only with --fp16, which is refused: the cross entropy runs in fp32",
    "perform_initialization": "weights are initialised anyway (a little start-up time); with --load the "
                              "checkpoint's replace them",
    "clone_scatter_output_in_embedding": "the embedding's output is cloned under --sequence-parallel as megatron-core "
                                         "does by default (a little memory)",
    "te_rng_tracker": "megatron-core's own RNG tracker draws the dropout masks (the same distribution, other masks "
                      "than Transformer Engine's tracker)",
    "use_te_activation_func": "megatron-core's SwiGLU runs (the same values); Transformer Engine's activation "
                              "modules are not used",
    "high_priority_stream_groups": "collectives run on torch's default streams",
    "symmetric_ar_type": "all-reduces use torch.distributed's default algorithm",
    "disable_jit_fuser": "the fused kernels here are switched by --no-bias-swiglu-fusion and --no-rope-fusion; "
                         "pass those for the unfused path",
    "train_sync_interval": "the host waits for the GPU where the training loop needs a value (loss, grad norm)",
    "overlap_param_gather_with_optimizer_step": "the parameter all-gather overlaps the next forward pass "
                                                "(--overlap-param-gather), not the optimizer step",
    "distributed_timeout_seconds_after_init": "collectives keep --distributed-timeout-minutes",
    "enable_gloo_process_groups": "megatron-core's gloo groups are created anyway (a little host memory)",
    "use_sharp": "NCCL's SHARP in-network reductions are not requested here",
    "sharp_enabled_group": "NCCL's SHARP in-network reductions are not requested here",
    "create_all_gather_group": "all-gathers share the data-parallel group",
    "nccl_communicator_config_path": "communicators keep NCCL's default configuration",
    "num_dataset_builder_threads": "the datasets are built in one thread",
    "per_dataset_sequences_path": "each dataset's sequence count is read from its index",
    "dataloader_fast_cache_load": "the dataset index caches are read the standard way",
    "dataloader_defer_npy_index_mmap": "the dataset index caches are memory-mapped at start-up",
    "record_memory_history": f"a CUDA memory history {_DIAGNOSTICS}",
    "memory_snapshot_path": f"a CUDA memory snapshot {_DIAGNOSTICS}",
    "save_wgrads_interval": f"a dump of the weight gradients {_DIAGNOSTICS}",
    "save_dgrads_interval": f"a dump of the activation gradients {_DIAGNOSTICS}",
    "dump_param_to_param_group_map": f"the parameter-group map {_DIAGNOSTICS}",
    "check_weight_hash_across_dp_replicas_interval": f"a weight-hash check across data-parallel replicas "
                                                     f"{_DIAGNOSTICS}",
    "config_logger_dir": f"a log of the modules' configurations {_DIAGNOSTICS}",
    "log_progress": f"progress.txt {_DIAGNOSTICS} (see the exit record, docs/faults.md)",
    "timing_log_option": "timers are printed as (min, max) over ranks (Megatron-LM's default minmax)",
    "log_memory_interval": f"a periodic memory line {_DIAGNOSTICS} (--log-memory-to-tensorboard writes memory "
                           f"scalars)",
    "log_device_memory_used": f"the device memory used {_DIAGNOSTICS}",
    "log_max_attention_logit": f"the largest attention logit {_DIAGNOSTICS}",
    "log_energy": f"the energy used {_DIAGNOSTICS}",
    "logging_level": "Python logging keeps its level (warnings and errors)",
    "log_straggler": f"straggler detection {_DIAGNOSTICS}",
    "straggler_ctrlr_port": f"straggler detection {_DIAGNOSTICS}",
    "straggler_minmax_count": f"straggler detection {_DIAGNOSTICS}",
    "disable_straggler_on_startup": f"straggler detection {_DIAGNOSTICS}",
    "run_workload_inspector_server": f"the workload inspector server {_DIAGNOSTICS}",
    "one_logger_project": _TELEMETRY,
    "one_logger_run_name": _TELEMETRY,
    "one_logger_async": _TELEMETRY,
    "app_tag_run_name": _TELEMETRY,
    "app_tag_run_version": _TELEMETRY,
    "rerun_mode": "megatron-core's rerun state machine does not run here: a non-finite loss or gradient is handled "
                  "by --non-finite-grad-policy and a spike reported by --check-for-spiky-loss (docs/faults.md)",
}

# Refused (dest -> why, and what to do instead).
REFUSED = {
    "fp16": "fp16 training needs loss scaling, which this program does not set up; use --bf16",
    "fp8_wgrad": "a plan gives each module one precision for both backward GEMMs (dgrad and wgrad); keep the "
                 "backward out of fp8 with --precision-schedule bwd=bf16@1, or drop the flag",
    "loss_scale": "a constant loss scale is not applied here (bf16 and fp32 train without loss scaling); drop it",
    "use_precision_aware_optimizer": "megatron-core runs it only with Transformer Engine's FusedAdam, which this "
                                     "program's optimizer (torch's Adam through megatron-core) and its checkpoints do "
                                     "not use; the optimizer state stays fp32",
    "main_grads_dtype": "other than fp32 only with --use-precision-aware-optimizer (refused): main gradients stay fp32",
    "main_params_dtype": "other than fp32 only with --use-precision-aware-optimizer (refused): main parameters stay "
                         "fp32",
    "exp_avg_dtype": "other than fp32 only with --use-precision-aware-optimizer (refused): Adam's moments stay fp32",
    "exp_avg_sq_dtype": "other than fp32 only with --use-precision-aware-optimizer (refused): Adam's moments stay fp32",
    "no_weight_decay_cond_type": "weight decay skips the 1-D parameters (the norms) and nothing else here "
                                 "(megatron-core's default condition)",
    "pipeline_model_parallel_comm_backend": "pipeline messages go through --distributed-backend",
    "pipeline_model_parallel_layout": "give uneven stages with --decoder-first-pipeline-num-layers and "
                                      "--decoder-last-pipeline-num-layers",
    "account_for_embedding_in_pipeline_split": "give uneven stages with --decoder-first-pipeline-num-layers and "
                                               "--decoder-last-pipeline-num-layers",
    "account_for_loss_in_pipeline_split": "give uneven stages with --decoder-first-pipeline-num-layers and "
                                          "--decoder-last-pipeline-num-layers",
    "microbatch_group_size_per_vp_stage": "the interleaved schedule runs micro-batches in groups of "
                                          "--pipeline-model-parallel-size here (megatron-core's default)",
    "overlap_p2p_comm_warmup_flush": "not supported here; drop it",
    "use_ring_exchange_p2p": "pipeline messages go through torch.distributed's send/recv here",
    "defer_embedding_wgrad_compute": "not supported here; drop it",
    "wgrad_deferral_limit": "only with --defer-embedding-wgrad-compute (refused)",
    "distribute_saved_activations": "not supported here; drop it (full recompute keeps each layer's input on every "
                                    "tensor-parallel rank)",
    "recompute_modules": "selective recompute recomputes the attention core (core_attn) here; drop it or pass "
                         "core_attn",
    "cross_entropy_fusion_impl": "the fused cross entropy is megatron-core's native one here "
                                 "(--cross-entropy-fusion-impl native)",
    "batch_invariant_mode": "batch-invariant kernels are not used here",
    "disable_bf16_reduced_precision_matmul": "bf16 GEMMs keep torch's default (reduced-precision reductions "
                                             "allowed); not supported",
    "data_parallel_random_init": "every data-parallel replica starts from the same weights here (Megatron-LM's "
                                 "default)",
    "init_method_xavier_uniform": "weights are initialised from normal(0, --init-method-std) here (Megatron-LM's "
                                  "default)",
    "use_legacy_models": "Megatron-LM's legacy models are gone; megatron-core models only",
    "rampup_batch_size": "batch-size ramp-up is not supported: --global-batch-size stays fixed",
    "decrease_batch_size_if_needed": "the global batch is never decreased here: give --global-batch-size a multiple "
                                     "of --micro-batch-size x the data-parallel size",
    "iterations_to_skip": "skipping iterations is not supported",
    "batch_size": "Megatron-LM's old flag: use --micro-batch-size",
    "checkpoint_activations": "no longer valid in Megatron-LM: use --recompute-activations, or "
                              "--recompute-granularity and --recompute-method",
    "model_parallel_size": "no longer valid in Megatron-LM: use --tensor-model-parallel-size",
    "warmup": "Megatron-LM's old flag: use --lr-warmup-iters or --lr-warmup-fraction",
    "load_main_params_from_ckpt": "a load without the optimizer state rebuilds the fp32 main parameters from the "
                                  "model's weights here (Megatron-LM's default); drop it",
    "ckpt_step": "--load loads the iteration its tracker file names (--ckpt-fallback: the newest intact one)",
    "dist_ckpt_strictness": "the checkpoint must hold every tensor the model has (checked before loading, naming "
                            "what differs)",
    "dist_ckpt_save_pre_mcore_014": "checkpoints are written in megatron-core 0.16.1's format",
    "distrib_optim_fully_reshardable_mem_efficient": "--dist-ckpt-optim-fully-reshardable saves with "
                                                     "megatron-core's default gathering here; drop it",
    "ckpt_convert_format": "checkpoint conversion: only torch_dist exists here",
    "ckpt_convert_save": "checkpoint conversion: only torch_dist exists here",
    "ckpt_convert_update_legacy_dist_opt_format": "checkpoint conversion: only torch_dist exists here",
    "use_mp_args_from_checkpoint_args": "the parallel layout comes from the launch; checkpoints reshard to it",
    "padded_vocab_size": "the embedding rows are --vocab-size padded to a multiple of --make-vocab-size-divisible-by "
                         "x TP (or a checkpoint's)",
    "tokenizer_metadata": "not read here: give --tokenizer-type and --tokenizer-model",
    "tokenizer_special_tokens": "special tokens are the tokenizer file's own here",
    "tokenizer_sentencepiece_legacy": "SentencePiece files are read with Megatron-LM's default behaviour here",
    "tokenizer_hf_include_special_tokens": "special tokens are not added to the text here",
    "lazy_mpu_init": "for external code that initializes the process groups; not supported",
    "num_distributed_optimizer_instances": "one distributed-optimizer instance over the whole data-parallel group",
    "use_tp_pp_dp_mapping": "ranks are ordered as megatron-core's default (tp-cp-ep-dp-pp)",
    "fake_process_group": "real process groups only",
    "test_mode": "not supported",
    "full_validation": "validation runs --eval-iters batches",
    "multiple_validation_sets": "one validation set",
    "phase_transition_iterations": "multi-phase data schedules are not supported",
    "object_storage_cache_path": "data is read from local files only",
    "mid_level_dataset_surplus": "the blend's surplus stays megatron-core's default",
    "allow_ambiguous_pad_tokens": "not supported",
    "spec": "the layer spec is Llama's, local or Transformer Engine's (--transformer-impl)",
    "exit_signal": "this program stops on SIGTERM or SIGUSR1 (its handler is always on); send one of those",
}

# Values of a refused or noticed option, besides Megatron-LM's default, that ask for what runs here.
ACCEPTED_VALUES = {
    "recompute_modules": (["core_attn"],),
    "cross_entropy_fusion_impl": ("native",),
    "rope_type": ("rope",),
    "timing_log_option": ("minmax",),
    "rerun_mode": ("disabled",),
    "main_grads_dtype": ("fp32",),
    "main_params_dtype": ("fp32",),
    "exp_avg_dtype": ("fp32",),
    "exp_avg_sq_dtype": ("fp32",),
    "exit_signal": ("SIGTERM", "SIGUSR1"),
}


def family_of(option: MegatronOption) -> Family | None:
    """The first family that holds ``option`` (tests check that at most one does)."""
    return next((f for f in FAMILIES if f.holds(option)), None)


def answer(option: MegatronOption, shown: str, value: Any) -> tuple[str, str]:
    """How ``option``, given as ``shown`` with ``value``, is answered: ("accepted", ""), ("notice", line) or
    ("refused", line). KeyError for an option no rule answers (tests check there is none)."""
    default = list(option.default) if isinstance(option.default, tuple) else option.default
    if option.dest in ACCEPTED or value == default or value in ACCEPTED_VALUES.get(option.dest, ()):
        return "accepted", ""
    if option.dest in NOTICED:
        return "notice", f"{shown}: {NOTICED[option.dest]}"
    if option.dest in REFUSED:
        return "refused", f"{shown}: {REFUSED[option.dest]}"
    family = family_of(option)
    if family is None:
        raise KeyError(option.dest)
    return "refused", f"{shown}: {family.reason}; drop Megatron-LM's {family.name} flags"


GIVEN = "megatron_lm_given"  # the namespace key of the options given: {dest: (option, as given, value)}


class Given(argparse.Action):
    """Records a Megatron-LM option answered by this module (with its values) under :data:`GIVEN`."""

    def __init__(self, option_strings, dest, option: MegatronOption, **kwargs):
        super().__init__(option_strings, GIVEN, **kwargs)
        self.option = option

    def __call__(self, parser, namespace, values, option_string=None):
        given = dict(getattr(namespace, GIVEN) or {})
        given[self.option.dest] = (self.option, self.option.shown(values, option_string),
                                   self.option.value(option_string, values))
        setattr(namespace, GIVEN, given)


def add_megatron_lm_options(parser: argparse.ArgumentParser) -> None:
    """Parse every Megatron-LM option that ``parser`` does not define (hidden from ``--help``)."""
    ours = set(parser._option_string_actions)
    for option in MEGATRON_LM_OPTIONS:
        spellings = [s for s in option.spellings if s not in ours]
        if not spellings:
            continue
        nargs = {0: 0, None: None}.get(option.nargs, option.nargs)
        metavar = None if nargs == 0 else "VALUE"
        parser.add_argument(*spellings, action=Given, option=option, nargs=nargs, default=None, metavar=metavar,
                            help=argparse.SUPPRESS)

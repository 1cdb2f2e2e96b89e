"""Megatron-LM's checkpoint fields, read and written: ``common.pt`` and the RNG state's layout.

A checkpoint here is Megatron-LM 0.16.1's torch_dist checkpoint (``megatron/training/checkpointing.py``:
``save_checkpoint``, ``generate_state_dict``, ``load_checkpoint``). Its ``common.pt`` holds

- ``args``: Megatron-LM's argparse Namespace, under Megatron-LM's names (:func:`namespace`);
  ``load_checkpoint`` reads the parallel sizes, ``no_save_optim`` / ``no_save_rng`` and the consumed
  sample counts from it, ``check_checkpoint_args`` the shape, ``--use-checkpoint-args`` the rest;
- ``checkpoint_version`` 3.0, ``iteration``, ``num_floating_point_operations_so_far``;
- ``opt_param_scheduler``: megatron-core's scheduler state, stepped by the samples of each iteration;
- ``content_metadata`` (stored by ``dist_checkpointing.save``): how the optimizer state is sharded
  (:func:`content_metadata`), which the loader must pass back to ``sharded_state_dict``;
- this program's record under its own key (``checkpoint_record.RECORD_KEY``), which Megatron-LM ignores.

Sharded beside the tensors: ``rng_state`` as Megatron-LM writes it, one list ``[{random_rng_state, ...}]``
per (pp, tp) rank, replicated over the data-parallel (with context-parallel) ranks (:func:`rng_object`),
and this program's quantization state (stochastic-rounding streams, delayed-scaling histories) as an
object of its own, per (pp, tp, dp-cp) rank (:func:`quantization_object`).

A checkpoint Megatron-LM wrote has no record of ours: :func:`read_common` translates its ``args`` into
this program's flags (the shape and its meaning: tying, the padded vocabulary, NullTokenizer's size,
rotary settings), refusing in one message per field what this program cannot build (:class:`CannotLoad`).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping
from typing import Any

from megatron_snip.training.checkpoint_record import (
    RECORD_KEY,
    SAVED_BY_MEGATRON_LM,
    VERSION_KEY,
    CheckpointRecord,
)

CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version since its torch_dist format
RNG_KEY = "rng_state"
QUANTIZATION_KEY = "megatron_snip_quantization_state"
FLOPS_KEY = "num_floating_point_operations_so_far"
SCHEDULER_KEY = "opt_param_scheduler"

# This program's flag -> Megatron-LM's args field, where the names differ.
_RENAMED = {"norm_epsilon": "layernorm_epsilon", "apply_layernorm_1p": "layernorm_zero_centered_gamma",
            "fp8_format": "fp8", "fp4_format": "fp4"}
# ... and where the field says the opposite.
_NEGATED = {"disable_bias_linear": "add_bias_linear",
            "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights"}
# Megatron-LM's fields for what every model here is (a Llama), as its readers expect them.
_LLAMA = {"add_bias_linear": False, "add_qkv_bias": False, "swiglu": True, "squared_relu": False,
          "normalization": "RMSNorm", "position_embedding_type": "rope", "add_position_embedding": True,
          "use_rotary_position_embeddings": False, "rotary_percent": 1.0, "rotary_interleaved": False,
          "rotary_seq_len_interpolation_factor": None, "apply_query_key_layer_scaling": False,
          "apply_residual_connection_post_layernorm": False, "qk_layernorm": False, "num_experts": None,
          "multi_latent_attention": False, "is_hybrid_model": False, "mtp_num_layers": None, "fp16": False,
          "ckpt_format": "torch_dist", "use_dist_ckpt": True, "data_parallel_random_init": False,
          "phase_transition_iterations": None, "vocab_file": None, "merge_file": None}

# Megatron-LM's fields a checkpoint of it gives this program's flags (the same names), where set.
_TAKEN = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
          "max_position_embeddings", "rotary_base", "use_rope_scaling", "rope_scaling_factor", "vocab_size",
          "padded_vocab_size", "make_vocab_size_divisible_by", "tokenizer_type", "tokenizer_model", "swiglu",
          "normalization", "position_embedding_type", "group_query_attention", "untie_embeddings_and_output_weights",
          "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "bf16",
          "use_distributed_optimizer", "global_batch_size", "micro_batch_size")

# Megatron-LM checkpoint fields whose value this program cannot build, and what such a model is.
_CANNOT_BUILD = (
    ("swiglu", lambda v: v is not True, "a GELU MLP (Llama's is SwiGLU)"),
    ("add_bias_linear", lambda v: v is True, "biases in the linear layers (Llama has none)"),
    ("add_qkv_bias", lambda v: v is True, "biases in the query/key/value projection"),
    ("normalization", lambda v: v not in (None, "RMSNorm"), "a norm other than RMSNorm"),
    ("position_embedding_type", lambda v: v not in (None, "rope"), "position embeddings other than rotary"),
    ("rotary_percent", lambda v: v not in (None, 1.0), "rotary embeddings on part of each head"),
    ("rotary_interleaved", lambda v: v is True, "interleaved rotary embeddings"),
    ("rotary_seq_len_interpolation_factor", lambda v: v is not None, "interpolated rotary positions"),
    ("num_experts", lambda v: v is not None, "a mixture of experts"),
    ("multi_latent_attention", lambda v: v is True, "multi-latent attention"),
    ("qk_layernorm", lambda v: v is True, "query/key norms"),
    ("squared_relu", lambda v: v is True, "a squared-ReLU MLP"),
    ("apply_residual_connection_post_layernorm", lambda v: v is True, "residual connections after the norm"),
    ("is_hybrid_model", lambda v: v is True, "a hybrid (Mamba) model"),
    ("mtp_num_layers", lambda v: v is not None, "multi-token prediction layers"),
    ("window_size", lambda v: v is not None, "sliding-window attention"),
)


class CannotLoad(ValueError):
    """A Megatron-LM checkpoint this program cannot resume: one line per field (``problems``)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def content_metadata(distributed_optimizer: bool, fully_reshardable: bool = False) -> dict[str, Any]:
    """What Megatron-LM 0.16.1 passes to ``sharded_state_dict`` and stores as the checkpoint's content metadata
    (``_build_sharded_state_dict_metadata`` without its process group): the distributed optimizer's format
    (``dp_reshardable``, or ``fully_reshardable`` with --dist-ckpt-optim-fully-reshardable) and the key layout."""
    out: dict[str, Any] = {}
    if distributed_optimizer:
        out["distrib_optim_sharding_type"] = "fully_reshardable" if fully_reshardable else "dp_reshardable"
        if fully_reshardable:
            out["distrib_optim_fully_reshardable_mem_efficient"] = False
    return {**out, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


# -- writing ----------------------------------------------------------------------------------------------

def common_state(record: CheckpointRecord) -> dict[str, Any]:
    """The non-sharded entries of a checkpoint's ``common.pt`` for ``record`` (the content metadata aside,
    which ``dist_checkpointing.save`` stores): Megatron-LM's fields and this program's record."""
    common = {"args": namespace(record), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": record.iteration, FLOPS_KEY: float(record.floating_point_operations),
              RECORD_KEY: record.stored()}
    if record.scheduler is not None:
        common[SCHEDULER_KEY] = dict(record.scheduler)
    return common


def namespace(record: CheckpointRecord) -> argparse.Namespace:
    """Megatron-LM's ``args`` for ``record``: the run's Megatron-LM flags under Megatron-LM's names (this
    program's own flags stay in its record), what a Llama is in Megatron-LM's fields, the parallel sizes and
    the training position. Only plain values, torch dtypes and megatron-core enums: Megatron-LM unpickles it
    without this program."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    values = dict(_LLAMA)
    megatron_named = _megatron_named()
    for key, value in record.args.items():
        if key not in megatron_named:
            continue
        if key in _NEGATED:
            values[_NEGATED[key]] = None if value is None else not value
        else:
            values[_RENAMED.get(key, key)] = list(value) if isinstance(value, tuple) else value
    lay = record.layout
    tp, pp, dp, cp = (int(lay.get(k, 1)) for k in ("tp", "pp", "dp", "cp"))
    args = record.args
    heads = args.get("num_attention_heads")
    values.update({
        "kv_channels": args["hidden_size"] // heads if heads else None,
        "group_query_attention": bool(args.get("num_query_groups") not in (None, heads)),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": dp,
        "context_parallel_size": cp, "world_size": tp * pp * dp * cp,
        "virtual_pipeline_model_parallel_size": lay.get("vpp"),
        "transformer_pipeline_model_parallel_size": pp,
        "encoder_num_layers": args.get("num_layers"), "encoder_seq_length": args.get("seq_length"),
        "consumed_train_samples": record.consumed_samples, "consumed_valid_samples": record.consumed_valid_samples,
        "skipped_train_samples": record.skipped_train_samples,
        "no_save_optim": bool(record.no_optimizer_state or record.model_only),
        "no_save_rng": bool(record.no_rng_state or record.model_only),
        "params_dtype": torch.bfloat16 if args.get("bf16") else torch.float32,
    })
    backend = values.get("attention_backend")
    if isinstance(backend, str) and backend in AttnBackend.__members__:
        values["attention_backend"] = AttnBackend[backend]
    return argparse.Namespace(**values)


# Fields of the run's configuration that are no flags but Megatron-LM's args hold too.
_MEGATRON_DERIVED = ("data_parallel_size", "padded_vocab_size", "share_embeddings_and_output_weights")


def _megatron_named() -> frozenset[str]:
    """The keys of a record's args that are Megatron-LM's (its flags, by this program's name): every flag of
    the run's configuration but this program's own, and the derived fields Megatron-LM's args hold too."""
    import dataclasses

    from megatron_snip.flags import dest_of, is_flag
    from megatron_snip.training.config import SECTIONS

    return frozenset(dest_of(f) if is_flag(f) else f.name for section in SECTIONS.values()
                     for f in dataclasses.fields(section)
                     if (is_flag(f) and not f.metadata.get("ours")) or f.name in _MEGATRON_DERIVED)


# -- reading ----------------------------------------------------------------------------------------------

def read_common(common: Mapping[str, Any], source: str) -> CheckpointRecord:
    """The record of a checkpoint from its ``common.pt`` (``source``: its path, for messages): this program's
    (any version), or a Megatron-LM checkpoint's translated. ValueError for a common state that is neither;
    :class:`CannotLoad` for a Megatron-LM model this program cannot build."""
    if RECORD_KEY in common:
        return CheckpointRecord.from_stored(common[RECORD_KEY], _megatron_fields(common), source)
    args = common.get("args")
    if VERSION_KEY in common or isinstance(args, Mapping) or (args is None and "iteration" in common):
        return CheckpointRecord.from_legacy(common, source)
    if isinstance(args, argparse.Namespace):
        return _from_megatron_lm(common, args, source)
    raise ValueError(f"{source}: neither a Megatron-LM nor a megatron-snip checkpoint (its common state holds "
                     f"{', '.join(sorted(map(str, common))[:8]) or 'nothing'})")


def _megatron_fields(common: Mapping[str, Any]) -> dict[str, Any]:
    """The record's fields Megatron-LM keeps in its own places of ``common``."""
    args = common.get("args")
    iteration = common.get("iteration", common.get("total_iters"))
    if iteration is None:
        raise ValueError("its common state has no iteration")
    counted = {name: int(getattr(args, name, 0) or 0)
               for name in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")}
    scheduler = common.get(SCHEDULER_KEY, common.get("lr_scheduler"))  # lr_scheduler: Megatron-LM's older name
    return {"iteration": int(iteration), "consumed_samples": counted["consumed_train_samples"],
            "consumed_valid_samples": counted["consumed_valid_samples"],
            "skipped_train_samples": counted["skipped_train_samples"],
            "floating_point_operations": float(common.get(FLOPS_KEY, 0) or 0), "scheduler": scheduler,
            "content_metadata": common.get("content_metadata")}


def _from_megatron_lm(common: Mapping[str, Any], ns: argparse.Namespace, source: str) -> CheckpointRecord:
    """The record of a checkpoint Megatron-LM wrote: its args as this program's flags, its counters as
    Megatron-LM's load_checkpoint reads them."""
    problems = [f"{source} is a Megatron-LM checkpoint of {what} ({field} {getattr(ns, field)!r} in its args), "
                f"which this program cannot build; it cannot be loaded here"
                for field, cannot, what in _CANNOT_BUILD if cannot(getattr(ns, field, None))]
    heads = getattr(ns, "num_attention_heads", None)
    kv = getattr(ns, "kv_channels", None)
    if kv is not None and heads and kv * heads != getattr(ns, "hidden_size", None):
        problems.append(f"{source} is a Megatron-LM checkpoint with kv_channels {kv} x num_attention_heads {heads} "
                        f"!= hidden_size {ns.hidden_size} in its args, which this program cannot build; it cannot "
                        f"be loaded here")
    if problems:
        raise CannotLoad(problems)
    fields = _megatron_fields(common)
    args = {key: getattr(ns, key) for key in _TAKEN if getattr(ns, key, None) is not None}
    args["norm_epsilon"] = getattr(ns, "layernorm_epsilon", getattr(ns, "norm_epsilon", 1e-5))
    args["apply_layernorm_1p"] = bool(getattr(ns, "layernorm_zero_centered_gamma",
                                              getattr(ns, "apply_layernorm_1p", False)))
    args["disable_bias_linear"] = True
    args["share_embeddings_and_output_weights"] = not getattr(ns, "untie_embeddings_and_output_weights", False)
    args["num_query_groups"] = ns.num_query_groups if getattr(ns, "group_query_attention", False) else heads
    if fields["consumed_samples"] == 0 and fields["iteration"] > 0 and getattr(ns, "train_samples", None) is None:
        # Megatron-LM's rule for checkpoints older than the counter (build_train_valid_test_data_loaders).
        fields["consumed_samples"] = fields["iteration"] * int(getattr(ns, "global_batch_size", 0) or 0)
    if fields["content_metadata"] is None and getattr(ns, "use_distributed_optimizer", False):
        # Saved by megatron-core < 0.13, which stored no content metadata: Megatron-LM's assumption.
        fields["content_metadata"] = {"distrib_optim_sharding_type": (
            "fully_sharded_model_space" if getattr(ns, "ckpt_fully_parallel_save", False)
            else "dp_zero_gather_scatter")}
    layout = {"tp": int(getattr(ns, "tensor_model_parallel_size", 1) or 1),
              "pp": int(getattr(ns, "pipeline_model_parallel_size", 1) or 1),
              "dp": int(getattr(ns, "data_parallel_size", 1) or 1),
              "cp": int(getattr(ns, "context_parallel_size", 1) or 1)}
    if getattr(ns, "virtual_pipeline_model_parallel_size", None):
        layout["vpp"] = int(ns.virtual_pipeline_model_parallel_size)
    dropped = []
    if common.get("rerun_state_machine"):
        dropped.append("its rerun state machine's state (Megatron-LM's --rerun-mode): this program has no "
                       "rerun machine, so a rerun the save left pending is not repeated")
    return CheckpointRecord(**fields, args=args, layout=layout,
                            no_optimizer_state=bool(getattr(ns, "no_save_optim", False)),
                            no_rng_state=bool(getattr(ns, "no_save_rng", False)),
                            saved_by=SAVED_BY_MEGATRON_LM, dropped=tuple(dropped))


# -- the RNG state --------------------------------------------------------------------------------------

def rng_entry() -> dict[str, Any]:
    """This rank's RNG states with Megatron-LM's keys (``get_rng_state``); without CUDA the CPU generator
    stands in for the CUDA one, as megatron-core's RNG tracker uses it here."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    from megatron_snip.compat.device import has_cuda

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if has_cuda() else torch.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng(entry: Mapping[str, Any]) -> None:
    """Restore :func:`rng_entry`'s states (Megatron-LM's load_checkpoint); the CUDA generator only with CUDA."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    from megatron_snip.compat.device import has_cuda

    random.setstate(entry["random_rng_state"])
    np.random.set_state(entry["np_rng_state"])
    torch.set_rng_state(entry["torch_rng_state"])
    if has_cuda():
        torch.cuda.set_rng_state(entry["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(entry["rng_tracker_states"])


def rng_object(entries: list[dict[str, Any]] | None = None):
    """Megatron-LM's ``rng_state``: ``entries`` (default: this rank's :func:`rng_entry`) sharded over (pp, tp),
    replicated over the data-parallel ranks with context parallelism (replica_id = the dp-cp rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(RNG_KEY, [rng_entry()] if entries is None else entries,
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def quantization_object(state: Mapping[str, Any] | None = None):
    """This rank's module quantization state (stochastic-rounding streams, delayed-scaling histories: they differ
    between data-parallel and context-parallel ranks) sharded over (pp, tp, dp-cp)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(QUANTIZATION_KEY, dict(state or {}),
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                          ps.get_data_parallel_world_size(with_context_parallel=True)),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                          ps.get_data_parallel_rank(with_context_parallel=True)),
                         replica_id=0)


def pick_rng(loaded: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """This rank's entry of a loaded ``rng_state`` list: Megatron-LM saves one per data-parallel rank only with
    --data-parallel-random-init, else one."""
    from megatron.core import parallel_state as ps

    return loaded[ps.get_data_parallel_rank()] if len(loaded) > 1 else loaded[0]

"""Train with pretrain_llama.py's flags and write or read a checkpoint the way stock Megatron-LM 0.16.1 does.

Used by tests/test_megatron_lm_checkpoint.py under the forked launcher; this is test code standing in for
Megatron-LM's own (``megatron/training/checkpointing.py``), which the project does not carry, written from
it without the project's checkpoint code:

- ``MEGATRON_LM_SAVE=DIR:N``: train to iteration N, write DIR/iter_000000N as Megatron-LM's
  ``save_checkpoint`` does (``generate_state_dict``: its ``args`` Namespace, ``checkpoint_version`` 3.0, the
  model and the distributed optimizer sharded with its content metadata, ``opt_param_scheduler``,
  ``rng_state`` over (pp, tp) replicated over the dp-cp ranks, ``num_floating_point_operations_so_far``;
  no megatron-snip record), then train on to --train-iters (the uninterrupted run).
- ``MEGATRON_LM_LOAD=1``: resume (--load) and train as pretrain_llama.py does, then read the checkpoint the
  run saved last as Megatron-LM's ``load_checkpoint`` reads it, with its default flags: ``check_checkpoint_args``,
  the content metadata into ``sharded_state_dict``, the (tp, pp) test for the RNG state, a load with its
  default strictness, the scheduler into an ``OptimizerParamScheduler`` built as ``get_optimizer_param_scheduler``
  builds it (asserting every saved setting equals the flags': no --use-checkpoint-opt_param-scheduler), and
  prints ``MEGATRON-LM-LOAD {json}`` on rank 0: what it read.
- ``MEGATRON_LM_WITH_TE=1``: save or load as Megatron-LM does with Transformer Engine installed (its final norm
  is then TE's, which keeps an ``_extra_state``; model_state).

The Namespace is tests/data/megatron_lm_args.json (what stock Megatron-LM saved for a run of these flags)
with this run's values in the fields its loaders read.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

ARGS_FILE = Path(__file__).resolve().parents[1] / "data" / "megatron_lm_args.json"


def megatron_args(trainer, consumed: int) -> argparse.Namespace:
    """Megatron-LM's args for this run: the stored Namespace, this run's values where its loaders read them."""
    from megatron.core import parallel_state as ps

    stored = json.loads(ARGS_FILE.read_text())
    values = dict(stored["args"])
    for name, spelled in stored["objects"].items():
        module, _, member = spelled.rpartition(".")
        owner = importlib.import_module(module) if module == "torch" else None
        if owner is not None:
            values[name] = getattr(owner, member)
        else:
            module, _, cls = module.rpartition(".")
            values[name] = getattr(getattr(importlib.import_module(module), cls), member)
    c = trainer.config
    m, t, p = c.model, c.training, c.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    values.update(
        num_layers=m.num_layers, encoder_num_layers=m.num_layers, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, group_query_attention=m.num_query_groups != m.num_attention_heads,
        kv_channels=m.hidden_size // m.num_attention_heads, seq_length=m.seq_length, encoder_seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings, vocab_size=m.vocab_size,
        padded_vocab_size=trainer.vocab_rows, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=not m.share_embeddings_and_output_weights,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        transformer_pipeline_model_parallel_size=pp, data_parallel_size=ps.get_data_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(), world_size=torch.distributed.get_world_size(),
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size, train_iters=t.train_iters,
        lr=t.lr, min_lr=t.min_lr, lr_warmup_iters=t.lr_warmup_iters, lr_decay_iters=t.lr_decay_iters,
        lr_decay_style=t.lr_decay_style, seed=t.seed, weight_decay=t.weight_decay,
        start_weight_decay=t.start_weight_decay, end_weight_decay=t.end_weight_decay,
        use_distributed_optimizer=p.use_distributed_optimizer, bf16=m.bf16,
        dist_ckpt_optim_fully_reshardable=c.checkpoint.dist_ckpt_optim_fully_reshardable,
        params_dtype=torch.bfloat16 if m.bf16 else torch.float32, consumed_train_samples=consumed,
        curr_iteration=trainer.state.iteration - 1)
    return argparse.Namespace(**values)


def content_metadata(args: argparse.Namespace) -> dict:
    """_build_sharded_state_dict_metadata."""
    from megatron.core import parallel_state as ps

    metadata = {}
    if args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = (
                args.distrib_optim_fully_reshardable_mem_efficient)
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


def rng_state():
    """get_rng_state for torch_dist without expert parallelism (no --data-parallel-random-init)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state], (ps.get_pipeline_model_parallel_world_size(),
                                                ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


FINAL_NORM_EXTRA_STATE = "decoder.final_layernorm._extra_state"


def model_state(chunk, metadata) -> dict:
    """The chunk's sharded state as Megatron-LM's model (local layer spec) has it: megatron-core's local
    linears' ``_extra_state`` (None) as they are; the final norm's only with Transformer Engine installed
    (``MEGATRON_LM_WITH_TE=1``: megatron-core's LayerNormImpl is then TENorm, TE's norm operation, whose state
    dict holds one), built here as megatron-core builds it for any module (make_sharded_tensors_for_checkpoint:
    no layer offsets, replica (0, tp rank, dp-cp rank)), not taken from this program's norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    state = chunk.sharded_state_dict(metadata=metadata)
    state.pop(FINAL_NORM_EXTRA_STATE, None)
    if os.environ.get("MEGATRON_LM_WITH_TE") == "1" and chunk.post_process:
        replica = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
        state[FINAL_NORM_EXTRA_STATE] = make_sharded_object_for_checkpoint(
            torch.empty(0, dtype=torch.uint8), FINAL_NORM_EXTRA_STATE, (), replica_id=replica)
    return state


def generate_state_dict(args, model, optimizer, scheduler, rng, metadata, is_loading=False) -> dict:
    state = {"args": args, "checkpoint_version": 3.0}
    for i, chunk in enumerate(model):
        state["model" if len(model) == 1 else f"model{i}"] = model_state(chunk, metadata)
    if optimizer is not None:
        kwargs = {"metadata": metadata, **({"is_loading": True} if is_loading else {})}
        state["optimizer"] = optimizer.sharded_state_dict(state, **kwargs)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng is not None:
        state["rng_state"] = rng
    return state


def save_checkpoint(trainer, root: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from megatron_snip.training import save_helper

    iteration = trainer.state.iteration
    args = megatron_args(trainer, trainer.state.consumed_samples)
    metadata = content_metadata(args)
    model = [chunk.module for chunk in trainer.model]
    state = generate_state_dict(args, model, trainer.optimizer, trainer.scheduler, rng_state(), metadata)
    state["iteration"] = iteration
    state["num_floating_point_operations_so_far"] = trainer.state.floating_point_operations
    path = os.path.join(root, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                ps.get_data_parallel_group(with_context_parallel=True))
    clean = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    save_helper.install()  # the writer's helper process without torch's imports (the files are the same)
    dist_checkpointing.save(state, path, strategy, content_metadata=clean)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        Path(root, "latest_checkpointed_iteration.txt").write_text(str(iteration))


def check_checkpoint_args(ckpt_args, args) -> None:
    """check_checkpoint_args for a torch_dist checkpoint (checkpoint_version 3.0; no vocab file)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        assert getattr(ckpt_args, name) == getattr(args, name), name
    assert getattr(ckpt_args, "add_position_embedding", True) == args.add_position_embedding


def scheduler_as_megatron_lm_builds_it(args, optimizer):
    """get_optimizer_param_scheduler for iteration-based training, with Megatron-LM's default
    --use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler (both off)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
        wsd_decay_steps=None, lr_wsd_decay_style=args.lr_wsd_decay_style)


def adam_steps_as_fused_adam_keeps_them(content: dict):
    """Megatron-LM's load meets apex's / Transformer Engine's Adam on a GPU, which keeps no step per parameter;
    torch's here does, which megatron-core 0.16.1's fully_reshardable load cannot copy (KeyError 'step')."""
    from megatron_snip.training.adam_state import fully_reshardable_steps_kept

    return fully_reshardable_steps_kept(content)


def load_checkpoint(trainer, root: str) -> dict:
    """Megatron-LM's load_checkpoint of the newest checkpoint in ``root`` into this run's model and optimizer."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    iteration = int(Path(root, "latest_checkpointed_iteration.txt").read_text())
    path = os.path.join(root, f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state_dict(path)  # _load_base_checkpoint(rank0=True)
    ckpt_args = common["args"]
    assert isinstance(ckpt_args, argparse.Namespace), type(ckpt_args)
    args = megatron_args(trainer, 0)  # the resuming run's own args
    ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                  getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    run_tp_pp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    loads_rng = ckpt_tp_pp == run_tp_pp and not getattr(ckpt_args, "no_save_rng", False)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    loads_optim = not getattr(ckpt_args, "no_save_optim", False)
    if args.use_distributed_optimizer:  # the format Megatron-LM itself would have saved with these flags
        assert metadata["distrib_optim_sharding_type"] == content_metadata(args)["distrib_optim_sharding_type"]
    stored_metadata = dict(metadata or {})
    metadata = {**(metadata or {}), "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    model = [chunk.module for chunk in trainer.model]
    scheduler = scheduler_as_megatron_lm_builds_it(args, trainer.optimizer)
    state = generate_state_dict(args, model, trainer.optimizer if loads_optim else None, scheduler,
                                rng_state() if loads_rng else None, metadata, is_loading=True)
    loaded = dist_checkpointing.load(state, path, strict="assume_ok_unexpected")
    assert loaded["checkpoint_version"] == 3.0
    check_checkpoint_args(loaded["args"], args)
    for i, chunk in enumerate(model):
        weights = loaded["model" if len(model) == 1 else f"model{i}"]
        if chunk.post_process:  # the stand-in's final norm (this program's) takes an extra state in any case
            weights = {FINAL_NORM_EXTRA_STATE: None, **weights}
        chunk.load_state_dict(weights)
    with adam_steps_as_fused_adam_keeps_them(stored_metadata):
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])  # asserts each saved setting equals the flags'
    rng = loaded["rng_state"][0]
    return {"iteration": loaded["iteration"], "checkpoint_version": loaded["checkpoint_version"],
            "num_floating_point_operations_so_far": loaded.get("num_floating_point_operations_so_far"),
            "consumed_train_samples": getattr(loaded["args"], "consumed_train_samples", 0),
            "skipped_train_samples": getattr(loaded["args"], "skipped_train_samples", 0),
            "consumed_valid_samples": getattr(loaded["args"], "consumed_valid_samples", 0),
            "ckpt_tp_pp": list(ckpt_tp_pp), "loads_rng": loads_rng, "loads_optim": loads_optim,
            "content_metadata": stored_metadata, "rng_keys": sorted(rng), "scheduler_steps": scheduler.num_steps,
            "lr": [g["lr"] for g in trainer.optimizer.param_groups][:1],
            "untie_embeddings_and_output_weights": loaded["args"].untie_embeddings_and_output_weights}


if __name__ == "__main__":
    from megatron_snip.cli.pretrain import trainer_from_command_line

    trainer = trainer_from_command_line(sys.argv[1:])
    if os.environ.get("MEGATRON_LM_SAVE"):
        root, at = os.environ["MEGATRON_LM_SAVE"].rsplit(":", 1)
        trainer.train(until=int(at))
        save_checkpoint(trainer, root)
        trainer.train()
    else:
        trainer.resume()
        trainer.train()
        report = load_checkpoint(trainer, trainer.config.checkpoint.save)
        if torch.distributed.get_rank() == 0:
            print("MEGATRON-LM-LOAD " + json.dumps(report, default=str), flush=True)
    trainer.logger.close()

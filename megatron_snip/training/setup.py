"""Process groups, seeds, and the megatron-core DDP wrapper, optimizer and LR scheduler."""

from __future__ import annotations

import argparse
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_snip.compat import cpu as cpu_compat


def initialize_distributed(args: argparse.Namespace) -> None:
    """Start torch.distributed (env:// from torchrun/srun) and megatron's parallel groups."""
    cpu_compat.enable()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=args.distributed_backend,
                                timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
    )
    set_seeds(args.seed)


def set_seeds(seed: int) -> None:
    """Megatron's seeding: a different stream per pipeline stage, TP-aware CUDA RNG tracker."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def wrap_ddp(args: argparse.Namespace, config: TransformerConfig,
             chunks: list[torch.nn.Module]) -> list[DistributedDataParallel]:
    """Wrap this rank's model chunks (one, or one per virtual pipeline stage) in megatron-core DDP
    and hook their gradient and parameter syncs into the schedules."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    # As megatron.training: only the first chunk's gradients are bucketed (the interleaved schedule
    # reduces the other chunks' gradients as their last backward finishes).
    ddps = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]

    def per_chunk(attr: str):
        funcs = [getattr(d, attr) for d in ddps]
        return funcs[0] if len(funcs) == 1 else funcs

    # What megatron.training wires up: without finalize_model_grads the
    # schedules never reduce gradients across DP ranks or tied stages.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk("no_sync")
    if args.overlap_grad_reduce:
        config.grad_sync_func = per_chunk("start_grad_sync")
    if args.overlap_param_gather and args.use_distributed_optimizer:
        config.param_sync_func = per_chunk("start_param_sync")
    return ddps


def build_optimizer(args: argparse.Namespace, chunks: list[DistributedDataParallel]):
    """megatron-core's optimizer (Adam/AdamW or SGD, optionally distributed) over the model chunks."""
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        chunks,
    )


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Warmup then linear/cosine/... decay, stepped once per iteration."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        # megatron-core requires warmup < decay; only a 0-iteration run can violate it.
        lr_decay_steps=max(args.lr_decay_iters, args.lr_warmup_iters + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=max(args.train_iters, 1),
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )

"""Process groups, seeds, and the megatron-core DDP wrapper, optimizer and LR scheduler."""

from __future__ import annotations

import datetime
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_snip.compat.device import check_device_setup
from megatron_snip.model.config import ModelConfig, ParallelConfig
from megatron_snip.training import multi_tensor
from megatron_snip.training.config import TrainingConfig

FUSED_ADAM_DEVICES = ("cuda", "cpu")  # where torch's Adam/AdamW has a fused kernel


def initialize_distributed(parallel: ParallelConfig, seed: int) -> None:
    """Start torch.distributed (env:// from torchrun/srun) and megatron's parallel groups, and seed.
    The entry point has set up the device (``compat.device.setup_device``)."""
    check_device_setup()
    if not dist.is_initialized():
        dist.init_process_group(backend=parallel.distributed_backend,
                                timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
    )
    set_seeds(seed)


def set_seeds(seed: int) -> None:
    """Megatron's seeding: a different stream per pipeline stage, TP-aware CUDA RNG tracker."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def ddp_config(parallel: ParallelConfig, num_parameters: int, check_for_large_grads: bool = False
               ) -> DistributedDataParallelConfig:
    """megatron-core's DDP settings, as Megatron-LM derives them from its flags; ``num_parameters``: this
    rank's (for --ddp-num-buckets)."""
    bucket_size = parallel.ddp_bucket_size
    if parallel.ddp_num_buckets is not None:
        bucket_size = num_parameters // parallel.ddp_num_buckets
    return DistributedDataParallelConfig(
        # Gradient buffers in fp32 (Megatron-LM's --accumulate-allreduce-grads-in-fp32, its default with
        # --bf16), or in the parameters' dtype with --grad-reduce-in-bf16.
        grad_reduce_in_fp32=not parallel.grad_reduce_in_bf16,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        # Megatron-LM's rule: the all-gathers are aligned only under the interleaved schedule
        align_param_gather=parallel.align_param_gather and parallel.virtual_pipeline_model_parallel_size is not None,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        check_for_large_grads=check_for_large_grads,
        bucket_size=bucket_size,  # None: megatron-core's default (one bucket without --overlap-grad-reduce)
        pad_buckets_for_high_nccl_busbw=parallel.ddp_pad_buckets_for_high_nccl_busbw,
        reduce_scatter_with_fp32_accumulation=parallel.ddp_reduce_scatter_with_fp32_accumulation,
        average_in_collective=parallel.ddp_average_in_collective,
    )


def wrap_ddp(parallel: ParallelConfig, config: TransformerConfig, chunks: list[torch.nn.Module], *,
             check_for_large_grads: bool = False) -> list[DistributedDataParallel]:
    """Wrap this rank's model chunks (one, or one per virtual pipeline stage) in megatron-core DDP
    and hook their gradient and parameter syncs into the schedules, as Megatron-LM's training loop does."""
    settings = ddp_config(parallel, sum(p.numel() for chunk in chunks for p in chunk.parameters()),
                          check_for_large_grads)
    # As megatron.training: only the first chunk's gradients are bucketed (the interleaved schedule
    # reduces the other chunks' gradients as their last backward finishes).
    ddps = [DistributedDataParallel(config, settings, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]

    def per_chunk(attr: str):
        funcs = [getattr(d, attr) for d in ddps]
        return funcs[0] if len(funcs) == 1 else funcs

    # What megatron.training wires up: without finalize_model_grads the
    # schedules never reduce gradients across DP ranks or tied stages.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk("no_sync")
    if parallel.overlap_grad_reduce and parallel.align_grad_reduce:
        config.grad_sync_func = per_chunk("start_grad_sync")
    if parallel.overlap_param_gather and settings.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    return ddps


def build_optimizer(training: TrainingConfig, model: ModelConfig, parallel: ParallelConfig,
                    chunks: list[DistributedDataParallel], count_zeros: bool = False):
    """megatron-core's optimizer (Adam/AdamW or SGD, optionally distributed) over the model chunks;
    ``count_zeros``: its step also counts the gradients' zero entries (--log-num-zeros-in-grad).

    Without Transformer Engine or apex, megatron-core falls back to ``torch.optim.AdamW`` (foreach on a
    GPU, a loop over parameters on a CPU) and to per-tensor loops for the gradient norm, the clipping and
    the optimizer's copies: :func:`use_fused_adam` and ``training/multi_tensor.py`` put the fused and
    multi-tensor kernels back."""
    multi_tensor.install()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=training.optimizer,
            lr=training.lr,
            min_lr=training.min_lr,
            weight_decay=training.weight_decay,
            adam_beta1=training.adam_beta1,
            adam_beta2=training.adam_beta2,
            adam_eps=training.adam_eps,
            sgd_momentum=training.sgd_momentum,
            clip_grad=training.clip_grad,
            # Megatron-LM's --decoupled-lr: the embedding and output layer's own peak (and minimum) learning rate.
            decoupled_lr=training.decoupled_lr,
            decoupled_min_lr=training.decoupled_min_lr,
            bf16=model.bf16,
            params_dtype=model.params_dtype,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
            log_num_zeros_in_grad=count_zeros,
        ),
        chunks,
    )
    use_fused_adam(optimizer)
    multi_tensor.use_foreach_copies(optimizer)
    return optimizer


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam/AdamW inside megatron-core's optimizer to its fused kernel (one call over all
    tensors of a group instead of a loop over them, or foreach's several passes), on a GPU as Megatron-LM's
    apex/TE FusedAdam, and on a CPU (torch's fused CPU kernel); called again after a checkpoint's parameter
    groups are loaded (they carry the saving run's choice). Returns the number of parameter groups switched."""
    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            params = group["params"]
            if params and all(p.device.type in FUSED_ADAM_DEVICES and p.is_floating_point() for p in params):
                group.update(fused=True, foreach=False)
                switched += 1
                for p in params:  # a loaded unfused state counts its steps on the host; fused counts on the device
                    step = torch_optimizer.state.get(p, {}).get("step")
                    if torch.is_tensor(step) and step.device != p.device:
                        torch_optimizer.state[p]["step"] = step.to(p.device, torch.float32)
    return switched


def build_scheduler(training: TrainingConfig, optimizer, *, override: bool = False) -> OptimizerParamScheduler:
    """Warmup then linear/cosine/... decay, as Megatron-LM's get_optimizer_param_scheduler builds it: counted
    in samples (the trainer steps it by the global batch of every applied update), so a checkpoint's scheduler
    state means the same to Megatron-LM. ``override`` (--override-opt_param-scheduler): a loaded checkpoint's
    schedule settings give way to these (its step count is kept); without it the checkpoint's are used."""
    gbs = training.global_batch_size
    if training.train_samples is not None:  # Megatron-LM's sample-based training: the lengths as given
        decay, warmup = training.lr_decay_samples, training.lr_warmup_samples
        wd_incr, wsd = training.train_samples, training.lr_wsd_decay_samples
    else:  # iterations, each of one global batch
        decay, warmup = training.lr_decay_iters * gbs, training.lr_warmup_iters * gbs
        wd_incr = max(training.train_iters, 1) * gbs
        wsd = None if training.lr_wsd_decay_iters is None else training.lr_wsd_decay_iters * gbs
    if training.lr_warmup_fraction is not None:
        warmup = training.lr_warmup_fraction * decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=training.lr_warmup_init,
        max_lr=training.lr,
        min_lr=training.min_lr,
        lr_warmup_steps=warmup,
        # megatron-core requires warmup < decay; only a 0-iteration run can violate it.
        lr_decay_steps=max(decay, warmup + 1),
        lr_decay_style=training.lr_decay_style,
        start_wd=training.start_weight_decay,
        end_wd=training.end_weight_decay,
        wd_incr_steps=wd_incr,
        wd_incr_style=training.weight_decay_incr_style,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=training.lr_wsd_decay_style,
        use_checkpoint_opt_param_scheduler=not override,
        override_opt_param_scheduler=override,
    )

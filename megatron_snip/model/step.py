"""One micro-batch through a model chunk and its loss: what megatron's pipeline schedules call.

Both the trainer and SNIP's probe passes run these (the batch keys and the loss key are the
contract between the data loader, the schedule and whoever reads the losses).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config, get_pg_size

from megatron_snip.compat.device import current_device

LOSS_KEY = "lm loss"  # the key of the reported loss in what the schedule returns per micro-batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """Mean token loss of one micro-batch; the reported value is this DP rank's (as Megatron-LM's, whoever
    reads the losses reduces them over DP ranks once per step: :func:`reduced_losses`).

    Under context parallelism this rank holds 1/CP of each sequence's tokens: the mean is over the whole
    micro-batch, its (sum, count) all-reduced over the CP group, and each rank's loss is its own tokens'
    share of it (its sum over the micro-batch's count). megatron-core's schedule multiplies a loss returned
    this way by CP and DDP averages gradients over DP x CP ranks, so the gradients are CP=1's.

    ``per_token`` (--calculate-per-token-loss): the loss summed over the micro-batch's tokens and their
    count, which megatron-core's schedule and ``finalize_model_grads`` normalise by the global batch's
    loss tokens (counted over DP x CP ranks); reported as (sum, count) (:func:`mean_loss` divides the pairs
    summed over DP x CP ranks)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total, count = torch.sum(losses * mask), mask.sum()
    if per_token:
        return total, count.int(), {LOSS_KEY: torch.stack([total.detach(), count])}
    cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    if get_pg_size(cp_group) > 1:
        whole = torch.stack([total.detach(), count])
        dist.all_reduce(whole, group=cp_group)
        loss = total / whole[1].clamp(min=1.0)
        return loss, {LOSS_KEY: whole[0] / whole[1].clamp(min=1.0)}
    loss = total / count.clamp(min=1.0)
    return loss, {LOSS_KEY: loss.detach().clone()}


def forward_step(data_iterator, model):
    """One micro-batch (``tokens``, ``position_ids``, ``labels``, ``loss_mask``, optional
    ``attention_mask``) through this stage; the schedule feeds the stage input itself. Under context
    parallelism every CP rank reads the same micro-batch and keeps its two chunks of each sequence
    (megatron-core's ``get_batch_on_this_cp_rank``; nothing in megatron-core calls it for GPT)."""
    batch = next(data_iterator)
    device = current_device()
    batch = get_batch_on_this_cp_rank({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], per_token=get_model_config(model).calculate_per_token_loss)


def reduced_losses(losses: list[dict], key: str = LOSS_KEY) -> torch.Tensor | None:
    """The micro-batch losses (``key`` of each dict) the schedule returned on the last stage (None elsewhere),
    reduced over the DP ranks in one all-reduce and no host sync: fp32 [micro-batches] on the device, each
    averaged over DP ranks (each already the whole micro-batch's under context parallelism: :func:`loss_func`);
    with --calculate-per-token-loss fp32 [micro-batches, 2], (sum, count) summed over DP x CP ranks. The same
    values on every rank of the last stage."""
    if not losses:
        return None
    values = torch.stack([d[key] for d in losses])
    if values.dim() == 2:  # (sum, count) per micro-batch: this rank's tokens
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return values
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    return values / parallel_state.get_data_parallel_world_size()


def step_loss(values: torch.Tensor) -> torch.Tensor:
    """The step's loss from :func:`reduced_losses`'s values: their mean, or with --calculate-per-token-loss
    ([micro-batches, 2] of (sum, count)) the loss per token over the global batch."""
    if values.dim() == 2:
        return values[:, 0].sum() / values[:, 1].sum().clamp(min=1.0)
    return values.mean()


def mean_loss(losses: list[dict]) -> torch.Tensor | None:
    """The step's loss as a device scalar (read it where it is logged), None off the last stage."""
    values = reduced_losses(losses)
    return None if values is None else step_loss(values)

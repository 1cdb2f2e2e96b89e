"""One micro-batch through a model chunk and its loss: what megatron's pipeline schedules call.

Both the trainer and SNIP's probe passes run these (the batch keys and the loss key are the
contract between the data loader, the schedule and whoever reads the losses).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron_snip.compat.device import current_device

LOSS_KEY = "lm loss"  # the key of the reported loss in what the schedule returns per micro-batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """Mean token loss of one micro-batch; the reported value is averaged over DP ranks.

    ``per_token`` (--calculate-per-token-loss): the loss summed over the micro-batch's tokens and their
    count, which megatron-core's schedule and ``finalize_model_grads`` normalise by the global batch's
    loss tokens; reported as (sum, count) summed over DP ranks (:func:`mean_loss` divides)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    if per_token:
        total, count = torch.sum(losses * mask), mask.sum()
        reported = torch.stack([total.detach(), count])
        dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        return total, count.int(), {LOSS_KEY: reported}
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    reported /= parallel_state.get_data_parallel_world_size()
    return loss, {LOSS_KEY: reported}


def forward_step(data_iterator, model):
    """One micro-batch (``tokens``, ``position_ids``, ``labels``, ``loss_mask``, optional
    ``attention_mask``) through this stage; the schedule feeds the stage input itself."""
    batch = next(data_iterator)
    device = current_device()
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], per_token=get_model_config(model).calculate_per_token_loss)


def mean_loss(losses: list[dict]) -> float | None:
    """Mean of the micro-batch losses the schedule returned on the last stage (None elsewhere); per token
    over the global batch with --calculate-per-token-loss."""
    if not losses:
        return None
    reported = torch.stack([d[LOSS_KEY] for d in losses])
    if reported.dim() == 2:  # (sum, count) per micro-batch
        return (reported[:, 0].sum() / reported[:, 1].sum().clamp(min=1.0)).item()
    return reported.mean().item()

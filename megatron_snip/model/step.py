"""One micro-batch through a model chunk and its loss: what megatron's pipeline schedules call.

Both the trainer and SNIP's probe passes run these (the batch keys and the loss key are the
contract between the data loader, the schedule and whoever reads the losses).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_snip.compat.device import current_device

LOSS_KEY = "lm loss"  # the key of the reported loss in what the schedule returns per micro-batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch; the reported value is this DP rank's (as Megatron-LM's, whoever
    reads the losses averages them over DP ranks once per step: :func:`reduced_losses`)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    return loss, {LOSS_KEY: loss.detach().clone()}


def forward_step(data_iterator, model):
    """One micro-batch (``tokens``, ``position_ids``, ``labels``, ``loss_mask``, optional
    ``attention_mask``) through this stage; the schedule feeds the stage input itself."""
    batch = next(data_iterator)
    device = current_device()
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def reduced_losses(losses: list[dict], key: str = LOSS_KEY) -> torch.Tensor | None:
    """The micro-batch losses (``key`` of each dict) the schedule returned on the last stage (None elsewhere),
    each averaged over the DP ranks: fp32 [micro-batches] on the device, in one all-reduce and no host sync."""
    if not losses:
        return None
    values = torch.stack([d[key] for d in losses])
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    return values / parallel_state.get_data_parallel_world_size()


def mean_loss(losses: list[dict]) -> torch.Tensor | None:
    """Mean of :func:`reduced_losses`: a device scalar (read it where it is logged), None off the last stage."""
    values = reduced_losses(losses)
    return None if values is None else values.mean()

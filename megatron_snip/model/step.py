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
    """Mean token loss of one micro-batch; the reported value is averaged over DP ranks."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
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
    return output, partial(loss_func, batch["loss_mask"])


def mean_loss(losses: list[dict]) -> float | None:
    """Mean of the micro-batch losses the schedule returned on the last stage (None elsewhere)."""
    if not losses:
        return None
    return torch.stack([d[LOSS_KEY] for d in losses]).mean().item()

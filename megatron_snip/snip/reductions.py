"""How the probes' per-rank sums become a module's statistics: completed over the tensor-parallel
shards, then added or averaged over the data- and context-parallel ranks (docs/snip.md, "Reductions")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .module_probe import ModuleProbe, Sum

# Quantities of the weight alone, no sum over tokens: the same on every context-parallel rank.
WEIGHT_QUANTITIES = ("weight_sq", "w_quant_sq")
# Sums of squares over the module's weight, weighted by Adam's response: under the distributed optimizer
# each rank holds the response of its shard only. (The perturbation passes move every shard on every
# rank, so their sums, ``gain`` and ``propagated``, are sums over tokens like the others.)
SHARDED_QUANTITIES = ("update_sq",)


def reduction_factors(keys: Sequence[Sum], *, cp_rank: int, dp: int, dp_sharded: bool
                      ) -> tuple[list[float], list[float]]:
    """How each rank's sums ``keys`` (complete over TP) become a module's statistics: every rank's sum
    times its weight, added over the data- and context-parallel ranks (megatron-core's dp-cp group),
    divided by the divisor. The statistics are those of one data-parallel replica's probe batch (whose
    tokens its CP ranks share), averaged over the ``dp`` replicas:

    - a sum over tokens (element counts, norms of X, Y and dY, output- and input-gradient errors,
      first-order terms, the operand errors of X and dY, curvatures, gains, the propagated terms
      ``<dX, eX>``): each CP rank holds a part of its replica's tokens, so CP ranks add (weight 1) and
      replicas average (divisor dp);
    - a quantity of the weight alone (``weight_sq``, the operand error of W): the same on every CP rank,
      counted once (weight 1 on CP rank 0, else 0), averaged over replicas;
    - ``update_sq``, measured on the wgrad error summed over the CP ranks before it is squared (the
      error of the replica's gradient): the same on every CP rank, counted once, averaged over replicas;
    - with ``dp_sharded`` (distributed optimizer) ``update_sq`` is a response-weighted sum over this rank's
      shard of the weight (shards over dp-cp): all of them add (weight 1, divisor 1).

    Returns:
        (weights, divisors), one of each per key.
    """
    once = 1.0 if cp_rank == 0 else 0.0
    weights, divisors = [], []
    for key in keys:
        if dp_sharded and key.quantity in SHARDED_QUANTITIES:
            weights.append(1.0)
            divisors.append(1.0)
        else:
            weights.append(once if key.quantity in (*WEIGHT_QUANTITIES, "update_sq") else 1.0)
            divisors.append(float(dp))
    return weights, divisors


def reduce_sums(probes: list[ModuleProbe], keys: list[Sum], dp_sharded: bool) -> dict[str, dict[Sum, float]]:
    """Complete the sums ``keys`` of every probe over TP (SUM; replicas were weighted 0), then over the
    data- and context-parallel ranks as :func:`reduction_factors` says."""
    if not probes or not keys:
        return {p.name: {} for p in probes}
    device = probes[0].module.weight.device
    table = torch.stack([torch.stack([torch.as_tensor(p.sums.get(k, 0.0), dtype=torch.float64, device=device)
                                      for k in keys]) for p in probes])
    weights, divisors = (torch.tensor(f, dtype=torch.float64, device=device) for f in reduction_factors(
        keys, cp_rank=parallel_state.get_context_parallel_rank(), dp=parallel_state.get_data_parallel_world_size(),
        dp_sharded=dp_sharded))
    table = table * weights
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(table, group=parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dist.all_reduce(table, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    values = (table / divisors).tolist()
    return {p.name: dict(zip(keys, row)) for p, row in zip(probes, values)}

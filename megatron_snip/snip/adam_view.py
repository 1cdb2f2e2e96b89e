"""Adam's state as the SNIP probes see it: each model parameter's slice of the fp32 main
parameter and optimizer state held on this rank.

The whole parameter for megatron's ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``;
a shard of the flat buffer for the ``DistributedOptimizer``, whose sums then run over the
group it shards over: the data-parallel ranks with the context-parallel ones (megatron-core's
dp-cp group; the data-parallel group itself at CP=1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.transformer.module import param_is_not_shared

from megatron_snip.compat.device import current_device
from megatron_snip.model.parameter_names import global_parameter_names

from .estimators import AdamHyper, adam_sensitivity, adam_update, metric_scale


@dataclass(eq=False)
class AdamSlice:
    """The elements ``start:end`` of a flattened model parameter that this rank's optimizer
    updates, with their Adam state.

    Attributes:
        param: the model parameter; name: its global name (layout-independent).
        start, end: the slice of ``param.view(-1)``.
        state: the inner optimizer's state of the main parameter (``exp_avg``, ``exp_avg_sq``,
            ``step``), each holding ``end - start`` elements.
        group: the inner optimizer's param group (lr, betas, eps).
        dp_sharded: held by one rank of the data- and context-parallel group only (distributed
            optimizer: megatron-core's dp-cp group).
        counted: counts in model-wide sums on this rank (not a tensor-parallel duplicate
            held by a rank other than TP rank 0, not a shared copy).
        main: the optimizer's main parameter of the slice (``end - start`` elements; the model
            parameter itself where the optimizer keeps no copy); None, with ``state`` and ``group``
            empty, for a slice another data- or context-parallel rank's optimizer updates
            (:meth:`AdamView.sharding_peers`).
    """

    param: torch.nn.Parameter
    name: str
    start: int
    end: int
    state: dict
    group: dict
    dp_sharded: bool
    counted: bool
    main: torch.Tensor | None = None

    @property
    def step(self) -> float:
        return float(self.state["step"])

    @property
    def lr(self) -> float:
        """The group's learning rate, or 1 when the schedule is at 0 (warm-up start, decay to 0).

        Every divergence SNIP uses is normalised by the clean update, and the LR
        enters numerator and denominator squared, so its scale cancels; only a
        zero LR would leave nothing to normalise by.
        """
        return self.group["lr"] or 1.0

    @property
    def hyper(self) -> AdamHyper:
        return AdamHyper(self.lr, *self.group["betas"], self.group["eps"], self.step)

    def sensitivity(self, grad: torch.Tensor) -> torch.Tensor:
        """``P~ = du / dg`` on the slice (flat) at the (flat, data-parallel mean) gradient ``grad``."""
        return adam_sensitivity(self.state["exp_avg"].view(-1), self.state["exp_avg_sq"].view(-1), grad, self.hyper)

    def update(self, grad: torch.Tensor) -> torch.Tensor:
        """The Adam update this slice would take for (flat) gradient ``grad``."""
        return adam_update(self.state["exp_avg"].view(-1), self.state["exp_avg_sq"].view(-1), grad, self.hyper)

    def in_metric(self, step: torch.Tensor, grad: torch.Tensor, metric: str) -> torch.Tensor:
        """``sqrt(w) * step``: a (flat) drift of the slice's update, or a response to the gradient, scaled so
        that its squared norm is the drift in the update metric (``estimators.metric_scale``) at ``grad``."""
        scale = metric_scale(self.state["exp_avg_sq"].view(-1), grad, self.hyper, metric)
        return step if scale is None else step * scale

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.view(-1)[start:end]`` (tensor shaped like the parameter)."""
        return tensor.view(-1)[self.start:self.end]

    def main_as_param(self) -> torch.Tensor | None:
        """The slice's values as the model holds them, rebuilt from the main parameter (the model's
        copy is the optimizer's cast of it), or None where that does not give them bit for bit (no
        separate main copy, or the model's copy differs from it)."""
        # A shared storage (FP32Optimizer; the distributed optimizer's view of an fp32 parameter's shard)
        # moves with the model's values: no separate copy to rebuild them from.
        if self.main is None or self.main.untyped_storage().data_ptr() == self.param.untyped_storage().data_ptr():
            return None
        rebuilt = self.main.detach().view(-1).to(self.param.dtype)
        return rebuilt if torch.equal(rebuilt, self.flat(self.param.detach())) else None


class AdamView:
    """Model parameter -> :class:`AdamSlice` for every parameter this rank's optimizer updates.

    Supported: megatron's ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` and
    ``DistributedOptimizer`` (alone or chained) around torch Adam/AdamW.

    Raises:
        ValueError: another optimizer, a precision-aware distributed optimizer (main params
            held inside the fused optimizer), AMSGrad, or no Adam state yet.
    """

    def __init__(self, optimizer, chunks: Sequence[torch.nn.Module]):
        names = global_parameter_names(chunks)
        self._params = {name: param for param, name in names.items()}
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.slices: dict[torch.nn.Parameter, AdamSlice] = {}
        parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
        self._sharded = any(isinstance(opt, DistributedOptimizer) for opt in parts)
        for opt in parts:
            groups = {id(p): g for g in opt.optimizer.param_groups for p in g["params"]}
            for param, main, start, end, sharded in _main_params(opt):
                if main is None:
                    raise ValueError(f"{names.get(param, 'a parameter')}: the optimizer keeps no fp32 main "
                                     "parameter (precision-aware distributed optimizer); SNIP probes need "
                                     "its Adam state: run without --use-precision-aware-optimizer")
                group = groups[id(main)]
                if group.get("amsgrad", False):
                    raise ValueError("SNIP probes model Adam without AMSGrad; the optimizer uses amsgrad=True")
                state = opt.optimizer.state.get(main, {})
                if "exp_avg_sq" not in state:
                    raise ValueError(f"{names.get(param, 'a parameter')}: no Adam state (exp_avg_sq): "
                                     f"the optimizer is {type(opt.optimizer).__name__} or has not stepped yet; "
                                     "SNIP probes need Adam/AdamW after at least one optimizer step")
                counted = (param_is_not_shared(param)
                           and (tensor_parallel.param_is_not_tensor_parallel_duplicate(param) or tp_rank == 0))
                self.slices[param] = AdamSlice(param, names[param], start, end, state, group, sharded, counted, main)

    @property
    def dp_sharded(self) -> bool:
        """Whether the optimizer shards its state over the data- and context-parallel ranks: the same on
        every rank, whichever slices it holds (collectives depend on it)."""
        return self._sharded

    def model_sum(self, per_slice: Callable[[AdamSlice], torch.Tensor]) -> float:
        """``sum over every parameter element of the model`` of a per-slice fp64 sum, complete over
        tensor-, pipeline- and (distributed optimizer) data- and context-parallel shards; the same on
        every rank."""
        device = next(iter(self.slices)).device if self.slices else _default_device()
        sharded = torch.zeros((), dtype=torch.float64, device=device)
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        for s in self.slices.values():
            if s.counted:
                if s.dp_sharded:
                    sharded += per_slice(s)
                else:
                    replicated += per_slice(s)
        if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
            dist.all_reduce(sharded, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        total = sharded + replicated
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
        return total.item()


    def sharding_peers(self, values: dict[AdamSlice, torch.Tensor]) -> dict[AdamSlice, torch.Tensor]:
        """The slices the other ranks of the group the distributed optimizer shards over (megatron-core's
        dp-cp group) update, each with the flat fp32 value that rank has for it in its ``values`` (one per
        slice it holds). Collective over that group.

        A perturbation of the parameters must be the same on every rank of a data-parallel replica (its
        context-parallel ranks run one forward together: attention gathers their keys and values) and on
        every replica (the probes sum what each replica's tokens see of the same perturbation): each rank
        applies its own slices' and its peers'. Without the distributed optimizer every rank holds every
        slice: nothing to exchange. With it, this holds one fp32 value per parameter of the rank's model
        for as long as the caller keeps the result (the probe cycle's perturbation passes)."""
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        size = dist.get_world_size(group)
        if size == 1 or not self.dp_sharded:
            return {}
        mine = [s for s in self.slices.values() if s in values]
        described: list = [None] * size
        dist.all_gather_object(described, [(s.name, s.start, s.end) for s in mine], group=group)
        device = next(iter(self.slices)).device if self.slices else _default_device()
        lengths = [sum(end - start for _, start, end in d) for d in described]
        flat = torch.zeros(max(lengths), dtype=torch.float32, device=device)
        if mine:
            flat[:lengths[dist.get_rank(group)]] = torch.cat([values[s].float().reshape(-1) for s in mine])
        gathered = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(gathered, flat, group=group)
        peers = {}
        for rank, (slices, received) in enumerate(zip(described, gathered)):
            if rank == dist.get_rank(group):
                continue
            offset = 0
            for name, start, end in slices:
                param = self._params[name]
                peer = AdamSlice(param, name, start, end, state={}, group={}, dp_sharded=True, counted=False)
                peers[peer] = received[offset:offset + end - start]
                offset += end - start
        return peers


def _default_device() -> torch.device:
    return current_device()


def _main_params(opt):
    """(model param, main param or None, start, end, dp_sharded) for one megatron optimizer."""
    if isinstance(opt, DistributedOptimizer):
        if opt.data_parallel_group.size() != parallel_state.get_data_parallel_world_size(with_context_parallel=True):
            raise ValueError("SNIP probes sum the distributed optimizer's shards over the whole data- and "
                             "context-parallel group; several distributed-optimizer instances (partial sharding) "
                             "are not supported")
        pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                 *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
        for model_group, main_group in pairs:
            for param, main in zip(model_group, main_group):
                r = opt._get_model_param_range_map(param)["param"]
                yield param, main, r.start, r.end, True
    elif isinstance(opt, Float16OptimizerWithFloat16Params):
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for param, main in zip(model_group, main_group):
                yield param, main, 0, param.numel(), False
        for group in opt.fp32_from_fp32_groups:
            for param in group:
                yield param, param, 0, param.numel(), False
    elif isinstance(opt, FP32Optimizer):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                yield param, param, 0, param.numel(), False
    else:
        raise ValueError(f"SNIP probes support megatron's FP32Optimizer, Float16OptimizerWithFloat16Params and "
                         f"DistributedOptimizer; got {type(opt).__name__}")

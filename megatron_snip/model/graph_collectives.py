"""megatron-core's tensor- and context-parallel mappings as functional collectives, which a compiled graph holds.

megatron-core's mappings (``tensor_parallel.mappings``) run torch.distributed's in-place collectives
into buffers of their own; dynamo cannot trace those, and megatron-core calls the linears inside a
context manager (its activation-offloading interface) where dynamo cannot break a graph either, so it
would give up the whole layer. A layer traced by ``--torch-compile`` (model/compile.py) calls these
instead: the same communication, forward and backward, through ``torch.distributed``'s functional
collectives (the same reductions over the same group: the same values), which dynamo traces into the
graph and inductor schedules. Eager code keeps megatron-core's.

Each takes megatron-core's arguments and is called only where its group has more than one rank.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol


class _CopyToRegion(torch.autograd.Function):
    """Identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return funcol.all_reduce(x.contiguous(), "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, tensor_parallel_output_grad: bool = True,
                                         group=None) -> torch.Tensor:
    """All-gather along dim 0 forward; backward the reduce-scatter (sum) of the gradient, which is megatron-core's
    backward for ``tensor_parallel_output_grad=True`` (the only way the layers call it)."""
    if not tensor_parallel_output_grad:
        raise ValueError("gather_from_sequence_parallel_region: only tensor_parallel_output_grad=True is traced")
    return funcol.all_gather_tensor_autograd(input_.contiguous(), 0, group)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter (sum) along dim 0 forward, all-gather of the gradient backward."""
    return funcol.reduce_scatter_single_autograd(input_.contiguous(), "sum", 0, group)

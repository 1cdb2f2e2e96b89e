"""The quantized linear as a custom operator, so that a compiled graph holds it instead of breaking at it.

``torch.compile`` traces the layers of ``--torch-compile`` whole; a linear module whose precision is
not BF16 calls :func:`compiled_quantized_linear` there. The graph sees one operator
(``megatron_snip::quantized_linear``: X, W -> Y) and its backward
(``megatron_snip::quantized_linear_backward``: dY -> dX, dW), whose shapes it knows without running them;
what they compute is :func:`linear.fprop` and :func:`linear.bprop`, the functions the eager autograd
function runs, so a compiled layer quantizes to the same bits as an eager one.

Nothing the graph is specialised on changes with the precision:

- the module is named by a *key*, a 0-d int64 CPU tensor (:func:`register`): a tensor, so the graph takes
  it as an input and guards on its shape, not on its value, and every layer shares the graph;
- the operator asks the key's module for its :class:`LinearQuantization` when it runs (the precision,
  recipe and state of that moment): a re-plan between two steps changes no graph;
- the mutable state (delayed-scaling histories, the stochastic-rounding generators, the health
  statistics) lives in the module's ``QuantState``, outside the graph, as in eager code.

X and W are saved for the backward by autograd, as any operator's inputs (so the compiler keeps their
memory for it). What fprop makes for the backward (the quantized X / W where the backward GEMM reuses
them: FP8 bytes, delayed scaling) is held under a *ticket*, a 0-d int64 CPU tensor the forward operator
returns and autograd saves too: the kept tensors live exactly as long as the ticket (freed with the
autograd graph, as ``save_for_backward``'s would be). Where the backward reuses the quantized X, eager
code saves only that, a compiled graph X as well: one more activation per such linear (the price of a
graph that does not depend on the recipe).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from megatron_snip.numerics.linear import LinearQuantization, bprop, fprop

_KEYS = itertools.count()
_PROVIDERS: dict[int, Callable[[], Callable[[], LinearQuantization]]] = {}  # key -> weakref to a bound method
_TICKETS = itertools.count()
_KEPT: dict[int, tuple] = {}  # ticket -> (X's quantized copy or None, W's or None, Fprop, quantization)


def register(quantization: Callable[[], LinearQuantization]) -> torch.Tensor:
    """A key for ``quantization`` (a bound method of a module: what the module's GEMMs run now), as the
    0-d CPU tensor :func:`compiled_quantized_linear` takes. The module is held weakly; its key dies with it."""
    key = next(_KEYS)
    owner = quantization.__self__
    _PROVIDERS[key] = weakref.WeakMethod(quantization)
    weakref.finalize(owner, _PROVIDERS.pop, key, None)
    return torch.tensor(key, dtype=torch.int64)


def _quantization(key: torch.Tensor) -> LinearQuantization:
    provider = _PROVIDERS.get(int(key))
    method = provider() if provider is not None else None
    if method is None:
        raise RuntimeError(f"quantized linear key {int(key)}: its module is gone")
    return method()


def kept_count() -> int:
    """How many forwards' kept operands wait for their backward (for tests: none once graphs are freed)."""
    return len(_KEPT)


@torch.library.custom_op("megatron_snip::quantized_linear", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))  # stochastic rounding: never merged or rerun
def _forward(x: torch.Tensor, weight: torch.Tensor, key: torch.Tensor, x_grad: bool, w_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    quant = _quantization(key)
    y, x_saved, w_saved, info = fprop(x, weight, quant, x_grad, w_grad)
    ticket = next(_TICKETS)
    _KEPT[ticket] = (x_saved if info.x_ready else None, w_saved if info.w_ready else None, info, quant)
    out = torch.tensor(ticket, dtype=torch.int64)
    weakref.finalize(out, _KEPT.pop, ticket, None)
    return y, out


@_forward.register_fake
def _(x, weight, key, x_grad, w_grad):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("megatron_snip::quantized_linear_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, ticket: torch.Tensor, needs_dx: bool,
                 needs_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x_kept, w_kept, info, quant = _KEPT[int(ticket)]
    x_saved = x.reshape(-1, x.shape[-1]) if x_kept is None else x_kept
    dx, dw = bprop(dy, x_saved, weight if w_kept is None else w_kept, info, quant, needs_dx, needs_dw)
    return (dx if dx is not None else dy.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_backward_op.register_fake
def _(dy, x, weight, ticket, needs_dx, needs_dw):
    dx = x.new_empty(x.shape) if needs_dx else dy.new_empty(0)
    return dx, weight.new_empty(weight.shape if needs_dw else (0,))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _autograd_backward(ctx, dy: torch.Tensor, _ticket_grad):
    x, weight, ticket = ctx.saved_tensors
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.megatron_snip.quantized_linear_backward(dy, x, weight, ticket, needs_dx, needs_dw)
    return (dx if needs_dx else None), (dw if needs_dw else None), None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def compiled_quantized_linear(x: torch.Tensor, weight: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``Y = Q(X) Q(W)^T`` of the module ``key`` names (:func:`register`), with the backward GEMMs of
    :func:`megatron_snip.numerics.linear.quantized_linear`, as one operator a compiled graph holds."""
    grad = torch.is_grad_enabled()
    y, _ = torch.ops.megatron_snip.quantized_linear(x, weight, key, grad and x.requires_grad,
                                                    grad and weight.requires_grad)
    return y

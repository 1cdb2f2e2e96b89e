"""``--torch-compile``: every transformer layer compiled by ``torch.compile``, its linear layers left out.

What is compiled is what lies between the linear layers: the norms, the query/key/value split,
RoPE, the core attention, the SwiGLU activation, the residual adds and megatron-core's Python
glue around them. Each linear module stays a call into eager code (a graph break), because
everything that changes while a run trains lives there:

- its precision: a re-plan (SNIP cycle, promotion, precision schedule) changes which GEMMs a
  linear runs, never a compiled graph, so it recompiles nothing;
- SNIP's probe hooks, registered on the linear modules, run in eager code, as without compile;
- megatron-core's tensor-parallel autograd functions and their collectives (all-reduce,
  all-gather, reduce-scatter under sequence parallelism), and the per-tensor amax all-reduces of
  the quantized GEMMs: no collective is traced into a graph.

The layers of a model share their graphs (one code object, guards on structure, not on which
layer), so a 22-layer model compiles as fast as a 1-layer one: about a dozen graphs for training,
as many again the first time the model runs under ``torch.no_grad`` (evaluation, SNIP's forward
passes).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_snip.model.config import COMPILE_BACKENDS
from megatron_snip.model.quantized.layers import PlanLinear


def keep_eager(module: torch.nn.Module) -> None:
    """Make calls to ``module`` (its hooks and forward) opaque to ``torch.compile``: a compiled caller
    stops its graph there, calls the module eagerly, and resumes after it."""
    module._call_impl = torch.compiler.disable(module._call_impl)


def compile_layers(chunks: Iterable[torch.nn.Module], backend: str) -> int:
    """Compile the forward of every :class:`TransformerLayer` in ``chunks`` with ``backend``, every
    linear module of the plan (:class:`PlanLinear`) kept eager. Returns the number of layers compiled.

    In place, on this rank's model chunks before they are wrapped in DDP; parameters, state dicts
    and checkpoints are unchanged.
    """
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"torch.compile backend {backend!r} is not one of {COMPILE_BACKENDS}")
    layers = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, PlanLinear):
                keep_eager(module.forward_module)
            elif isinstance(module, TransformerLayer):
                module.forward = torch.compile(module.forward, backend=backend)
                layers += 1
    return layers

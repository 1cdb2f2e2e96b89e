"""``--torch-compile``: every transformer layer compiled whole by ``torch.compile``, its linears inside.

One graph per layer call, forward and backward: the norms, the linear GEMMs, the query/key/value
split, RoPE, the core attention, the SwiGLU activation, the residual adds and megatron-core's Python
glue around them; dynamo gives up no frame and breaks no graph inside a layer (tests/test_compile.py
reads its counters). What changes while a run trains stays out of what the graph is specialised on:

- a linear's precision: a BF16 linear runs torch's GEMM in the graph; any other runs the quantized
  GEMM as a custom operator (``numerics/linear_op.py``) that reads the module's precision, recipe and
  state when it runs. The graph depends on which linears are BF16 and on nothing else, so a re-plan
  (SNIP cycle, promotion, precision schedule) compiles at most one graph per new pattern of BF16 and
  quantized linears in a layer (16 at most, each once per grad mode; :data:`RECOMPILE_LIMIT` leaves
  room for them all) and none when only the formats change;
- hooks: dynamo does not see forward hooks added after it traced a module, so SNIP's probe passes,
  which hook the linears, run the layers eagerly (:func:`eager_layers`, around every probe pass:
  ``snip.passes.PassRunner.run``);
- collectives: under TP > 1 or CP > 1 the linears' and the attention's all-gathers, reduce-scatters and
  all-reduces are traced as torch.distributed's functional collectives (``model/graph_collectives.py``):
  megatron-core's in-place ones cannot be traced, and it calls the linears inside a context manager of
  its own (activation offloading) where dynamo could not break the graph either; at TP = CP = 1 they
  are identities traced away;
- recomputation: ``--recompute-granularity selective`` checkpoints the core attention inside the layer
  with megatron-core's checkpoint function, which saves and restores the RNG states (dynamo cannot
  trace that); in a traced layer :func:`traced_checkpoint` uses torch's checkpoint instead, which the
  graph holds (the layers run without dropout under compile: no RNG to restore); the layer still breaks
  where megatron-core reads the attention's mask type back from a tensor (``.item()``), the one break
  this design leaves. Full recomputation checkpoints whole layers from outside them, with megatron-core's
  function, as without compile (each layer's no-grad forward and its recomputation: two graphs);
- strides: the first layer takes its input from the embedding with other strides than the layers
  after it take theirs (the same element order, a different stride on the size-1 batch dim), which
  dynamo would compile a second graph for; each layer's input is given the canonical strides first
  (a view, no copy).

The layers share their graphs (one code object, guards on structure, not on which layer), so a
22-layer model compiles as fast as a 1-layer one. Under ``torch.no_grad`` (evaluation) the layers
compile once more, the first time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_snip.model.config import COMPILE_BACKENDS

# Graphs dynamo may keep per code object: the 16 patterns of BF16 / quantized linears of a layer, under
# grad and no_grad, with room to spare (dynamo's default, 8, would send a layer of a mixed plan back to eager).
RECOMPILE_LIMIT = 64


def collective(fn):
    """``fn`` (a megatron-core mapping that runs a collective) as a call a compiled graph makes eagerly: the
    graph stops before it and resumes after it. Call it only where the group has more than one rank."""
    return torch.compiler.disable(fn, reason="a torch.distributed collective (in place)")


def traced_checkpoint(checkpoint):
    """megatron-core's ``tensor_parallel.checkpoint`` that, in a graph being traced, is torch's checkpoint."""
    @functools.wraps(checkpoint)
    def call(function, distribute_saved_activations, *args):
        if torch.compiler.is_compiling() and not distribute_saved_activations:
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        return checkpoint(function, distribute_saved_activations, *args)

    call.traced = True
    return call


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides a contiguous tensor of its shape has (a view), where it is contiguous but
    strided otherwise along size-1 dims (the embedding's [s, b, h] output at b = 1)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    if t.is_contiguous() and t.stride() != tuple(reversed(strides)):
        return t.view(t.shape)
    return t


def _with_canonical_input(forward):
    @functools.wraps(forward)
    def call(*args, **kwargs):
        if args:
            args = (_canonical(args[0]), *args[1:])
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs["hidden_states"] = _canonical(kwargs["hidden_states"])
        return forward(*args, **kwargs)

    return call


def compile_layers(chunks: Iterable[torch.nn.Module], backend: str, fall_back: bool = False) -> int:
    """Compile the forward of every :class:`TransformerLayer` in ``chunks`` with ``backend``. Returns the
    number of layers compiled. ``fall_back``: a layer whose compile fails runs eagerly (dynamo's
    ``suppress_errors``; the training log's counters show the frames given up) instead of failing the
    run: for the default's compile, which the user did not ask for.

    In place, on this rank's model chunks before they are wrapped in DDP; parameters, state dicts
    and checkpoints are unchanged.
    """
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"torch.compile backend {backend!r} is not one of {COMPILE_BACKENDS}")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if fall_back:
        torch._dynamo.config.suppress_errors = True
    if not getattr(tensor_parallel.checkpoint, "traced", False):  # megatron-core's layers call it through the package
        tensor_parallel.checkpoint = traced_checkpoint(tensor_parallel.checkpoint)
    layers = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                module.forward = _with_canonical_input(torch.compile(module.forward, backend=backend))
                layers += 1
    return layers


@contextlib.contextmanager
def eager_layers() -> Iterator[None]:
    """Run compiled layers eagerly inside this block (their Python, hooks included, runs as without
    compile; the graphs are kept for afterwards). For passes that hook modules inside the layers:
    SNIP's probe passes."""
    with torch.compiler.set_stance("force_eager"):
        yield


def counters() -> dict[str, int]:
    """dynamo's counters since its last reset, in the terms the compiled layers are judged by: frames
    compiled (``frames``) and given up to eager (``frames_given_up``), graph breaks, graphs, and
    recompiles of the transformer layer (its graphs beyond the first)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters as dynamo

    frames = dynamo["frames"]
    layer_graphs = len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__))
    return {"frames": frames["total"], "frames_given_up": frames["total"] - frames["ok"],
            "graph_breaks": sum(dynamo["graph_break"].values()), "graphs": dynamo["stats"]["unique_graphs"],
            "recompiles": max(layer_graphs - 1, 0)}


class CompileLog:
    """dynamo's counters as a console line for the training log, when they changed since the last line."""

    def __init__(self):
        self.last: dict[str, int] | None = None

    def line(self) -> str | None:
        """The line, or None when nothing changed."""
        now = counters()
        if now == self.last:
            return None
        self.last = now
        return (f"[compile] so far: {now['graphs']} graph(s), {now['graph_breaks']} graph break(s), "
                f"{now['frames_given_up']} frame(s) given up to eager, {now['recompiles']} recompile(s) of the "
                "transformer layer")

"""One linear module's measurement in a SNIP probe cycle: how the module is split over the
tensor- and context-parallel ranks (:class:`ModuleLayout`), the sums it accumulates before they are
reduced (:class:`Sum`), and, in the clean pass's backward, the exact errors of its three GEMMs in
every candidate format (:meth:`ModuleProbe.measure_errors`), the layers' own quantizers on the
captured X, W and dY.

The modules are seen through :class:`~megatron_snip.model.quantized.layers.PlanLinear` only (a forward
hook, the GEMM's input, weight and output gradient), so the same measurement runs whether this
package's quantized linears or Transformer Engine's execute the GEMMs (``--transformer-impl``).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_pg_size

from megatron_snip.model.quantized.layers import PlanLinear
from megatron_snip.numerics.linear import LinearQuantization, QuantState, bprop, fprop, quantize_operand
from megatron_snip.numerics.recipes import Precision

from .adam_view import AdamSlice, AdamView
from .noise import layout_rademacher


@dataclass(frozen=True)
class Sum:
    """The name of one of a probe's accumulated sums (before the TP / DP reduction): a clean-pass
    quantity (``fmt`` and ``probe`` None), a candidate format's error quantity (``fmt``), or a noise
    probe's (``probe``: the Hutchinson or perturbation pass)."""

    quantity: str
    fmt: str | None = None
    probe: int | None = None


# The clean pass's quantities of the module itself, and of each candidate format's errors.
CLEAN_QUANTITIES = ("input_numel", "output_numel", "input_sq", "weight_sq", "output_sq", "output_grad_sq")
# FormatErrors.operand_sq's operands -> the quantities that hold them.
OPERAND_QUANTITIES = {"x": "x_quant_sq", "w": "w_quant_sq", "dy": "dy_quant_sq"}
FORMAT_QUANTITIES = ("output_sq", "first_order", "input_grad_sq", "update_sq", *OPERAND_QUANTITIES.values())

def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||^2`` as an fp64 0-d tensor (no host sync), detached: a measurement kept with its
    autograd graph would hold the graph's saved tensors (an fp32 copy of every module output,
    for every micro-batch) for the whole cycle and, through the backward hooks, beyond it.

    An fp32 dot product (within ~1e-6 of the fp64 sum: the squares are all positive, so nothing
    cancels), then fp64 for the sums over micro-batches and ranks: ~15x faster on a CPU than a norm
    accumulated in fp64, which casts the whole tensor first."""
    flat = t.detach().float().reshape(-1)
    return torch.dot(flat, flat).double()


@dataclass(frozen=True)
class ModuleLayout:
    """How a linear module is split over its tensor-parallel group, and its tokens over the
    context-parallel group.

    Attributes:
        tp, tp_rank: size of the module's TP group and this rank's place in it.
        cp, cp_rank: size of the context-parallel group and this rank's place in it: the module's
            input and output hold this rank's part of the sequence (dim 0; megatron-core's head-tail
            chunks, ``noise.context_parallel_positions``), its weight is the same on every CP rank.
        row: row-parallel (X and W split along in; Y all-reduced, replicated) rather than
            column-parallel (W split along out; X replicated, Y split).
        sequence_input, sequence_output: with sequence parallelism, the module's input
            (column-parallel) or output (row-parallel) is this rank's slice of the sequence, where
            the GEMM sees the whole sequence (the layer all-gathers X / reduce-scatters Y).
        x_weight, y_weight: for values of the module's input and output (and its gradient) as
            this rank holds them: 1 where they are a distinct shard (so they add over TP ranks), 0
            on TP ranks > 0 where they are a replica (column-parallel X, row-parallel Y without
            sequence parallelism): one SUM over the TP group then completes every sum.
        gemm_x_weight, gemm_y_weight: the same for values shaped like the GEMM's whole-sequence
            operands (the quantization errors, measured on the all-gathered X and dY): replicas
            on TP ranks > 0 (column-parallel X and its all-reduced dgrad error; row-parallel Y and
            its all-reduced error) weigh 0, with or without sequence parallelism.
    """

    tp: int
    tp_rank: int
    cp: int
    cp_rank: int
    row: bool
    sequence_input: bool
    sequence_output: bool
    x_weight: float
    y_weight: float
    gemm_x_weight: float
    gemm_y_weight: float

    @classmethod
    def of(cls, module: PlanLinear) -> ModuleLayout:
        tp = get_pg_size(module.tp_group)
        tp_rank = module.tp_group.rank() if tp > 1 else 0
        row = module.row_parallel
        sequence = tp > 1 and bool(module.sequence_parallel)  # megatron turns the flag off at TP=1
        gemm_x, gemm_y = (1.0 if row or tp_rank == 0 else 0.0), (1.0 if not row or tp_rank == 0 else 0.0)
        return cls(tp, tp_rank, parallel_state.get_context_parallel_world_size(),
                   parallel_state.get_context_parallel_rank(), row,
                   sequence_input=sequence and not row, sequence_output=sequence and row,
                   x_weight=1.0 if sequence and not row else gemm_x, y_weight=1.0 if sequence and row else gemm_y,
                   gemm_x_weight=gemm_x, gemm_y_weight=gemm_y)

    def output_partition_dim(self) -> int | None:
        """The dim of the module's output split over TP on this rank: features (column-parallel),
        the sequence (row-parallel under sequence parallelism), or none (replicated)."""
        return 0 if self.sequence_output else None if self.row else -1


def gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence of a sequence-parallel tensor [s / tp, ...] (dim 0, rank order)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class OperandErrors:
    """Where the probe's GEMMs keep their quantization health (``QuantState.health``), their operands' own
    errors ``||Q(T) - T||^2`` (fp64 0-d) as the GEMMs quantize them, for the named operands (``"fprop.x"``,
    ``"dgrad.dy"``): the SNIP paper's quantization-error baselines read them at no second quantization."""

    def __init__(self, keys: Sequence[str]):
        self.keys = frozenset(keys)
        self.errors: dict[str, torch.Tensor] = {}

    def record(self, key: str, x: torch.Tensor, q, quantizer=None, amax=None) -> None:
        """``HealthStats.record``'s call: ``x`` quantized to ``q`` (or a function giving the dequantized values)."""
        if key in self.keys:
            self.errors[key] = squared_norm((q() if callable(q) else q) - x)

    def record_output(self, key: str, y: torch.Tensor, bound=None) -> None:
        """A GEMM output: nothing to keep."""


class MicrobatchCounter:
    """Index of the micro-batch now in a module's forward, from the order of its forwards.

    Forwards run in micro-batch order within a pass; forwards without grad (the first run of a
    recomputed layer) count separately from those with it (its recomputation), so both runs
    of a micro-batch get the same index.
    """

    def __init__(self):
        self._counts: dict[bool, int] = {}
        self._first = 0

    def __call__(self) -> int:
        grad = torch.is_grad_enabled()
        m = self._counts.get(grad, self._first)
        self._counts[grad] = m + 1
        return m

    def reset(self, first: int = 0) -> None:
        """Start a new pass, whose first micro-batch is ``first`` of the batch."""
        self._counts.clear()
        self._first = first


@dataclass(eq=False)
class ModuleProbe:
    """One module's measurement state on this rank (sums before the TP / DP reduction).

    Attributes:
        response: the update metric's response of Adam's next step to the gradient on this rank's slice
            of the weight (``AdamSlice.in_metric`` of ``P~ = du/dg``, at the clean gradient); None where
            this rank's optimizer does not update the weight.
        clean_inputs: micro-batch index -> X(0), the module's input (as its forward hook sees it) in the clean
            pass, kept for the perturbation passes of the same micro-batches to difference against.
        repeated_errors: micro-batch index -> format -> the dgrad error that repeats from step to step
            (:meth:`repeated_input_grad_error`; all of eX under round to nearest), shaped and split like
            X(0), kept for the perturbation passes to project their input changes on.
    """

    name: str
    module: PlanLinear
    layout: ModuleLayout
    formats: list[str]
    unsupported: dict[str, str]
    adam: AdamSlice | None
    response: torch.Tensor | None = None
    states: dict[str, QuantState] = field(default_factory=dict)
    operand_states: dict[str, QuantState] = field(default_factory=dict)  # for the operands' own errors
    sums: dict[Sum, torch.Tensor] = field(default_factory=dict)
    next_microbatch: MicrobatchCounter = field(default_factory=MicrobatchCounter)
    clean_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    repeated_errors: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    sigma: float = 0.0

    @classmethod
    def make(cls, name: str, module: PlanLinear, formats: Sequence[str], adam: AdamView) -> ModuleProbe:
        """The probe of ``module`` for the candidate ``formats`` it can run (the others recorded as
        unsupported, with why), with private quantization states: the module's own RNG stream and
        delayed-scaling history stay untouched; the same seed gives the same Hadamard signs it uses."""
        supported, unsupported = [], {}
        for fmt in formats:
            try:
                module.check_precision(Precision.uniform(fmt), module.recipe)
                supported.append(fmt)
            except ValueError as e:
                unsupported[fmt] = str(e)
        probe = cls(name, module, ModuleLayout.of(module), supported, unsupported, adam=adam.slices.get(module.weight))
        for fmt in supported:
            for states in (probe.states, probe.operand_states):
                state = QuantState(module.quant_state.seed, module.quant_state.stream)
                state.delayed = copy.deepcopy(module.quant_state.delayed)
                states[fmt] = state
            probe.states[fmt].health = OperandErrors(("fprop.x", "dgrad.dy"))
        return probe

    def add(self, key: Sum, value: torch.Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def output_noise(self, y: torch.Tensor, key: int) -> torch.Tensor:
        """Layout-invariant Rademacher noise shaped like this rank's output (column-parallel
        outputs are split along features like the weight's rows; under context parallelism the
        rank's tokens draw the values of their places in the whole sequence)."""
        dim = self.layout.output_partition_dim()
        return layout_rademacher(y.shape, key, partition_dim=dim,
                                 stride=getattr(self.module.weight, "partition_stride", 1) if dim == -1 else 1,
                                 rank=self.layout.tp_rank, size=self.layout.tp, cp_rank=self.layout.cp_rank,
                                 cp_size=self.layout.cp, device=y.device).view(y.shape)

    def quantized_gemms(self, fmt: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
        """(Y, dX, dW, Q(W)) of the module's GEMMs in ``fmt`` on fp32 (tokens, in) x, (out, in) w,
        (tokens, out) dy: the forward and backward GEMMs of the layer's autograd function (:func:`fprop`,
        :func:`bprop`, called without the autograd engine), its quantizers and amax reductions (TP, CP);
        Q(W) is the dequantized W dgrad read where fprop's served it (else None)."""
        quant = self.quantization(fmt, self.states[fmt])
        y, x_saved, w_saved, info = fprop(x, w, quant, x_grad=True, w_grad=True, keep_dequantized=True)
        dx, dw = bprop(dy, x_saved, w_saved, info, quant, needs_dx=True, needs_dw=True)
        return y, dx, dw, w_saved if info.w_ready and isinstance(w_saved, torch.Tensor) else None

    def operand_error_sq(self, fmt: str, gemm: str, operand: str, t: torch.Tensor) -> torch.Tensor:
        """``||Q(t) - t||^2`` of a 2-D fp32 operand quantized as ``gemm`` quantizes ``operand`` in
        ``fmt`` (the layer's quantizers and amax reductions, a private state: the GEMMs' random
        draws are left as they were)."""
        quant = self.quantization(fmt)
        return squared_norm(quantize_operand(t, quant.quantizer(gemm, operand), operand, quant) - t)

    def quantization(self, fmt: str, state: QuantState | None = None) -> LinearQuantization:
        """The layer's quantization of ``fmt`` with a private ``state`` (default: the one for the operands' own
        errors)."""
        return LinearQuantization(Precision.uniform(fmt), self.module.recipe,
                                  self.operand_states[fmt] if state is None else state,
                                  **self.module.split_reductions())

    def repeated_input_grad_error(self, fmt: str, dy: torch.Tensor, w: torch.Tensor, dx_ref: torch.Tensor,
                                  w_quantized: torch.Tensor | None = None) -> torch.Tensor | None:
        """Where dgrad rounds dY stochastically, the part of the dgrad error ``eX_f`` the rounding does not draw
        afresh at every step, its mean over the rounding: ``dY (Q(W) - W)``, the weight's quantization error
        carried by the exact dY (stochastic rounding is unbiased); as the layer's dgrad, a partial sum under TP
        for a column-parallel module (not yet reduced). The rest is independent noise from element to element.
        None where dgrad rounds dY to nearest: all of eX then repeats for the same dY, and the rounding of dY
        adds up over the tokens like the weight's error does (a systematic part of the error, measured).
        ``w_quantized``: dgrad's Q(W), if the caller has it."""
        quant = self.quantization(fmt)
        if not quant.quantizer("dgrad", "dy").stochastic:
            return None
        if w_quantized is None:
            w_quantized = quantize_operand(w, quant.quantizer("dgrad", "w"), "w", quant)
        return dy @ w_quantized - dx_ref

    def measure_errors(self, x: torch.Tensor, dy: torch.Tensor, grad_scale: float, microbatch: int) -> None:
        """Clean-pass backward of one micro-batch: ``||dY||^2`` and every format's exact GEMM errors,
        measured on the operands the GEMM quantizes (under sequence parallelism the all-gathered X /
        dY); ``dy`` is ``grad_scale`` times dL/dY. The part of each format's dgrad error that repeats is kept
        (``repeated_errors``) for the perturbation passes that follow (:meth:`measure_input_change`)."""
        exact = x.is_cuda and _tf32_exact(x, dy, self.module.weight, scale=grad_scale)
        w = self.module.weight.detach().float()
        self.add(Sum("output_grad_sq"), self.layout.y_weight * squared_norm(dy.detach().float() / grad_scale))
        local_rows = x.numel() // x.shape[-1]
        if self.layout.sequence_input:
            x = gather_sequence(x.detach(), self.module.tp_group)
        if self.layout.sequence_output:
            dy = gather_sequence(dy.detach(), self.module.tp_group)
        x = x.detach().reshape(-1, x.shape[-1]).float()
        dy = dy.detach().reshape(-1, dy.shape[-1]).float() / grad_scale
        with _tf32_matmuls(exact):
            y_ref, dx_ref, dw_ref = x @ w.t(), dy @ w, dy.t() @ x
        for fmt in self.formats:
            y, dx, dw, w_dgrad = self.quantized_gemms(fmt, x, w, dy)
            e_out, e_in = y - y_ref, dx - dx_ref
            e_repeated = self.repeated_input_grad_error(fmt, dy, w, dx_ref, w_dgrad)
            # Partial sums over a split reduction dim: the error of the sum is the sum of errors.
            if self.layout.tp > 1 and self.layout.row:
                dist.all_reduce(e_out, group=self.module.tp_group)
            if self.layout.tp > 1 and not self.layout.row:
                dist.all_reduce(e_in, group=self.module.tp_group)
                if e_repeated is not None:
                    dist.all_reduce(e_repeated, group=self.module.tp_group)
            if e_repeated is None:
                e_repeated = e_in
            else:  # what stochastic rounding draws afresh at every step
                self.add(Sum("input_grad_noise_sq", fmt), self.layout.gemm_x_weight * squared_norm(e_in - e_repeated))
            self.add(Sum("output_sq", fmt), self.layout.gemm_y_weight * squared_norm(e_out))
            self.add(Sum("first_order", fmt), self.layout.gemm_y_weight * (e_out * dy).sum(dtype=torch.float64))
            self.add(Sum("input_grad_sq", fmt), self.layout.gemm_x_weight * squared_norm(e_in))
            operands = self.states[fmt].health.errors
            self.add(Sum("x_quant_sq", fmt), self.layout.gemm_x_weight * operands["fprop.x"])
            self.add(Sum("dy_quant_sq", fmt), self.layout.gemm_y_weight * operands["dgrad.dy"])
            # Kept as this rank's forward holds the input: its slice of the sequence under sequence parallelism.
            mine = e_repeated[self.layout.tp_rank * local_rows:(self.layout.tp_rank + 1) * local_rows] \
                if self.layout.sequence_input else e_repeated
            self.repeated_errors.setdefault(microbatch, {})[fmt] = mine.reshape(-1).clone()
            e_w = dw - dw_ref
            if self.layout.cp > 1:  # this rank's tokens' part of the replica's wgrad: its error, too, adds up
                dist.all_reduce(e_w, group=parallel_state.get_context_parallel_group())
            if self.response is not None:
                self.add(Sum("update_sq", fmt), squared_norm(self.response * self.adam.flat(e_w)))


    def measure_input_change(self, x: torch.Tensor, microbatch: int, sigma: float, k: int) -> None:
        """A perturbation pass of draw k: ``dX = (X(+) - X(0)) / sigma``, ``||dX||^2`` into ``gain.k`` and, per
        format, ``<dX, e>`` (e the repeated dgrad error of the clean pass) into ``propagated.k``: summed over
        the batch and squared, the propagated update drift (``estimators.propagated_drift``)."""
        change = (x.detach().float() - self.clean_inputs[microbatch].float()).reshape(-1)  # sigma dX
        self.add(Sum("gain", probe=k), (self.layout.x_weight / sigma ** 2) * squared_norm(change))
        for fmt, error in self.repeated_errors.get(microbatch, {}).items():
            self.add(Sum("propagated", fmt, probe=k),
                     (self.layout.x_weight / sigma) * torch.dot(change, error).double())

    def forget_group(self) -> None:
        """Drop what a group of micro-batches kept for its perturbation passes."""
        self.clean_inputs.clear()
        self.repeated_errors.clear()


def _tf32_exact(*tensors: torch.Tensor, scale: float) -> bool:
    """Whether fp32 GEMMs on these tensors (cast to fp32, divided by ``scale``) may run on TF32 tensor
    cores and give the fp32 GEMM's result up to summation order: every operand a 16-bit float (8 or 11
    significant bits, within TF32's 11, and in its exponent range) and ``scale`` a power of 2, so TF32
    rounds no operand and each product is exact in the fp32 accumulator."""
    return all(t.dtype in (torch.bfloat16, torch.float16) for t in tensors) and math.frexp(scale)[0] == 0.5


@contextlib.contextmanager
def _tf32_matmuls(enabled: bool) -> Iterator[None]:
    """fp32 CUDA matmuls on TF32 tensor cores inside (when ``enabled``): ~7x the fp32 GEMM's speed on
    Hopper; only for operands :func:`_tf32_exact` allows."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    previous, matmul.fp32_precision = matmul.fp32_precision, "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = previous



@contextlib.contextmanager
def module_hooks(probes: list[ModuleProbe], hook: Callable) -> Iterator[None]:
    """``hook(probe, X, output)`` after every probed module's forward, X the GEMM's input (its return
    value, if not None, replaces the output)."""
    def run(p: ModuleProbe, args: tuple, kwargs: dict, out):
        with torch.no_grad():  # X is only read (detached), never differentiated
            x = p.module.gemm_input(_input(args, kwargs))
        return hook(p, x, out)

    handles = [p.module.forward_module.register_forward_hook(
        lambda mod, args, kwargs, out, p=p: run(p, args, kwargs, out), with_kwargs=True) for p in probes]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The forward's input (megatron's local linears name it ``input_``, TE's ``x``)."""
    return args[0] if args else kwargs["input_"] if "input_" in kwargs else kwargs["x"]


def needs_grad(out) -> bool:
    """Whether a linear's forward output (output, bias) will receive a gradient."""
    return torch.is_grad_enabled() and out[0].requires_grad


"""The SNIP probe cycle: measure, on a probe batch, what the estimators need.

:func:`run_probe_cycle` runs on every rank of the job at once (it drives
megatron-core's pipeline schedule, so all tensor-, pipeline- and data-parallel
ranks must call it together) and returns this pipeline stage's
:class:`ProbeStatistics`; :func:`gather_across_pipeline` merges the stages.
All passes run every linear module in bf16 (the reference) and on the same
micro-batches, with the RNG reset before each pass so dropout draws the same
masks:

0. **gradient pass** (forward + backward): the clean, data-parallel-reduced
   gradient g, which gives Adam's response ``P~ = du/dg`` at g (Adam's second
   moment folds g^2 in, so the response depends on g: ``estimators.adam_sensitivity``)
   and the clean Adam update ``||u||^2``;
1. **clean pass** (forward + backward): per module ``||X||^2, ||W||^2,
   ||Y||^2, ||dY||^2`` and, per candidate format f, the exact errors
   ``||E_f||^2, ||eX_f||^2, ||P~ * eW_f||^2``: the quantized GEMMs are
   re-run on the captured X, W, dY through
   :func:`megatron_snip.numerics.linear.quantized_linear` (the layers' own
   code), and each operand's own quantization error ``||Q(T) - T||^2`` for
   T = X, W (fprop's quantizers) and dY (dgrad's), what the SNIP paper's
   quantization-error baselines sum;
2. **Hutchinson passes** (K forward + backward): Rademacher noise
   ``+sigma_l Z_l`` at every module output at once; ``<Z_l, G(+) - G(0)>``, with
   ``<Z_l, G(0)>`` read in the clean pass's backward, gives ``tr(H_l)`` for every module
   (none run with ``--snip-curvature fisher``, whose ``tr(H_l) = N ||dY_l||^2`` the clean
   pass gives: ``estimators.fisher_trace``);
3. **perturbation passes** (1 + K forward only, micro-batch by micro-batch): a clean
   forward keeps the micro-batch's module inputs X(0), then every parameter moved by
   ``+sigma P~ * w``; ``||X(+) - X(0)||^2`` at every module input gives the
   propagated gains ``g_l``.

Noise is a counter-based hash of (seed, pass, tensor name, global element
index), so it is the same for every tensor-/pipeline-parallel layout and
needs no storage. Side effects: none on parameters, precisions, quantization
states or RNG states; the DDP gradient buffers are zeroed (or restored with
``ProbeConfig.restore_grads``); the caller's data iterator is read for exactly
``num_microbatches`` micro-batches.

The modules are seen through :class:`~megatron_snip.model.quantized.layers.PlanLinear` only (a forward
hook, the GEMM's input, weight and output gradient), so the same measurement runs whether this
package's quantized linears or Transformer Engine's execute the GEMMs (``--transformer-impl``).

Parts in their own modules: the noise (``noise.py``), Adam's state per
parameter slice on this rank (``adam_view.py``), replaying passes through the
pipeline schedule without side effects (``passes.py``).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_pg_size

from megatron_snip.compat.device import current_device
from megatron_snip.model.quantized.controller import PrecisionController
from megatron_snip.model.quantized.layers import PlanLinear
from megatron_snip.model.step import LOSS_KEY, forward_step
from megatron_snip.numerics.linear import LinearQuantization, QuantState, quantize_operand, quantized_linear
from megatron_snip.numerics.recipes import BF16, Precision
from megatron_snip.numerics.registry import precision_format
from megatron_snip.precision.plan import parse_module_name

from .adam_view import AdamSlice, AdamView
from .config import CURVATURES, SnipConfig
from .estimators import REFERENCE_FORMAT, fisher_trace, hutchinson_trace, perturbation_gain
from .noise import layout_rademacher, noise_key, param_noise
from .passes import ForwardStep, PassRunner, RngStates, preserved_training_state
from .statistics import FormatErrors, ModuleStatistics, ProbeStatistics


@dataclass(frozen=True)
class ProbeConfig:
    """Settings of a probe cycle.

    Attributes:
        formats: candidate formats to measure; bf16, the reference (cost 0), may be listed
            and is dropped: it needs no measurement.
        curvature: where each module's ``tr H`` comes from: "hutchinson" (the noise passes
            below) or "fisher" (the empirical Fisher of the clean pass, ``estimators.fisher_trace``:
            no Hutchinson passes run).
        hutchinson_probes: K noise draws for the curvatures, each one forward + backward
            pass differenced against the clean pass (K passes; none with ``curvature`` "fisher").
        perturbation_probes: K parameter-perturbation draws for the gains, each one
            forward-only pass differenced against the clean pass (K passes).
        output_noise: Hutchinson noise scale relative to each module's output RMS.
        param_noise: parameter perturbation size relative to the parameter norm,
            ``||sigma P~ w|| = param_noise * ||theta||``; None: 1e-3 for fp32 parameters,
            3e-2 for 16-bit ones (a smaller step would round away in bf16).
        seed: seed of the noise.
        gain_excludes: name substrings of parameters the perturbation passes leave unperturbed, so
            every module's gain, hence its propagated update drift, leaves out their drift
            (``--snip-gain-exclude``); sigma is the unrestricted one, so the other parameters
            move exactly as in a cycle without exclusions.
        restore_grads: put the DDP gradient buffers back as they were (costs a copy of them);
            otherwise they are left zeroed, as every training step begins anyway.
    """

    formats: tuple[str, ...] = ("fp8", "nvfp4", "mxfp4")
    curvature: str = "hutchinson"
    hutchinson_probes: int = 3
    perturbation_probes: int = 3
    output_noise: float = 0.05
    param_noise: float | None = None
    seed: int = 0
    gain_excludes: tuple[str, ...] = ()
    restore_grads: bool = False

    def __post_init__(self):
        for f in self.formats:
            Precision.uniform(f)
        object.__setattr__(self, "formats", tuple(f for f in self.formats if f != REFERENCE_FORMAT))
        if self.curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {self.curvature!r}")
        if self.hutchinson_probes < 1 or self.perturbation_probes < 1:
            raise ValueError("hutchinson_probes and perturbation_probes must be >= 1")

    @classmethod
    def from_snip(cls, snip: SnipConfig, seed: int) -> ProbeConfig:
        """The probes a run's ``--snip-*`` flags ask for: its quantized candidates, its curvature,
        ``--snip-probe-passes`` draws per estimator."""
        return cls(formats=tuple(f for f in snip.snip_formats if precision_format(f).quantized),
                   curvature=snip.snip_curvature, hutchinson_probes=snip.snip_probe_passes,
                   perturbation_probes=snip.snip_probe_passes, gain_excludes=snip.snip_gain_exclude or (), seed=seed)

    @property
    def curvature_passes(self) -> int:
        """The Hutchinson passes a cycle runs."""
        return self.hutchinson_probes if self.curvature == "hutchinson" else 0
        if not self.output_noise > 0 or (self.param_noise is not None and not self.param_noise > 0):
            raise ValueError("output_noise and param_noise must be > 0")


# -- per-module measurement ------------------------------------------------------------------------

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
    for every micro-batch) for the whole cycle and, through the backward hooks, beyond it."""
    return torch.linalg.vector_norm(t.detach().float(), dtype=torch.float64).square()


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


def _gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence of a sequence-parallel tensor [s / tp, ...] (dim 0, rank order)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class MicrobatchCounter:
    """Index of the micro-batch now in a module's forward, from the order of its forwards.

    Forwards run in micro-batch order within a pass; forwards without grad (the first run of a
    recomputed layer) count separately from those with it (its recomputation), so both runs
    of a micro-batch get the same index.
    """

    def __init__(self):
        self._counts: dict[bool, int] = {}

    def __call__(self) -> int:
        grad = torch.is_grad_enabled()
        m = self._counts.get(grad, 0)
        self._counts[grad] = m + 1
        return m

    def reset(self) -> None:
        """Start a new pass."""
        self._counts.clear()


@dataclass(eq=False)
class _Probe:
    """One module's measurement state on this rank (sums before the TP / DP reduction)."""

    name: str
    module: PlanLinear
    layout: ModuleLayout
    formats: list[str]
    unsupported: dict[str, str]
    adam: AdamSlice | None
    sensitivity: torch.Tensor | None = None  # Adam's du/dg on the weight's slice at the clean gradient
    states: dict[str, QuantState] = field(default_factory=dict)
    operand_states: dict[str, QuantState] = field(default_factory=dict)  # for the operands' own errors
    sums: dict[Sum, torch.Tensor] = field(default_factory=dict)
    next_microbatch: MicrobatchCounter = field(default_factory=MicrobatchCounter)
    sigma: float = 0.0

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
        """(Y, dX, dW) of the module's GEMMs in ``fmt`` on fp32 (tokens, in) x, (out, in) w,
        (tokens, out) dy: the layer's own autograd function, quantizers and amax reductions (TP, CP)."""
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            w = w.detach().requires_grad_()
            y = quantized_linear(x, w, Precision.uniform(fmt), self.module.recipe, self.states[fmt],
                                 **self.module.split_reductions())
            dx, dw = torch.autograd.grad(y, (x, w), dy)
        return y.detach(), dx, dw

    def operand_error_sq(self, fmt: str, gemm: str, operand: str, t: torch.Tensor) -> torch.Tensor:
        """``||Q(t) - t||^2`` of a 2-D fp32 operand quantized as ``gemm`` quantizes ``operand`` in
        ``fmt`` (the layer's quantizers and amax reductions, a private state: the GEMMs' random
        draws are left as they were)."""
        quant = LinearQuantization(Precision.uniform(fmt), self.module.recipe, self.operand_states[fmt],
                                   **self.module.split_reductions())
        return squared_norm(quantize_operand(t, quant.quantizer(gemm, operand), operand, quant) - t)

    def measure_errors(self, x: torch.Tensor, dy: torch.Tensor, grad_scale: float) -> None:
        """Clean-pass backward: ``||dY||^2`` and every format's exact GEMM errors, measured on the
        operands the GEMM quantizes (under sequence parallelism the all-gathered X / dY); ``dy`` is
        ``grad_scale`` times dL/dY (``PassRunner.output_grad_scale``)."""
        exact = x.is_cuda and _tf32_exact(x, dy, self.module.weight, scale=grad_scale)
        w = self.module.weight.detach().float()
        self.add(Sum("output_grad_sq"), self.layout.y_weight * squared_norm(dy.detach().float() / grad_scale))
        if self.layout.sequence_input:
            x = _gather_sequence(x.detach(), self.module.tp_group)
        if self.layout.sequence_output:
            dy = _gather_sequence(dy.detach(), self.module.tp_group)
        x = x.detach().reshape(-1, x.shape[-1]).float()
        dy = dy.detach().reshape(-1, dy.shape[-1]).float() / grad_scale
        with _tf32_matmuls(exact):
            y_ref, dx_ref, dw_ref = x @ w.t(), dy @ w, dy.t() @ x
        for fmt in self.formats:
            y, dx, dw = self.quantized_gemms(fmt, x, w, dy)
            e_out, e_in = y - y_ref, dx - dx_ref
            # Partial sums over a split reduction dim: the error of the sum is the sum of errors.
            if self.layout.tp > 1 and self.layout.row:
                dist.all_reduce(e_out, group=self.module.tp_group)
            if self.layout.tp > 1 and not self.layout.row:
                dist.all_reduce(e_in, group=self.module.tp_group)
            self.add(Sum("output_sq", fmt), self.layout.gemm_y_weight * squared_norm(e_out))
            self.add(Sum("first_order", fmt), self.layout.gemm_y_weight * (e_out * dy).sum(dtype=torch.float64))
            self.add(Sum("input_grad_sq", fmt), self.layout.gemm_x_weight * squared_norm(e_in))
            self.add(Sum("x_quant_sq", fmt), self.layout.gemm_x_weight * self.operand_error_sq(fmt, "fprop", "x", x))
            self.add(Sum("dy_quant_sq", fmt), self.layout.gemm_y_weight * self.operand_error_sq(fmt, "dgrad", "dy", dy))
            e_w = dw - dw_ref
            if self.layout.cp > 1:  # this rank's tokens' part of the replica's wgrad: its error, too, adds up
                dist.all_reduce(e_w, group=parallel_state.get_context_parallel_group())
            if self.sensitivity is not None:
                self.add(Sum("update_sq", fmt), squared_norm(self.sensitivity * self.adam.flat(e_w)))


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


# Quantities of the weight alone, no sum over tokens: the same on every context-parallel rank.
WEIGHT_QUANTITIES = ("weight_sq", "w_quant_sq")
# Sums of squares over the module's weights (P~-weighted): under the distributed optimizer each rank
# holds the preconditioner of its shard only.
SHARDED_QUANTITIES = ("update_sq", "gain")


def reduction_factors(keys: Sequence[Sum], *, cp_rank: int, dp: int, dp_sharded: bool
                      ) -> tuple[list[float], list[float]]:
    """How each rank's sums ``keys`` (complete over TP) become a module's statistics: every rank's sum
    times its weight, added over the data- and context-parallel ranks (megatron-core's dp-cp group),
    divided by the divisor. The statistics are those of one data-parallel replica's probe batch (whose
    tokens its CP ranks share), averaged over the ``dp`` replicas:

    - a sum over tokens (element counts, norms of X, Y and dY, output- and input-gradient errors,
      first-order terms, the operand errors of X and dY, curvatures, gains): each CP rank holds a part of
      its replica's tokens, so CP ranks add (weight 1) and replicas average (divisor dp);
    - a quantity of the weight alone (``weight_sq``, the operand error of W): the same on every CP rank,
      counted once (weight 1 on CP rank 0, else 0), averaged over replicas;
    - ``update_sq``, measured on the wgrad error summed over the CP ranks before it is squared (the
      error of the replica's gradient): the same on every CP rank, counted once, averaged over replicas;
    - with ``dp_sharded`` (distributed optimizer) ``update_sq`` and ``gain`` are P~-weighted sums over
      this rank's shard of the weights (shards over dp-cp): all of them add (weight 1, divisor 1).

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


def _reduce(probes: list[_Probe], keys: list[Sum], dp_sharded: bool) -> dict[str, dict[Sum, float]]:
    """Complete the sums ``keys`` of every probe over TP (SUM; replicas were weighted 0), then over the
    data- and context-parallel ranks as :func:`reduction_factors` says."""
    if not probes:
        return {}
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


@contextlib.contextmanager
def _hooks(probes: list[_Probe], hook: Callable) -> Iterator[None]:
    """``hook(probe, X, output)`` after every probed module's forward, X the GEMM's input (its return
    value, if not None, replaces the output)."""
    def run(p: _Probe, args: tuple, kwargs: dict, out):
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


# -- the cycle -------------------------------------------------------------------------------------

def run_probe_cycle(
    model: Sequence[torch.nn.Module],
    optimizer,
    controller: PrecisionController,
    data_iterator: Iterator | None,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    config: ProbeConfig = ProbeConfig(),
    forward_step_func: ForwardStep = forward_step,
    loss_key: str = LOSS_KEY,
    iteration: int | None = None,
) -> ProbeStatistics:
    """Measure this pipeline stage's modules on one probe batch (call on every rank at once).

    Args:
        model: this rank's model chunks (one, DDP-wrapped), as the trainer holds them.
        optimizer: the megatron optimizer (Adam state after >= 1 step).
        controller: the :class:`PrecisionController` of ``model`` (names the modules).
        data_iterator: yields this rank's probe micro-batches (dicts the forward step reads);
            exactly ``num_microbatches`` are read. Not the training iterator.
        num_microbatches, seq_length, micro_batch_size: the probe batch, as for the schedule.
        config: probe settings.
        forward_step_func: megatron forward step (default: ``model.step.forward_step``, the trainer's).
        loss_key: key of the reported loss in the loss function's dict.
        iteration: recorded in the statistics.
    Returns:
        this stage's :class:`ProbeStatistics` (``loss`` only on the last stage); pass it to
        :func:`gather_across_pipeline`.
    """
    chunks = list(model)
    runner = PassRunner(chunks, data_iterator, num_microbatches=num_microbatches, seq_length=seq_length,
                        micro_batch_size=micro_batch_size,
                        forward_step_func=forward_step_func, loss_key=loss_key)
    adam = AdamView(optimizer, chunks)
    modules = controller.modules()
    probes = [_make_probe(name, module, config.formats, adam) for name, module in modules.items()]
    with preserved_training_state(chunks, modules, config.restore_grads) as rng:
        for module in modules.values():
            module.precision = BF16
        grad_scale = runner.output_grad_scale
        # Adam's response to a gradient error depends on the gradient itself (its second moment
        # folds g^2 in): one plain pass gives the clean, data-parallel-reduced gradient first.
        rng.restore()
        runner.run(forward_only=False)
        sensitivity, update_sq = _clean_adam_response(adam, runner.loss_scale)
        for p in probes:
            p.sensitivity = sensitivity.get(p.adam)
        rng.restore()
        curvature_keys = [noise_key(config.seed, "output", k) for k in range(config.curvature_passes)]
        loss = _clean_pass(runner, probes, grad_scale, curvature_keys)
        clean_keys = [*map(Sum, CLEAN_QUANTITIES), *[Sum(q, f) for f in config.formats for q in FORMAT_QUANTITIES]]
        clean = _reduce(probes, clean_keys, adam.dp_sharded)
        for p in probes:
            rms = math.sqrt(clean[p.name][Sum("output_sq")] / clean[p.name][Sum("output_numel")])
            p.sigma = config.output_noise * (rms if rms > 0 else 1.0)
        param_sigma = _param_sigma(adam, sensitivity, config)
        perturbed = _perturbed(adam, sensitivity, config.gain_excludes)
        _perturbation_passes(runner, probes, rng, {**perturbed, **adam.context_parallel_peers(perturbed)},
                             param_sigma, config)
        for k, key in enumerate(curvature_keys):
            _hutchinson_pass(runner, probes, rng, key, k, grad_scale)
        noise_keys = ([Sum("curvature", probe=k) for k in range(config.curvature_passes)]
                      + [Sum("gain", probe=k) for k in range(config.perturbation_probes)])
        noisy = _reduce(probes, noise_keys, adam.dp_sharded)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stats = {p.name: _module_statistics(p, {**clean[p.name], **noisy[p.name]}, config, param_sigma, stage)
             for p in probes}
    return ProbeStatistics(
        modules=stats, formats=list(config.formats), loss=loss, update_sq=update_sq,
        data_parallel_size=parallel_state.get_data_parallel_world_size(), num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size, seq_length=seq_length, iteration=iteration,
        settings={**asdict(config), "formats": list(config.formats), "param_sigma": param_sigma,
                  "optimizer_dp_sharded": adam.dp_sharded},
        stages=[stage],
    )


def _make_probe(name: str, module: PlanLinear, formats: Sequence[str], adam: AdamView) -> _Probe:
    supported, unsupported = [], {}
    for fmt in formats:
        try:
            module.check_precision(Precision.uniform(fmt), module.recipe)
            supported.append(fmt)
        except ValueError as e:
            unsupported[fmt] = str(e)
    probe = _Probe(name, module, ModuleLayout.of(module), supported, unsupported, adam=adam.slices.get(module.weight))
    # Private quantization states: the module's own RNG stream and delayed-scaling history stay
    # untouched; the same seed gives the same Hadamard signs the module uses.
    for fmt in supported:
        for states in (probe.states, probe.operand_states):
            state = QuantState(module.quant_state.seed, module.quant_state.stream)
            state.delayed = copy.deepcopy(module.quant_state.delayed)
            states[fmt] = state
    return probe


def _clean_pass(runner: PassRunner, probes: list[_Probe], grad_scale: float,
                curvature_keys: Sequence[int]) -> float | None:
    """The reference pass: norms, every format's exact GEMM errors, and ``-<Z_k, G(0)>`` into
    ``curvature.k`` for the noise each Hutchinson pass k will add (see :func:`_hutchinson_pass`);
    activation gradients are ``grad_scale`` times dL/dY (``PassRunner.output_grad_scale``)."""
    def hook(p: _Probe, x: torch.Tensor, out):
        microbatch = p.next_microbatch()  # counted as in the noise passes
        if not needs_grad(out):
            return None
        y = out[0]
        p.add(Sum("input_numel"), p.layout.x_weight * x.numel())
        p.add(Sum("output_numel"), p.layout.y_weight * y.numel())
        p.add(Sum("input_sq"), p.layout.x_weight * squared_norm(x))
        p.add(Sum("output_sq"), p.layout.y_weight * squared_norm(y))

        def backward(dy: torch.Tensor) -> None:
            p.measure_errors(x, dy, grad_scale)
            for k, key in enumerate(curvature_keys):
                z = p.output_noise(dy, noise_key(key, p.name, microbatch))
                p.add(Sum("curvature", probe=k),
                      (-p.layout.y_weight / grad_scale) * (z * dy.float()).sum(dtype=torch.float64))

        y.register_hook(backward)
        return None

    for p in probes:
        p.add(Sum("weight_sq"), squared_norm(p.module.weight))
        for fmt in p.formats:  # each rank's W is a distinct shard: its errors add over TP
            p.add(Sum("w_quant_sq", fmt), p.operand_error_sq(fmt, "fprop", "w", p.module.weight.detach().float()))
        p.next_microbatch.reset()
    with _hooks(probes, hook):
        return runner.run(forward_only=False)


def _hutchinson_pass(runner: PassRunner, probes: list[_Probe], rng: RngStates, key: int, k: int,
                     grad_scale: float) -> None:
    """A pass with ``+sigma_l Z`` at every module output (Z drawn per module and micro-batch);
    accumulates ``<Z, G(+)>`` into ``curvature.k``, where the clean pass put ``-<Z, G(0)>``."""
    def hook(p: _Probe, x: torch.Tensor, out):
        y = out[0]
        z = p.output_noise(y, noise_key(key, p.name, p.next_microbatch()))
        # In the output's dtype: a bf16 model must stay bf16 downstream (and across stages).
        noisy = y + (p.sigma * z).to(y.dtype)
        if needs_grad(out):
            # The backward reads the same Z: kept as int8 (+-1) until then rather than hashed again.
            z8 = z.to(torch.int8)

            def read(g, p=p, z8=z8):
                # Z is +-1, so the products are exact in fp32; the sum runs in fp64.
                dot = (z8 * g.float()).sum(dtype=torch.float64)
                p.add(Sum("curvature", probe=k), (p.layout.y_weight / grad_scale) * dot)
            noisy.register_hook(read)
        return (noisy, *out[1:])

    for p in probes:
        p.next_microbatch.reset()
    rng.restore()
    with _hooks(probes, hook):
        runner.run(forward_only=False)


def _clean_adam_response(adam: AdamView, loss_scale: float) -> tuple[dict[AdamSlice, torch.Tensor], float]:
    """After a plain forward-backward pass: every slice's ``P~ = du/dg`` at the clean gradient, and
    ``||u||^2`` of the clean update over the whole model (the normaliser of the update divergence).
    Slice by slice, so that one slice's fp32 gradient copy is alive at a time, not the model's."""
    sensitivity, update_sq = {}, {}
    for s in adam.slices.values():
        grad = s.flat(s.param.main_grad).float() / loss_scale
        sensitivity[s] = s.sensitivity(grad)
        if s.counted:  # what model_sum adds up
            update_sq[s] = squared_norm(s.update(grad))
    return sensitivity, adam.model_sum(update_sq.__getitem__)


def _param_sigma(adam: AdamView, sensitivity: dict[AdamSlice, torch.Tensor], config: ProbeConfig) -> float:
    """The perturbation scale sigma with ``||sigma P~ w|| = rel * ||theta||`` over the whole model
    (Rademacher w: ``||P~ w|| = ||P~||`` exactly)."""
    rel = config.param_noise
    if rel is None:
        dtypes = {s.param.dtype for s in adam.slices.values()}
        rel = 1e-3 if dtypes <= {torch.float32, torch.float64} else 3e-2
    theta_sq = adam.model_sum(lambda s: squared_norm(s.flat(s.param.detach())))
    sens_sq = adam.model_sum(lambda s: squared_norm(sensitivity[s]))
    return rel * math.sqrt(theta_sq / sens_sq)


def unmatched_gain_excludes(names: Collection[str], excludes: Sequence[str]) -> str | None:
    """Why ``--snip-gain-exclude`` is wrong, or None: a pattern that names no parameter of the model
    (``names``: this rank's global parameter names) would silently measure the default gains.
    Collective over every rank: a pipeline stage may hold none of a pattern's parameters."""
    found = torch.tensor([float(any(e in n for n in names)) for e in excludes], dtype=torch.float64,
                         device=current_device())
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    missing = [e for e, f in zip(excludes, found.tolist()) if not f]
    if not missing:
        return None
    some = ", ".join(sorted(names)[:4])
    return (f"--snip-gain-exclude {' '.join(missing)}: names no parameter of the model; give a part of a parameter "
            f"name, e.g. 'embedding' (the model has {some}, ...)")


def _perturbed(adam: AdamView, sensitivity: dict[AdamSlice, torch.Tensor],
               excludes: tuple[str, ...]) -> dict[AdamSlice, torch.Tensor]:
    """``sensitivity`` with the slices of parameters named by ``excludes`` at 0: the perturbation
    passes leave those parameters where they are."""
    if not excludes:
        return sensitivity
    error = unmatched_gain_excludes([s.name for s in adam.slices.values()], excludes)
    if error:
        raise ValueError(error)
    return {s: torch.zeros_like(v) if any(e in s.name for e in excludes) else v for s, v in sensitivity.items()}


def _perturbation_passes(runner: PassRunner, probes: list[_Probe], rng: RngStates,
                         sensitivity: dict[AdamSlice, torch.Tensor], sigma: float, config: ProbeConfig) -> None:
    """For each draw k, forward passes with every parameter at ``theta + sigma P~ w_k``; accumulates
    every module's ``||X(+) - X(0)||^2`` as ``gain.k``. ``sensitivity``: P~ of every slice to perturb,
    the same on every context-parallel rank of a replica (its own slices and its peers',
    ``AdamView.context_parallel_peers``), so that the replica's forward sees one set of parameters.

    Micro-batch by micro-batch (``PassRunner.groups``: the whole batch at once under the interleaved
    schedule): a clean forward keeps the group's module inputs X(0), then one forward per draw, each
    from the RNG state the group starts with in a whole pass. So only one micro-batch's X(0) is held
    (a whole batch's is as large as the model's activations), X(0) comes from the same forward-only
    kernels as X(+), and each sum adds its micro-batches in the order a pass-by-pass loop would. The
    price: the parameters are perturbed once per draw and micro-batch. They are restored bit for bit."""
    saved = {s: _Original(s) for s in sensitivity}

    def keep(p: _Probe, x: torch.Tensor, out, inputs: dict):
        inputs[p.name, p.next_microbatch()] = x.detach().clone()

    def compare(p: _Probe, x: torch.Tensor, out, inputs: dict, k: int):
        x_clean = inputs[p.name, p.next_microbatch()]
        p.add(Sum("gain", probe=k), p.layout.x_weight * squared_norm(x.detach().float() - x_clean.float()))

    def restore() -> None:
        for s, original in saved.items():
            s.flat(s.param.data).copy_(original.values())

    keys = [noise_key(config.seed, "param", k) for k in range(config.perturbation_probes)]
    start = rng  # the RNG states the group starts with
    try:
        for group in runner.groups():
            inputs: dict[tuple[str, int], torch.Tensor] = {}
            for p in probes:
                p.next_microbatch.reset()
            start.restore()
            with _hooks(probes, lambda p, x, out: keep(p, x, out, inputs)):
                runner.run(forward_only=True, microbatches=group)
            after = RngStates()
            for k, key in enumerate(keys):
                with torch.no_grad():
                    for s, original in saved.items():
                        w = param_noise(s.param, noise_key(key, s.name), s.start, s.end)
                        perturbed = original.values().float() + sigma * sensitivity[s] * w
                        s.flat(s.param.data).copy_(perturbed.to(s.param.dtype))
                for p in probes:
                    p.next_microbatch.reset()
                start.restore()
                with _hooks(probes, lambda p, x, out, k=k: compare(p, x, out, inputs, k)):
                    runner.run(forward_only=True, microbatches=group)
            with torch.no_grad():
                restore()
            start = after
    finally:
        with torch.no_grad():
            restore()


class _Original:
    """A parameter slice's values before the perturbation passes: rebuilt from the optimizer's main
    copy on demand where that gives them bit for bit (``AdamSlice.main_as_param``), else copied."""

    def __init__(self, s: AdamSlice):
        self.slice = s
        self.copy = None if s.main_as_param() is not None else s.flat(s.param.detach()).clone()

    def values(self) -> torch.Tensor:
        return self.copy if self.copy is not None else self.slice.main.detach().view(-1).to(self.slice.param.dtype)


def _module_statistics(p: _Probe, sums: dict[Sum, float], config: ProbeConfig, param_sigma: float,
                       stage: int) -> ModuleStatistics:
    layer, _ = parse_module_name(p.name)
    out_local, in_local = p.module.weight.shape
    tp = p.layout.tp
    out_features = out_local * (1 if p.layout.row else tp)
    curv = [hutchinson_trace(sums[Sum("curvature", probe=k)], p.sigma) for k in range(config.curvature_passes)]
    curvature = (sum(curv) / len(curv) if curv
                 else fisher_trace(sums[Sum("output_grad_sq")], sums[Sum("output_numel")], out_features))
    gains = [perturbation_gain(sums[Sum("gain", probe=k)], param_sigma)
             for k in range(config.perturbation_probes)]
    return ModuleStatistics(
        name=p.name, layer=layer, stage=stage,
        in_features=in_local * (tp if p.layout.row else 1), out_features=out_features,
        **{q: sums[Sum(q)] for q in CLEAN_QUANTITIES},
        curvature=curvature, curvature_probes=curv, gain=sum(gains) / len(gains), gain_probes=gains,
        errors={f: FormatErrors(*(sums[Sum(q, f)] for q in ("output_sq", "first_order", "input_grad_sq", "update_sq")),
                                {o: sums[Sum(q, f)] for o, q in OPERAND_QUANTITIES.items()})
                for f in p.formats},
        unsupported=dict(p.unsupported),
    )


def gather_across_pipeline(stats: ProbeStatistics) -> ProbeStatistics:
    """Every stage's statistics merged, on every rank (all_gather_object over the pipeline
    group; call on all ranks)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, stats.to_dict(), group=group)
    return ProbeStatistics.merge(ProbeStatistics.from_dict(p) for p in parts)

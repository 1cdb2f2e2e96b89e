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
   moment folds g^2 in, so the response depends on g: ``estimators.adam_sensitivity``),
   in the update metric ``R = sqrt(w) P~`` (``estimators.metric_scale``), and the clean
   update's squared norm in that metric;
1. **measurement passes**, micro-batch by micro-batch (the whole batch at once under the
   interleaved schedule, whose micro-batch groups span the pipeline):

   a. a **clean forward + backward**: per module ``||X||^2, ||W||^2, ||Y||^2, ||dY||^2`` and,
      per candidate format f, the exact errors ``||E_f||^2, ||eX_f||^2, ||R * eW_f||^2`` (the
      quantized GEMMs re-run on the captured X, W, dY through the GEMMs of
      :func:`megatron_snip.numerics.linear.quantized_linear`, the layers' own code), each
      operand's own quantization error ``||Q(T) - T||^2`` for T = X, W (fprop's quantizers) and
      dY (dgrad's; of X and dY as those GEMMs quantized them), what the SNIP paper's
      quantization-error baselines sum; it keeps every module's input X(0) and the part e_f of its
      dgrad error that repeats from step to step;
   b. K **perturbed forwards** through the transformer layers (no output layer, no loss), every
      parameter up to the last layer moved to ``theta + sigma R w_k`` (``perturbation.py``):
      ``<dX_k, e_f>`` at every module input, ``dX_k = (X(+) - X(0)) / sigma``,
      summed over the batch (and averaged over the data-parallel replicas) and squared, its mean over
      the draws is ``||R * J^T e_f||^2``, the propagated update drift of the realised error;
      ``||dX_k||^2``, the isotropic gain ``||J R||_F^2`` (a diagnostic, and the drift of the rest of
      the error, which stochastic rounding draws afresh: ``estimators.module_divergences``);
2. **Hutchinson passes** (K forward + backward): Rademacher noise
   ``+sigma_l Z_l`` at every module output at once; ``<Z_l, G(+) - G(0)>``, with
   ``<Z_l, G(0)>`` read in the clean backward, gives ``tr(H_l)`` for every module
   (none run with ``--snip-curvature fisher``, whose ``tr(H_l) = N ||dY_l||^2`` the clean
   pass gives: ``estimators.fisher_trace``).

Noise is a counter-based hash of (seed, pass, tensor name, global element
index), so it is the same for every tensor-/pipeline-parallel layout and
needs no storage. Side effects: none on parameters, precisions, quantization
states or RNG states; the DDP gradient buffers are zeroed (or restored with
``ProbeConfig.restore_grads``); the caller's data iterator is read for exactly
``num_microbatches`` micro-batches.

Parts in their own modules: one module's measurement (``module_probe.py``), the reductions over
the parallel ranks (``reductions.py``), the parameter perturbation (``perturbation.py``), the noise
(``noise.py``), Adam's state per parameter slice on this rank (``adam_view.py``), replaying passes
through the pipeline schedule without side effects (``passes.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_snip.model.quantized.controller import PrecisionController
from megatron_snip.model.step import LOSS_KEY, forward_step
from megatron_snip.numerics.recipes import BF16, Precision
from megatron_snip.numerics.registry import precision_format
from megatron_snip.precision.plan import parse_module_name

from .adam_view import AdamSlice, AdamView
from .config import CURVATURES, UPDATE_METRICS, SnipConfig
from .estimators import REFERENCE_FORMAT, fisher_trace, hutchinson_trace, propagated_drift
from .module_probe import (
    CLEAN_QUANTITIES,
    FORMAT_QUANTITIES,
    OPERAND_QUANTITIES,
    ModuleProbe,
    Sum,
    module_hooks,
    needs_grad,
    squared_norm,
)
from .noise import noise_key
from .passes import ForwardStep, PassRunner, RngStates, preserved_training_state
from .perturbation import ParameterPerturbation
from .reductions import reduce_sums
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
        perturbation_probes: K parameter-perturbation draws for the propagated update drift
            (and the gains), each a forward pass per micro-batch group differenced against a clean one.
        output_noise: Hutchinson noise scale relative to each module's output RMS.
        param_noise: parameter perturbation size relative to the parameter norm,
            ``||sigma P~ w|| = param_noise * ||theta||``; None: 1e-3 for fp32 parameters,
            3e-2 for 16-bit ones (a smaller step would round away in bf16).
        seed: seed of the noise.
        update_metric: how the update divergence measures a drift of Adam's step
            (``estimators.metric_scale``): "fisher" (weighted by Adam's second moment) or "paper"
            (plain squared weight drift). Every P~-weighted quantity (the local part, the perturbation
            the gains are measured with, the clean update's norm) is then in that metric.
        gain_excludes: name substrings of parameters the perturbation passes leave unperturbed, so
            every module's gain, hence its propagated update drift, leaves out their drift
            (``--snip-gain-exclude``); sigma is the unrestricted one, so the other parameters
            move exactly as in a cycle without exclusions.
        restore_grads: put the DDP gradient buffers back as they were (costs a copy of them);
            otherwise they are left zeroed, as every training step begins anyway.
    """

    formats: tuple[str, ...] = ("fp8", "nvfp4", "mxfp4")
    curvature: str = "fisher"
    hutchinson_probes: int = 8
    perturbation_probes: int = 8
    output_noise: float = 0.05
    param_noise: float | None = None
    seed: int = 0
    update_metric: str = "fisher"
    gain_excludes: tuple[str, ...] = ()
    restore_grads: bool = False

    def __post_init__(self):
        for f in self.formats:
            Precision.uniform(f)
        object.__setattr__(self, "formats", tuple(f for f in self.formats if f != REFERENCE_FORMAT))
        if self.curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {self.curvature!r}")
        if self.update_metric not in UPDATE_METRICS:
            raise ValueError(f"update_metric must be one of {UPDATE_METRICS}, got {self.update_metric!r}")
        if self.hutchinson_probes < 1 or self.perturbation_probes < 1:
            raise ValueError("hutchinson_probes and perturbation_probes must be >= 1")
        if not self.output_noise > 0 or (self.param_noise is not None and not self.param_noise > 0):
            raise ValueError("output_noise and param_noise must be > 0")

    @classmethod
    def from_snip(cls, snip: SnipConfig, seed: int) -> ProbeConfig:
        """The probes a run's ``--snip-*`` flags ask for: its quantized candidates, its curvature,
        ``--snip-probe-passes`` draws per estimator."""
        return cls(formats=tuple(f for f in snip.snip_formats if precision_format(f).quantized),
                   curvature=snip.snip_curvature, hutchinson_probes=snip.snip_probe_passes,
                   perturbation_probes=snip.snip_probe_passes, update_metric=snip.snip_update_metric,
                   gain_excludes=snip.snip_gain_exclude or (), seed=seed)

    @property
    def curvature_passes(self) -> int:
        """The Hutchinson passes a cycle runs."""
        return self.hutchinson_probes if self.curvature == "hutchinson" else 0



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
    probes = [ModuleProbe.make(name, module, config.formats, adam) for name, module in modules.items()]
    with preserved_training_state(chunks, modules, config.restore_grads) as rng:
        for module in modules.values():
            module.precision = BF16
        # Adam's response to a gradient error depends on the gradient itself (its second moment
        # folds g^2 in): one plain pass gives the clean, data-parallel-reduced gradient first.
        rng.restore()
        runner.run(forward_only=False)
        responses, update_sq = _clean_adam_response(adam, runner.loss_scale, config.update_metric)
        for p in probes:
            p.response = responses.get(p.adam)
        perturbation = ParameterPerturbation(adam, responses, _relative_perturbation(adam, config), config.seed,
                                             config.perturbation_probes, config.gain_excludes)
        curvature_keys = [noise_key(config.seed, "output", k) for k in range(config.curvature_passes)]
        for p in probes:
            p.add(Sum("weight_sq"), squared_norm(p.module.weight))
            for fmt in p.formats:  # each rank's W is a distinct shard: its errors add over TP
                p.add(Sum("w_quant_sq", fmt), p.operand_error_sq(fmt, "fprop", "w", p.module.weight.detach().float()))
        loss = _measurement_passes(runner, probes, rng, perturbation, config, curvature_keys)
        param_sigma = perturbation.sigma
        del perturbation  # the peers' responses (distributed optimizer) and the parameter copies
        clean_keys = [*map(Sum, CLEAN_QUANTITIES), *[Sum(q, f) for f in config.formats for q in FORMAT_QUANTITIES],
                      *[Sum("input_grad_noise_sq", f) for f in _stochastic_dgrad(probes, config.formats)],
                      *[Sum("gain", probe=k) for k in range(config.perturbation_probes)],
                      *[Sum("propagated", f, probe=k) for f in config.formats
                        for k in range(config.perturbation_probes)]]
        clean = reduce_sums(probes, clean_keys, adam.dp_sharded)
        for p in probes:
            rms = math.sqrt(clean[p.name][Sum("output_sq")] / clean[p.name][Sum("output_numel")])
            p.sigma = config.output_noise * (rms if rms > 0 else 1.0)
        for k, key in enumerate(curvature_keys):
            _hutchinson_pass(runner, probes, rng, key, k)
        noisy = reduce_sums(probes, [Sum("curvature", probe=k) for k in range(config.curvature_passes)],
                            adam.dp_sharded)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stats = {p.name: _module_statistics(p, {**clean[p.name], **noisy[p.name]}, config, stage) for p in probes}
    return ProbeStatistics(
        modules=stats, formats=list(config.formats), loss=loss, update_sq=update_sq,
        data_parallel_size=parallel_state.get_data_parallel_world_size(), num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size, seq_length=seq_length, iteration=iteration,
        settings={**asdict(config), "formats": list(config.formats), "param_sigma": param_sigma,
                  "optimizer_dp_sharded": adam.dp_sharded},
        stages=[stage],
    )


def _stochastic_dgrad(probes: list[ModuleProbe], formats: Sequence[str]) -> list[str]:
    """The formats whose dgrad rounds dY stochastically (their ``input_grad_noise_sq`` is measured): decided by the
    run's recipe, which every module and rank shares, so every rank reduces the same sums."""
    return [f for f in formats if any(f in p.formats and p.quantization(f).quantizer("dgrad", "dy").stochastic
                                      for p in probes)]


def _relative_perturbation(adam: AdamView, config: ProbeConfig) -> float:
    """``||sigma R w|| / ||theta||``: ``config.param_noise``, or 1e-3 for fp32 parameters and 3e-2 for
    16-bit ones (a smaller step would round away in bf16)."""
    if config.param_noise is not None:
        return config.param_noise
    dtypes = {s.param.dtype for s in adam.slices.values()}
    return 1e-3 if dtypes <= {torch.float32, torch.float64} else 3e-2


def _measurement_passes(runner: PassRunner, probes: list[ModuleProbe], rng: RngStates,
                        perturbation: ParameterPerturbation, config: ProbeConfig,
                        curvature_keys: Sequence[int]) -> float | None:
    """Steps 1a-b of the cycle (module docstring), group by group of micro-batches (``PassRunner.groups``):
    the clean forward + backward measures the norms, every format's GEMM errors and ``-<Z_k, G(0)>`` into
    ``curvature.k`` for the noise each Hutchinson pass k will add (:func:`_hutchinson_pass`), and keeps every
    module's input X(0) and the part of its dgrad errors that repeats; each draw's perturbed forward then adds
    ``||dX_k||^2`` into ``gain.k`` and ``<dX_k, e_f>`` into ``propagated.k``, ``dX_k = (X(+) - X(0)) / sigma``
    (``ModuleProbe.measure_input_change``). Every pass of a group starts from the RNG state the group starts
    with in a whole pass, so dropout draws the masks a pass over the whole batch would.

    Only one group's module inputs and repeated errors (1 + F copies of the inputs for F formats) are held
    at a time. The group's backward runs without the gradients' data-parallel reduction (nothing reads them)
    and scales the loss by the group's size, not the batch's: its activation gradients are ``batch / group``
    times those of a whole pass.

    Returns:
        the clean loss (mean over the batch) on the last stage, None elsewhere.
    """
    def measure(p: ModuleProbe, x: torch.Tensor, out, grad_scale: float):
        microbatch = p.next_microbatch()  # counted as in the perturbation and noise passes
        p.clean_inputs.setdefault(microbatch, x.detach().clone())  # once: a recomputed layer runs twice
        if not needs_grad(out):
            return None
        y = out[0]
        p.add(Sum("input_numel"), p.layout.x_weight * x.numel())
        p.add(Sum("output_numel"), p.layout.y_weight * y.numel())
        p.add(Sum("input_sq"), p.layout.x_weight * squared_norm(x))
        p.add(Sum("output_sq"), p.layout.y_weight * squared_norm(y))

        def backward(dy: torch.Tensor) -> None:
            p.measure_errors(x, dy, grad_scale, microbatch)
            for k, key in enumerate(curvature_keys):
                z = p.output_noise(dy, noise_key(key, p.name, microbatch))
                p.add(Sum("curvature", probe=k),
                      (-p.layout.y_weight / grad_scale) * (z * dy.float()).sum(dtype=torch.float64))

        y.register_hook(backward)
        return None

    def counted_from(first: int) -> None:
        for p in probes:
            p.next_microbatch.reset(first)

    start, losses = rng, []
    for group in runner.groups():
        counted_from(group.start)
        start.restore()
        grad_scale = runner.output_grad_scale * runner.num_microbatches / len(group)
        with module_hooks(probes, lambda p, x, out: measure(p, x, out, grad_scale)):
            loss = runner.run(forward_only=False, microbatches=group, sync_grads=False)
        if loss is not None:
            losses.append(loss * len(group))
        after = RngStates()
        for k in range(config.perturbation_probes):
            with perturbation.applied(k):
                counted_from(group.start)
                start.restore()
                with module_hooks(probes, lambda p, x, out, k=k: p.measure_input_change(
                        x, p.next_microbatch(), perturbation.sigma, k)):
                    runner.run_decoder(microbatches=group)
        for p in probes:
            p.forget_group()
        start = after
    return sum(losses) / runner.num_microbatches if losses else None


def _hutchinson_pass(runner: PassRunner, probes: list[ModuleProbe], rng: RngStates, key: int, k: int) -> None:
    """A pass with ``+sigma_l Z`` at every module output (Z drawn per module and micro-batch);
    accumulates ``<Z, G(+)>`` into ``curvature.k``, where the clean backward put ``-<Z, G(0)>``."""
    grad_scale = runner.output_grad_scale

    def hook(p: ModuleProbe, x: torch.Tensor, out):
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
    with module_hooks(probes, hook):
        runner.run(forward_only=False, sync_grads=False)


def _clean_adam_response(adam: AdamView, loss_scale: float,
                         metric: str) -> tuple[dict[AdamSlice, torch.Tensor], float]:
    """After a plain forward-backward pass: every slice's response ``R = sqrt(w) P~`` (``P~ = du/dg``) at
    the clean gradient, and the squared norm of the clean update over the whole model (the normaliser of
    the update divergence), both in the update ``metric`` (weights w: ``estimators.metric_scale``).
    Slice by slice, so that one slice's fp32 gradient copy is alive at a time, not the model's."""
    responses, update_sq = {}, {}
    for s in adam.slices.values():
        grad = s.flat(s.param.main_grad).float() / loss_scale
        responses[s] = s.in_metric(s.sensitivity(grad), grad, metric)
        if s.counted:  # what model_sum adds up
            update_sq[s] = squared_norm(s.in_metric(s.update(grad), grad, metric))
    return responses, adam.model_sum(update_sq.__getitem__)


def _module_statistics(p: ModuleProbe, sums: dict[Sum, float], config: ProbeConfig, stage: int) -> ModuleStatistics:
    layer, _ = parse_module_name(p.name)
    out_local, in_local = p.module.weight.shape
    tp = p.layout.tp
    out_features = out_local * (1 if p.layout.row else tp)
    curv = [hutchinson_trace(sums[Sum("curvature", probe=k)], p.sigma) for k in range(config.curvature_passes)]
    curvature = (sum(curv) / len(curv) if curv
                 else fisher_trace(sums[Sum("output_grad_sq")], sums[Sum("output_numel")], out_features))
    gains = [sums[Sum("gain", probe=k)] for k in range(config.perturbation_probes)]

    def errors(fmt: str) -> FormatErrors:
        projections = [sums[Sum("propagated", fmt, probe=k)] for k in range(config.perturbation_probes)]
        return FormatErrors(*(sums[Sum(q, fmt)] for q in ("output_sq", "first_order", "input_grad_sq", "update_sq")),
                            {o: sums[Sum(q, fmt)] for o, q in OPERAND_QUANTITIES.items()},
                            propagated=propagated_drift(projections), propagated_probes=[c * c for c in projections],
                            input_grad_noise_sq=sums.get(Sum("input_grad_noise_sq", fmt)))

    return ModuleStatistics(
        name=p.name, layer=layer, stage=stage,
        in_features=in_local * (tp if p.layout.row else 1), out_features=out_features,
        **{q: sums[Sum(q)] for q in CLEAN_QUANTITIES},
        curvature=curvature, curvature_probes=curv, gain=sum(gains) / len(gains), gain_probes=gains,
        errors={f: errors(f) for f in p.formats},
        unsupported=dict(p.unsupported),
    )


def gather_across_pipeline(stats: ProbeStatistics) -> ProbeStatistics:
    """Every stage's statistics merged, on every rank (all_gather_object over the pipeline
    group; call on all ranks)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, stats.to_dict(), group=group)
    return ProbeStatistics.merge(ProbeStatistics.from_dict(p) for p in parts)

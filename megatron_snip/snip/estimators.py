"""SNIP's divergence estimators: pure functions of the probe statistics.

For one linear module ``Y = X W^T`` and a candidate format f (derivations and
units in ``docs/snip.md``):

* forward loss divergence, the second-order loss rise when the module's fprop
  runs in f::

      dL(l, f) = 0.5 * (tr H_l / numel(Y_l)) * ||E_f||^2,   E_f = Q(X) Q(W)^T - X W^T

  with ``tr H_l`` the trace of the loss Hessian with respect to the module
  output (a Hutchinson estimate, or the empirical Fisher's trace with
  ``--snip-curvature fisher``: :func:`fisher_trace`), so ``tr H_l / numel(Y_l)``
  is the mean per-element curvature;

* backward weight divergence, the squared drift of the Adam update when the
  module's dgrad and wgrad run in f, in the update metric (``sum w du^2``,
  :func:`metric_scale`)::

      dU(l, f) = ||R * eW_f||^2 / D  +  ||R * J_l^T E[eX_f]||^2  +  g_l ||eX_f - E[eX_f]||^2 / numel(X_l) / D

  local part (the module's own weight gradient error eW) plus propagated part
  (the input-gradient error eX entering every lower parameter's gradient through
  ``J_l = dX_l / d theta_<l``): its mean over stochastic rounding (all of eX under round to
  nearest; ``dY (Q(W) - W)`` where dY rounds stochastically), measured along its own
  direction by parameter perturbations (:func:`propagated_drift`), and what stochastic
  rounding draws afresh, independent noise, through the gain ``g_l = ||J_l R||_F^2``;
  ``R = sqrt(w) P~``, with ``P~ = du/dg`` the
  element-wise response of Adam's next update to the gradient, at the clean
  gradient (see :func:`adam_sensitivity`), and D the number of data-parallel ranks whose
  gradients are averaged (their local errors taken as independent);

* normalised: ``dL / loss`` and, for the fisher metric, ``0.5 B dU / loss`` (the loss the drift costs at
  the next step, ``B v_hat`` the per-token empirical Fisher, B the batch's tokens: :func:`update_normaliser`),
  for the paper's ``dU / ||u||^2`` (u the clean update), so both are dimensionless;
  ``cost = alpha * forward + beta * backward``.

Everything here is plain arithmetic on floats and tensors: no distributed code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean, stdev

import torch

from .statistics import ModuleStatistics, ProbeStatistics

# The reference precision: a module in bf16 runs megatron-core's own layer, so it
# diverges from the clean model by definition not at all.
REFERENCE_FORMAT = "bf16"


# -- Adam ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdamHyper:
    """What Adam's next step depends on besides the state: lr, betas, eps and the steps taken (>= 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    step: float

    def __post_init__(self):
        if self.step < 1:
            raise ValueError(f"Adam has taken {self.step} steps: its second moment is empty; probe after >= 1 step")


def _adam_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, h: AdamHyper):
    """(A, m', s, D): the next step is ``u = A m' / D`` with ``m' = beta1 m + (1 - beta1) g``,
    ``s = sqrt(v' / (1 - beta2^(t+1)))``, ``v' = beta2 v + (1 - beta2) g^2``, ``D = s + eps``."""
    t = h.step + 1
    m_next = h.beta1 * exp_avg + (1.0 - h.beta1) * grad
    s = second_moment(exp_avg_sq, grad, h).sqrt()
    return h.lr / (1.0 - h.beta1**t), m_next, s, s + h.eps


def second_moment(exp_avg_sq: torch.Tensor, grad: torch.Tensor, h: AdamHyper) -> torch.Tensor:
    """``v' / (1 - beta2^(t+1))``, ``v' = beta2 v + (1 - beta2) g^2``: the next step's bias-corrected second moment."""
    return (h.beta2 * exp_avg_sq + (1.0 - h.beta2) * grad * grad) / (1.0 - h.beta2 ** (h.step + 1))


def adam_update(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, h: AdamHyper) -> torch.Tensor:
    """The next step torch's Adam takes for gradient ``grad`` (weight decay left out: it does not
    depend on the gradient), element-wise; the state's moments fold ``grad`` in first::

        u = lr / (1 - beta1^(t+1)) * m' / (sqrt(v' / (1 - beta2^(t+1))) + eps)
        m' = beta1 m + (1 - beta1) g,  v' = beta2 v + (1 - beta2) g^2

    Args:
        exp_avg, exp_avg_sq: m and v (gradient, gradient^2); grad: g; all the same shape.
    Returns:
        u, units of the parameter (the result has the inputs' promoted dtype).
    """
    a, m_next, _, d = _adam_moments(exp_avg, exp_avg_sq, grad, h)
    return a * m_next / d


def adam_sensitivity(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                     h: AdamHyper) -> torch.Tensor:
    """``P~ = du / dg``, element-wise, of :func:`adam_update` at ``grad``: a small gradient error
    ``delta`` moves the next step by ``P~ * delta``. Units: parameter / gradient.

    ``du/dg = A ((1 - beta1) / D - m' (1 - beta2) g / ((1 - beta2^(t+1)) s D^2))``. The second
    term is v' answering the gradient: it makes an element that has had little or no gradient
    before insensitive (Adam's first step on it is ``lr * sign(g)`` whatever the size of g),
    where holding v fixed would give ``c / eps``, ~1e4x any trained element's. Embedding rows
    of rare tokens are such elements; with v held fixed they held all but 1e-6 of a small
    model's ``||P~||^2`` and decided the update divergence (docs/snip.md). Elements with
    ``v' = 0`` (no gradient now or ever) get 0: no gradient error reaches them.

    Not insensitive: a first-seen element (m = v = 0) whose gradient lies within ~eps / c of 0
    (c = sqrt((1 - beta2) / (1 - beta2^(t+1)))). There the step turns from -A (1 - beta1) / c to
    +A (1 - beta1) / c and ``P~ = A (1 - beta1) eps / (c |g| + eps)^2`` reaches A (1 - beta1) / eps.
    A few such elements, whose gradients sit at the level of rounding, can hold most of
    ``||P~||^2`` and overstate the drift of real gradient errors many times (an open defect:
    docs/snip.md, "First-seen tokens: Adam's eps window").
    """
    a, m_next, s, d = _adam_moments(exp_avg, exp_avg_sq, grad, h)
    ds_dg = (1.0 - h.beta2) * grad / ((1.0 - h.beta2 ** (h.step + 1)) * s)
    out = a * ((1.0 - h.beta1) / d - m_next * ds_dg / (d * d))
    return torch.where(s > 0, out, torch.zeros_like(out))


def metric_scale(exp_avg_sq: torch.Tensor, grad: torch.Tensor, h: AdamHyper, metric: str) -> torch.Tensor | None:
    """``sqrt(w)``, element-wise: the update metric measures a drift ``du`` of the next step as
    ``sum w du^2`` (``--snip-update-metric``).

    * ``fisher``: ``w = v' / (1 - beta2^(t+1))``, Adam's bias-corrected second moment with ``grad``
      folded in, the diagonal of the empirical Fisher, so ``sum w du^2`` is (up to a constant) the loss
      rise ``0.5 du^T F du`` that the drift costs. An element whose gradients have been ~0 (a token
      not yet seen, a rare token's embedding row) weighs ~0, however far its step would move: there
      ``P~`` is largest and least linear (Adam's eps window, docs/snip.md), and the weight bounds
      ``sqrt(w) P~`` by ``A (1 - beta1) / 4``, where a trained element's is ~``A (1 - beta1)``.
    * ``paper``: ``w = 1``, the SNIP paper's squared weight drift (None: no scaling).

    Units: gradient (loss / parameter) for fisher.
    """
    if metric == "paper":
        return None
    if metric != "fisher":
        raise ValueError(f"unknown update metric {metric!r}: fisher or paper")
    return second_moment(exp_avg_sq, grad, h).sqrt()


# -- probe read-outs -------------------------------------------------------------------------------

def hutchinson_trace(noise_dot_grad_diff: float, sigma: float) -> float:
    """``tr H ~= <Z, G(+sigma Z) - G(0)> / sigma`` for Rademacher Z (E[Z Z^T] = I).

    Forward difference against the clean pass's gradient G(0): exact for a quadratic loss;
    the next term, ``(sigma / 2) T[Z, Z, Z]`` of the third derivative T, has mean zero
    because every odd moment of Rademacher noise vanishes, so it adds variance, not bias
    (an antithetic pair would cancel it at the price of a second pass per draw).

    Args:
        noise_dot_grad_diff: ``<Z, G(+) - G(0)>`` (units of Z * dL/dY).
        sigma: absolute noise scale (units of Y).
    Returns:
        trace estimate, units loss / Y^2.
    """
    return noise_dot_grad_diff / sigma


def fisher_trace(output_grad_sq: float, output_numel: float, out_features: int) -> float:
    """``tr H`` of the loss with respect to a module output Y as the empirical Fisher gives it:
    ``N ||dY||^2`` for a loss averaged over the N tokens of Y (token t's own loss gradient is
    ``N dY_t``, and the Fisher is the mean of their outer products).

    Read from the clean pass alone, and always >= 0, where the Hutchinson trace is a difference of
    noisy passes that can come out negative (results/notebook.md, "Estimator variants").

    Args:
        output_grad_sq: ``||dY||^2`` of the clean pass (dY the gradient of the mean loss).
        output_numel: elements of Y (N tokens x ``out_features``).
        out_features: width of Y.
    Returns:
        trace estimate, units loss / Y^2 (as :func:`hutchinson_trace`'s).
    """
    return output_numel / out_features * output_grad_sq


# A Hutchinson trace whose mean lies within this many standard errors of zero is not told apart
# from 0 by its draws: the loss term then ranks such modules by noise.
UNRESOLVED_Z = 2.0


def unresolved_curvatures(stats: ProbeStatistics, z: float = UNRESOLVED_Z) -> list[str] | None:
    """Modules whose Hutchinson trace lies within ``z`` standard errors of zero.

    The standard error is the sample standard deviation of the module's per-draw values
    (``curvature_probes``) over ``sqrt(K)``. Every draw perturbs every module's output at once,
    so the cross terms add variance that grows with the number of modules: with 3 draws the
    median ``|mean| / standard error`` was 9 to 14 on the quickstart's 4-layer model, 1.2 to 1.9 on
    the prose corpus's 16-layer one, where half the modules or more were unresolved (docs/snip.md,
    "Unresolved curvatures").

    Returns:
        their names; None where no module has 2 or more draws to judge by (the empirical Fisher's
        curvature, ``--snip-probe-passes 1``).
    """
    if not any(len(m.curvature_probes) >= 2 for m in stats.modules.values()):
        return None
    return [name for name, m in stats.modules.items()
            if len(m.curvature_probes) >= 2 and draws_z(m.curvature_probes) <= z]


def draws_z(draws: list[float]) -> float:
    """``|mean| / standard error`` of two or more draws (the standard error: sample standard
    deviation over ``sqrt(K)``); inf where the draws agree exactly on a non-zero value."""
    mean, spread = fmean(draws), stdev(draws)
    if spread == 0.0:
        return math.inf if mean else 0.0
    return abs(mean) / (spread / math.sqrt(len(draws)))


def propagated_drift(projections: Sequence[float]) -> float:
    """``||R * J^T e||^2`` from K parameter perturbations: the mean of ``c_k^2``, where
    ``c_k = <J R w_k, e>`` is read at the module input as ``<(X(theta + sigma R w_k) - X(theta)) / sigma, e>``
    (e the input-gradient error, summed over the batch) and w_k is Rademacher noise: ``E[w w^T] = I``,
    so ``E c^2 = ||R * J^T e||^2``, the drift of the lower parameters' update that e causes.

    Unbiased for whatever direction e takes; each draw is one squared projection, so K draws have a
    relative spread of about ``sqrt(2 / K)``. The isotropic form ``||J R||_F^2 ||e||^2 / numel(e)``
    (statistics before version 3) assumes e spread evenly over every direction; a quantization error
    is not (its weight part ``dY (Q(W) - W)`` adds up over the tokens as the gradient does), and on
    the quickstart model that form came out 2 to 50x below the measured drift (docs/snip.md).

    Args:
        projections: ``c_k`` per draw (units: the metric's response times a gradient).
    Returns:
        the drift, in the update metric's units.
    """
    return fmean(c * c for c in projections)


# -- the divergences -------------------------------------------------------------------------------

def forward_loss_divergence(curvature_trace: float, output_numel: float, output_err_sq: float) -> float:
    """``dL = 0.5 * (tr H / numel(Y)) * ||E||^2`` (units of the loss)."""
    return 0.5 * curvature_trace * output_err_sq / output_numel


def propagated_update_divergence(gain: float, input_numel: float, input_grad_err_sq: float) -> float:
    """``g * ||eX||^2 / numel(X)``: the squared update drift of all lower parameters caused by an
    isotropic input-gradient error eX (units parameter^2): the propagated part of statistics before
    version 3, which measured no :func:`propagated_drift`."""
    return gain * input_grad_err_sq / input_numel


@dataclass(frozen=True)
class Divergence:
    """Estimated divergences of one (module, format) pair.

    Attributes:
        loss_change: dL, units of the loss.
        update_local: local part of dU (module's own weight), in the update metric.
        update_propagated: propagated part of dU (lower parameters), in the update metric.
        forward: dL / loss (dimensionless).
        backward: dU over :func:`update_normaliser` (dimensionless): in the fisher metric the loss the
            drift costs at the next step over the loss, in the paper's ``dU / ||u||^2``.
    """

    loss_change: float
    update_local: float
    update_propagated: float
    forward: float
    backward: float

    def cost(self, alpha: float = 1.0, beta: float = 1.0) -> float:
        """``alpha * forward + beta * backward``."""
        return alpha * self.forward + beta * self.backward


ZERO = Divergence(0.0, 0.0, 0.0, 0.0, 0.0)


def update_normaliser(stats: ProbeStatistics) -> float:
    """What an update drift is divided by to give the update divergence (dimensionless), by the metric it was
    measured in (``stats.update_metric``):

    * ``fisher``: ``2 loss / B``, B the tokens of the global batch: the divergence is the loss the drift
      costs at the next step over the loss, ``0.5 du^T F du / loss``, with the per-token empirical Fisher
      ``F = B v_hat`` (Adam's second moment is the batch-mean gradient's, whose variance is ``F / B``; an
      upper estimate where the tokens' gradients are correlated), as the loss divergence is the loss the
      forward error costs. Both terms are then in the loss's units.
    * ``paper``: ``||u||^2``, the clean update's squared norm (the SNIP paper's relative drift).
    """
    if stats.update_metric == "fisher":
        return 2.0 * stats.loss / stats.tokens
    return stats.update_sq


def module_divergences(module: ModuleStatistics, *, loss: float, update_norm: float,
                       data_parallel_size: int = 1) -> dict[str, Divergence]:
    """Divergences of one module for every format it was measured in.

    Args:
        module: its statistics (sums over the probe batch of one data-parallel rank,
            averaged over ranks).
        loss: the clean loss, for normalisation.
        update_norm: what a drift is divided by (:func:`update_normaliser`).
        data_parallel_size: D; wgrad errors of D ranks average in the update, and taken as
            independent their squares add: the local drift of the mean is 1/D of a rank's. (The
            propagated part is measured on the data-parallel mean itself.)
    Returns:
        format -> :class:`Divergence`.
    """
    if not (loss > 0 and update_norm > 0):
        raise ValueError(f"normalisers must be positive: loss {loss}, update drift's {update_norm}")
    out = {}
    for fmt, err in module.errors.items():
        dl = forward_loss_divergence(module.curvature, module.output_numel, err.output_sq)
        local = err.update_sq / data_parallel_size
        if err.propagated is None:  # statistics before version 3
            propagated = propagated_update_divergence(module.gain, module.input_numel,
                                                      err.input_grad_sq) / data_parallel_size
        else:  # the error that repeats measured along its direction, stochastic rounding's as independent noise
            propagated = err.propagated + propagated_update_divergence(
                module.gain, module.input_numel, err.input_grad_noise_sq or 0.0) / data_parallel_size
        out[fmt] = Divergence(dl, local, propagated, dl / loss, (local + propagated) / update_norm)
    return out


def divergences(stats: ProbeStatistics) -> dict[str, dict[str, Divergence]]:
    """Module -> format -> :class:`Divergence` for every module of ``stats`` (which must hold
    the clean loss, i.e. include the last pipeline stage: see ``gather_across_pipeline``)."""
    if stats.loss is None:
        raise ValueError("the statistics carry no loss (it lives on the last pipeline stage): "
                         "gather them across the pipeline first")
    norm = update_normaliser(stats)
    return {name: module_divergences(m, loss=stats.loss, update_norm=norm, data_parallel_size=stats.data_parallel_size)
            for name, m in stats.modules.items()}


@dataclass(frozen=True)
class CostTables:
    """Cost tables in the form :class:`megatron_snip.snip.ilp.SnipProblem` takes.

    ``joint`` for one format per module (``cost=``); ``forward`` and ``backward`` for split
    mode (``fwd_cost=``, ``bwd_cost=``). Each maps module -> format -> cost (>= 0, finite).
    """

    joint: dict[str, dict[str, float]]
    forward: dict[str, dict[str, float]]
    backward: dict[str, dict[str, float]]


def cost_tables(stats: ProbeStatistics, alpha: float = 1.0, beta: float = 1.0,
                formats: Iterable[str] | None = None) -> CostTables:
    """The ILP's cost tables: ``alpha * dL/loss`` (forward), ``beta * dU/||u||^2`` (backward),
    their sum (joint). ``bf16`` costs 0 (the reference).

    Args:
        stats: statistics of every module (gathered across the pipeline).
        formats: the ILP's candidates (default: bf16 and every measured format).
    Raises:
        ValueError: a candidate was not measured for some module, or a module cannot run it
            (e.g. a tensor-parallel split off its block boundaries); the message names them.
    """
    formats = list(formats) if formats is not None else [REFERENCE_FORMAT, *stats.formats]
    table = divergences(stats)
    missing = [f"{name}: {fmt} ({stats.modules[name].unsupported.get(fmt, 'not measured')})"
               for name in table for fmt in formats
               if fmt != REFERENCE_FORMAT and fmt not in table[name]]
    if missing:
        raise ValueError(f"no estimate for {len(missing)} (module, format) pair(s): " + "; ".join(missing[:5])
                         + ("; ..." if len(missing) > 5 else "")
                         + ". Leave the format out of the candidates or pin those modules.")
    fwd, bwd, joint = {}, {}, {}
    for name, per_format in table.items():
        pick = {f: ZERO if f == REFERENCE_FORMAT else per_format[f] for f in formats}
        fwd[name] = {f: _finite(alpha * d.forward, name, f) for f, d in pick.items()}
        bwd[name] = {f: _finite(beta * d.backward, name, f) for f, d in pick.items()}
        joint[name] = {f: fwd[name][f] + bwd[name][f] for f in formats}
    return CostTables(joint, fwd, bwd)


def _finite(value: float, name: str, fmt: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name}: the {fmt} estimate is {value}; the probe statistics are not finite")
    # A Hutchinson trace is an unbiased but noisy estimate and may come out negative (at 16 layers
    # with 3 draws, a third of them: unresolved_curvatures); the ILP wants costs >= 0.
    return max(value, 0.0)


def local_error_baselines(stats: ProbeStatistics) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The quantization-error baselines measured on the forward GEMM's output (this project's
    variants; :func:`operand_error_baselines` are the SNIP paper's).

    Returns:
        (absolute, relative): module -> format -> ``||E_f||^2`` and ``||E_f||^2 / ||Y||^2``.
    """
    absolute = {n: {f: e.output_sq for f, e in m.errors.items()} for n, m in stats.modules.items()}
    relative = {n: {f: e.output_sq / m.output_sq for f, e in m.errors.items()} for n, m in stats.modules.items()}
    return absolute, relative



def operand_error_baselines(stats: ProbeStatistics) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The SNIP paper's quantization-error baselines (``best_quant_err``, ``best_rel_quant_err``): the
    quantization errors of every tensor a module's GEMMs quantize, X, W and dY, summed.

    Returns:
        (absolute, relative): module -> format -> ``sum_T ||Q(T) - T||^2`` and
        ``sum_T ||Q(T) - T||^2 / ||T||^2`` over T = X, W, dY.
    Raises:
        ValueError: statistics of version 1, which did not measure the operands' errors.
    """
    norms = {n: {"x": m.input_sq, "w": m.weight_sq, "dy": m.output_grad_sq} for n, m in stats.modules.items()}
    absolute, relative = {}, {}
    for n, m in stats.modules.items():
        for f, e in m.errors.items():
            if e.operand_sq is None:
                raise ValueError(f"statistics of iteration {stats.iteration}: {n} has no operand errors (statistics "
                                 f"version {stats.version} predates them); the paper's baselines need version 2")
            absolute.setdefault(n, {})[f] = sum(e.operand_sq.values())
            relative.setdefault(n, {})[f] = sum(v / norms[n][t] for t, v in e.operand_sq.items())
    return absolute, relative

"""SNIP's flags (``--snip-*``), validated once by ``megatron_snip.arguments``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.flags import flag

# Where the loss term's curvature tr H comes from (--snip-curvature): the Hutchinson probe passes,
# or the empirical Fisher of the clean pass (estimators.fisher_trace, no probe passes of its own). Defined here,
# not beside the estimators: --help must not import torch.
CURVATURES = ("hutchinson", "fisher")
# How the update term measures a drift of Adam's step (--snip-update-metric; estimators.metric_scale):
# weighted by the diagonal empirical Fisher Adam's second moment holds (what the loss feels), or the
# SNIP paper's plain squared weight drift.
UPDATE_METRICS = ("fisher", "paper")
DEFAULT_FP4_TARGET = 0.75  # the paper's headline budget: 75% of the linear-layer FLOPs in FP4


class SnipConfigError(ValueError):
    """A ``--snip-*`` setting found wrong only once the model is built (``--snip-gain-exclude`` naming no
    parameter): the command line answers it as a flag error."""


@dataclass(frozen=True)
class SnipConfig:
    """Whether and how SNIP re-plans (docs/snip.md)."""

    enabled: bool = flag(False, "Re-plan the precision of every linear module at intervals from measured "
                         "divergences.", dest="snip", ours=True)
    snip_fp4_target: float | None = flag(
        None, f"Fraction of linear-layer FLOPs to run in FP4 (the paper's budget; default {DEFAULT_FP4_TARGET}, or 0 "
        "with --snip-time-target). Without --snip-time-target the plan's estimated GEMM time is also held to that of "
        "the baselines at this share (FP4 + FP8 remainder), so the non-FP4 modules run in FP8 unless BF16 pays for "
        "itself.", ours=True)
    snip_time_target: float | None = flag(
        None, "Budget in time: estimated linear-GEMM time / all-BF16 time <= T under --gemm-speed-model (per "
        "pipeline stage with --snip-budget per-stage).", ours=True)
    snip_interval: int | None = flag(None, "Iterations between re-plans (default: --save-interval).", ours=True)
    snip_warmup_plan: str | None = flag(
        None, "Plan before the first cycle: a precision name or a plan JSON file (default bf16; on resume the "
        "checkpoint's plan).", ours=True)
    snip_solver: str = flag("auto", "ILP solver: Gurobi when licensed and within its size limits, else HiGHS (auto).",
                            choices=("auto", "gurobi", "highs"), ours=True)
    snip_formats: tuple[str, ...] | None = flag(
        None, "Candidate precisions: bf16, fp8 (the run's --fp8-recipe), fp8:RECIPE (an FP8 recipe per module: "
        "fp8:tensorwise, fp8:rowwise, fp8:blockwise, fp8:mxfp8, fp8:delayed), nvfp4, mxfp4. Default: bf16 fp8 and "
        "--fp4-recipe; with --snip-time-target on a GPU, bf16 and those with a real kernel there (on Hopper: "
        "fp8:tensorwise fp8:rowwise fp8:blockwise), FP4 only where it has one or --snip-fp4-target is given.",
        ours=True)
    snip_budget: str = flag(
        "per-stage", "FP4 and time budgets for each pipeline stage, over the modules on it (uneven stages too), so no "
        "stage becomes the bottleneck; or only overall.",
        choices=("per-stage", "global"), ours=True)
    snip_split_passes: bool = flag(False, "Choose the forward GEMM's and the backward GEMMs' precision separately.",
                                   ours=True)
    snip_loss_weight: float = flag(1.0, "Weight of the loss divergence (alpha).", ours=True)
    snip_update_weight: float = flag(
        1.0, "Weight of the update divergence (beta; 1 as in the paper). 0 plans by the loss divergence alone: in the "
        "CPU-scale comparisons, with the Hutchinson curvature it trained better at 90%% FP4 and worse at 50%%; with "
        "--snip-curvature fisher, re-planned, better or equal at 90%% in every setting, but behind the default at 75%% "
        "on the quickstart corpus at 8 layers (docs/evidence.md).", ours=True)
    snip_switch_penalty: float = flag(0.0, "Objective penalty per module whose precision changes from the current "
                                      "plan.", ours=True)
    snip_curvature: str = flag(
        "fisher", "Curvature of the loss term: the empirical Fisher N ||dY||^2 of the clean pass (no passes of its "
        "own, never negative, the same on every layout), or Hutchinson noise passes (the paper's; a forward+backward "
        "pass per draw, and at depth its draws no longer tell the modules' traces from 0: docs/snip.md).",
        choices=CURVATURES, ours=True)
    snip_update_metric: str = flag(
        "fisher",
        "How the update divergence measures the drift of Adam's step: fisher, as the loss it costs at the next step, "
        "0.5 du^T F du with the empirical Fisher F = B v_hat from Adam's second moment (B: the batch's tokens), over "
        "the loss, like the loss divergence (a rare token's embedding row, or an element with no gradient history, "
        "weighs what its gradients say); paper, the SNIP paper's squared weight drift over the clean update's, which "
        "such elements decide (docs/snip.md, \"The update metric\").", choices=UPDATE_METRICS, ours=True)
    snip_probe_passes: int = flag(
        8, "Noise draws per estimator: parameter perturbations that measure the propagated update drift (a forward "
        "pass each; each draw one squared projection, so a module's estimate spreads by about sqrt(2/K)) and, with "
        "--snip-curvature hutchinson, Hutchinson draws (a forward+backward pass each). A cycle runs a gradient pass, "
        "then per micro-batch a clean forward, K perturbed forwards and a clean forward+backward that measures the "
        "quantization errors (docs/snip.md).", ours=True)

    snip_gain_exclude: tuple[str, ...] | None = flag(
        None, "Parameters (name substrings, e.g. embedding) whose drift the update divergence's propagated part leaves "
        "out: the probes' parameter perturbation skips them (default: none). A diagnostic: under the paper's update "
        "metric the embedding held most of the propagated drift of the CPU-scale models; under the default fisher "
        "metric a rare token's row weighs what its gradients say (docs/snip.md).", ours=True)

    def due(self, iteration: int) -> bool:
        """Whether a cycle runs after ``iteration``."""
        return self.enabled and iteration % self.snip_interval == 0

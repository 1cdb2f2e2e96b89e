"""What a SNIP cycle decided, told on the logging rank: a console line and table (a summary beyond
``TABLE_MAX_ROWS`` modules), TensorBoard scalars, the plan image and the decisions panel."""

from __future__ import annotations

from statistics import median

from megatron_snip.snip.decisions import TABLE_MAX_ROWS, CycleReport, decision_summary, decision_table
from megatron_snip.snip.estimators import UNRESOLVED_Z
from megatron_snip.snip.plan_image import plan_image
from megatron_snip.training import tags
from megatron_snip.training.logger import metric_line
from megatron_snip.training.progress import TrainingLogger

# Warn when at least this fraction of the modules has an unresolved Hutchinson curvature.
UNRESOLVED_WARN = 0.25


def log_cycle(logger: TrainingLogger, report: CycleReport, num_layers: int) -> None:
    """Console line and TensorBoard panels of one SNIP cycle (on the logging rank). The cycle's cost is
    also given in training iterations: its seconds over the median of the recent iterations' (those of
    the plan in force before the cycle: bf16 before the first one, unless a warm-up plan says otherwise)."""
    plan = report.plan
    metrics = {"fp4 flops fraction": report.fp4_fraction, "estimated gemm time vs bf16": report.time_ratio,
               "objective": report.objective, "loss divergence": report.loss_divergence,
               "update divergence": report.update_divergence, "solve seconds": report.solve_seconds,
               "cycle seconds": report.cycle_seconds}
    if logger.step_seconds:
        metrics["cycle iterations"] = report.cycle_seconds / median(logger.step_seconds)
    unresolved = report.unresolved_curvatures
    if unresolved is not None:
        metrics["unresolved curvature fraction"] = len(unresolved) / len(report.decisions)
    logger.text(metric_line("snip", report.iteration, metrics))
    logger.scalars({tags.snip(name): value for name, value in metrics.items()}, report.iteration)
    logger.scalars({tags.snip_layer_divergence(layer): v for layer, v in report.layer_divergence.items()},
                   report.iteration)
    logger.image(tags.SNIP_PLAN_IMAGE, plan_image(plan, num_layers, title=f"iteration {report.iteration}: FP4 "
                                                                      f"{report.fp4_fraction:.1%}"), report.iteration)
    rows = report.decisions
    table = decision_table(rows)
    logger.panel(tags.SNIP_DECISIONS, f"```\n{table}\n```", report.iteration)
    if len(rows) <= TABLE_MAX_ROWS:
        logger.text(f"[snip] iteration {report.iteration}: the plan, module by module\n{table}")
    else:
        logger.text(f"[snip] iteration {report.iteration}: the plan by module type (every module: "
                    f"snip_iter_{report.iteration:07d}.decisions.txt beside the statistics, and TensorBoard's text "
                    f"panel)\n{decision_summary(rows)}")
    logger.text(f"[snip] iteration {report.iteration}: solver {report.solver}, gap {report.gap:.2g}; per stage: FP4 "
                f"fraction " + ", ".join(f"{s}: {v:.3f}" for s, v in report.stage_fp4_fraction.items())
                + "; estimated GEMM time vs bf16 "
                + ", ".join(f"{s}: {v:.3f}" for s, v in report.stage_time_ratio.items())
                + f" (budget {report.time_target:.3f})")
    if unresolved is not None and len(unresolved) >= UNRESOLVED_WARN * len(report.decisions):
        logger.text(f"[snip] iteration {report.iteration}: the Hutchinson curvature of {len(unresolved)} of "
                    f"{len(report.decisions)} modules lies within {UNRESOLVED_Z:g} standard errors of 0 (e.g. "
                    f"{', '.join(unresolved[:3])}): the loss term ranks them by noise. More draws "
                    f"(--snip-probe-passes K, one forward+backward pass each: the standard error falls as "
                    f"1/sqrt(K)) or --snip-curvature fisher (no draws) resolve them; docs/snip.md, "
                    f"\"Unresolved curvatures\"")

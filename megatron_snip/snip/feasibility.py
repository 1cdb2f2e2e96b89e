"""Whether a SNIP problem's budgets can be met at all: the largest FP4 share and the smallest GEMM time its
allowed formats admit (globally and per pipeline stage), and the errors that say which budget fails, by how
much, and which flag to change (``--snip-fp4-target``, ``--snip-time-target``). Pure functions of a
:class:`~megatron_snip.snip.ilp.SnipProblem` (``problem`` below; not imported: the ILP imports these), which
checks itself with :func:`check_feasible` when it is built.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

# The command-line flags that set the budgets, named in infeasibility errors.
TARGET_FLAG = "--snip-fp4-target"
TIME_TARGET_FLAG = "--snip-time-target"

# Slack when comparing FLOP fractions with the target, so that a plan that
# meets the target exactly is not refused over a rounding error.
FRACTION_TOL = 1e-9


class InfeasibleBudgetError(ValueError):
    """No plan meets the problem's budgets (FP4 share, GEMM time, or both together)."""


class InfeasibleTargetError(InfeasibleBudgetError):
    """The FP4 target cannot be met.

    Attributes (fractions of linear-layer FLOPs, in [0, 1]):
    ``target``; ``largest_feasible``, the largest target that could be met
    (the global value, or with per-stage constraints the smallest stage
    value); ``global_max``; ``stage_max`` (stage -> largest FP4 fraction).
    """

    def __init__(self, message: str, *, target: float, largest_feasible: float,
                 global_max: float, stage_max: Mapping[int, float]):
        super().__init__(message)
        self.target = target
        self.largest_feasible = largest_feasible
        self.global_max = global_max
        self.stage_max = dict(stage_max)


class InfeasibleTimeTargetError(InfeasibleBudgetError):
    """The GEMM-time target cannot be met (alone, or together with the FP4 target).

    Attributes (estimated GEMM time / all-BF16 time): ``target``; ``smallest_feasible``, the
    smallest target that could be met (with per-stage constraints, the largest stage value;
    with an FP4 target, the smallest time at that FP4 share); ``stage_min`` (stage -> smallest
    time ratio, ignoring the FP4 target).
    """

    def __init__(self, message: str, *, target: float, smallest_feasible: float, stage_min: Mapping[int, float]):
        super().__init__(message)
        self.target = target
        self.smallest_feasible = smallest_feasible
        self.stage_min = dict(stage_min)


def fp4_capacity(problem) -> tuple[float, dict[int, float]]:
    """Largest achievable FP4 FLOP fraction: ``(global, {stage: fraction})``.

    Every unit that may take an FP4 format takes one; this maximises every
    stage at once, so these are exact maxima. Stages without FLOPs are left out.
    """
    can = {u.key: any(f in problem.fp4_formats for f in u.allowed) for u in problem.units}
    stage_cap: dict[int, float] = {}
    for u in problem.units:
        stage_cap[u.stage] = stage_cap.get(u.stage, 0.0) + (u.flops if can[u.key] else 0.0)
    glob = sum(stage_cap.values()) / problem.total_flops
    return glob, {s: stage_cap[s] / f for s, f in sorted(problem.stage_flops.items()) if f > 0}


def time_capacity(problem) -> tuple[float, dict[int, float]]:
    """Smallest achievable estimated-time ratio (time / all-BF16 time): ``(global, {stage: ratio})``.

    Every unit in its fastest allowed format minimises every stage at once (the FP4 target
    is ignored here). Needs ``problem.speed``.
    """
    stage_time: dict[int, float] = {}
    for u in problem.units:
        stage_time[u.stage] = stage_time.get(u.stage, 0.0) + min(problem.unit_time(u, f) for f in u.allowed)
    glob = sum(stage_time.values()) / problem.scope_bf16_time()
    return glob, {s: stage_time[s] / problem.scope_bf16_time(s) for s, f in sorted(problem.stage_flops.items())
                  if f > 0}


def smallest_feasible_time_target(problem) -> float:
    """The smallest time target the allowed formats admit (per-stage included; FP4 target ignored)."""
    glob, stages = time_capacity(problem)
    return max(stages.values()) if problem.per_stage else glob


def largest_feasible_target(problem) -> float:
    """The largest target the problem's constraints admit (pins and per-stage included)."""
    glob, stages = fp4_capacity(problem)
    return min(stages.values()) if problem.per_stage else glob


def capacity_text(glob: float, stages: Mapping[int, float], per_stage: bool) -> str:
    """e.g. "0.875 (global) / 0.8 (stage 1)": the binding stage is named only with per-stage budgets."""
    text = f"{glob:.6g} (global)"
    if per_stage:
        stage = min(stages, key=stages.get)
        text += f" / {stages[stage]:.6g} (stage {stage})"
    return text


def check_feasible(problem) -> None:
    """Raise the :class:`InfeasibleBudgetError` that says why, where a budget cannot be met on its own."""
    if problem.time_target is not None:
        smallest = smallest_feasible_time_target(problem)
        if problem.time_target < smallest - FRACTION_TOL:
            glob, stages = time_capacity(problem)
            where = f"{glob:.6g} (global)"
            if problem.per_stage:
                stage = max(stages, key=stages.get)
                where += f" / {stages[stage]:.6g} (stage {stage})"
            raise InfeasibleTimeTargetError(
                f"time target {problem.time_target:.6g} is infeasible: with every module in its fastest "
                f"candidate format ({_fastest(problem)}) the estimated GEMM time is {where} of the all-BF16 time. "
                f"Raise {TIME_TARGET_FLAG}, add a faster candidate format, or choose another --gemm-speed-model.",
                target=problem.time_target, smallest_feasible=smallest, stage_min=stages)
    largest = largest_feasible_target(problem)
    if problem.target <= largest + FRACTION_TOL:
        return
    glob, stages = fp4_capacity(problem)
    if not problem.fp4_formats:
        why = f"none of the candidate formats {list(problem.formats)} is FP4, so"
        advice = f"Add an FP4 candidate format or set {TARGET_FLAG} 0."
    else:
        pinned = Counter(u.pin for u in problem.units if u.pin is not None and u.pin not in problem.fp4_formats)
        n = sum(pinned.values())
        what = ("module pass" if problem.split else "module") + ("" if n == 1 else "es" if problem.split else "s")
        detail = ", ".join(f"{f}: {k}" for f, k in sorted(pinned.items()))
        why = f"with {n} {what} pinned to non-FP4 formats ({detail})"
        advice = f"Lower {TARGET_FLAG} or unpin modules."
    raise InfeasibleTargetError(
        f"FP4 target {problem.target:.6g} is infeasible: {why} the largest feasible target is "
        f"{capacity_text(glob, stages, problem.per_stage)}. {advice}",
        target=problem.target, largest_feasible=largest, global_max=glob, stage_max=stages,
    )


def _fastest(problem) -> str:
    best = max(problem.formats, key=problem.speed.get)
    return f"{best}: {problem.speed[best]:.3g}x bf16" + (" overall" if problem.unit_speed is not None else "")

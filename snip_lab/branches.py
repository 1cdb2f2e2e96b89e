"""What a comparison is: its settings, its arms, its branches and what a finished branch measured.

The runner (``comparison.py``), the report (``report.py``), the merge of reports (``merge.py``) and the
estimator screen (``tools/lab/screen_estimators.py``) all read these; none of them is needed to read a
comparison's records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_snip.snip.policies import POLICIES
from megatron_snip.snip.statistics_file import Budget

from .ablation import KINDS
from .oracle import NEEDS, ORACLE, load_costs

REFERENCE = "bf16"
# The noise floor: BF16 again from the same trunk on another order of the training documents (reorder.py);
# its paired gap to REFERENCE is what arms differ by when nothing but the batches differs.
NOISE = "bf16-reorder"
NOISE_ORDER_SEED = 1  # the permutation of the training documents (the same for every seed: each seed's
#                       dataset shuffle then draws its own order from it)
# Arms re-planned by SNIP at every --snip-interval from the branch point: arm -> (offline policy of the
# first plan, extra pretrain_llama.py flags). "snip-loss-term-replanned" plans by the loss term alone,
# "snip-fisher-loss-term-replanned" by the loss term with the empirical-Fisher curvature.
REPLANNED = {
    "snip": ("snip", ()),
    "snip-loss-term-replanned": ("snip-loss-term", ("--snip-update-weight", "0")),
    "snip-fisher-loss-term-replanned": ("snip-fisher-loss-term",
                                        ("--snip-update-weight", "0", "--snip-curvature", "fisher")),
}
FIXED = {"snip-fixed": "snip"}  # arm -> offline policy whose plan it keeps fixed
# SNIP flags the training flags may set: they change what the probes measure, not how an arm trains, so
# every arm shares them: the trunk's cycle (hence every statistics-based first plan) and every re-plan.
SHARED_PROBE_FLAGS = ("--snip-gain-exclude", "--snip-probe-passes")
# ORACLE plans with the costs the ablation arms measured, so its branches train after theirs (oracle.py).
ARMS = (*REPLANNED, *FIXED, *(p for p in POLICIES if p != "snip"), ORACLE)
TRACKER = "latest_checkpointed_iteration.txt"
# Settings that may change between reruns of one comparison (arms and seeds added; how the work is
# scheduled): the others fix what a branch measures, so branches of one folder, or merged reports, share them.
FREE_SETTINGS = ("policies", "budgets", "seeds", "ablations", "jobs", "noise_floor", "ablation_seeds", "versus",
                 "oracle_costs")


@dataclass(frozen=True)
class ComparisonConfig:
    """Settings of one comparison (``tools/lab/compare_precision.py`` flags).

    ``train_args`` are the ``pretrain_llama.py`` flags every run shares (model, data,
    tokenizer, optimizer, layout, evaluation); the tool adds seed, iterations, checkpoints,
    TensorBoard and the precision flags of each arm.
    """

    out: str
    train_args: tuple[str, ...]
    policies: tuple[str, ...]
    budgets: tuple[Budget, ...]
    seeds: tuple[int, ...]
    trunk_iters: int  # iterations of the BF16 trunk; its first SNIP cycle is the branch point
    train_iters: int  # total iterations of every branch (trunk included)
    snip_interval: int  # re-planning interval of the "snip" arm (and its checkpoint interval)
    formats: tuple[str, ...] = ("bf16", "fp8", "nvfp4")  # SNIP candidates (--snip-formats)
    nproc: int = 1  # processes per run (torchrun --nproc-per-node)
    window: int = 0  # mean training loss over the last `window` iterations (0: a fifth of the branch)
    solver: str = "auto"
    ablations: tuple[str, ...] = ()  # per-module ablation arms: "layers" and/or "types" (ablation.py)
    jobs: int = 1  # runs training at once (how the work is scheduled, not what it measures)
    noise_floor: bool = False  # train the NOISE arm for every seed
    ablation_seeds: tuple[int, ...] = ()  # seeds that train the ablation arms (default: every seed)
    versus: str | None = None  # the arm the report sets every other against (default: SNIP's, report.FOCUS)
    oracle_costs: str | None = None  # an earlier comparison's OUT/oracle/costs.json: the oracle's costs, no ablations

    def __post_init__(self):
        unknown = sorted(set(self.policies) - set(ARMS))
        if unknown:
            raise ValueError(f"--policies: unknown {unknown}; choose from {list(ARMS)}")
        if not 0 < self.trunk_iters < self.train_iters:
            raise ValueError(f"--trunk-iters {self.trunk_iters} must be > 0 and below --train-iters "
                             f"{self.train_iters} (the branches train from the trunk to --train-iters)")
        if not self.budgets and not self.ablations:
            raise ValueError("give at least one budget (--fp4-targets or --time-targets) or --ablations")
        bad = [b.label for b in self.budgets
               if not (0 < b.time_target if b.time_target is not None else 0 < b.fp4_target <= 1)]
        if bad:
            raise ValueError(f"budgets {bad}: an FP4 target is a share of the linear FLOPs in (0, 1] (--fp4-targets "
                             "0.75 0.9), a time target a positive ratio to all-BF16 GEMM time (--time-targets 0.4)")
        if set(self.ablations) - set(KINDS):
            raise ValueError(f"--ablations: unknown {sorted(set(self.ablations) - set(KINDS))}; choose from {KINDS}")
        if self.oracle_costs is not None:
            if ORACLE not in self.policies or self.ablations:
                raise ValueError(f"--oracle-costs plans the {ORACLE} arm with costs measured before: give it with "
                                 f"--policies ... {ORACLE} and without --ablations (which would measure them again)")
            load_costs(self.oracle_costs)
        elif ORACLE in self.policies and not any(set(n) <= set(self.ablations) for n in NEEDS):
            raise ValueError(f"--policies {ORACLE} plans with the costs the ablations measure: add --ablations "
                             f"{' or --ablations '.join(' '.join(n) for n in NEEDS)} (got {list(self.ablations)}), "
                             f"or --oracle-costs with an earlier comparison's OUT/{ORACLE}/costs.json")
        if not self.seeds:
            raise ValueError("give at least one --seeds value")
        if self.versus is not None and self.versus not in self.policies:
            raise ValueError(f"--versus {self.versus} is not among --policies {list(self.policies)}; the report "
                             "sets every arm against one of them")
        if set(self.ablation_seeds) - set(self.seeds):
            raise ValueError(f"--ablation-seeds {sorted(set(self.ablation_seeds) - set(self.seeds))} are not among "
                             f"--seeds {list(self.seeds)}")
        if self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs}: give 1 or more runs at once")
        visible = visible_devices()
        if self.jobs > 1 and visible and len(visible) < self.jobs * self.nproc:
            raise ValueError(f"--jobs {self.jobs} x --nproc-per-node {self.nproc} needs {self.jobs * self.nproc} "
                             f"GPUs, CUDA_VISIBLE_DEVICES={','.join(visible)} has {len(visible)}; lower --jobs")
        taken = {"--seed", "--train-iters", "--save", "--load", "--tensorboard-dir", "--snip", "--precision",
                 "--precision-plan", "--save-interval", "--snip-interval", "--exit-interval", "--finetune"}
        clash = sorted(a for a in self.train_args
                       if a in taken or (a.startswith("--snip-") and a not in SHARED_PROBE_FLAGS))
        if clash:
            raise ValueError(f"training flags {clash} are set by the comparison for each arm; remove them "
                             f"(use --seeds, --trunk-iters, --train-iters, --formats and the budget flags)")

    @property
    def branch_window(self) -> int:
        return self.window or max(1, (self.train_iters - self.trunk_iters) // 5)

    @property
    def seeds_of_ablations(self) -> tuple[int, ...]:
        return tuple(s for s in self.seeds if s in self.ablation_seeds) if self.ablation_seeds else self.seeds


@dataclass(frozen=True)
class Branch:
    """One training run: ``arm`` at ``budget`` (None for the BF16 reference) for ``seed``."""

    arm: str
    budget: Budget | None
    seed: int

    @property
    def name(self) -> str:
        return self.arm if self.budget is None else f"{self.arm}_{self.budget.tag}"


@dataclass
class BranchResult:
    """What one finished branch measured (from its TensorBoard scalars)."""

    final_valid_loss: float
    mean_train_loss: float  # over the last `window` iterations
    fp4_fraction: float  # of linear FLOPs at the end of the branch
    time_ratio: float  # estimated GEMM time vs bf16 at the end (an estimate)
    valid_curve: dict[int, float] = field(default_factory=dict)
    train_curve: dict[int, float] = field(default_factory=dict)


def branches(config: ComparisonConfig, ablation_arms: Sequence[str] = ()) -> list[Branch]:
    """Every branch, the BF16 reference of each seed first (then the noise floor), the ablation arms
    (budget-free, on their seeds) last; an arm's seeds one after the other, so a comparison cut short
    has whole arms."""
    out = [Branch(REFERENCE, None, s) for s in config.seeds]
    out += [Branch(NOISE, None, s) for s in config.seeds if config.noise_floor]
    out += [Branch(arm, b, s) for b in config.budgets for arm in config.policies for s in config.seeds]
    out += [Branch(arm, None, s) for arm in ablation_arms for s in config.seeds_of_ablations]
    return out


def branch_results(out: Path, every: Sequence[Branch]) -> dict[tuple[str, int], BranchResult]:
    """(branch name, seed) -> result of each finished branch of ``every`` in the comparison ``out``."""
    results = {}
    for b in every:
        path = out / f"seed{b.seed}" / b.name / "result.json"
        if path.exists():
            results[(b.name, b.seed)] = BranchResult(**json.loads(path.read_text()))
    return results


def final_losses(results: Mapping[tuple[str, int], BranchResult]) -> dict[str, dict[int, float]]:
    """branch name -> seed -> final validation loss, of :func:`branch_results`."""
    losses: dict[str, dict[int, float]] = {}
    for (name, seed), r in results.items():
        losses.setdefault(name, {})[seed] = r.final_valid_loss
    return losses


def first_plan_policy(arm: str) -> str:
    """The offline policy whose plan (at the arm's budget) a branch of ``arm`` starts from."""
    return REPLANNED[arm][0] if arm in REPLANNED else FIXED.get(arm, arm)


def visible_devices() -> list[str]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` names (empty when it is unset: every device)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else []


def settings(config: ComparisonConfig) -> dict:
    """The settings as comparison.json records them (budgets as tags, no ``out``)."""
    d = asdict(config)
    d["budgets"] = [b.tag for b in config.budgets]
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k != "out"}


def parse_budgets(fp4_targets: Sequence[float], time_targets: Sequence[float]) -> tuple[Budget, ...]:
    return tuple([Budget(t) for t in fp4_targets] + [Budget(time_target=t) for t in time_targets])

"""A head-to-head of precision policies: one training branch per (policy, budget, seed).

Every branch is a normal ``pretrain_llama.py`` run (any TP x PP x DP layout) started from the
same trunk checkpoint of its seed, so all branches of a seed share the weights, optimizer state
and data order up to the branch point and train the same iterations on the same batches. The
trunk runs BF16 with ``--snip`` until its first cycle, whose statistics give every policy its
plan (``megatron_snip/research/offline.py``) at exactly the same budget.

Layout of ``out/``::

    comparison.json                 the settings (a rerun with other settings is refused)
    seed<S>/trunk/                  trunk checkpoint and its snip/snip_iter_*.json
    seed<S>/plans/<policy>_<budget>.json
    seed<S>/<arm>/ckpt/, log.txt, result.json   one branch (result.json: finished)
    reordered/                      the noise-floor arm's data: training documents permuted (reorder.py)
    tensorboard/seed<S>/<arm>/     every branch side by side in TensorBoard
    results.json, results.md, gap_to_bf16.png

A branch without ``result.json`` is (re)started, from its own newest checkpoint if it has one,
so an interrupted comparison picks up where it stopped. A SIGTERM or SIGUSR1 to the tool (``kill``,
SLURM's ``--signal``) reaches the runs in flight, which save a checkpoint and stop (:class:`Runs`).
With ``jobs`` > 1 that many runs train at once (trunks of different seeds, then branches), each on
its own slice of ``CUDA_VISIBLE_DEVICES``; every run is deterministic on its own, so the results do
not depend on ``jobs``.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_snip.fileio import write_text_atomic
from megatron_snip.numerics.registry import FP4_NAMES
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.research.ablation import KINDS, NONE_ARM, ablation_plans, predictions
from megatron_snip.research.offline import POLICIES, policy_plans
from megatron_snip.research.oracle import (
    NEEDS,
    ORACLE,
    OracleCosts,
    load_costs,
    measured_costs,
    oracle_groups,
    oracle_plan,
    predicted_gap,
)
from megatron_snip.research.reorder import reordered_data_args
from megatron_snip.snip.ilp import InfeasibleBudgetError, evaluate_plan
from megatron_snip.snip.planner import to_precision_plan
from megatron_snip.snip.statistics_file import Budget, StatisticsFile
from megatron_snip.training import tags
from megatron_snip.training.metrics_record import read_metrics

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
    """Settings of one comparison (``tools/compare_precision.py`` flags).

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
        visible = _visible_devices()
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


class Stopped(Exception):
    """A signal stopped the comparison; the runs it interrupted were asked to save and stop."""

    def __init__(self, signum: int):
        self.signum = signum
        # A run still starting up (no handler yet) stops without saving: it resumes from its newest checkpoint.
        super().__init__(f"stopped by {signal.Signals(signum).name}: the runs in flight were asked to save a "
                         f"checkpoint; rerun the same command to resume from the newest ones")


class Runs:
    """The training runs in flight, so that a signal to the tool reaches them.

    Without it a ``kill`` of the tool (or SLURM's ``--signal`` aimed at the batch script) would leave
    its ``torchrun`` children training, and a rerun would start a second writer of the same checkpoint
    folder. :meth:`stop` sends SIGTERM to each ``torchrun``, which passes it to its workers; they finish
    the iteration, save and exit (``training/signals.py``). After :meth:`stop` no new run starts.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._procs: set[subprocess.Popen] = set()
        self.signum: int | None = None

    def run(self, cmd: Sequence[str], **popen_kwargs) -> int:
        """Run ``cmd`` to its end; its exit status, or :class:`Stopped` if :meth:`stop` was called."""
        with self._lock:  # a stop() between the check and the start would miss the new process
            if self.signum is not None:
                raise Stopped(self.signum)
            proc = subprocess.Popen(cmd, **popen_kwargs)
            self._procs.add(proc)
        try:
            status = proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self.signum is not None:
            raise Stopped(self.signum)
        return status

    def stop(self, signum: int) -> int:
        """Ask every run in flight to save and stop (a signal handler); returns how many there were."""
        with self._lock:
            self.signum = signum
            procs = list(self._procs)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)  # torchrun forwards SIGTERM to its workers (not SIGUSR1)
        return len(procs)


class Comparison:
    """Runs the branches of ``config`` that have not finished, then writes the report."""

    def __init__(self, config: ComparisonConfig, log=print):
        self.config = config
        self.out = Path(config.out)
        self.log = log
        self.ablation_arms: list[str] = []  # known once a trunk's statistics give the modules
        self.runs = Runs()

    def stop(self, signum: int, frame=None) -> None:
        """Signal handler: the runs in flight save and stop, no new one starts, :meth:`run` raises :class:`Stopped`."""
        n = self.runs.stop(signum)
        self.log(f"{signal.Signals(signum).name} received: asking {n} run(s) in flight to save a checkpoint and stop")

    # -- settings --------------------------------------------------------
    def check_settings(self) -> None:
        """Record the settings; refuse to mix branches of different settings in one folder."""
        path = self.out / "comparison.json"
        mine = settings(self.config)
        if path.exists():
            theirs = json.loads(path.read_text())
            # (a costs.json already there must equal --oracle-costs: _oracle_plans)
            differ = sorted(k for k in set(mine) | set(theirs)
                            if k not in FREE_SETTINGS and mine.get(k) != theirs.get(k))
            if differ:
                raise ValueError(f"{self.out} holds a comparison with other settings ({', '.join(differ)} differ); "
                                 f"choose another --out or the same settings")
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(str(path), json.dumps(mine, indent=1))

    # -- running ---------------------------------------------------------
    def run(self) -> dict:
        self.check_settings()
        c = self.config
        run_all([lambda slot, s=s: self._trunk(s, slot) for s in c.seeds], c.jobs)
        for seed in c.seeds:
            self._plans(seed)
        if c.noise_floor:
            self.log(f"noise floor: the training documents reordered under {self.out / 'reordered'}")
            reordered_data_args(c.train_args, self.out / "reordered", NOISE_ORDER_SEED)
        every = branches(c, self.ablation_arms)
        run_all(self._tasks([b for b in every if b.arm != ORACLE]), c.jobs)
        if ORACLE in c.policies:  # its plan needs every ablation branch's result
            self._oracle_plans()
            run_all(self._tasks([b for b in every if b.arm == ORACLE]), c.jobs)
        return self.report()

    def _tasks(self, todo: Sequence[Branch]) -> list[Callable[[int], None]]:
        """One task per branch, except that the branches of one seed that start from the same fixed plan
        (uniform at every budget; two policies that agree) are one task: a branch is a function of its
        seed's trunk and its plan, so one training run answers for all of them."""
        groups: dict[object, list[Branch]] = {}
        for b in todo:
            plan = None if b.arm in (REFERENCE, NOISE) or b.arm in REPLANNED else self.plan_path(b)
            key = (b.seed, plan.read_bytes()) if plan is not None and plan.exists() else b
            groups.setdefault(key, []).append(b)
        return [lambda slot, g=g: self._train_once(g, slot) for g in groups.values()]

    def _train_once(self, same_plan: Sequence[Branch], slot: int = 0) -> None:
        """Train the first of ``same_plan`` (branches of one seed with one fixed plan); the others take its result."""
        first, *others = same_plan
        self._branch(first, slot)
        for b in others:
            where = self.out / f"seed{b.seed}" / b.name
            if (where / "result.json").exists():
                self.log(f"seed {b.seed}: {b.name} done")
                continue
            where.mkdir(parents=True, exist_ok=True)
            result = (self.out / f"seed{first.seed}" / first.name / "result.json").read_text()
            write_text_atomic(str(where / "result.json"), result)
            self.log(f"seed {b.seed}: {b.name}: the plan of {first.name}, trained once: its result")

    def _trunk(self, seed: int, slot: int = 0) -> None:
        c = self.config
        trunk = self.out / f"seed{seed}" / "trunk"
        # Done = its statistics and its checkpoint at the branch point: a stop between the two (the statistics
        # written, the save cut short) leaves no checkpoint to branch from, so the trunk trains again.
        tracker = trunk / "ckpt" / TRACKER
        if self._stats_path(seed).exists() and tracker.exists() and tracker.read_text().strip() == str(c.trunk_iters):
            self.log(f"seed {seed}: trunk done ({trunk})")
            return
        self.log(f"seed {seed}: trunk, bf16 to iteration {c.trunk_iters} then one SNIP cycle")
        self._train(trunk, self.trunk_args(seed), log=trunk / "log.txt", slot=slot)
        if not self._stats_path(seed).exists():
            raise RuntimeError(f"the trunk of seed {seed} wrote no SNIP statistics ({self._stats_path(seed)}); "
                               f"see {trunk / 'log.txt'}")

    def trunk_args(self, seed: int) -> list[str]:
        """pretrain_llama.py's flags for the trunk of ``seed``: BF16, one SNIP cycle at --trunk-iters."""
        c = self.config
        trunk = self.out / f"seed{seed}" / "trunk"
        # --train-iters is the branches' so the learning-rate schedule is the one they continue.
        return [*c.train_args, "--seed", str(seed), "--train-iters", str(c.train_iters),
                "--exit-interval", str(c.trunk_iters), "--save", str(trunk / "ckpt"),
                "--load", str(trunk / "ckpt"), "--save-interval", str(c.trunk_iters),
                "--snip", "--snip-formats", *c.formats]

    def _stats_path(self, seed: int) -> Path:
        return self.out / f"seed{seed}" / "trunk" / "ckpt" / "snip" / f"snip_iter_{self.config.trunk_iters:07d}.json"

    def _plans(self, seed: int) -> None:
        """Each plan-based arm's plan at each budget, from the trunk's statistics (same budget for all)."""
        c = self.config
        stats = StatisticsFile.load(self._stats_path(seed))
        directory = self.out / f"seed{seed}" / "plans"
        directory.mkdir(parents=True, exist_ok=True)
        wanted = sorted({first_plan_policy(a) for a in c.policies if a != ORACLE})
        for budget in c.budgets:
            problem = stats.problem(budget, formats=c.formats, solver=c.solver)
            for name, plan in policy_plans(problem, stats.stats, wanted, seed=seed, solver=c.solver).items():
                path = directory / f"{name}_{budget.tag}.json"
                if isinstance(plan, InfeasibleBudgetError):
                    self.log(f"seed {seed}, {budget.label}: {name} cannot meet the budget: {plan}")
                    continue
                ev = evaluate_plan(problem, plan)
                to_precision_plan(plan, split=problem.split).save(path)
                self.log(f"seed {seed}, {budget.label}: {name}: {ev.fp4_fraction:.1%} FP4, estimated time "
                         f"{ev.time_ratio:.3f} x bf16, predicted divergence {ev.divergence:.4g}")
        if c.ablations:
            problem = stats.problem(Budget(0.0), formats=c.formats, solver=c.solver)
            plans = ablation_plans(problem, c.ablations, none=ORACLE in c.policies)
            predicted = {}
            for arm, plan in plans.items():
                to_precision_plan(plan, split=problem.split).save(directory / f"{arm}.json")
                predicted[arm] = predictions(problem, stats.stats, plan)
            write_text_atomic(str(directory / "predictions.json"), json.dumps(predicted, indent=1))
            self.ablation_arms = list(plans)

    def _oracle_plans(self) -> None:
        """The oracle's plan at each budget (``OUT/oracle/``) from the ablation branches' measured costs,
        or from ``--oracle-costs``.

        The costs are taken once, from the seeds measured then (``costs.json``); a rerun keeps them,
        so every oracle branch trains the same plan even when seeds are added (delete ``OUT/oracle``
        and the oracle branches to re-plan from all seeds). A budget added later is planned with them.
        """
        c = self.config
        directory = self.out / ORACLE
        directory.mkdir(parents=True, exist_ok=True)
        stats = StatisticsFile.load(self._stats_path(c.seeds[0]))  # every seed's problem has the same budgets
        path = directory / "costs.json"
        given = load_costs(c.oracle_costs) if c.oracle_costs is not None else None
        if given is not None:
            problem = stats.problem(Budget(0.0), formats=c.formats, solver=c.solver)
            missing = sorted(u.key for u in problem.units if u.pin is None and u.key not in given.modules)
            if missing:
                raise ValueError(f"--oracle-costs {c.oracle_costs}: no cost for {len(missing)} of this model's "
                                 f"modules ({missing[0]}, ...); they come from another model: give the costs.json "
                                 "of a comparison of the same model")
        if path.exists():
            costs = load_costs(path)
            if given is not None and _json(given) != _json(costs):
                raise ValueError(f"--oracle-costs {c.oracle_costs}: {path} holds other costs, which this folder's "
                                 "oracle branches planned with; choose another --out, or delete that file, the "
                                 f"{ORACLE}_*.json plans beside it and the {ORACLE} branches")
        else:
            costs = given or self._measured_costs(stats)
            write_text_atomic(str(path), _json(costs))
        origin = f", copied from {c.oracle_costs}" if given is not None else ""
        self.log(f"oracle: costs from the {costs.source} ablations of seeds {costs.seeds} ({path}{origin})")
        for budget in c.budgets:
            plan_path = directory / f"{ORACLE}_{budget.tag}.json"
            if plan_path.exists():
                continue
            problem = stats.problem(budget, formats=c.formats, solver=c.solver)
            plan = oracle_plan(problem, costs, c.solver)
            to_precision_plan(plan, split=False).save(plan_path)
            ev = evaluate_plan(problem, plan)
            self.log(f"oracle, {budget.label}: {ev.fp4_fraction:.1%} FP4, estimated time {ev.time_ratio:.3f} x bf16, "
                     f"additive prediction of its gap {predicted_gap(costs, fp4_modules(plan)):+.4f}")

    def _measured_costs(self, stats: StatisticsFile) -> OracleCosts:
        """The oracle's costs from the finished ablation branches (oracle.py: group and module costs)."""
        c = self.config
        problem = stats.problem(Budget(0.0), formats=c.formats, solver=c.solver)
        groups = oracle_groups(problem, c.ablations)
        return measured_costs(groups, final_losses(branch_results(self.out, branches(c, [*groups, NONE_ARM]))),
                              REFERENCE)

    def _branch(self, b: Branch, slot: int = 0) -> None:
        c = self.config
        where = self.out / f"seed{b.seed}" / b.name
        if (where / "result.json").exists():
            self.log(f"seed {b.seed}: {b.name} done")
            return
        resumed = (where / "ckpt" / TRACKER).exists()
        self.log(f"seed {b.seed}: {b.name}{' (resuming)' if resumed else ''}")
        start = time.monotonic()
        self._train(where, self.branch_args(b), log=where / "log.txt", slot=slot)
        result = read_result(where / "ckpt", c.train_iters, c.train_iters - c.branch_window)
        write_text_atomic(str(where / "result.json"), json.dumps(asdict(result)))
        self.log(f"seed {b.seed}: {b.name} finished in {(time.monotonic() - start) / 60:.1f} min: validation loss "
                 f"{result.final_valid_loss:.4f}")

    def branch_args(self, b: Branch) -> list[str]:
        """pretrain_llama.py's flags for branch ``b``: from the trunk's checkpoint, or from its own if it has one."""
        c = self.config
        ckpt = self.out / f"seed{b.seed}" / b.name / "ckpt"
        resumed = (ckpt / TRACKER).exists()
        train_args = (reordered_data_args(c.train_args, self.out / "reordered", NOISE_ORDER_SEED) if b.arm == NOISE
                      else c.train_args)
        args = [*train_args, "--seed", str(b.seed), "--train-iters", str(c.train_iters), "--save", str(ckpt),
                "--load", str(ckpt if resumed else self.out / f"seed{b.seed}" / "trunk" / "ckpt"),
                "--save-interval", str(c.snip_interval),
                "--tensorboard-dir", str(self.out / "tensorboard" / f"seed{b.seed}" / b.name)]
        if not resumed:  # from its own checkpoint a branch keeps its (possibly re-planned) plan
            args += self._precision_flags(b)
        if b.arm in REPLANNED:
            args += ["--snip", "--snip-formats", *c.formats, *_budget_flags(b.budget), *REPLANNED[b.arm][1]]
        return args

    def _precision_flags(self, b: Branch) -> list[str]:
        if b.arm in (REFERENCE, NOISE):
            return ["--precision", "bf16"]
        plan = self.plan_path(b)
        if b.budget is not None and not plan.exists():
            raise RuntimeError(f"no plan {plan}: the {b.arm} policy cannot meet {b.budget.label} (see above)")
        return ["--precision-plan", str(plan)]

    def plan_path(self, b: Branch) -> Path:
        """The plan file a branch (not the BF16 reference) starts from."""
        if b.budget is None:  # an ablation arm
            return self.out / f"seed{b.seed}" / "plans" / f"{b.arm}.json"
        if b.arm == ORACLE:
            return self.out / ORACLE / f"{ORACLE}_{b.budget.tag}.json"
        return self.out / f"seed{b.seed}" / "plans" / f"{first_plan_policy(b.arm)}_{b.budget.tag}.json"

    def _train(self, where: Path, args: list[str], log: Path, slot: int = 0) -> None:
        where.mkdir(parents=True, exist_ok=True)
        # --standalone: torchrun's agent binds its own rendezvous port, so runs started side by side (--jobs)
        # cannot race for one as a port picked beforehand can (EADDRINUSE ended a comparison that way).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(self.config.nproc),
               str(Path(__file__).resolve().parents[2] / "pretrain_llama.py"), *args]
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            env = run_env(slot, self.config.nproc, self.config.jobs)
            status = self.runs.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if status != 0:
            raise RuntimeError(f"training run failed (exit {status}); see {log}")

    # -- the report ------------------------------------------------------
    def report(self) -> dict:
        from megatron_snip.research.report import summarize, write_report

        every = branches(self.config, self.ablation_arms)
        results = branch_results(self.out, every)
        predicted = {s: json.loads((self.out / f"seed{s}" / "plans" / "predictions.json").read_text())
                     for s in self.config.seeds if self.ablation_arms}
        summary = summarize(self.config, results, every, predicted, self._additive_predictions(every))
        summary["settings"] = settings(self.config)  # what a merge of reports checks (merge.py)
        write_report(self.config, summary, results, self.out)
        return summary


    def _additive_predictions(self, every: Sequence[Branch]) -> dict | None:
        """With an oracle: its costs and, per fixed-plan branch at a budget (name -> seed ->), the gap
        its plan would have under additivity (oracle.predicted_gap), to set beside the measured one."""
        path = self.out / ORACLE / "costs.json"
        if not path.exists():
            return None
        costs = load_costs(path)
        predicted: dict[str, dict[int, float]] = {}
        for b in every:
            plan = self.plan_path(b) if b.budget is not None and b.arm not in REPLANNED else None
            if plan is not None and plan.exists():
                units = {name: p.fwd for name, p in PrecisionPlan.load(plan).modules.items()}
                predicted.setdefault(b.name, {})[b.seed] = predicted_gap(costs, fp4_modules(units))
        return {"costs": asdict(costs), "predicted": predicted}


def fp4_modules(plan: Mapping[str, str]) -> list[str]:
    """The modules a joint plan (module -> format) runs in an FP4 format."""
    return [m for m, f in plan.items() if f in FP4_NAMES]


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


def run_all(tasks: Sequence[Callable[[int], None]], jobs: int) -> None:
    """Run ``tasks`` (each called with its slot, 0 <= slot < jobs), at most ``jobs`` at once, in order.

    After a task fails no new one starts; those running finish, then the first error is raised.
    """
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(jobs):
        slots.put(slot)
    failed = threading.Event()

    def one(task):
        if failed.is_set():
            return
        slot = slots.get()
        try:
            task(slot)
        except BaseException:
            failed.set()
            raise
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, t) for t in tasks]
    for f in futures:
        f.result()  # re-raises the first task's error in task order


# torchrun SIGKILLs its workers this long after passing a stop signal on to them (torch's default: 30 s).
# A run asked to stop finishes its iteration and saves, which can take longer: under load (two runs on
# two cores) a 16-layer trunk's final save was cut, leaving no checkpoint at the branch point.
STOP_GRACE_S = 300


def run_env(slot: int, nproc: int, jobs: int) -> dict[str, str]:
    """The environment of one training run: one OpenMP thread per process and torchrun's grace for a save
    after a stop signal (:data:`STOP_GRACE_S`; either set in the tool's environment wins), and the run's
    devices (:func:`devices`)."""
    return {"OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(STOP_GRACE_S), **os.environ,
            **devices(slot, nproc, jobs)}


def devices(slot: int, nproc: int, jobs: int) -> dict[str, str]:
    """The environment that gives a run in ``slot`` its own ``nproc`` GPUs when ``jobs`` runs share a node
    (a slice of ``CUDA_VISIBLE_DEVICES``, or of 0..jobs*nproc-1); nothing when runs go one at a time."""
    if jobs == 1:
        return {}
    ids = _visible_devices() or [str(i) for i in range(jobs * nproc)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[slot * nproc:(slot + 1) * nproc])}


def _visible_devices() -> list[str]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` names (empty when it is unset: every device)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else []


def _budget_flags(budget: Budget) -> list[str]:
    if budget.time_target is None:
        return ["--snip-fp4-target", str(budget.fp4_target)]
    return ["--snip-time-target", str(budget.time_target), "--snip-fp4-target", "0"]


def read_result(save_dir: Path, train_iters: int, window_start: int) -> BranchResult:
    """A finished branch's numbers from its own record of its scalars (``SAVE/metrics.jsonl``: the values
    its TensorBoard shows)."""
    metrics = read_metrics(save_dir)
    valid, train = metrics.get(tags.LM_LOSS_VALIDATION, {}), metrics.get(tags.LM_LOSS, {})
    if train_iters not in valid:
        raise RuntimeError(f"{save_dir}: no validation loss at iteration {train_iters} (eval-iters 0?)")
    last = [v for it, v in train.items() if it > window_start]
    fp4, gemm_time = metrics.get(tags.FP4_FRACTION, {}), metrics.get(tags.GEMM_TIME, {})
    return BranchResult(final_valid_loss=valid[train_iters],
                        mean_train_loss=sum(last) / len(last) if last else math.nan,
                        fp4_fraction=fp4[max(fp4)] if fp4 else math.nan,
                        time_ratio=gemm_time[max(gemm_time)] if gemm_time else math.nan,
                        valid_curve=valid, train_curve=train)


def _json(costs: OracleCosts) -> str:
    """costs.json's text (nan as NaN, as json writes it): equal texts, equal costs."""
    return json.dumps(asdict(costs), indent=1)


def settings(config: ComparisonConfig) -> dict:
    """The settings as comparison.json records them (budgets as tags, no ``out``)."""
    d = asdict(config)
    d["budgets"] = [b.tag for b in config.budgets]
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k != "out"}


def parse_budgets(fp4_targets: Sequence[float], time_targets: Sequence[float]) -> tuple[Budget, ...]:
    return tuple([Budget(t) for t in fp4_targets] + [Budget(time_target=t) for t in time_targets])

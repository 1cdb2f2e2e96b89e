"""A head-to-head of precision policies: one training branch per (policy, budget, seed).

Every branch is a normal ``pretrain_llama.py`` run (any TP x PP x DP layout) started from the
same trunk checkpoint of its seed, so all branches of a seed share the weights, optimizer state
and data order up to the branch point and train the same iterations on the same batches. The
trunk runs BF16 with ``--snip`` until its first cycle, whose statistics give every policy its
plan (``megatron_snip/snip/policies.py``; the settings and branches: ``branches.py``) at exactly the same budget.

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
from dataclasses import asdict
from pathlib import Path

from megatron_snip.fileio import write_text_atomic
from megatron_snip.numerics.registry import FP4_NAMES
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.feasibility import InfeasibleBudgetError
from megatron_snip.snip.ilp import evaluate_plan
from megatron_snip.snip.planner import to_precision_plan
from megatron_snip.snip.policies import UnavailablePolicy, policy_plans
from megatron_snip.snip.statistics_file import Budget, StatisticsFile
from megatron_snip.training import tags
from megatron_snip.training.metrics_record import read_metrics

from .ablation import NONE_ARM, ablation_plans, predictions
from .branches import (
    FREE_SETTINGS,
    NOISE,
    NOISE_ORDER_SEED,
    REFERENCE,
    REPLANNED,
    TRACKER,
    Branch,
    BranchResult,
    ComparisonConfig,
    branch_results,
    branches,
    final_losses,
    first_plan_policy,
    settings,
    visible_devices,
)
from .oracle import ORACLE, OracleCosts, load_costs, measured_costs, oracle_groups, oracle_plan, predicted_gap
from .reorder import reordered_data_args
from .report import summarize, write_report


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
                if isinstance(plan, UnavailablePolicy):
                    raise ValueError(f"policy {name}: {plan}")
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
               str(Path(__file__).resolve().parents[1] / "pretrain_llama.py"), *args]
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            env = run_env(slot, self.config.nproc, self.config.jobs)
            status = self.runs.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if status != 0:
            raise RuntimeError(f"training run failed (exit {status}); see {log}")

    # -- the report ------------------------------------------------------
    def report(self) -> dict:
        paths = {s: self.out / f"seed{s}" / "plans" / "predictions.json" for s in self.config.seeds}
        predicted = {s: json.loads(p.read_text()) for s, p in paths.items() if self.config.ablations and p.exists()}
        if not self.ablation_arms:  # --report-only plans nothing: the arms are those the trunks' plans named
            self.ablation_arms = list(next(iter(predicted.values()), {}))
        every = branches(self.config, self.ablation_arms)
        results = branch_results(self.out, every)
        summary = summarize(self.config, results, every, predicted, self._additive_predictions(every))
        summary["settings"] = settings(self.config)  # what a merge of reports checks (merge.py)
        write_report(self.config, summary, results, self.out)
        return summary


    def _additive_predictions(self, every: Sequence[Branch]) -> dict | None:
        """With an oracle: its costs and, per branch at a budget (name -> seed ->), the gap its plan would
        have under additivity (oracle.predicted_gap), to set beside the measured one; a re-planned arm's is
        its first plan's (the report says so)."""
        path = self.out / ORACLE / "costs.json"
        if not path.exists():
            return None
        costs = load_costs(path)
        predicted: dict[str, dict[int, float]] = {}
        for b in every:
            plan = self.plan_path(b) if b.budget is not None else None
            if plan is not None and plan.exists():
                units = {name: p.fwd for name, p in PrecisionPlan.load(plan).modules.items()}
                predicted.setdefault(b.name, {})[b.seed] = predicted_gap(costs, fp4_modules(units))
        return {"costs": asdict(costs), "predicted": predicted}


def fp4_modules(plan: Mapping[str, str]) -> list[str]:
    """The modules a joint plan (module -> format) runs in an FP4 format."""
    return [m for m, f in plan.items() if f in FP4_NAMES]


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
    ids = visible_devices() or [str(i) for i in range(jobs * nproc)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[slot * nproc:(slot + 1) * nproc])}


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



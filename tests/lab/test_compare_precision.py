"""tools/lab/compare_precision.py: branches at equal budgets, resumption, the report."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_MODEL, launch, scalars

from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.statistics_file import Budget
from megatron_snip.training import tags
from snip_lab.branches import BranchResult, ComparisonConfig, branches
from snip_lab.comparison import Comparison, Runs, Stopped, devices, run_all
from snip_lab.merge import merge_reports
from snip_lab.report import ci95, markdown, summarize

BUDGET = Budget(0.75)


def config(**kw) -> ComparisonConfig:
    base = dict(out="unused", train_args=(), policies=("snip", "uniform"), budgets=(BUDGET,), seeds=(1, 2),
                trunk_iters=4, train_iters=8, snip_interval=2)
    return ComparisonConfig(**{**base, **kw})


def test_paired_gaps_and_noise_by_hand():
    """gap = loss - bf16 loss of the same seed; mean and sample std over seeds."""
    c = config()
    def r(v, t=0.0):
        return BranchResult(final_valid_loss=v, mean_train_loss=t, fp4_fraction=0.8, time_ratio=0.3)
    results = {("bf16", 1): r(5.0, 4.0), ("bf16", 2): r(5.2, 4.2),
               ("snip_fp4-0.75", 1): r(5.01, 4.02), ("snip_fp4-0.75", 2): r(5.23, 4.22),
               ("uniform_fp4-0.75", 1): r(5.1, 4.1)}
    s = summarize(c, results)
    rows = {row["arm"]: row for row in s["rows"]}
    assert rows["snip"]["gap"] == pytest.approx(0.02)  # (0.01 + 0.03) / 2
    assert rows["snip"]["gap_std"] == pytest.approx(math.sqrt(2) * 0.01)  # stdev of 0.01, 0.03
    assert rows["snip"]["train_gap"] == pytest.approx(0.02) and rows["snip"]["train_gap_std"] == pytest.approx(0)
    assert rows["uniform"]["gap"] == pytest.approx(0.1) and math.isnan(rows["uniform"]["gap_std"])
    assert s["bf16_seed_std"] == pytest.approx(math.sqrt(2) * 0.1)
    assert not s["complete"]  # uniform's seed 2 is missing
    table = markdown(s)
    assert "| FP4 target 0.75 | snip | 2 | 80.0% | 0.300 | 5.1200 | +0.0200 ± 0.0141 |" in table
    assert "Incomplete" in table


@pytest.mark.parametrize("train_args, named", [
    ((), "`--gemm-speed-model measured` (each format's speed as measured on the machine that trained"),
    (("--gemm-speed-model", "hopper", "--gemm-speed-model", "blackwell"), "`--gemm-speed-model blackwell` (published"),
    (("--gemm-speed-model=ada",), "`--gemm-speed-model ada` (published")])
def test_the_time_column_names_the_runs_speed_model(train_args, named):
    """On a CPU the measured model reads emulated FP4 as slower than BF16 (a ratio above 1): the table says
    which speeds its time column weighs, the flag's default when the runs do not give one."""
    c = config(train_args=train_args)
    results = {("bf16", 1): BranchResult(5.0, 4.0, 0.0, 1.0), ("snip_fp4-0.75", 1): BranchResult(5.1, 4.1, 0.8, 7.4)}
    summary = summarize(c, results)
    assert named in markdown(summary)
    del summary["speed_model"]  # a report written before the model was recorded
    assert "under the run's speed model (an estimate)" in markdown(summary)


def test_each_arm_starts_from_its_plan_and_the_replanned_ones_run_snip(tmp_path):
    c = config(out=str(tmp_path), policies=("snip", "snip-fixed", "snip-loss-term-replanned",
                                            "snip-fisher-loss-term-replanned", "uniform"), seeds=(1,))
    plans = tmp_path / "seed1" / "plans"
    plans.mkdir(parents=True)
    for policy in ("snip", "snip-loss-term", "snip-fisher-loss-term", "uniform"):
        PrecisionPlan.uniform("nvfp4").save(plans / f"{policy}_{BUDGET.tag}.json")
    comparison = Comparison(c, log=lambda *_: None)
    args = {b.arm: comparison.branch_args(b) for b in branches(c) if b.budget is not None}
    assert sorted(args) == ["snip", "snip-fisher-loss-term-replanned", "snip-fixed", "snip-loss-term-replanned",
                            "uniform"]

    def value(arm, flag):
        return args[arm][args[arm].index(flag) + 1] if flag in args[arm] else None

    snip_plan = str(plans / "snip_fp4-0.75.json")
    assert value("snip", "--precision-plan") == value("snip-fixed", "--precision-plan") == snip_plan
    assert value("snip-loss-term-replanned", "--precision-plan") == str(plans / "snip-loss-term_fp4-0.75.json")
    assert value("snip-loss-term-replanned", "--snip-update-weight") == "0"
    assert value("snip", "--snip-update-weight") is None
    fisher = "snip-fisher-loss-term-replanned"
    assert value(fisher, "--precision-plan") == str(plans / "snip-fisher-loss-term_fp4-0.75.json")
    assert (value(fisher, "--snip-update-weight"), value(fisher, "--snip-curvature")) == ("0", "fisher")
    assert value("snip", "--snip-curvature") is None
    assert "--snip" in args["snip-loss-term-replanned"] and "--snip" not in args["snip-fixed"]
    assert value("snip-loss-term-replanned", "--snip-fp4-target") == "0.75"
    assert value("uniform", "--load") == str(tmp_path / "seed1" / "trunk" / "ckpt")


def test_arms_with_the_same_fixed_plan_train_once_and_share_the_result(tmp_path):
    """uniform's plan is the same file at every budget: one branch per seed trains it and the other
    budgets take its result; a re-planning arm starting from that plan, and another plan, train on their own."""
    budgets = (Budget(0.5), BUDGET)
    c = config(out=str(tmp_path), policies=("snip", "uniform", "threshold"), budgets=budgets, seeds=(1, 2))
    for seed in (1, 2):
        plans = tmp_path / f"seed{seed}" / "plans"
        plans.mkdir(parents=True)
        for budget in budgets:
            PrecisionPlan.uniform("nvfp4").save(plans / f"uniform_{budget.tag}.json")
            PrecisionPlan.uniform("nvfp4").save(plans / f"snip_{budget.tag}.json")  # the same bytes, but re-planned
            PrecisionPlan.uniform("fp8" if budget is BUDGET else "nvfp4").save(plans / f"threshold_{budget.tag}.json")
    logs, trained = [], []

    def train(b, slot=0):  # stands in for the branch's training (tested above): its result names the branch
        trained.append(b.name)
        (tmp_path / f"seed{b.seed}" / b.name).mkdir(parents=True)
        (tmp_path / f"seed{b.seed}" / b.name / "result.json").write_text(f"{b.name}, seed {b.seed}")

    comparison = Comparison(c, log=logs.append)
    comparison._branch = train
    tasks = comparison._tasks(branches(c))
    # bf16 x 2 seeds, snip x 2 budgets x 2 seeds, uniform once per seed, threshold: at 0.5 the same plan as
    # uniform's (one task with it), at 0.75 its own.
    assert len(tasks) == 2 + 4 + 2 + 2
    for task in tasks:
        task(0)
    assert sorted(trained) == sorted(["bf16"] * 2 + ["snip_fp4-0.50", "snip_fp4-0.75"] * 2
                                     + ["uniform_fp4-0.50"] * 2 + ["threshold_fp4-0.75"] * 2)
    for seed in (1, 2):
        for name in ("uniform_fp4-0.75", "threshold_fp4-0.50"):
            result = (tmp_path / f"seed{seed}" / name / "result.json").read_text()
            assert result == f"uniform_fp4-0.50, seed {seed}"
    assert "seed 2: uniform_fp4-0.75: the plan of uniform_fp4-0.50, trained once: its result" in logs


def test_probe_settings_are_shared_by_every_arm_and_the_trunk(tmp_path):
    """--snip-gain-exclude and --snip-probe-passes change only what SNIP measures: allowed among the
    training flags, they reach the trunk's cycle and every branch (a SNIP flag that plans is refused above)."""
    shared = ("--lr", "1e-3", "--snip-gain-exclude", "embedding", "--snip-probe-passes", "6")
    c = config(out=str(tmp_path), policies=("snip", "uniform"), seeds=(1,), train_args=shared)
    plans = tmp_path / "seed1" / "plans"
    plans.mkdir(parents=True)
    for policy in ("snip", "uniform"):
        PrecisionPlan.uniform("nvfp4").save(plans / f"{policy}_{BUDGET.tag}.json")
    comparison = Comparison(c, log=lambda *_: None)
    trunk = comparison.trunk_args(1)
    for args in [trunk, *(comparison.branch_args(b) for b in branches(c) if b.budget is not None)]:
        assert args[:len(shared)] == list(shared)
    assert "--snip" in trunk


@pytest.mark.parametrize("bad, message", [
    (dict(trunk_iters=8), "--trunk-iters 8 must be > 0 and below --train-iters 8"),
    (dict(policies=("snip", "best")), "unknown ['best']"),
    (dict(train_args=("--lr", "1e-3", "--seed", "3")), "['--seed'] are set by the comparison"),
    (dict(train_args=("--snip-fp4-target", "0.9")), "['--snip-fp4-target'] are set by the comparison"),
    (dict(budgets=()), "at least one budget"),
    (dict(budgets=(BUDGET, Budget(1.5))), "budgets ['FP4 target 1.50']: an FP4 target is a share"),
    (dict(budgets=(Budget(time_target=0.0),)), "a time target a positive ratio"),
    (dict(jobs=0), "--jobs 0: give 1 or more"),
])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=None) as e:
        config(**bad)
    assert message in str(e.value)


def test_jobs_run_at_once_each_in_its_own_slot_and_a_failure_stops_the_rest():
    # Two tasks that each wait for the other pass the barrier only if they run at the same time.
    barrier = threading.Barrier(2, timeout=30)
    slots = []
    run_all([lambda slot: (slots.append(slot), barrier.wait()) for _ in range(2)], jobs=2)
    assert sorted(slots) == [0, 1]

    started = []

    def boom(slot):
        raise RuntimeError("training run failed")

    with pytest.raises(RuntimeError, match="training run failed"):
        run_all([lambda slot: started.append(0), boom, *[lambda slot, i=i: started.append(i) for i in (2, 3)]], jobs=1)
    assert started == [0]  # nothing after the failure started


@pytest.mark.integration  # it starts a process (a few lines of Python, no training)
def test_a_stop_reaches_the_runs_in_flight_and_starts_no_new_one(tmp_path):
    # A child that saves (writes a file) and exits 0 on SIGTERM, as a training run does.
    child = ("import signal, sys, time, pathlib\n"
             "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path(sys.argv[1]).write_text('saved'), sys.exit(0)))\n"
             "pathlib.Path(sys.argv[2]).write_text('ready')\n"
             "time.sleep(60)\n")
    runs, errors = Runs(), []

    def one():
        try:
            runs.run([sys.executable, "-c", child, str(tmp_path / "saved"), str(tmp_path / "ready")])
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=one)
    thread.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert thread.is_alive() and time.monotonic() < deadline, errors
        time.sleep(0.02)
    assert runs.stop(signal.SIGUSR1) == 1  # SLURM's --signal; the run itself gets SIGTERM
    thread.join(timeout=30)
    assert (tmp_path / "saved").read_text() == "saved"
    assert [type(e) for e in errors] == [Stopped] and errors[0].signum == signal.SIGUSR1
    assert "rerun the same command" in str(errors[0])
    with pytest.raises(Stopped):  # nothing new starts
        runs.run([sys.executable, "-c", "open('started', 'w')"], cwd=tmp_path)
    assert not (tmp_path / "started").exists()


def test_a_trunk_is_done_only_with_its_statistics_and_its_checkpoint(tmp_path, monkeypatch):
    """A stop after the trunk's SNIP cycle but before its checkpoint was saved leaves the statistics and no
    checkpoint: the trunk trains again (resume-or-start), where it had been taken as done and every branch
    failed on --load."""
    c = config(out=str(tmp_path), seeds=(1,))
    comparison = Comparison(c, log=lambda *_: None)
    trained = []
    monkeypatch.setattr(comparison, "_train", lambda where, args, log, slot=0: trained.append(where))
    stats = comparison._stats_path(1)
    stats.parent.mkdir(parents=True)
    stats.write_text("{}")
    (stats.parents[1] / "iter_0000004.tmp").mkdir()  # the save cut short
    comparison._trunk(1)
    assert trained == [tmp_path / "seed1" / "trunk"]
    (stats.parents[1] / "latest_checkpointed_iteration.txt").write_text("4")
    comparison._trunk(1)
    assert len(trained) == 1  # statistics and checkpoint at the branch point: done


def test_each_job_gets_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices(0, nproc=4, jobs=1) == {}  # one run at a time sees every device
    assert devices(1, nproc=2, jobs=4) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [devices(s, nproc=1, jobs=4)["CUDA_VISIBLE_DEVICES"] for s in range(4)] == ["4", "5", "6", "7"]
    with pytest.raises(ValueError, match="needs 8 GPUs, CUDA_VISIBLE_DEVICES=4,5,6,7 has 4"):
        config(jobs=4, nproc=2)


def run_tool(out, *extra, train_args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / "lab" / "compare_precision.py"), "--out", str(out), "--seeds", "1",
           "--trunk-iters", "4", "--snip-interval", "2", "--policies", "snip", "uniform", "threshold", *extra,
           "--", *train_args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.integration
def test_compare_precision_branches_resume_and_report(tiny_data, tmp_path):
    train_args = [*TINY_MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2",
                  "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--data-path", tiny_data.prefix,
                  "--split", "90,10,0",
                  "--tokenizer-model", tiny_data.tokenizer_model, "--log-interval", "1", "--eval-interval", "4",
                  "--eval-iters", "2"]
    out = tmp_path / "cmp"
    # Two runs at a time; the checks below (the BF16 branch equals an unbranched run, a branch resumed
    # one at a time reproduces it) show that concurrency changes no result.
    proc = run_tool(out, "--train-iters", "8", "--jobs", "2", train_args=train_args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    rows = {row["arm"]: row for row in summary["rows"]}
    assert set(rows) == {"bf16", "snip", "uniform", "threshold"} and summary["complete"]
    # The report records its settings (what a merge of reports checks); merged with itself it is itself.
    assert summary["settings"]["train_iters"] == 8 and summary["settings"]["train_args"] == train_args
    merged = merge_reports([out, out / "results.json"], str(tmp_path / "merged"))
    assert {r["arm"]: r["gap"] for r in merged["rows"]} == {a: r["gap"] for a, r in rows.items()}
    assert rows["bf16"]["fp4_fraction"] == 0.0 and rows["uniform"]["fp4_fraction"] == 1.0
    # Equal budgets: every arm's plan runs at least 75% of the linear FLOPs in FP4 (the logged fraction).
    assert all(rows[a]["fp4_fraction"] >= 0.75 - 1e-6 for a in ("snip", "uniform", "threshold"))
    # The fixed-plan arms trained exactly their plan file.
    plan = PrecisionPlan.load(out / "seed1" / "plans" / "threshold_fp4-0.75.json")
    log = (out / "seed1" / "threshold_fp4-0.75" / "log.txt").read_text()
    assert f"--precision-plan {out}/seed1/plans/threshold_fp4-0.75.json" in log and len(plan.modules) == 16
    # The snip arm re-planned inside the branch (iterations 6 and 8), the others did not.
    assert "[snip] iteration       6" in (out / "seed1" / "snip_fp4-0.75" / "log.txt").read_text()
    assert "[snip] iteration" not in log
    # The BF16 branch is the unbranched BF16 run: the trunk's schedule, data order and RNG carry over
    # the branch point exactly (the trunk's SNIP cycle changes nothing the training sees).
    launch(1, [*train_args, "--seed", "1", "--train-iters", "8", "--tensorboard-dir", str(tmp_path / "tb")])
    # (TensorBoard stores the value in float32, the branch's record in float64.)
    branch_loss = json.loads((out / "seed1" / "bf16" / "result.json").read_text())["final_valid_loss"]
    assert scalars(tmp_path / "tb", tags.LM_LOSS_VALIDATION)[8] == torch.tensor(branch_loss, dtype=torch.float32).item()
    assert (out / "gap_to_bf16.png").stat().st_size > 0 and "| FP4 target 0.75 | threshold |" in (
        out / "results.md").read_text()

    # Interrupted: threshold's branch lost its final checkpoint and result; a rerun resumes it from
    # iteration 6, skips everything else, and reproduces the final validation loss bit for bit.
    branch = out / "seed1" / "threshold_fp4-0.75"
    before = json.loads((branch / "result.json").read_text())["final_valid_loss"]
    (branch / "result.json").unlink()
    shutil.rmtree(branch / "ckpt" / "iter_0000008")
    (branch / "ckpt" / "latest_checkpointed_iteration.txt").write_text("6")
    # --report-only trains nothing: the report of the branches finished, marked incomplete.
    proc = run_tool(out, "--train-iters", "8", "--report-only", train_args=train_args)
    assert proc.returncode == 0 and not (branch / "result.json").exists(), proc.stderr[-3000:]
    assert "| FP4 target 0.75 | threshold |" not in proc.stdout and "| FP4 target 0.75 | uniform |" in proc.stdout
    assert "**Incomplete**" in (out / "results.md").read_text()
    proc = run_tool(out, "--train-iters", "8", train_args=train_args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "seed 1: threshold_fp4-0.75 (resuming)" in proc.stdout
    assert "seed 1: trunk done" in proc.stdout and "seed 1: uniform_fp4-0.75 done" in proc.stdout
    assert json.loads((branch / "result.json").read_text())["final_valid_loss"] == before

    # Other settings in the same folder are refused, naming what differs.
    proc = run_tool(out, "--train-iters", "10", train_args=train_args)
    assert proc.returncode == 1 and "train_iters differ" in proc.stderr


def test_report_only_reports_the_ablations_finished(tmp_path):
    """--report-only plans nothing, so the ablation arms come from the trunks' plans (predictions.json):
    their rows and their estimators' table are in the report, and a missing one marks it incomplete."""
    c = config(out=str(tmp_path), policies=("uniform",), seeds=(1,), ablations=("types",))
    arms = {"ablate-linear_qkv": 2e-4, "ablate-linear_fc2": 5e-4}
    (tmp_path / "seed1" / "plans").mkdir(parents=True)
    (tmp_path / "seed1" / "plans" / "predictions.json").write_text(json.dumps(
        {a: dict.fromkeys(("snip_divergence", "relative_error"), v) for a, v in arms.items()}))
    for name, loss in (("bf16", 5.0), ("uniform_fp4-0.75", 5.02), ("ablate-linear_fc2", 5.01)):
        (tmp_path / "seed1" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "seed1" / name / "result.json").write_text(json.dumps(asdict(BranchResult(loss, loss, 0.5, 1.0))))
    summary = Comparison(c, log=lambda *_: None).report()
    assert {r["arm"] for r in summary["rows"]} == {"bf16", "uniform", "ablate-linear_fc2"}
    assert summary["ablation"]["arms"] == ["ablate-linear_fc2"] and not summary["complete"]  # qkv's is missing
    table = (tmp_path / "results.md").read_text()
    assert "| ablate-linear_fc2 | 50.0% | 0.0005 | 0.0005 | +0.0100 |" in table and "**Incomplete**" in table


def test_ablation_plans_put_exactly_one_group_in_fp4():
    from megatron_snip.snip.ilp import LinearModule, SnipProblem
    from snip_lab.ablation import ablation_plans

    types = ("self_attention.linear_qkv", "mlp.linear_fc2")
    mods = [LinearModule.from_shape(f"decoder.layers.{i}.{t}", i, 64, 32, 32) for i in range(3) for t in types]
    problem = SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.0, cost={m.name: {"bf16": 0, "fp8": 0, "nvfp4": 1}
                                                                     for m in mods})
    plans = ablation_plans(problem, ("layers", "types"))
    assert sorted(plans) == ["ablate-layer0", "ablate-layer1", "ablate-layer2", "ablate-linear_fc2",
                             "ablate-linear_qkv"]
    assert {n for n, f in plans["ablate-layer1"].items() if f == "nvfp4"} == {
        "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc2"}
    assert {n for n, f in plans["ablate-linear_fc2"].items() if f == "nvfp4"} == {
        f"decoder.layers.{i}.mlp.linear_fc2" for i in range(3)}
    assert all(f in ("nvfp4", "fp8") for plan in plans.values() for f in plan.values())


def test_spearman_by_hand():
    from snip_lab.ranks import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x: 0,1,2,3; y (tie at 5): 0, 1.5, 1.5, 3 -> Pearson of the ranks
    assert spearman([1, 2, 3, 4], [1, 5, 5, 9]) == pytest.approx(0.9486833, abs=1e-6)
    assert math.isnan(spearman([1, 2], [2, 1]))


@pytest.mark.integration
def test_sigterm_to_the_tool_saves_the_branch_in_flight_and_a_rerun_finishes_it(tiny_data, tmp_path):
    """kill (or SLURM's --signal) aimed at the tool alone: its torchrun child passes the signal to the
    workers, which save and exit; the tool exits 128 + 15 leaving no process behind, and a rerun resumes
    the branch and ends where an uninterrupted run ends."""
    import psutil

    train_args = [*TINY_MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2",
                  "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--data-path", tiny_data.prefix,
                  "--split", "90,10,0",
                  "--tokenizer-model", tiny_data.tokenizer_model, "--log-interval", "1", "--eval-interval", "16",
                  "--eval-iters", "2"]
    out = tmp_path / "cmp"
    # 16 iterations: the stop lands at iteration 6 or soon after, far from the end (a signal reaches the
    # workers within milliseconds, an iteration takes a tenth of a second or more).
    cmd = [sys.executable, str(ROOT / "tools" / "lab" / "compare_precision.py"), "--out", str(out), "--seeds", "1",
           "--trunk-iters", "2", "--train-iters", "16", "--policies", "--", *train_args]
    tool = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "seed1" / "bf16" / "log.txt"
    deadline = time.monotonic() + 600
    while not (log.exists() and re.search(r"\[train\] iteration\s+6/", log.read_text())):
        assert tool.poll() is None and time.monotonic() < deadline, tool.communicate()
        time.sleep(0.02)
    tree = psutil.Process(tool.pid).children(recursive=True)
    tool.send_signal(signal.SIGTERM)
    stdout, stderr = tool.communicate(timeout=300)
    assert tool.returncode == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
    assert "stopped by SIGTERM" in stderr and "rerun the same command to resume" in stderr
    saved = re.search(r"exit signal received: saving at iteration (\d+)", log.read_text())
    assert saved and 6 < int(saved.group(1)) < 16
    assert (out / "seed1" / "bf16" / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == saved.group(1)
    assert not (out / "seed1" / "bf16" / "result.json").exists()
    psutil.wait_procs(tree, timeout=30)
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    # The rerun resumes the branch; the BF16 reference is all this comparison has (no policies).
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "seed 1: bf16 (resuming)" in proc.stdout
    launch(1, [*train_args, "--seed", "1", "--train-iters", "16", "--tensorboard-dir", str(tmp_path / "tb")])
    assert scalars(tmp_path / "tb", tags.LM_LOSS_VALIDATION)[16] == json.loads(
        (out / "seed1" / "bf16" / "result.json").read_text())["final_valid_loss"]


# -- the oracle arm ------------------------------------------------------------------------------------------

def two_by_two_problem(target: float = 0.0):
    """2 layers x (qkv 32->96, fc2 64->32): FLOPs 3072 and 2048 per layer (x 3 x 2 x 64 tokens)."""
    from megatron_snip.snip.ilp import LinearModule, SnipProblem

    shapes = {"self_attention.linear_qkv": (32, 96), "mlp.linear_fc2": (64, 32)}
    mods = [LinearModule.from_shape(f"decoder.layers.{i}.{t}", i, 64, *shapes[t]) for i in range(2) for t in shapes]
    return SnipProblem(mods, ("bf16", "fp8", "nvfp4"), target,
                       cost={m.name: {"bf16": 0.0, "fp8": 0.0, "nvfp4": 1.0} for m in mods})


QKV0, FC2_0, QKV1, FC2_1 = (f"decoder.layers.{i}.{t}" for i in range(2)
                            for t in ("self_attention.linear_qkv", "mlp.linear_fc2"))
# Final validation losses (arm -> seed -> loss): each group's loss minus ablate-none's of the same seed
# averages to layer0 .035, layer1 .014 (sum .049), qkv .021, fc2 .028 (sum .049).
ABLATION_LOSSES = {
    "bf16": {1: 4.990, 2: 5.095},
    "ablate-none": {1: 5.000, 2: 5.100},
    "ablate-layer0": {1: 5.030, 2: 5.140},
    "ablate-layer1": {1: 5.010, 2: 5.118},
    "ablate-linear_qkv": {1: 5.020, 2: 5.122},
    "ablate-linear_fc2": {1: 5.028, 2: 5.128},
}


def oracle_costs(losses=ABLATION_LOSSES, kinds=("layers", "types"), clip=True):
    from snip_lab.oracle import measured_costs, oracle_groups

    return measured_costs(oracle_groups(two_by_two_problem(), kinds), losses, "bf16", clip)


def test_oracle_module_costs_are_the_layer_share_times_the_type_share_of_the_measured_total():
    costs = oracle_costs()
    assert costs.groups == pytest.approx({"ablate-layer0": 0.035, "ablate-layer1": 0.014,
                                          "ablate-linear_qkv": 0.021, "ablate-linear_fc2": 0.028})
    # C = .049, layer shares 5/7 and 2/7, type shares 3/7 (qkv) and 4/7 (fc2): C * 1/49 * (5*3, 5*4, 2*3, 2*4).
    assert costs.modules == pytest.approx({QKV0: 0.015, FC2_0: 0.020, QKV1: 0.006, FC2_1: 0.008})
    assert costs.source == "layers x types" and costs.seeds == [1, 2]
    assert costs.base_gap == pytest.approx(0.0075)  # ablate-none - bf16: .010, .005

    # Totals that disagree: C is their mean, and the shares keep each kind's ranking.
    losses = {**ABLATION_LOSSES, "ablate-linear_fc2": {1: 5.042, 2: 5.142}}  # fc2 .042: types sum to .063
    costs = oracle_costs(losses)
    assert sum(costs.modules.values()) == pytest.approx((0.049 + 0.063) / 2)
    assert costs.modules[FC2_0] == pytest.approx(0.056 * (5 / 7) * (2 / 3))
    # A group the high format matches or beats costs 0 (noise), not a negative cost.
    costs = oracle_costs({**ABLATION_LOSSES, "ablate-layer1": {1: 4.990, 2: 5.100}})
    assert costs.groups["ablate-layer1"] == 0.0 and costs.modules[QKV1] == costs.modules[FC2_1] == 0.0
    # Unclipped (the cross-fit's held-out prices): the noise stays, so a price is not biased upward.
    costs = oracle_costs({**ABLATION_LOSSES, "ablate-layer1": {1: 4.990, 2: 5.100}}, clip=False)
    assert costs.groups["ablate-layer1"] == pytest.approx(-0.005)
    # C = (.030 + .049) / 2, layer shares .035 / .030 and -.005 / .030: layer 1's modules cost < 0.
    assert costs.modules[FC2_1] == pytest.approx(0.0395 * (-0.005 / 0.030) * (4 / 7))


def test_oracle_module_ablations_are_the_costs_and_missing_ablations_are_refused():
    from snip_lab.oracle import group_costs

    modules = {"ablate-layer0-linear_qkv": 0.004, "ablate-layer0-linear_fc2": 0.009,
               "ablate-layer1-linear_qkv": -0.002, "ablate-layer1-linear_fc2": 0.001}
    losses = {**ABLATION_LOSSES, **{arm: {1: 5.0 + d, 2: 5.1 + d} for arm, d in modules.items()}}
    costs = oracle_costs(losses, kinds=("layers", "types", "modules"))  # measured one by one: no product model
    assert costs.source == "modules"
    assert costs.modules == pytest.approx({QKV0: 0.004, FC2_0: 0.009, QKV1: 0.0, FC2_1: 0.001})
    with pytest.raises(ValueError, match="needs --ablations modules or --ablations layers types"):
        oracle_costs(kinds=("layers",))
    with pytest.raises(ValueError, match="ablate-layer1 and ablate-none measured on a common seed"):
        group_costs({"ablate-none": {1: 5.0}, "ablate-layer1": {2: 5.1}}, ["ablate-layer1"])


def test_oracle_plan_is_the_brute_force_optimum_of_the_measured_costs():
    """The ILP on the product-model costs picks, of the 16 plans, the cheapest that meets the budget."""
    import itertools

    from megatron_snip.snip.ilp import evaluate_plan
    from snip_lab.oracle import oracle_plan, predicted_gap

    costs = oracle_costs()
    for target in (0.25, 0.5, 0.7, 0.9):
        problem = two_by_two_problem(target)
        plan = oracle_plan(problem, costs, solver="highs")
        best = min((dict(zip(costs.modules, fmts)) for fmts in itertools.product(("fp8", "nvfp4"), repeat=4)),
                   key=lambda p: (not evaluate_plan(problem, p).meets_target,
                                  sum(costs.modules[m] for m, f in p.items() if f == "nvfp4")))
        assert plan == best, target
    # At 50% (5120 of 10240 FLOPs): layer 1 in FP4 (.006 + .008) beats every other pair that reaches it.
    plan = oracle_plan(two_by_two_problem(0.5), costs, solver="highs")
    assert {m for m, f in plan.items() if f == "nvfp4"} == {QKV1, FC2_1}
    assert predicted_gap(costs, [QKV1, FC2_1]) == pytest.approx(0.0075 + 0.014)
    # Groups that all cost 0 (noise) tie every plan: the oracle then takes the fewest FP4 FLOPs, at 50%
    # one qkv and one fc2 (5120 of 10240 FLOPs), not both qkv (6144) or three modules.
    free = oracle_costs({arm: ABLATION_LOSSES["ablate-none"] for arm in ABLATION_LOSSES})
    half = two_by_two_problem(0.5)
    assert evaluate_plan(half, oracle_plan(half, free, "highs")).fp4_fraction == 0.5


def test_regret_to_the_oracle_and_the_additive_prediction_by_hand():
    c = config(policies=("oracle", "uniform", "snip"), ablations=("layers", "types"))
    def r(v, t):
        return BranchResult(final_valid_loss=v, mean_train_loss=t, fp4_fraction=0.75, time_ratio=0.3)
    results = {("bf16", 1): r(5.0, 4.0), ("bf16", 2): r(5.2, 4.2),
               ("oracle_fp4-0.75", 1): r(5.01, 4.01), ("oracle_fp4-0.75", 2): r(5.21, 4.22),
               ("uniform_fp4-0.75", 1): r(5.03, 4.04), ("uniform_fp4-0.75", 2): r(5.24, 4.23),
               ("snip_fp4-0.75", 1): r(5.02, 4.02), ("snip_fp4-0.75", 2): r(5.22, 4.22)}
    oracle = {"costs": {"source": "layers x types", "seeds": [1, 2]},
              "predicted": {"oracle_fp4-0.75": {1: 0.012, 2: 0.012}, "uniform_fp4-0.75": {1: 0.02, 2: 0.03},
                            "snip_fp4-0.75": {1: 0.014, 2: 0.016}}}
    s = summarize(c, results, branches(c), oracle=oracle)
    rows = {row["arm"]: row for row in s["rows"]}
    assert rows["uniform"]["regret"] == pytest.approx(0.025)  # (0.02 + 0.03) / 2
    assert rows["uniform"]["regret_std"] == pytest.approx(math.sqrt(2) * 0.005)
    assert rows["uniform"]["train_regret"] == pytest.approx(0.02) and rows["uniform"]["train_regret_std"] == (
        pytest.approx(math.sqrt(2) * 0.01))
    assert rows["oracle"]["regret"] == 0.0 and rows["uniform"]["additive_prediction"] == pytest.approx(0.025)
    table = markdown(s)
    assert "layers x types ablations of seeds [1, 2]" in table
    # gap / oracle's: uniform's mean gap (0.03, 0.04 val; 0.04, 0.03 train) over the oracle's (0.01, 0.01; 0.01, 0.02).
    assert rows["uniform"]["ratio_to_oracle"] == pytest.approx(3.5)
    assert rows["uniform"]["train_ratio_to_oracle"] == pytest.approx(0.035 / 0.015)
    assert "| FP4 target 0.75 | oracle | +0.0120 | +0.0100 ± 0.0000 | +0.0000 [+0.0000, +0.0000] |" in table
    # 95% intervals over 2 seeds: 12.706 x std / sqrt(2).
    assert ("| FP4 target 0.75 | uniform | +0.0250 | +0.0350 ± 0.0071 | +0.0250 [-0.0385, +0.0885] | "
            "+0.0200 [-0.1071, +0.1471] | 3.50x / 2.33x |" in table)
    # SNIP re-plans: its prediction is its first plan's, and the table says so.
    assert "| FP4 target 0.75 | snip | +0.0150 (first plan) | +0.0200 ± 0.0000 |" in table


def test_the_oracle_test_by_hand():
    """SNIP's gap within 1.25x the oracle's; every arm the oracle leads by 2 paired sd led by SNIP by 2 too."""
    c = config(policies=("snip", "oracle", "uniform", "keep-ends-high"), seeds=(1, 2, 3), ablations=("layers", "types"))
    bf16 = {1: (5.0, 4.0), 2: (5.2, 4.1), 3: (5.1, 4.3)}
    # Gaps to bf16 per seed (val and train alike): oracle .010, snip .012 (1.2x); uniform .020, .022, .024 (the
    # oracle leads by .012 ± .002 = 6 sd, snip by .010 ± .002 = 5 sd); keep-ends-high .0125, .0135, .0145 (the
    # oracle leads by .0035 ± .001 = 3.5 sd, snip by .0015 ± .001 = 1.5 sd: the condition fails).
    offsets = {"oracle": (0.010,) * 3, "snip": (0.012,) * 3, "uniform": (0.020, 0.022, 0.024),
               "keep-ends-high": (0.0125, 0.0135, 0.0145)}
    results = {("bf16", s): BranchResult(final_valid_loss=v, mean_train_loss=t, fp4_fraction=0.0, time_ratio=1.0)
               for s, (v, t) in bf16.items()}
    for arm, off in offsets.items():
        results.update({(f"{arm}_fp4-0.75", s): BranchResult(final_valid_loss=bf16[s][0] + d, fp4_fraction=0.75,
                                                              mean_train_loss=bf16[s][1] + d, time_ratio=0.3)
                        for s, d in zip(bf16, off)})
    [test] = summarize(c, results)["oracle_test"]
    assert test["focus"] == "snip" and test["ratio_to_oracle"] == pytest.approx(1.2) and test["within"]
    leads = {lead["arm"]: lead for lead in test["leads"]}
    assert set(leads) == {"uniform", "keep-ends-high"} and leads["uniform"]["seeds"] == [1, 2, 3]
    assert leads["uniform"]["oracle_lead"] == pytest.approx(6.0)
    assert leads["uniform"]["focus_lead"] == pytest.approx(5.0)
    assert leads["uniform"]["holds"] and leads["uniform"]["focus_lead_train"] == pytest.approx(5.0)
    assert leads["keep-ends-high"]["oracle_lead"] == pytest.approx(3.5)
    assert leads["keep-ends-high"]["focus_lead"] == pytest.approx(1.5) and not leads["keep-ends-high"]["holds"]
    table = markdown(summarize(c, results))
    assert "| FP4 target 0.75 | 1.20x (1.20x): met | keep-ends-high | 3 | +3.5 (+3.5) | +1.5 (+1.5) | **no** |" in table
    # Without spread a lead is infinite: an oracle .002 ahead on every seed leads by +inf.
    results.update({("uniform_fp4-0.75", s): results[("snip_fp4-0.75", s)] for s in bf16})
    uniform = next(lead for lead in summarize(c, results)["oracle_test"][0]["leads"] if lead["arm"] == "uniform")
    assert uniform["oracle_lead"] == math.inf and uniform["focus_lead"] == 0.0 and not uniform["holds"]
    # One seed has no spread: the condition is undecided, not met.
    one = {k: v for k, v in results.items() if k[1] == 1}
    summary = summarize(replace(c, seeds=(1,)), one)
    assert {lead["arm"]: lead["holds"] for lead in summary["oracle_test"][0]["leads"]} == {
        "uniform": None, "keep-ends-high": None}
    assert "| keep-ends-high | 1 | - (-) | - (-) | not yet (under 2 seeds) |" in markdown(summary)


def test_the_oracle_arm_trains_its_plan_and_needs_the_ablations(tmp_path, capsys, monkeypatch):
    from snip_lab.ablation import ablation_plans

    with pytest.raises(ValueError, match="add --ablations modules or --ablations layers types"):
        config(policies=("oracle",), ablations=("types",))
    c = config(out=str(tmp_path), policies=("oracle", "random"), ablations=("modules",), seeds=(1,))
    oracle = next(b for b in branches(c) if b.arm == "oracle")
    (tmp_path / "oracle").mkdir()
    PrecisionPlan.uniform("nvfp4").save(tmp_path / "oracle" / "oracle_fp4-0.75.json")
    args = Comparison(c, log=lambda *_: None).branch_args(oracle)
    assert args[args.index("--precision-plan") + 1] == str(tmp_path / "oracle" / "oracle_fp4-0.75.json")
    # With the oracle the ablations include the all-high arm whose gap the group costs are measured from.
    plans = ablation_plans(two_by_two_problem(), ("modules",), none=True)
    assert sorted(plans) == ["ablate-layer0-linear_fc2", "ablate-layer0-linear_qkv", "ablate-layer1-linear_fc2",
                             "ablate-layer1-linear_qkv", "ablate-none"]
    assert set(plans["ablate-none"].values()) == {"fp8"}
    assert {m for m, f in plans["ablate-layer1-linear_qkv"].items() if f == "nvfp4"} == {QKV1}

    # The command line: the arm and the kind are accepted, the missing ablations named (no run starts).
    from snip_lab.cli import compare_precision

    base = ["--out", str(tmp_path / "cli"), "--trunk-iters", "4", "--train-iters", "8",
            "--policies", "oracle", "random"]
    assert compare_precision.main(base) == 1
    assert "--policies oracle plans with the costs the ablations measure" in capsys.readouterr().err
    assert compare_precision.main([*base, "--ablations", "modules", "--", "--seed", "1"]) == 1
    assert "['--seed'] are set by the comparison" in capsys.readouterr().err  # parsed, refused at the flags after --
    assert compare_precision.main([*base, "--oracle-costs", str(tmp_path / "none.json")]) == 1
    assert f"{tmp_path / 'none.json'}: not the oracle's costs.json" in capsys.readouterr().err


def test_the_oracle_plans_with_an_earlier_comparisons_costs(tmp_path):
    """--oracle-costs: the oracle arm planned from a costs.json of an earlier comparison, no ablations;
    its plan is the oracle's ILP on those costs, and the folder keeps the costs it planned with."""
    import random

    from megatron_snip.snip.statistics_file import StatisticsFile
    from snip_lab.oracle import load_costs, oracle_plan

    stats_file = ROOT / "tests" / "data" / "snip_iter_schema1.json"  # 4 layers, candidates fp8 nvfp4
    rng = random.Random(5)
    modules = {n: rng.uniform(0.0, 0.01) for n in StatisticsFile.load(stats_file).stats.modules}
    costs = {"modules": modules, "groups": {}, "base_gap": 0.001, "source": "modules", "seeds": [1]}
    earlier = tmp_path / "earlier_costs.json"
    earlier.write_text(json.dumps(costs))
    out = tmp_path / "cmp"
    c = config(out=str(out), policies=("oracle", "snip"), seeds=(4, 5), oracle_costs=str(earlier))
    assert not [b for b in branches(c) if b.arm.startswith("ablate")]  # nothing measured again

    def trunks(out):  # each seed's trunk statistics at the branch point (iteration 4)
        for seed in c.seeds:
            snip = out / f"seed{seed}" / "trunk" / "ckpt" / "snip"
            snip.mkdir(parents=True)
            shutil.copy(stats_file, snip / "snip_iter_0000004.json")

    trunks(out)
    logs = []
    Comparison(c, log=logs.append)._oracle_plans()
    assert f"copied from {earlier}" in logs[0]
    problem = StatisticsFile.load(stats_file).problem(BUDGET, formats=c.formats, solver="highs")
    want = oracle_plan(problem, load_costs(earlier), "highs")
    plan = PrecisionPlan.load(out / "oracle" / "oracle_fp4-0.75.json")
    assert {m: p.fwd for m, p in plan.modules.items()} == want
    assert sorted(set(want.values())) == ["fp8", "nvfp4"]  # a real choice: not every module in FP4
    assert json.loads((out / "oracle" / "costs.json").read_text())["modules"] == modules
    Comparison(c, log=logs.append)._oracle_plans()  # a rerun with the same file: accepted
    # Every arm's plan priced by additivity, SNIP's (re-planned) by its first plan.
    first = {m: ("nvfp4" if i % 2 else "fp8") for i, m in enumerate(modules)}
    (out / "seed4" / "plans").mkdir(parents=True)
    PrecisionPlan.from_dict({"version": 1, "default": "bf16", "modules": first}).save(
        out / "seed4" / "plans" / "snip_fp4-0.75.json")
    predicted = Comparison(c, log=logs.append)._additive_predictions(branches(c))["predicted"]
    assert predicted["snip_fp4-0.75"] == {4: pytest.approx(0.001 + sum(modules[m] for m, f in first.items()
                                                                       if f == "nvfp4"))}
    assert set(predicted["oracle_fp4-0.75"]) == {4, 5}

    # Other costs than the folder planned with, costs of another model, a file that is not costs: refused.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**costs, "modules": {m: 0.0 for m in modules}}))
    with pytest.raises(ValueError, match=f"{out / 'oracle' / 'costs.json'} holds other costs"):
        Comparison(replace(c, oracle_costs=str(other)), log=logs.append)._oracle_plans()
    other.write_text(json.dumps({**costs, "modules": {m: 0.0 for m in list(modules)[1:]}}))
    trunks(tmp_path / "cmp2")
    with pytest.raises(ValueError, match=r"no cost for 1 of this model's modules"):
        Comparison(replace(c, out=str(tmp_path / "cmp2"), oracle_costs=str(other)), log=logs.append)._oracle_plans()
    assert not (tmp_path / "cmp2" / "oracle" / "costs.json").exists()
    other.write_text(json.dumps({**costs, "modules": {**modules, next(iter(modules)): -1.0}}))
    with pytest.raises(ValueError, match="must be finite numbers >= 0"):
        replace(c, oracle_costs=str(other))
    with pytest.raises(ValueError, match="not the oracle's costs.json"):
        replace(c, oracle_costs=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="--oracle-costs plans the oracle arm"):
        replace(c, ablations=("layers", "types"))
    with pytest.raises(ValueError, match="--oracle-costs plans the oracle arm"):
        replace(c, policies=("snip",))


# -- statistical power: the noise floor, fewer seeds for the ablations, paired differences with 95% intervals ------

def test_the_noise_floor_reorders_only_the_training_documents(tmp_path, tiny_data):
    """The noise-floor arm trains BF16 on a copy of the data whose training documents are permuted, so the
    same --seed draws the same validation samples (megatron-core splits by contiguous document ranges)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from snip_lab.reorder import training_documents

    c = config(out=str(tmp_path), policies=("uniform",), seeds=(1, 2), noise_floor=True,
               train_args=("--lr", "1e-3", "--data-path", tiny_data.prefix, "--split", "80,20,0", "--eval-iters", "2"))
    noise = [b for b in branches(c) if b.arm == "bf16-reorder"]
    assert [b.seed for b in noise] == [1, 2] and all(b.budget is None for b in noise)
    args = Comparison(c, log=lambda *_: None).branch_args(noise[0])
    copy = args[args.index("--data-path") + 1]
    assert copy == str(tmp_path / "reordered" / f"0_{Path(tiny_data.prefix).name}")
    assert args[args.index("--precision") + 1] == "bf16" and args[args.index("--seed") + 1] == "1"
    assert args[args.index("--split") + 1] == "80,20,0" and args[args.index("--eval-iters") + 1] == "2"

    source, reordered = IndexedDataset(tiny_data.prefix), IndexedDataset(copy)
    n = len(source)
    train = training_documents(n, "80,20,0")
    assert train == round(0.8 * n) and len(reordered) == n
    assert all(np.array_equal(source[i], reordered[i]) for i in range(train, n))  # validation as it was
    moved = [i for i in range(train) if not np.array_equal(source[i], reordered[i])]
    assert len(moved) > train // 2  # the training documents in another order, none lost:
    assert sorted(map(bytes, (source[i] for i in range(train)))) == sorted(
        map(bytes, (reordered[i] for i in range(train))))


def test_ablations_train_on_their_seeds_only():
    c = config(policies=("uniform",), seeds=(1, 2, 3), ablations=("types",), ablation_seeds=(2, 3))
    ablations = [(b.arm, b.seed) for b in branches(c, ["ablate-linear_fc2"]) if b.arm.startswith("ablate-")]
    assert ablations == [("ablate-linear_fc2", 2), ("ablate-linear_fc2", 3)]
    assert {b.seed for b in branches(c) if b.arm == "uniform"} == {1, 2, 3}
    with pytest.raises(ValueError, match=r"--ablation-seeds \[4\] are not among --seeds \[1, 2, 3\]"):
        config(seeds=(1, 2, 3), ablation_seeds=(3, 4))


def test_every_arm_against_snip_with_95_percent_intervals_and_the_noise_floor_by_hand():
    c = config(policies=("snip-fixed", "uniform", "threshold"), seeds=(1, 2, 3), noise_floor=True)
    def r(v, t):
        return BranchResult(final_valid_loss=v, mean_train_loss=t, fp4_fraction=0.75, time_ratio=0.3)
    bf16 = {1: (5.0, 4.0), 2: (5.2, 4.1), 3: (5.1, 4.3)}
    # Differences to bf16 (val, train) per seed: snip .010/.010, .012/.012, .014/.014; uniform +.010 on top of
    # snip on every seed; threshold +.001, +.003, +.005 on top (mean .003, std .002); the noise arm -.002, 0, +.002.
    offsets = {"snip-fixed_fp4-0.75": (0.010, 0.012, 0.014), "bf16-reorder": (-0.002, 0.0, 0.002)}
    offsets["uniform_fp4-0.75"] = tuple(x + 0.010 for x in offsets["snip-fixed_fp4-0.75"])
    offsets["threshold_fp4-0.75"] = tuple(x + d for x, d in zip(offsets["snip-fixed_fp4-0.75"], (0.001, 0.003, 0.005)))
    results = {("bf16", s): r(*bf16[s]) for s in bf16}
    for name, off in offsets.items():
        results.update({(name, s): r(bf16[s][0] + d, bf16[s][1] + d) for s, d in zip(bf16, off)})
    summary = summarize(c, results)
    versus = {v["arm"]: v for v in summary["versus_snip"]}
    assert set(versus) == {"uniform", "threshold"} and versus["uniform"]["focus"] == "snip-fixed"
    assert versus["uniform"]["val"] == pytest.approx(0.010)
    assert versus["uniform"]["val_std"] == pytest.approx(0, abs=1e-9)
    t = versus["threshold"]
    assert t["val"] == pytest.approx(0.003) and t["val_std"] == pytest.approx(0.002)
    assert t["val_ci"] == pytest.approx(4.303 * 0.002 / math.sqrt(3))  # Student's t, 2 degrees of freedom
    assert t["train_ci"] == pytest.approx(t["val_ci"]) and t["seeds"] == [1, 2, 3]
    floor = summary["noise_floor"]
    assert floor["val"] == pytest.approx(0.0, abs=1e-9) and floor["val_std"] == pytest.approx(0.002)
    table = markdown(summary)
    assert "| FP4 target 0.75 | threshold | 3 | +0.0030 [-0.0020, +0.0080] | +1.5 |" in table
    assert "Noise floor (bf16-reorder" in table and "val +0.0000 ± 0.0020 on the same validation samples" in table
    assert math.isnan(ci95(0.002, 1)) and ci95(1.0, 100) == pytest.approx(2.042 / 10)
    # --versus threshold: every other arm minus threshold's, the same pairs turned round.
    against = {v["arm"]: v for v in summarize(replace(c, versus="threshold"), results)["versus_snip"]}
    assert set(against) == {"snip-fixed", "uniform"} and against["uniform"]["focus"] == "threshold"
    assert against["snip-fixed"]["val"] == pytest.approx(-0.003) and against["uniform"]["val"] == pytest.approx(0.007)
    with pytest.raises(ValueError, match=r"--versus snip is not among --policies"):
        replace(c, versus="snip")

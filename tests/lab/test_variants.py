"""The offline screen of estimator variants (snip_lab/variants.py, tools/lab/screen_estimators.py; the
variant's planning itself is the product's, megatron_snip/snip/policies.py): the
Fisher curvature by hand, and the oracle never beaten on the costs it planned with."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import ROOT

from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.estimators import cost_tables, divergences, operand_error_baselines
from megatron_snip.snip.planner import to_precision_plan
from megatron_snip.snip.policies import Variant, fisher_curvature, variant_plan, with_curvature
from megatron_snip.snip.statistics import ModuleStatistics
from megatron_snip.snip.statistics_file import Budget, StatisticsFile
from snip_lab.cli.screen_estimators import main
from snip_lab.ranks import spearman
from snip_lab.variants import (
    VARIANTS,
    curvature_resolution,
    measured_update_stats,
    module_type,
    momentum_gain,
    type_terms,
)

TYPES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
STATS = ROOT / "tests" / "data" / "snip_iter_schema1.json"  # the quickstart's first cycle: 4 layers, fp8 nvfp4


def test_fisher_curvature_is_the_trace_of_the_empirical_fisher_by_hand():
    """For a loss averaged over N tokens, each a cross-entropy of its own output row, the empirical
    Fisher's trace (1/N) sum_t ||d l_t / d y_t||^2, computed token by token, is N ||dY||^2 of the mean."""
    g = torch.Generator().manual_seed(0)
    tokens, width = 12, 5
    y = torch.randn(tokens, width, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, width, (tokens,), generator=g)
    per_token = torch.nn.functional.cross_entropy(y, labels, reduction="none")
    (dy,) = torch.autograd.grad(per_token.mean(), y, retain_graph=True)
    fisher_trace = sum(torch.autograd.grad(per_token[t], y, retain_graph=True)[0].square().sum()
                       for t in range(tokens)) / tokens
    m = ModuleStatistics(name="decoder.layers.0.mlp.linear_fc2", layer=0, stage=0, in_features=7, out_features=width,
                         input_numel=7.0 * tokens, output_numel=float(width * tokens), input_sq=1.0, weight_sq=1.0,
                         output_sq=1.0, output_grad_sq=dy.square().sum().item(), curvature=-1.0,
                         curvature_probes=[-1.0], gain=0.0, gain_probes=[0.0], errors={})
    assert fisher_curvature(m) == pytest.approx(fisher_trace.item(), rel=1e-12)


def test_fisher_variant_changes_the_curvature_only():
    stats = StatisticsFile.load(STATS).stats
    fisher = with_curvature(stats, "fisher")
    assert with_curvature(stats, "hutchinson") is stats
    for name, m in stats.modules.items():
        assert fisher.modules[name].curvature == fisher_curvature(m) > 0
        assert fisher.modules[name].errors == m.errors and fisher.modules[name].gain == m.gain
    terms = type_terms(stats, "nvfp4")
    assert set(terms) == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert all(row["loss (fisher)"] > 0 for row in terms.values())
    with pytest.raises(ValueError, match="curvature must be one of"):
        Variant("x", curvature="gauss")
    # Statistics of a --snip-curvature fisher run hold no Hutchinson trace to screen.
    measured_fisher = replace(fisher, settings={**fisher.settings, "curvature": "fisher"})
    assert with_curvature(measured_fisher, "fisher").modules == fisher.modules
    with pytest.raises(ValueError, match="hold no Hutchinson curvature"):
        with_curvature(measured_fisher, "hutchinson")


def test_the_fisher_loss_term_policy_plans_by_the_fisher_loss_divergence():
    """``snip-fisher-loss-term`` (offline.POLICIES): of two equal modules, one in FP4, it puts the one
    whose loss divergence under the Fisher curvature is smaller there, where the Hutchinson one
    (``snip-loss-term``) says the opposite."""
    from dataclasses import replace

    from megatron_snip.snip.estimators import cost_tables
    from megatron_snip.snip.ilp import LinearModule, SnipProblem
    from megatron_snip.snip.policies import POLICIES

    full = StatisticsFile.load(STATS).stats
    a, b = "decoder.layers.1.mlp.linear_fc1", "decoder.layers.2.mlp.linear_fc1"
    # a: small Hutchinson curvature, large gradient (Fisher); b: the other way round
    modules = {a: replace(full.modules[a], curvature=1e-3, output_grad_sq=1e3 * full.modules[a].output_grad_sq),
               b: replace(full.modules[b], curvature=1e3, output_grad_sq=1e-3 * full.modules[b].output_grad_sq)}
    stats = replace(full, modules=modules)
    formats = ("bf16", "nvfp4")
    problem = SnipProblem([LinearModule.from_shape(n, i, 64, 8, 16) for i, n in enumerate((a, b))], formats, 0.5,
                          cost=cost_tables(stats, formats=formats).joint)
    in_fp4 = {name: [n for n, f in POLICIES[name](problem, stats, 0, "highs").items() if f == "nvfp4"]
              for name in ("snip-loss-term", "snip-fisher-loss-term")}
    assert in_fp4 == {"snip-loss-term": [a], "snip-fisher-loss-term": [b]}


def test_curvature_resolution_by_hand():
    """Draws (3, 1.1): |mean| / standard error 2.05 / 0.95; (3, 0.9): 1.95 / 1.05, within 2 standard
    errors of 0; (-1, -1.2): 1.1 / 0.1, resolved and negative."""
    stats = StatisticsFile.load(STATS).stats
    names = list(stats.modules)[:3]
    stats = replace(stats, modules={n: stats.modules[n] for n in names})
    for name, draws in zip(names, ([3.0, 1.1], [3.0, 0.9], [-1.0, -1.2])):
        stats.modules[name] = replace(stats.modules[name], curvature=sum(draws) / 2, curvature_probes=draws)
    r = curvature_resolution(stats)
    assert r["modules"] == 3 and r["unresolved"] == pytest.approx(1 / 3) and r["negative"] == pytest.approx(1 / 3)
    assert r["median |mean| / standard error"] == pytest.approx(2.05 / 0.95)
    fisher = replace(stats, modules={n: replace(m, curvature_probes=[]) for n, m in stats.modules.items()})
    assert curvature_resolution(fisher) is None


def test_momentum_gain_by_hand_and_by_simulation():
    """(rho + (1 - rho)(1 - b) / (1 + b)) / (1 - b)^2: 1 / (1 - b^2) for an independent error, 1 / (1 - b)^2
    for a repeated one, 1 without momentum; and what an EMA of errors with a shared part does."""
    assert momentum_gain(0.0, 0.9) == pytest.approx(1 / 0.19, rel=1e-12)
    assert momentum_gain(1.0, 0.9) == pytest.approx(100.0, rel=1e-12)
    assert momentum_gain(0.25, 0.9) == pytest.approx((0.25 + 0.75 * 0.1 / 1.9) / 0.01, rel=1e-12)
    assert momentum_gain(0.3, 0.0) == pytest.approx(1.0, rel=1e-12)
    # e_t = sqrt(rho) b + sqrt(1 - rho) n_t (b fixed per trial, n_t fresh): lag correlation rho, variance 1
    g = torch.Generator().manual_seed(0)
    beta1, rho, trials = 0.8, 0.2, 200_000
    shared = torch.randn(trials, generator=g, dtype=torch.float64)
    m = torch.zeros(trials, dtype=torch.float64)
    for _ in range(150):  # 0.8^150: the start forgotten
        e = rho**0.5 * shared + (1 - rho) ** 0.5 * torch.randn(trials, generator=g, dtype=torch.float64)
        m = beta1 * m + (1 - beta1) * e
    one_step = (1 - beta1) ** 2
    assert m.square().mean().item() / one_step == pytest.approx(momentum_gain(rho, beta1), rel=0.02)
    with pytest.raises(ValueError, match="beta1"):
        momentum_gain(0.5, 1.0)


def _by_type(stats, scale_own=None, persistence=None):
    """A --validate-by-type record of ``stats``: SNIP's sums, the measured drift = SNIP's (times
    ``scale_own[type]`` on the own weights), persistence per type."""
    out = {}
    for fmt in stats.formats:
        out[fmt] = {kind: {"SNIP local": t["update, local"], "SNIP propagated": t["update, propagated"],
                           "bwd: own": t["update, local"] * (scale_own or {}).get(kind, 1.0),
                           "bwd: other": t["update, propagated"],
                           "bwd: persistence": (persistence or {}).get(kind, 0.1)}
                    for kind, t in type_terms(stats, fmt).items()}
    return out


def test_measured_update_stats_rescale_the_update_term_only():
    stats = StatisticsFile.load(STATS).stats
    before = divergences(stats)
    # measured = estimated: SNIP's costs unchanged; with one persistence for every type too (the gain cancels)
    same = cost_tables(stats).joint
    for rescaled in (measured_update_stats(stats, _by_type(stats)), measured_update_stats(stats, _by_type(stats), 0.9)):
        for name, row in cost_tables(rescaled).joint.items():
            assert row == pytest.approx(same[name], rel=1e-9)
    # fc2's own weights drift twice what SNIP says: its local part doubles, nothing else moves
    after = divergences(measured_update_stats(stats, _by_type(stats, scale_own={"linear_fc2": 2.0})))
    for name, per in before.items():
        for fmt, d in per.items():
            a = after[name][fmt]
            assert a.update_local == pytest.approx(d.update_local * (2.0 if module_type(name) == "linear_fc2" else 1.0),
                                                   rel=1e-12)
            assert a.update_propagated == pytest.approx(d.update_propagated, rel=1e-12)
            assert a.loss_change == d.loss_change
    # fc2's error repeats (0.5), the rest barely (0.05): fc2 weighs gain(0.5) / gain(0.05) more than the
    # others, and each format's update terms still sum to SNIP's
    kept = divergences(measured_update_stats(
        stats, _by_type(stats, persistence={"linear_fc2": 0.5, "linear_qkv": 0.05, "linear_proj": 0.05,
                                            "linear_fc1": 0.05}), 0.9))
    ratio = momentum_gain(0.5, 0.9) / momentum_gain(0.05, 0.9)
    fc2, qkv = "decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_qkv"
    for fmt in stats.formats:
        assert sum(kept[n][fmt].backward for n in kept) == pytest.approx(sum(before[n][fmt].backward for n in before),
                                                                          rel=1e-9)
        assert (kept[fc2][fmt].backward / kept[qkv][fmt].backward
                == pytest.approx(ratio * before[fc2][fmt].backward / before[qkv][fmt].backward, rel=1e-9))
    # a record of another probe cycle is refused
    other = _by_type(stats)
    other["nvfp4"]["linear_qkv"]["SNIP local"] *= 1.5
    with pytest.raises(ValueError, match="measured on another probe cycle"):
        measured_update_stats(stats, other)


def _run_dir(tmp_path, targets=("fp4-0.5", "fp4-0.75")):
    """A comparison's --out as the screen reads it: the settings, one seed's branch-point
    statistics, and oracle costs (random, but fixed) for every module."""
    out = tmp_path / "run"
    snip = out / "seed1" / "trunk" / "ckpt" / "snip"
    snip.mkdir(parents=True)
    shutil.copy(STATS, snip / "snip_iter_0000100.json")
    (out / "comparison.json").write_text(json.dumps(
        {"seeds": [1], "trunk_iters": 100, "formats": ["bf16", "fp8", "nvfp4"], "budgets": list(targets)}))
    rng = random.Random(3)
    modules = {n: rng.uniform(0.0, 0.01) for n in StatisticsFile.load(STATS).stats.modules}
    groups = {f"ablate-{t}": sum(c for n, c in modules.items() if n.endswith(t)) for t in TYPES}
    (out / "oracle").mkdir()
    (out / "oracle" / "costs.json").write_text(json.dumps(
        {"modules": modules, "groups": groups, "base_gap": 0.001, "source": "modules", "seeds": [1]}))
    return out


def test_no_variant_beats_the_oracle_on_the_costs_it_planned_with(tmp_path, capsys):
    out = _run_dir(tmp_path)
    assert main([str(out), "--solver", "highs", "--json", str(tmp_path / "screen.json")]) == 0
    printed = capsys.readouterr().out
    assert "FP4 target 0.50" in printed and "FP4 target 0.75" in printed and "| linear_fc2 |" in printed
    record = json.loads((tmp_path / "screen.json").read_text())
    resolution = curvature_resolution(StatisticsFile.load(STATS).stats)
    assert record["curvature_resolution"] == {"1": resolution} and "resolve the curvatures" in printed
    screens = record["screens"]
    assert {s["fp4_target"] for s in screens} == {0.5, 0.75}
    for s in screens:
        rows = s["rows"]
        assert set(rows) == {v.name for v in VARIANTS} | {"oracle"}
        oracle_gap = rows["oracle"][1]
        for name, (share, gap) in rows.items():
            assert share >= s["fp4_target"] - 1e-9, name
            assert gap >= oracle_gap - 1e-12, f"{name} beat the oracle on its own costs"
        # the screen is worth something only if the variants plan differently from the oracle
        assert any(gap > oracle_gap + 1e-6 for gap in (r[1] for r in rows.values()))


def test_the_error_baselines_are_ranked_beside_the_variants(tmp_path, capsys):
    """The screen's rank correlations hold the paper's operand-error table, as spearman ranks it by hand."""
    out = _run_dir(tmp_path)
    assert main([str(out), "--solver", "highs", "--json", str(tmp_path / "screen.json")]) == 0
    assert "| operand error (min-operand-error) |" in capsys.readouterr().out
    rho = json.loads((tmp_path / "screen.json").read_text())["rank_correlations"]["operand error (min-operand-error)"]
    costs = json.loads((out / "oracle" / "costs.json").read_text())
    operand = operand_error_baselines(StatisticsFile.load(STATS).stats)[0]
    names = sorted(operand)
    assert rho["modules"] == pytest.approx(spearman([operand[n]["nvfp4"] for n in names],
                                                    [costs["modules"][n] for n in names]))
    per_type = {t: sum(operand[n]["nvfp4"] for n in names if n.endswith(t)) for t in TYPES}
    assert rho["types"] == pytest.approx(spearman([per_type[t] for t in TYPES],
                                                  [costs["groups"][f"ablate-{t}"] for t in TYPES]))


def test_statistics_without_operand_errors_leave_only_those_rows_out(tmp_path, capsys):
    """Statistics older than the operands' errors: the screen says so in the operand rows and ranks the rest."""
    out = _run_dir(tmp_path)
    path = out / "seed1" / "trunk" / "ckpt" / "snip" / "snip_iter_0000100.json"
    record = json.loads(path.read_text())
    for module in record["statistics"]["modules"].values():
        for errors in module["errors"].values():
            errors["operand_sq"] = None
    path.write_text(json.dumps(record))
    assert main([str(out), "--solver", "highs", "--json", str(tmp_path / "screen.json")]) == 0
    assert "| operand error (min-operand-error) | statistics of iteration" in capsys.readouterr().out
    ranked = json.loads((tmp_path / "screen.json").read_text())["rank_correlations"]
    assert "operand error (min-operand-error)" not in ranked and "output error (min-quant-error)" in ranked


def test_the_by_type_rows_come_from_each_seeds_record(tmp_path, capsys):
    from snip_lab.cli.screen_estimators import MEASURED, MEASURED_MOMENTUM

    out = _run_dir(tmp_path)
    stats = StatisticsFile.load(STATS).stats
    record = {"iteration": stats.iteration, "by_type": _by_type(stats, persistence={"linear_fc2": 0.6})}
    (tmp_path / "bt_s1.json").write_text(json.dumps(record))
    pattern = str(tmp_path / "bt_s{seed}.json")
    plans = tmp_path / "plans"
    assert main([str(out), "--solver", "highs", "--by-type", pattern, "--json", str(tmp_path / "s.json"),
                 "--write-plans", str(plans)]) == 0
    assert f"| {MEASURED_MOMENTUM} |" in capsys.readouterr().out
    # every row's plan is written for training; SNIP's is the plan SNIP's ILP makes from the statistics
    names = {p.name for p in (plans / "seed1").iterdir()}
    assert names == {f"{n.replace(' ', '-')}_fp4-{t}.json" for n in [v.name for v in VARIANTS]
                     + [MEASURED, MEASURED_MOMENTUM, "oracle"] for t in ("0.50", "0.75")}
    problem = StatisticsFile.load(STATS).problem(Budget(0.75), formats=["bf16", "fp8", "nvfp4"], solver="highs")
    snip = to_precision_plan(variant_plan(problem, stats, VARIANTS[0], "highs"), split=problem.split)
    assert PrecisionPlan.load(plans / "seed1" / "snip_fp4-0.75.json") == snip
    for s in json.loads((tmp_path / "s.json").read_text())["screens"]:
        rows = s["rows"]
        assert rows[MEASURED] == pytest.approx(rows["snip"])  # measured = SNIP's own terms: the same plan
        assert rows[MEASURED_MOMENTUM][1] >= rows["oracle"][1] - 1e-12
    with pytest.raises(SystemExit):
        main([str(out), "--by-type", str(tmp_path / "bt.json")])
    assert "the pattern must hold '{seed}'" in capsys.readouterr().err
    assert main([str(out), "--by-type", str(tmp_path / "none_s{seed}.json")]) == 2
    assert "none_s1.json does not exist: run tools/lab/snip_validate.py --validate-by-type" in capsys.readouterr().err
    other = json.loads(json.dumps(record))
    other["by_type"]["nvfp4"]["linear_fc2"]["SNIP propagated"] *= 2
    (tmp_path / "bt_s1.json").write_text(json.dumps(other))
    assert main([str(out), "--by-type", pattern]) == 2
    assert "bt_s1.json: the record's nvfp4 'SNIP propagated' of linear_fc2" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit):
        main([str(out), "--write-plans", str(tmp_path / "a_file" / "plans")])
    assert "--write-plans" in capsys.readouterr().err
    (tmp_path / "bt_s1.json").write_text(json.dumps({**record, "iteration": 7}))
    assert main([str(out), "--by-type", pattern]) == 2
    assert "is not a --validate-by-type record of iteration" in capsys.readouterr().err


def test_the_other_row_plans_from_the_other_runs_statistics_of_the_same_trunk(tmp_path, capsys):
    """``--other NAME=DIR``: a row planned with SNIP's cost from DIR's branch-point statistics, the same
    trunk measured with other probe settings (here: layer 0's gains 0, as --snip-gain-exclude of the
    parameters below it would give); DIR needs no oracle. Another trunk is refused."""
    out = _run_dir(tmp_path)
    stats = StatisticsFile.load(STATS).stats
    data = json.loads(STATS.read_text())
    for m in data["statistics"]["modules"].values():
        if m["layer"] == 0:
            m["gain"], m["gain_probes"] = 0.0, [0.0 for _ in m["gain_probes"]]
    other = tmp_path / "other"
    (other / "seed1" / "trunk" / "ckpt" / "snip").mkdir(parents=True)
    shutil.copy(out / "comparison.json", other / "comparison.json")
    (other / "seed1" / "trunk" / "ckpt" / "snip" / "snip_iter_0000100.json").write_text(json.dumps(data))
    changed = StatisticsFile.load(other / "seed1" / "trunk" / "ckpt" / "snip" / "snip_iter_0000100.json").stats
    assert changed.modules != stats.modules
    plans = tmp_path / "plans"
    assert main([str(out), "--solver", "highs", "--other", f"layer 0 local={other}", "--write-plans", str(plans)]) == 0
    assert "| layer 0 local |" in capsys.readouterr().out
    problem = StatisticsFile.load(STATS).problem(Budget(0.75), formats=["bf16", "fp8", "nvfp4"], solver="highs")
    expected = to_precision_plan(variant_plan(problem, changed, VARIANTS[0], "highs"), split=problem.split)
    assert PrecisionPlan.load(plans / "seed1" / "layer-0-local_fp4-0.75.json") == expected
    assert PrecisionPlan.load(plans / "seed1" / "snip_fp4-0.75.json") != expected  # the row is not SNIP's own
    data["statistics"]["loss"] *= 1.01
    (other / "seed1" / "trunk" / "ckpt" / "snip" / "snip_iter_0000100.json").write_text(json.dumps(data))
    assert main([str(out), "--other", f"x={other}"]) == 2
    assert "seed 1: " in (err := capsys.readouterr().err) and "is not this run's" in err
    assert main([str(out), "--other", str(other)]) == 2
    assert "give NAME=DIR" in capsys.readouterr().err


def test_a_target_outside_0_1_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(_run_dir(tmp_path)), "--targets", "0.75", "1.5"])
    assert exit_info.value.code == 2
    assert "--targets 1.5: an FP4 target is a share of the linear FLOPs, in (0, 1]" in capsys.readouterr().err


def test_a_run_without_the_oracle_arm_is_refused(tmp_path, capsys):
    out = _run_dir(tmp_path)
    (out / "oracle" / "costs.json").unlink()
    assert main([str(out)]) == 2
    err = capsys.readouterr().err
    assert "costs.json does not exist" in err and "--policies oracle" in err and "give --oracle-costs" in err


def test_oracle_costs_from_another_file_screen_a_run_without_its_own(tmp_path, capsys):
    """--oracle-costs: the trunks of a comparison whose oracle arm has not run, screened against given costs,
    print what the run's own costs.json would give."""
    out = _run_dir(tmp_path)
    assert main([str(out), "--solver", "highs", "--json", str(tmp_path / "own.json")]) == 0
    own = capsys.readouterr().out
    costs = tmp_path / "costs.json"
    (out / "oracle" / "costs.json").rename(costs)
    given = ["--oracle-costs", str(costs), "--json", str(tmp_path / "given.json")]
    assert main([str(out), "--solver", "highs", *given]) == 0
    assert capsys.readouterr().out == own
    assert json.loads((tmp_path / "given.json").read_text())["rank_correlations"] == \
        json.loads((tmp_path / "own.json").read_text())["rank_correlations"]
    (tmp_path / "bad.json").write_text("{}")
    assert main([str(out), "--oracle-costs", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not the oracle's costs.json of a comparison" in capsys.readouterr().err


def test_the_cross_fit_holds_out_each_ablation_seed_and_the_oracle_wins_in_sample(tmp_path, capsys):
    """A run with per-module ablations on two seeds: the screen adds the cross-fit (snip_lab/crossfit.py)
    at each budget, one fold per seed; in-sample, on the costs it was fitted on, the oracle's plan is
    never beaten by a variant's, held out it can be. One ablation seed: no cross-fit, said so."""
    from snip_lab.oracle import oracle_groups

    out = _run_dir(tmp_path)
    settings = json.loads((out / "comparison.json").read_text())
    (out / "comparison.json").write_text(json.dumps({**settings, "seeds": [1, 2], "ablations": ["modules"]}))
    shutil.copytree(out / "seed1" / "trunk", out / "seed2" / "trunk")
    problem = StatisticsFile.load(STATS).problem(Budget(0.5), formats=["bf16", "fp8", "nvfp4"], solver="highs")
    rng = random.Random(5)
    for seed in (1, 2):
        for arm in [*oracle_groups(problem, ("modules",)), "ablate-none", "bf16"]:
            loss = 5.0 + (0.0 if arm == "bf16" else 0.002 if arm == "ablate-none" else rng.uniform(0.0, 0.01))
            (out / f"seed{seed}" / arm).mkdir()
            (out / f"seed{seed}" / arm / "result.json").write_text(json.dumps(
                {"final_valid_loss": loss, "mean_train_loss": loss, "fp4_fraction": 0.0, "time_ratio": 1.0}))
    assert main([str(out), "--solver", "highs", "--json", str(tmp_path / "screen.json")]) == 0
    printed = capsys.readouterr().out
    assert "Cross-fit at FP4 target 0.50" in printed and "The oracle's optimism" in printed
    folds = json.loads((tmp_path / "screen.json").read_text())["cross_fit"]
    assert sorted((f["fp4_target"], f["held_out"]) for f in folds) == [(0.5, 1), (0.5, 2), (0.75, 1), (0.75, 2)]
    for f in folds:
        assert set(f["in_sample"]) == {v.name for v in VARIANTS} | {"oracle"}
        assert f["in_sample"]["oracle"] <= min(f["in_sample"].values()) + 1e-12
    assert any(f["held_out_price"]["oracle"] > min(f["held_out_price"].values()) for f in folds)
    shutil.rmtree(out / "seed2" / "ablate-none")
    assert main([str(out), "--solver", "highs"]) == 0
    assert "No cross-fit: a cross-fit holds one ablation seed out of the others" in capsys.readouterr().out

"""The offline screen of estimator variants (research/variants.py, tools/screen_estimators.py): the
Fisher curvature by hand, and the oracle never beaten on the costs it planned with."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import ROOT

from megatron_snip.cli.screen_estimators import main
from megatron_snip.research.variants import (
    VARIANTS,
    Variant,
    curvature_resolution,
    fisher_curvature,
    type_terms,
    with_curvature,
)
from megatron_snip.snip.statistics import ModuleStatistics
from megatron_snip.snip.statistics_file import StatisticsFile

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

    from megatron_snip.research.offline import POLICIES
    from megatron_snip.snip.estimators import cost_tables
    from megatron_snip.snip.ilp import LinearModule, SnipProblem

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
    groups = {f"ablate-{t}": sum(c for n, c in modules.items() if n.endswith(t))
              for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}
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
    assert "costs.json does not exist" in err and "--policies oracle" in err

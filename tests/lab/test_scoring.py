"""The lab's scoring of SNIP's estimates: rank correlations, and what an ablation plan's estimators
predict (on the toy statistics of tests/test_snip_estimators.py)."""

from __future__ import annotations

import math

import pytest
from test_snip_estimators import _stats

from megatron_snip.snip.estimators import cost_tables, divergences
from megatron_snip.snip.ilp import LinearModule, SnipProblem
from snip_lab.ablation import predictions
from snip_lab.ranks import rank_correlations, rank_with_ties, spearman


def test_spearman_with_ties():
    assert rank_with_ties([10.0, 20.0, 20.0, 5.0, 20.0]) == [2.0, 4.0, 4.0, 1.0, 4.0]
    # The classic textbook example (IQ vs hours of TV): rho = -29/165.
    iq = [106, 100, 86, 101, 99, 103, 97, 113, 112, 110]
    tv = [7, 27, 2, 50, 28, 29, 20, 12, 6, 17]
    assert spearman(iq, tv) == pytest.approx(-29 / 165)
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # With ties: Pearson correlation of the mid-ranks.
    x, y = [1, 2, 2, 3], [1, 3, 2, 4]
    rx, ry = [1, 2.5, 2.5, 4], [1, 3, 2, 4]
    mx, my = sum(rx) / 4, sum(ry) / 4
    expected = sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / math.sqrt(
        sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    assert spearman(x, y) == pytest.approx(expected)
    assert math.isnan(spearman([1, 1], [1, 2]))


def test_rank_correlations_overall_and_per_format():
    truth = {"a": {"fp8": 1.0, "nvfp4": 10.0}, "b": {"fp8": 2.0, "nvfp4": 20.0}, "c": {"fp8": 3.0, "nvfp4": 15.0}}
    estimate = {"a": {"fp8": 1.0, "nvfp4": 9.0}, "b": {"fp8": 3.0, "nvfp4": 30.0}, "c": {"fp8": 2.0, "nvfp4": 40.0}}
    rho = rank_correlations(estimate, truth)
    assert rho["fp8"] == pytest.approx(0.5) and rho["nvfp4"] == pytest.approx(0.5)
    assert rho["all"] == pytest.approx(spearman([1, 9, 3, 30, 2, 40], [1, 10, 2, 20, 3, 15]))


def test_ablation_predictions_split_snips_divergence_into_its_two_terms():
    """What the ablation report scores against training: SNIP's loss and update terms of a plan are the
    summed forward and backward divergences of its modules' formats, and add up to the ILP's objective."""
    stats = _stats()
    names = sorted(stats.modules)
    tables = cost_tables(stats, formats=("bf16", "fp8", "nvfp4"))
    problem = SnipProblem([LinearModule.from_shape(n, i, 64, 8, 16) for i, n in enumerate(names)],
                          ("bf16", "fp8", "nvfp4"), 0.0, cost=tables.joint)
    plan = {names[0]: "nvfp4", names[1]: "fp8"}
    p = predictions(problem, stats, plan)
    d = divergences(stats)
    assert p["snip_loss_term"] == pytest.approx(d[names[0]]["nvfp4"].forward + d[names[1]]["fp8"].forward)
    assert p["snip_update_term"] == pytest.approx(d[names[0]]["nvfp4"].backward + d[names[1]]["fp8"].backward)
    assert p["snip_divergence"] == pytest.approx(p["snip_loss_term"] + p["snip_update_term"])
    assert p["fp4_fraction"] == pytest.approx(0.5)

"""The cross-fit (snip_lab/crossfit.py): the oracle planned without one ablation seed, every plan
priced with the other seeds' costs and with the held-out seed's, by hand."""

from __future__ import annotations

import pytest
from test_compare_precision import FC2_0, FC2_1, QKV0, QKV1, two_by_two_problem

from snip_lab.crossfit import cross_fit
from snip_lab.oracle import ORACLE, oracle_groups

# Per-module ablations (arm minus ablate-none of the same seed):
#   seed 1: qkv0 .004, fc2_0 .016, qkv1 -.002, fc2_1 .011 (ablate-none - bf16 .010)
#   seed 2: qkv0 .016, fc2_0 .004, qkv1  .010, fc2_1 .011 (ablate-none - bf16 .005)
DELTAS = {1: (0.004, 0.016, -0.002, 0.011), 2: (0.016, 0.004, 0.010, 0.011)}
ARMS = ("ablate-layer0-linear_qkv", "ablate-layer0-linear_fc2", "ablate-layer1-linear_qkv", "ablate-layer1-linear_fc2")
LOSSES = {"bf16": {1: 4.990, 2: 5.095}, "ablate-none": {1: 5.000, 2: 5.100},
          **{arm: {s: {1: 5.000, 2: 5.100}[s] + d[i] for s, d in DELTAS.items()} for i, arm in enumerate(ARMS)}}
# Plans that did not look at the costs: layer 1, and layer 0.
FIXED = {"layer 1": [QKV1, FC2_1], "layer 0": [QKV0, FC2_0]}


def test_cross_fit_by_hand():
    """At 50% FP4 (>= 5120 of 10240 FLOPs: two modules, one a qkv) the oracle takes the cheapest pair of
    the seed it is fitted on, which the held-out seed prices higher; the fixed plans it does not beat."""
    p = two_by_two_problem(0.5)  # 2 layers x (qkv 3072, fc2 2048 FLOPs): 10240
    folds = cross_fit(p, oracle_groups(p, ("modules",)), LOSSES, "bf16", {1: FIXED, 2: FIXED}, solver="highs")
    one, two = folds
    assert [f.held_out for f in folds] == [1, 2]
    # Hold out seed 1: fitted on seed 2 (fc2_0 .004 + qkv1 .010 = .014, base .005); seed 1 prices that pair
    # .016 - .002 unclipped (base .010), layer 1 .021 -> .009 and layer 0 .020 -> .020.
    assert one.in_sample == pytest.approx({ORACLE: 0.019, "layer 1": 0.026, "layer 0": 0.025})
    assert one.held_out_price == pytest.approx({ORACLE: 0.024, "layer 1": 0.019, "layer 0": 0.030})
    assert one.optimism() == pytest.approx(0.005 - (-0.007 + 0.005) / 2)
    # Hold out seed 2: fitted on seed 1 with qkv1's -.002 clipped to 0, the oracle takes both qkv
    # (.004 + 0, 6144 FLOPs); seed 2 prices them .026.
    assert two.in_sample == pytest.approx({ORACLE: 0.014, "layer 1": 0.021, "layer 0": 0.030})
    assert two.held_out_price == pytest.approx({ORACLE: 0.031, "layer 1": 0.026, "layer 0": 0.025})
    assert two.excess(ORACLE) == pytest.approx(0.017) and two.optimism() == pytest.approx(0.017)
    # In-sample the oracle is never beaten: it is the optimum of the costs it was fitted on.
    assert all(f.in_sample[ORACLE] <= min(f.in_sample.values()) for f in folds)
    # A seed without plans (no statistics of its trunk) is not held out.
    assert [f.held_out for f in cross_fit(p, oracle_groups(p, ("modules",)), LOSSES, "bf16", {2: FIXED})] == [2]


def test_a_cross_fit_needs_two_ablation_seeds():
    p = two_by_two_problem(0.5)  # 2 layers x (qkv 3072, fc2 2048 FLOPs): 10240
    one_seed = {arm: {1: per[1]} for arm, per in LOSSES.items()}
    with pytest.raises(ValueError, match="needs the ablations of two or more seeds"):
        cross_fit(p, oracle_groups(p, ("modules",)), one_seed, "bf16", {1: FIXED})

"""What a SNIP cycle decided, module by module (snip/decisions.py), and the plan picture (snip/plan_image.py)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_snip.numerics.recipes import Precision
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_name
from megatron_snip.snip.decisions import decision_summary, decision_table, decisions
from megatron_snip.snip.estimators import CostTables
from megatron_snip.snip.plan_image import FORMAT_COLOURS, layer_tick_step, plan_image

FORMATS = ("bf16", "fp8", "nvfp4")
QKV, FC2 = module_name(0, "self_attention.linear_qkv"), module_name(0, "mlp.linear_fc2")


def _costs() -> CostTables:
    fwd = {QKV: {"bf16": 0.0, "fp8": 0.1, "nvfp4": 1.0}, FC2: {"bf16": 0.0, "fp8": 0.2, "nvfp4": 3.0}}
    bwd = {QKV: {"bf16": 0.0, "fp8": 0.01, "nvfp4": 0.5}, FC2: {"bf16": 0.0, "fp8": 0.02, "nvfp4": 0.25}}
    joint = {n: {f: fwd[n][f] + bwd[n][f] for f in FORMATS} for n in fwd}
    return CostTables(joint, fwd, bwd)


def test_each_module_shows_its_choice_its_costs_and_the_next_faster_format():
    plan = PrecisionPlan({QKV: Precision.uniform("fp8"), FC2: Precision.uniform("nvfp4")})
    rows = decisions(plan, _costs(), FORMATS, speed={"bf16": 1.0, "fp8": 2.0, "nvfp4": 4.0}, pins={FC2})
    qkv, fc2 = rows
    assert (qkv.precision, qkv.loss, qkv.update, qkv.faster, qkv.faster_cost, qkv.pinned) == (
        "fp8", 0.1, 0.01, "nvfp4", 1.5, False)
    assert (fc2.precision, fc2.loss, fc2.update, fc2.faster, fc2.faster_cost, fc2.pinned) == (
        "nvfp4", 3.0, 0.25, None, None, True)
    table = decision_table(rows)
    assert QKV in table and "nvfp4 (1.5)" in table and "[pinned]" in table.splitlines()[2]


def test_without_a_speed_model_fewer_bits_are_faster_and_fixed_passes_cost_nothing():
    plan = PrecisionPlan({QKV: Precision.uniform("bf16"), FC2: Precision.parse("fp8/bf16")})
    rows = decisions(plan, _costs(), FORMATS, fixed={"fwd": None, "bwd": "bf16"})
    assert rows[0].faster == "fp8" and rows[0].faster_cost == pytest.approx(0.11)
    assert (rows[1].precision, rows[1].loss, rows[1].update) == ("fp8/bf16", 0.2, 0.0)


def test_summary_counts_precisions_per_module_type():
    plan = PrecisionPlan({QKV: Precision.uniform("fp8"), FC2: Precision.uniform("nvfp4")})
    summary = decision_summary(decisions(plan, _costs(), FORMATS), top=1)
    assert "self_attention.linear_qkv" in summary and "fp8: 1" in summary
    assert summary.splitlines()[-1] == f"costliest 1 choices: {FC2} nvfp4 (3.25)"


@pytest.mark.parametrize("layers", [2, 32, 80])
def test_plan_picture_is_wide_labelled_and_shows_each_format_used(layers):
    modules = {module_name(i, m): Precision.uniform("nvfp4" if (i + j) % 2 else "fp8")
               for i in range(layers) for j, m in enumerate(LINEAR_MODULES)}
    image = plan_image(PrecisionPlan(modules), layers)
    assert image.dtype == np.uint8 and image.shape[1] >= 400 and image.shape[0] >= 6 * layers
    colours = {tuple(c) for c in image.reshape(-1, 3)}
    assert tuple(FORMAT_COLOURS["nvfp4"]) in colours and tuple(FORMAT_COLOURS["fp8"]) in colours
    assert tuple(FORMAT_COLOURS["mxfp4"]) not in colours  # the legend lists only formats the plan uses


def test_layer_ticks_stay_readable_at_any_depth():
    assert layer_tick_step(16) == 1 and layer_tick_step(32) == 2 and layer_tick_step(80) == 5
    assert layer_tick_step(126) == 10

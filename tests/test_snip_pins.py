"""User pins under SNIP: --first-last-layers-bf16 (and its layer counts) and the modules a
--te-precision-config-file sets are never re-planned, count in the budgets, and hold in split-pass
mode, across cycles and a resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import yaml
from conftest import launch, run_config, scalars, train_args

from megatron_snip.arguments import ArgumentError
from megatron_snip.numerics.recipes import BF16, Precision
from megatron_snip.precision.flops import LlamaLinearDims, flop_fractions
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, end_layers, module_name, module_names
from megatron_snip.snip.estimators import CostTables
from megatron_snip.snip.ilp import LinearModule
from megatron_snip.snip.planner import (
    PlannerConfig,
    build_problem,
    implied_time_target,
    linear_modules,
    solve_plan,
    unit_pins,
)
from megatron_snip.training import tags
from megatron_snip.training.precision_setup import describe_pins, initial_plan, snip_pins

DIMS = LlamaLinearDims(num_layers=4, hidden_size=64, ffn_hidden_size=192, kv_channels=16, num_query_groups=2)
FORMATS = ("bf16", "fp8", "nvfp4")
BLACKWELL = {"bf16": 1.0, "fp8": 2.0, "nvfp4": 4.0}
NVFP4, FP8 = Precision.uniform("nvfp4"), Precision.uniform("fp8")
ENDS = {module_name(i, m): BF16 for i in (0, 3) for m in LINEAR_MODULES}
SNIP = ("--snip", "--snip-interval", "2")


def cheap_fp4_at_the_ends():
    """FP4 costs nothing in layers 0 and 3 and a lot in 1 and 2: without pins the ILP puts the ends in FP4."""
    div = {n: {"bf16": 0.0, "fp8": 0.01, "nvfp4": 0.0 if n.startswith(("decoder.layers.0.", "decoder.layers.3."))
               else 10.0} for n in module_names(4)}
    joint = {n: {f: 2 * c for f, c in row.items()} for n, row in div.items()}
    return CostTables(joint=joint, forward=div, backward=div)


# -- the ILP -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [False, True], ids=["joint", "split"])
def test_pins_are_never_replanned_and_count_in_the_fp4_denominator(split):
    free = PlannerConfig(formats=FORMATS, fp4_target=0.25, per_stage=True, split_passes=split, speed=BLACKWELL)
    mods = linear_modules(DIMS, 8, PipelineLayout(4, 2))
    plan, _ = solve_plan(build_problem(mods, cheap_fp4_at_the_ends(), free), free)
    assert plan["decoder.layers.0.mlp.linear_fc1"].fwd == "nvfp4"  # what the measured bug did
    pinned = replace(free, pins=ENDS)
    plan, sol = solve_plan(build_problem(mods, cheap_fp4_at_the_ends(), pinned, current=PrecisionPlan.uniform("nvfp4")),
                           pinned)
    assert all(plan[n] == BF16 for n in ENDS)
    # The target holds over all FLOPs, the pinned ones included: each stage puts half its free layer in FP4.
    assert sol.fp4_fraction == pytest.approx(flop_fractions(plan, DIMS).fp4) and sol.fp4_fraction >= 0.25 - 1e-9
    assert min(sol.stage_fp4_fraction.values()) >= 0.25 - 1e-9


def test_pins_hold_with_a_schedules_fixed_passes():
    """A schedule fixing the forward GEMMs: the plan keeps the pins (the schedule runs on top of them)."""
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False, speed=BLACKWELL, pins=ENDS)
    fixed = {"fwd": "fp8", "bwd": None}
    plan, sol = solve_plan(build_problem(linear_modules(DIMS, 8), cheap_fp4_at_the_ends(), cfg, fixed=fixed),
                           cfg, fixed)
    assert all(plan[n] == BF16 for n in ENDS)
    assert all(plan[n].fwd == "fp8" for n in module_names(4) if n not in ENDS)
    assert sol.fp4_fraction >= 0.5 - 1e-9


def test_unit_pins():
    pins = {"decoder.layers.0.mlp.linear_fc1": BF16, "decoder.layers.1.mlp.linear_fc1": Precision("fp8", "bf16")}
    assert unit_pins(pins, split=True) == {("decoder.layers.0.mlp.linear_fc1", "fwd"): "bf16",
                                           ("decoder.layers.0.mlp.linear_fc1", "bwd"): "bf16",
                                           ("decoder.layers.1.mlp.linear_fc1", "fwd"): "fp8",
                                           ("decoder.layers.1.mlp.linear_fc1", "bwd"): "bf16"}
    with pytest.raises(ValueError, match="decoder.layers.1.mlp.linear_fc1 -> fp8/bf16 .* needs --snip-split-passes"):
        unit_pins(pins, split=False)


def four_modules(flops, stages=(0, 0, 0, 0)):
    return [LinearModule(f"decoder.layers.{i}.mlp.linear_fc1", i, f, f, f, s) for i, (f, s) in
            enumerate(zip(flops, stages))]


def test_the_implied_time_target_charges_pinned_units_their_pinned_time():
    """Four equal modules at 50% FP4 on Blackwell, m0 pinned bf16: the baselines' plan is m0 bf16 (1), two
    nvfp4 (1/4 each), one fp8 (1/2): 2 of 4 BF16 time units. The pin-blind 0.5/4 + 0.5/2 = 0.375 would
    leave no plan (the least time at 50% FP4 with m0 in bf16 is 0.5)."""
    pin = {"decoder.layers.0.mlp.linear_fc1": BF16}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False, speed=BLACKWELL, pins=pin)
    assert implied_time_target(four_modules([1.0] * 4), cfg) == pytest.approx(0.5)
    assert implied_time_target(four_modules([1.0] * 4), replace(cfg, pins={})) == \
        pytest.approx(0.375)
    cost = {f"decoder.layers.{i}.mlp.linear_fc1": {"bf16": 0.0, "fp8": 0.01, "nvfp4": 1.0} for i in range(4)}
    plan, sol = solve_plan(build_problem(four_modules([1.0] * 4), CostTables(cost, cost, cost), cfg), cfg)
    assert plan["decoder.layers.0.mlp.linear_fc1"] == BF16 and sol.time_ratio == pytest.approx(0.5)
    # A pin in FP4 supplies FP4 FLOPs: m0 in nvfp4 leaves one more FP4 unit to find.
    fp4_pin = replace(cfg, pins={"decoder.layers.0.mlp.linear_fc1": NVFP4})
    assert implied_time_target(four_modules([1.0] * 4), fp4_pin) == pytest.approx((0.25 + 0.25 + 0.5 + 0.5) / 4)


def test_per_stage_the_implied_time_target_is_the_slowest_stages():
    """Stage 0 holds the bf16 pin (its baseline time 1 + 1/4 of 2 units), stage 1 none (0.375)."""
    pin = {"decoder.layers.0.mlp.linear_fc1": BF16}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=True, speed=BLACKWELL, pins=pin)
    assert implied_time_target(four_modules([1.0] * 4, (0, 0, 1, 1)), cfg) == pytest.approx(0.625)


def test_hopper_overshoot_counts_only_free_units():
    """FP4 emulated (slower than FP8): one free unit may overshoot the target; a pinned unit cannot."""
    hopper = {"bf16": 1.0, "fp8": 2.0, "nvfp4": 1.0}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False, speed=hopper,
                        pins={"decoder.layers.0.mlp.linear_fc1": BF16})
    # pinned 4 (bf16), need 4 of the free 1+1+2 in FP4 (time 4), the rest 0: 8 / 8, plus (1 - 1/2) x 2/8.
    assert implied_time_target(four_modules([4.0, 1.0, 1.0, 2.0]), cfg) == pytest.approx(1.0 + 0.5 * 2 / 8)


# -- the flags ----------------------------------------------------------------------------------------------

def test_first_last_layers_bf16_are_pins_named_at_start_up():
    pins, text = snip_pins(run_config(*SNIP, "--snip-fp4-target", "0.5", "--first-last-layers-bf16"))
    assert pins == ENDS
    assert text == "SNIP pins: 8 modules (layers 0, 3) in bf16 (--first-last-layers-bf16)"
    pins, text = snip_pins(run_config(*SNIP, "--snip-fp4-target", "0.25", "--first-last-layers-bf16",
                                      "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0"))
    assert set(pins) == {module_name(i, m) for i in (0, 1) for m in LINEAR_MODULES}
    assert text == "SNIP pins: 8 modules (layers 0-1) in bf16 (--first-last-layers-bf16)"
    assert snip_pins(run_config(*SNIP, "--snip-fp4-target", "0.5")) == ({}, "")


def test_the_start_up_plan_carries_the_pins():
    plan, source = initial_plan(run_config(*SNIP, "--snip-fp4-target", "0.5", "--first-last-layers-bf16",
                                           "--snip-warmup-plan", "fp8"))
    assert source == "--snip-warmup-plan fp8, with the SNIP pins"
    assert {n: plan[n] for n in module_names(4)} == {n: ENDS.get(n, FP8) for n in module_names(4)}


def test_a_target_the_pins_rule_out_fails_at_start_up():
    with pytest.raises(ArgumentError) as e:
        run_config(*SNIP, "--first-last-layers-bf16", "--pipeline-model-parallel-size", "2", world_size=2)
    assert str(e.value) == (
        "--snip budgets: FP4 target 0.75 is infeasible: with 8 modules pinned to non-FP4 formats (bf16: 8) the "
        "largest feasible target is 0.5 (global) / 0.5 (stage 0). Lower --snip-fp4-target or unpin modules. "
        "(SNIP pins: 8 modules (layers 0, 3) in bf16 (--first-last-layers-bf16))")
    # Without a speed table at start-up (measured at launch), the FP4 share is still checked.
    with pytest.raises(ArgumentError, match="FP4 target 0.75 is infeasible"):
        run_config(*SNIP, "--first-last-layers-bf16", "--gemm-speed-model", "measured")
    run_config(*SNIP, "--first-last-layers-bf16", "--snip-fp4-target", "0.5", "--pipeline-model-parallel-size", "2",
               world_size=2)


def test_a_pin_outside_the_candidates_is_refused():
    with pytest.raises(ArgumentError, match=r"^--first-last-layers-bf16 pins modules to bf16, which is not among "
                                            r"--snip-formats fp8 nvfp4: .* add bf16 to --snip-formats$"):
        run_config(*SNIP, "--snip-fp4-target", "0.5", "--first-last-layers-bf16", "--snip-formats", "fp8", "nvfp4")


def te_file(tmp_path, matchers, **configs):
    path = tmp_path / "te.yaml"
    path.write_text(yaml.safe_dump({
        "configs": {k: {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": v}
                    for k, v in configs.items()},
        "matchers": {f"m{i}": {"type": "glob", "pattern": p, "config": c, "enabled": True}
                     for i, (p, c) in enumerate(matchers)}}))
    return path


def test_a_precision_config_files_modules_are_pins(tmp_path):
    """The file pins every linear_proj in fp8; on the bf16 end layers it overrides their bf16 as in
    Megatron-LM (override_nonquantized_autocast: true), so layer 0 and 3's linear_proj are the file's."""
    path = te_file(tmp_path, [("*.linear_proj", "fp8")], fp8={"fp8_quantization_recipe": "tensorwise",
                                                               "fp8_format": "hybrid",
                                                               "override_nonquantized_autocast": True})
    pins, text = snip_pins(run_config(*SNIP, "--snip-fp4-target", "0.25", "--first-last-layers-bf16",
                                      "--te-precision-config-file", str(path)))
    proj = {module_name(i, "self_attention.linear_proj"): FP8 for i in range(4)}
    assert pins == {**ENDS, **proj}
    assert text == (f"SNIP pins: 6 modules (layers 0, 3) in bf16 (--first-last-layers-bf16); 4 modules (layers 0-3) in "
                    f"fp8 (--te-precision-config-file {path})")


def test_a_config_whose_pin_would_depend_on_snips_choice_is_refused(tmp_path):
    path = te_file(tmp_path, [("*.linear_proj", "fp8")], fp8={"fp8_quantization_recipe": "tensorwise",
                                                               "fp8_format": "hybrid"})
    with pytest.raises(ArgumentError, match=f"^--te-precision-config-file {path}: config 'fp8' .* "
                                            "override_nonquantized_autocast is false"):
        run_config(*SNIP, "--snip-fp4-target", "0.25", "--te-precision-config-file", str(path))


def test_describe_pins():
    assert describe_pins([("--a", {module_name(i, "mlp.linear_fc1"): BF16 for i in (0, 1, 2, 5)}),
                          ("--b", {module_name(5, "mlp.linear_fc1"): FP8})]) == \
        "SNIP pins: 3 modules (layers 0-2) in bf16 (--a); 1 module (layer 5) in fp8 (--b)"
    assert describe_pins([]) == ""


def test_end_layers():
    assert end_layers(4, 1, 1) == [0, 3] and end_layers(4, 3, 3) == [0, 1, 2, 3] and end_layers(4, 0, 0) == []
    with pytest.raises(ValueError, match="last_n must be in"):
        end_layers(4, 1, 5)


# -- in training (processes) -------------------------------------------------------------------------------

LAYOUT = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
PINNED = ("--snip", "--snip-fp4-target", "0.25", "--snip-split-passes", "--first-last-layers-bf16",
          "--save-interval", "2", "--snip-probe-passes", "1", "--lr-decay-style", "constant")


@pytest.mark.integration
def test_pins_hold_at_tp2_pp2_in_split_mode_across_cycles_and_a_resume(tiny_data, tmp_path):
    """4 iterations at TP2 x PP2, re-planning at 2 and 4 in split-pass mode with the first and last layers
    pinned; then a resume from iteration 2 re-plans at 4 identically. Every plan, the checkpoints' included,
    keeps both passes of layers 0 and 3 in bf16 while the free layers meet the per-stage budget."""
    run = tmp_path / "run"
    out = launch(4, train_args(tiny_data, *LAYOUT, *PINNED, "--save", str(run / "ckpt"), "--tensorboard-dir",
                               str(run / "tb"), iters=4))
    assert "SNIP pins: 8 modules (layers 0, 3) in bf16 (--first-last-layers-bf16)" in out.stdout
    for it in (2, 4):
        record = json.loads((run / "ckpt" / "snip" / f"snip_iter_{it:07d}.json").read_text())
        plan = PrecisionPlan.from_dict(record["cycle"]["plan"])
        assert all(plan[n] == BF16 for n in ENDS), it
        assert any(p.fwd == "nvfp4" or p.bwd == "nvfp4" for p in plan.modules.values())
        assert min(record["cycle"]["stage_fp4_fraction"].values()) >= 0.25 - 1e-9
        assert record["run"]["pins"] == {n: "bf16" for n in ENDS}
    fp4 = scalars(run / "tb", tags.FP4_FRACTION)
    assert fp4[1] == fp4[2] == 0.0 and fp4[3] >= 0.25 - 1e-9
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(run / "ckpt" / "iter_0000002", resumed / "ckpt" / "iter_0000002")
    (resumed / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    launch(4, train_args(tiny_data, *LAYOUT, *PINNED, "--load", str(resumed / "ckpt"), "--save",
                         str(resumed / "ckpt"), "--tensorboard-dir", str(resumed / "tb"), iters=4))
    for tag in (tags.LM_LOSS, tags.FP4_FRACTION, tags.snip("objective")):
        full, again = scalars(run / "tb", tag), scalars(resumed / "tb", tag)
        assert again and {k: full[k] for k in again} == again, tag
    from megatron_snip.training.checkpointing import read_record

    saved = PrecisionPlan.from_dict(read_record(str(resumed / "ckpt")).precision_plan)
    assert all(saved[n] == BF16 for n in ENDS)

"""The measured GEMM speed table: timed per module shape and precision, cached, priced per module by
the time ratio the logs report and by SNIP's time budget; emulation never planned as a speed-up."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.precision.flops import LlamaLinearDims, estimated_time_ratio
from megatron_snip.precision.gemm_speed import cached_times, speed_model_from_times, time_linears
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.ilp import LinearModule, SnipProblem, solve
from megatron_snip.snip.planner import unit_speeds

SHAPES = {"self_attention.linear_qkv": (32, 64, 128), "mlp.linear_fc2": (32, 192, 64)}
# Forward / backward seconds by hand: qkv's fp8 pays twice, fc2's fp8 not at all; emulated nvfp4 slower than
# bf16, emulated mxfp4 timed faster than bf16 at qkv (a CPU whose bf16 GEMM is slow).
TIMES = {"self_attention.linear_qkv": {"bf16": (1.0, 2.0), "fp8": (0.5, 1.0), "nvfp4": (3.0, 6.0),
                                       "mxfp4": (0.5, 1.0)},
         "mlp.linear_fc2": {"bf16": (2.0, 4.0), "fp8": (2.0, 4.0), "nvfp4": (3.0, 6.0), "mxfp4": (2.0, 4.0)}}


def test_time_linears_times_every_shape_and_precision_on_the_training_path():
    times = time_linears(SHAPES, RecipeConfig(), device=torch.device("cpu"), dtype=torch.float32, repeats=1)
    assert set(times) == set(SHAPES) and all(set(row) == {"bf16", "fp8", "nvfp4", "mxfp4"} for row in times.values())
    assert all(f > 0 and b > 0 for row in times.values() for f, b in row.values())


def test_fp8_recipes_are_timed_each_through_its_own_recipe_and_priced_per_unit():
    """fp8:RECIPE names are timed beside the run's fp8 (sharing its figures where they quantize alike, so noise
    cannot tell them apart), and a time budget chooses among recipes per module by each one's measured time."""
    names = ("bf16", "fp8", "fp8:tensorwise", "fp8:rowwise", "fp8:blockwise")
    times = time_linears({"mlp.linear_fc2": (16, 128, 64)}, RecipeConfig(), device=torch.device("cpu"),
                         dtype=torch.float32, names=names, repeats=1)["mlp.linear_fc2"]
    assert list(times) == list(names) and times["fp8:tensorwise"] is times["fp8"]
    assert times["fp8:rowwise"] is not times["fp8"] and all(f > 0 and b > 0 for f, b in times.values())
    # By hand: rowwise pays at qkv, blockwise at fc2 (tensorwise at neither).
    by_hand = {"self_attention.linear_qkv": {"bf16": (1.0, 2.0), "fp8": (1.0, 2.0), "fp8:rowwise": (0.5, 1.0),
                                             "fp8:blockwise": (1.0, 2.0)},
               "mlp.linear_fc2": {"bf16": (2.0, 4.0), "fp8": (2.0, 4.0), "fp8:rowwise": (2.0, 4.0),
                                  "fp8:blockwise": (1.0, 2.0)}}
    model = speed_model_from_times(by_hand, SHAPES, RecipeConfig(), device="CPU", source="by hand")
    assert model.precision_speeds(RecipeConfig()) == pytest.approx(
        {"bf16": 1.0, "fp8": 1.0, "fp8:rowwise": 9 / 7.5, "fp8:blockwise": 9 / 6})
    with pytest.raises(KeyError, match="precision fp8:mxfp8 was not timed by the measured speed table"):
        model.precision_speed("fp8:mxfp8", RecipeConfig())
    mods = [LinearModule.from_shape("decoder.layers.0.self_attention.linear_qkv", 0, 32, 64, 128),
            LinearModule.from_shape("decoder.layers.0.mlp.linear_fc2", 0, 32, 192, 64)]
    formats = ("bf16", "fp8", "fp8:rowwise", "fp8:blockwise")
    # Each module costs least in the recipe that does not pay for it there.
    cost = {mods[0].name: {"bf16": 0.0, "fp8": 0.1, "fp8:rowwise": 0.3, "fp8:blockwise": 0.1},
            mods[1].name: {"bf16": 0.0, "fp8": 0.1, "fp8:rowwise": 0.1, "fp8:blockwise": 0.3}}
    problem = SnipProblem(mods, formats, 0.0, cost=cost, speed=model.precision_speeds(RecipeConfig()),
                          unit_speed=unit_speeds(mods, model.module_speeds(formats), split=False), time_target=0.6)
    solution = solve(problem)
    assert solution.plan == {mods[0].name: "fp8:rowwise", mods[1].name: "fp8:blockwise"}
    assert solution.time_ratio == pytest.approx(4.5 / 9)  # qkv 1.5 s + fc2 3 s of 9 s


def test_speeds_are_relative_to_the_model_wide_bf16_rate_and_emulation_is_capped():
    model = speed_model_from_times(TIMES, SHAPES, RecipeConfig(), device="CPU", source="by hand",
                                   emulated=["nvfp4", "mxfp4"])
    assert model.measured and model.basis == "measured on CPU" and "measured, CPU" in model.ratio_label
    # bf16 rate = 3 * (2*32*64*128 + 2*32*192*64) FLOPs / 9 s; qkv's GEMM is 524288 FLOPs.
    rate = 3 * (2 * 32 * 64 * 128 + 2 * 32 * 192 * 64) / 9.0
    qkv = model.modules["self_attention.linear_qkv"]
    assert qkv["bf16"][0] == pytest.approx(2 * 32 * 64 * 128 / 1.0 / rate)
    assert qkv["fp8"] == pytest.approx((2 * qkv["bf16"][0], 2 * qkv["bf16"][1]))
    assert qkv["nvfp4"] == pytest.approx((qkv["bf16"][0] / 3, qkv["bf16"][1] / 3))  # slower: as measured
    assert qkv["mxfp4"] == qkv["bf16"]  # emulated and timed faster than bf16: capped at bf16's speed
    # whole model: bf16 9 s, fp8 1.5 + 6 = 7.5 s
    assert model.overall["fp8"] == pytest.approx(9 / 7.5) and model.precision_speed("fp8", RecipeConfig()) == \
        pytest.approx(9 / 7.5)


def test_the_logged_time_ratio_sums_each_modules_own_measured_time():
    dims = LlamaLinearDims(num_layers=1, hidden_size=64, ffn_hidden_size=64, kv_channels=16, num_query_groups=2,
                           gated=False)
    shapes = {m: (32, *dims.in_out(m)) for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                    "mlp.linear_fc1", "mlp.linear_fc2")}
    times = {m: {"bf16": (1.0, 2.0), "fp8": (0.5, 1.0)} for m in shapes}
    times["mlp.linear_fc1"] = {"bf16": (4.0, 8.0), "fp8": (4.0, 4.0)}
    model = speed_model_from_times(times, shapes, RecipeConfig(), device="CPU", source="by hand")
    plan = PrecisionPlan({"decoder.layers.0.mlp.linear_fc1": Precision.uniform("fp8"),
                          "decoder.layers.0.self_attention.linear_qkv": Precision("fp8", "bf16")})
    # seconds: qkv 0.5 + 2, proj 3, fc1 4 + 4, fc2 3 -> 16.5 of 21 in bf16
    ratio = estimated_time_ratio(plan, dims, {}, module_speeds=model.module_speeds())
    assert ratio == pytest.approx(16.5 / 21)


def test_the_ilp_prices_each_unit_by_its_measured_time():
    """A time budget that fp8 meets only where it pays: qkv's fp8 halves its time, fc2's does nothing, so the
    ILP puts qkv in fp8 although fc2's fp8 costs less divergence."""
    model = speed_model_from_times(TIMES, SHAPES, RecipeConfig(), device="CPU", source="by hand",
                                   emulated=["nvfp4"])
    mods = [LinearModule.from_shape("decoder.layers.0.self_attention.linear_qkv", 0, 32, 64, 128),
            LinearModule.from_shape("decoder.layers.0.mlp.linear_fc2", 0, 32, 192, 64)]
    cost = {mods[0].name: {"bf16": 0.0, "fp8": 1.0}, mods[1].name: {"bf16": 0.0, "fp8": 0.1}}
    speeds = model.module_speeds(("bf16", "fp8"))
    problem = SnipProblem(mods, ("bf16", "fp8"), 0.0, cost=cost, speed=dict(model.overall),
                          unit_speed=unit_speeds(mods, speeds, split=False), time_target=0.9)
    solution = solve(problem)
    assert solution.plan == {mods[0].name: "fp8", mods[1].name: "bf16"}
    assert solution.time_ratio == pytest.approx(7.5 / 9)  # qkv 1.5 s + fc2 6 s of 9 s
    split = SnipProblem(mods, ("bf16", "fp8"), 0.0, fwd_cost=cost, bwd_cost=cost, speed=dict(model.overall),
                        unit_speed=unit_speeds(mods, speeds, split=True), time_target=0.9)
    solution = solve(split)  # per pass: qkv's backward alone in fp8 meets the budget (1 + 1 + 6 s of 9 s)
    assert {k: f for k, f in solution.plan.items() if f == "fp8"} == {(mods[0].name, "bwd"): "fp8"}
    assert solution.time_ratio == pytest.approx(8 / 9)


def test_measured_times_are_cached_per_device_versions_recipe_and_shapes(tmp_path):
    kwargs = dict(device=torch.device("cpu"), dtype=torch.float32, names=("bf16", "fp8"), repeats=1,
                  cache_dir=tmp_path)
    shapes = {"mlp.linear_fc2": (16, 32, 32)}
    times, cached, path = cached_times(shapes, RecipeConfig(), **kwargs)
    assert not cached and path.parent == tmp_path
    record = json.loads(path.read_text())
    assert record["key"]["device"] == "CPU" and record["key"]["torch"] == torch.__version__
    assert record["key"]["shapes"] == {"mlp.linear_fc2": [16, 32, 32]} and record["key"]["recipe"]["fp8_recipe"]
    again, cached, same = cached_times(shapes, RecipeConfig(), **kwargs)
    assert cached and same == path and again == times
    _, cached, other = cached_times(shapes, RecipeConfig(fp8_recipe="rowwise"), **kwargs)
    assert not cached and other != path


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the measured table decides at the first solve")
def test_a_time_target_below_1_is_refused_where_every_low_precision_runs_emulated():
    from conftest import run_config

    from megatron_snip.arguments import ArgumentError

    with pytest.raises(ArgumentError) as e:
        run_config("--snip", "--snip-interval", "2", "--snip-time-target", "0.85")
    assert str(e.value) == (
        "--snip-time-target 0.85 cannot be met: on this device (no GPU) every candidate precision below bf16 (fp8, "
        "nvfp4) runs emulated, no faster than bf16, so the fastest feasible target is 1 (every module in bf16); "
        "give --snip-time-target 1 or more, or --gemm-speed-model blackwell to plan for hardware with FP8/FP4 "
        "tensor cores")
    with pytest.raises(ArgumentError, match="fastest feasible target is above 1 \\(bf16 is not among"):
        run_config("--snip", "--snip-interval", "2", "--snip-time-target", "0.85", "--snip-formats", "fp8", "nvfp4")
    run_config("--snip", "--snip-interval", "2", "--snip-time-target", "1")  # no speed-up asked: planned
    run_config("--snip", "--snip-interval", "2", "--snip-time-target", "0.85", "--gemm-speed-model", "blackwell")


def test_a_replan_whose_measured_step_misses_its_target_is_named():
    from megatron_snip.training.precision_setup import bf16_gemm_seconds, missed_time_target

    model = speed_model_from_times(TIMES, SHAPES, RecipeConfig(), device="CPU", source="by hand")
    names = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc2",
             "decoder.layers.1.mlp.linear_fc2"]
    assert bf16_gemm_seconds(model, names, micro_batches=2) == 2 * (3.0 + 6.0 + 6.0)
    # bf16 step 40 s of which 30 s GEMMs; a plan at 0.8 should take 34 s
    assert missed_time_target(0.8, 40.0, 30.0, 34.0) is None
    assert missed_time_target(0.8, 40.0, 30.0, 36.4) is None  # GEMM ratio 0.88: within 10% of 0.8
    message = missed_time_target(0.8, 40.0, 30.0, 37.0)  # 0.9: 12% over
    assert message == ("SNIP plan missed --snip-time-target 0.8: its steps took 37000.0 ms against 40000.0 ms in "
                       "bf16, whose linear GEMMs take 30000.0 ms by the speed table: a GEMM time of 0.900 of bf16, "
                       "+12% over the target (more than 10%)")


def test_research_mode_plans_do_not_depend_on_the_measured_table():
    """The quickstart's path (--snip-fp4-target, no time target): its implied time budget is priced by the
    device's peak estimate whatever was measured, so its plans are the same run to run and as before
    the measured default; and timing the table draws nothing from the global RNGs its training uses."""
    from megatron_snip.precision.gemm_speed import peak_speed_model
    from megatron_snip.snip.config import SnipConfig
    from megatron_snip.snip.planner import PlannerConfig

    model = speed_model_from_times(TIMES, SHAPES, RecipeConfig(), device="CPU", source="by hand")
    research = SnipConfig(enabled=True, snip_fp4_target=0.75, snip_formats=("bf16", "fp8", "nvfp4"))
    planner = PlannerConfig.from_snip(research, RecipeConfig(), model)
    auto = peak_speed_model("auto")
    assert planner.speed == auto.precision_speeds(RecipeConfig(), research.snip_formats)
    assert planner.module_speed is None
    timed = PlannerConfig.from_snip(SnipConfig(enabled=True, snip_fp4_target=0.0, snip_time_target=0.9,
                                               snip_formats=("bf16", "fp8")), RecipeConfig(), model)
    assert timed.module_speed is not None and timed.speed == {"bf16": 1.0, "fp8": pytest.approx(9 / 7.5)}
    state = torch.get_rng_state()
    time_linears({"mlp.linear_fc2": (16, 32, 32)}, RecipeConfig(), device=torch.device("cpu"), dtype=torch.float32,
                 repeats=1)
    assert torch.equal(torch.get_rng_state(), state)

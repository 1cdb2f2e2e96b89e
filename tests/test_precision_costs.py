"""The format registry, the GEMM speed model, estimated GEMM time and precision schedules."""

from __future__ import annotations

import pytest
import torch

from megatron_snip.numerics.fake_quant import FORMATS, fake_quantize
from megatron_snip.numerics.quantize import quantize_dequantize
from megatron_snip.numerics.recipes import GEMM_OPERANDS, Precision, RecipeConfig, operand_quantizer
from megatron_snip.numerics.registry import FP4_NAMES, PRECISION_NAMES, SCHEME_NAMES, family
from megatron_snip.precision.flops import LlamaLinearDims, estimated_time_ratio, flop_fractions
from megatron_snip.precision.gemm_speed import PEAK_MODELS, peak_speed_model
from megatron_snip.precision.plan import PrecisionPlan, module_names
from megatron_snip.precision.schedule import PrecisionSchedule, ScheduleEntry

DIMS = LlamaLinearDims(num_layers=4, hidden_size=64, ffn_hidden_size=192, kv_channels=16, num_query_groups=2)
RECIPES = [RecipeConfig(fp8_recipe=r) for r in ("tensorwise", "delayed", "blockwise", "mxfp8")] + [
    RecipeConfig(fp4_stochastic_rounding=False, nvfp4_random_hadamard=False, nvfp4_2d_weights=False)]


def test_every_recipe_quantizer_is_a_registered_scheme_with_a_quantizer():
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    for recipe in RECIPES:
        for name in PRECISION_NAMES:
            for gemm, operands in GEMM_OPERANDS.items():
                for operand in operands:
                    q = operand_quantizer(name, gemm, operand, recipe)
                    assert q.scheme in SCHEME_NAMES
                    scale = torch.tensor(1.0) if q.scheme.startswith("fp8_t") or q.scheme == "fp8_delayed" else None
                    out = quantize_dequantize(x, q, scale=scale, generator=torch.Generator().manual_seed(1))
                    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert FP4_NAMES == ("nvfp4", "mxfp4")
    assert [family(n) for n in PRECISION_NAMES] == ["bf16", "fp8", *["fp8"] * 5, "fp4", "fp4"]


def test_fake_quantize_goes_through_the_same_quantizers_as_the_layers():
    """fake_quantize(fmt) and the layers' quantize_dequantize give the same bits for the same scheme."""
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)) * 3
    layer_nvfp4 = operand_quantizer("nvfp4", "fprop", "w", RecipeConfig())  # 16x16 weight tiles
    assert torch.equal(fake_quantize(x, "nvfp4", role="weight"), quantize_dequantize(x, layer_nvfp4))
    layer_mx = operand_quantizer("mxfp4", "fprop", "x", RecipeConfig())
    assert torch.equal(fake_quantize(x, "mxfp4"), quantize_dequantize(x, layer_mx))
    assert set(FORMATS) == {"bf16", "fp8_e4m3", "fp8_e5m2", "fp8_rowwise", "fp8_block", "mxfp8", "mxfp4", "nvfp4"}


def test_peak_speed_models_follow_the_published_ratios():
    hopper, blackwell = PEAK_MODELS["hopper"], PEAK_MODELS["blackwell"]
    fp8 = {"fp8:tensorwise": 2.0, "fp8:delayed": 2.0, "fp8:rowwise": 2.0, "fp8:blockwise": 2.0}
    assert hopper.precision_speeds(RecipeConfig()) == {"bf16": 1.0, "fp8": 2.0, **fp8, "fp8:mxfp8": 1.0,
                                                       "nvfp4": 1.0, "mxfp4": 1.0}
    assert blackwell.precision_speeds(RecipeConfig()) == {"bf16": 1.0, "fp8": 2.0, **fp8, "fp8:mxfp8": 2.0,
                                                          "nvfp4": 4.0, "mxfp4": 4.0}
    # MXFP8 has no tensor cores on Hopper: fp8 under --fp8-recipe mxfp8 is emulated there.
    assert hopper.precision_speed("fp8", RecipeConfig(fp8_recipe="mxfp8")) == 1.0
    assert blackwell.precision_speed("fp8", RecipeConfig(fp8_recipe="mxfp8")) == 2.0
    assert peak_speed_model("auto").name == ("blackwell" if not torch.cuda.is_available() else peak_speed_model(
        "auto").name)
    with pytest.raises(ValueError, match="unknown GEMM speed model 'tpu'"):
        peak_speed_model("tpu")


def test_estimated_time_ratio_by_hand():
    """fc1 of every layer in nvfp4, qkv of layer 0 fp8/bf16, the rest bf16, under blackwell."""
    plan = PrecisionPlan({**{f"decoder.layers.{i}.mlp.linear_fc1": Precision.uniform("nvfp4") for i in range(4)},
                          "decoder.layers.0.self_attention.linear_qkv": Precision("fp8", "bf16")})
    speeds = PEAK_MODELS["blackwell"].precision_speeds(RecipeConfig())
    # Per layer (in x out): qkv 64x128, proj 64x64, fc1 64x384, fc2 192x64; 3 GEMMs each.
    per_layer = 3 * (64 * 128 + 64 * 64 + 64 * 384 + 192 * 64)
    fc1, qkv = 3 * 64 * 384, 64 * 128
    bf16_time = 4 * per_layer - 4 * fc1 - qkv  # what stays bf16 (qkv's two backward GEMMs included)
    want = (bf16_time + 4 * fc1 / 4 + qkv / 2) / (4 * per_layer)
    assert estimated_time_ratio(plan, DIMS, speeds) == pytest.approx(want, rel=1e-12)
    assert estimated_time_ratio(PrecisionPlan.uniform("bf16"), DIMS, speeds) == 1.0
    assert flop_fractions(plan, DIMS).fp4 == pytest.approx(4 * fc1 / (4 * per_layer))


def test_schedule_parses_steps_and_fractions_and_imposes_its_passes():
    schedule = PrecisionSchedule.parse(["fwd=bf16@0.82", "all=fp8@95", "bwd=nvfp4@90%"], train_iters=100)
    assert schedule.entries == (ScheduleEntry("fwd", "bf16", 83), ScheduleEntry("all", "fp8", 95),
                                ScheduleEntry("bwd", "nvfp4", 91))
    assert schedule.to_list() == ["fwd=bf16@83", "all=fp8@95", "bwd=nvfp4@91"]
    assert PrecisionSchedule.parse(schedule.to_list(), train_iters=7) == schedule  # what checkpoints store
    assert schedule.fixed(82) == {"fwd": None, "bwd": None}
    assert schedule.fixed(83) == {"fwd": "bf16", "bwd": None}
    assert schedule.fixed(91) == {"fwd": "bf16", "bwd": "nvfp4"}
    assert schedule.fixed(95) == {"fwd": "fp8", "bwd": "fp8"}  # a later entry wins
    plan = PrecisionPlan({"decoder.layers.1.mlp.linear_fc2": Precision.uniform("mxfp4")},
                         default=Precision.uniform("nvfp4"))
    assert schedule.apply(plan, 10, 4) is plan
    late = schedule.apply(plan, 83, 4)
    assert all(late[n] == Precision("bf16", "mxfp4" if "layers.1.mlp.linear_fc2" in n else "nvfp4")
               for n in module_names(4))


@pytest.mark.parametrize("spec,message", [
    ("fwd=bf16", "expected PASSES=PRECISION@START"),
    ("both=bf16@10", "expected PASSES=PRECISION@START"),
    ("fwd=fp6@10", "unknown precision 'fp6'"),
    ("fwd=bf16@1.5", "must lie in \\[0, 1\\]"),
])
def test_bad_schedule_entries_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        PrecisionSchedule.parse([spec], train_iters=100)

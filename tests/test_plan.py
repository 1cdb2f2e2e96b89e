"""Precision plans (JSON form, errors, first/last layers in bf16) and the FLOP split of a plan."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from megatron_snip.numerics.recipes import BF16, PRECISION_NAMES, Precision
from megatron_snip.precision.flops import LlamaLinearDims, flop_fractions, flops_by_format, gemm_flops
from megatron_snip.precision.plan import (
    LINEAR_MODULES,
    PlanError,
    PrecisionPlan,
    module_name,
    module_names,
    parse_module_name,
)

NV, FP8 = Precision.uniform("nvfp4"), Precision.uniform("fp8")


def test_module_names_in_layer_and_execution_order():
    assert module_names(2) == [
        "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2",
        "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.self_attention.linear_proj",
        "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2",
    ]
    assert parse_module_name("decoder.layers.12.mlp.linear_fc2") == (12, "mlp.linear_fc2")
    for bad in ("decoder.layers.01.mlp.linear_fc1", "layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc3",
                "module.decoder.layers.0.mlp.linear_fc1"):
        with pytest.raises(ValueError, match="not a linear module name"):
            parse_module_name(bad)


def test_json_round_trip(tmp_path):
    plan = PrecisionPlan({module_name(3, "mlp.linear_fc1"): NV,
                          module_name(0, "self_attention.linear_qkv"): Precision("fp8", "bf16"),
                          module_name(1, "mlp.linear_fc2"): BF16},  # equal to the default: dropped
                         default=BF16)
    assert list(plan.modules) == [module_name(0, "self_attention.linear_qkv"), module_name(3, "mlp.linear_fc1")]
    data = json.loads(plan.to_json())
    assert data == {"version": 1, "default": "bf16",
                    "modules": {"decoder.layers.0.self_attention.linear_qkv": "fp8/bf16",
                                "decoder.layers.3.mlp.linear_fc1": "nvfp4"}}
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert PrecisionPlan.load(path) == plan
    assert list(tmp_path.iterdir()) == [path], "no temporary files left behind"
    assert plan[module_name(3, "mlp.linear_fc1")] == NV and plan[module_name(9, "mlp.linear_fc1")] == BF16


def test_fp8_recipes_per_module_round_trip_and_old_plans_keep_their_meaning(tmp_path):
    """fp8:RECIPE is a precision of its own in plans (split too); a version-1 plan's fp8 stays fp8, which runs
    the run's --fp8-recipe, while fp8:RECIPE keeps its recipe under any --fp8-recipe."""
    from megatron_snip.numerics.recipes import RecipeConfig, operand_quantizer

    plan = PrecisionPlan({module_name(0, "self_attention.linear_qkv"): Precision.parse("fp8:rowwise"),
                          module_name(0, "mlp.linear_fc1"): Precision.parse("fp8:blockwise/bf16"),
                          module_name(1, "mlp.linear_fc2"): Precision.parse("fp8")},
                         default=Precision.uniform("fp8:mxfp8"))
    text = plan.to_json()
    assert json.loads(text) == {"version": 1, "default": "fp8:mxfp8", "modules": {
        "decoder.layers.0.self_attention.linear_qkv": "fp8:rowwise", "decoder.layers.0.mlp.linear_fc1":
        "fp8:blockwise/bf16", "decoder.layers.1.mlp.linear_fc2": "fp8"}}
    assert PrecisionPlan.from_json(text) == plan
    assert plan[module_name(0, "mlp.linear_fc1")] == Precision("fp8:blockwise", "bf16")
    old = PrecisionPlan.from_json('{"version": 1, "default": "fp8", "modules": {}}')  # written before fp8:RECIPE
    assert old == PrecisionPlan.uniform("fp8") != PrecisionPlan.uniform("fp8:tensorwise")
    for run in ("tensorwise", "rowwise", "blockwise"):
        recipe = RecipeConfig(fp8_recipe=run)
        assert operand_quantizer("fp8", "dgrad", "dy", recipe) == operand_quantizer(f"fp8:{run}", "dgrad", "dy")
        assert operand_quantizer("fp8:rowwise", "fprop", "x", recipe).scheme == "fp8_rowwise"


def test_equality_is_semantic():
    assert PrecisionPlan.uniform("nvfp4") == PrecisionPlan({module_name(0, "mlp.linear_fc1"): NV}, NV)
    assert PrecisionPlan.uniform("nvfp4") != PrecisionPlan.uniform("mxfp4")
    assert PrecisionPlan.uniform("fp8/bf16").default == Precision("fp8", "bf16")


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"version": 2, "default": "bf16", "modules": {}}', "unsupported plan version 2"),
    ('{"default": "bf16"}', "unsupported plan version None"),
    ('{"version": 1, "default": "fp16"}', "default: unknown precision 'fp16'"),
    ('{"version": 1, "modules": {"decoder.layers.0.mlp.linear_fc1": "nvfp5"}}',
     "module decoder.layers.0.mlp.linear_fc1: unknown precision 'nvfp5'"),
    ('{"version": 1, "modules": {"decoder.layers.0.mlp.fc1": "nvfp4"}}', "not a linear module name"),
    ('{"version": 1, "default": "fp8:fast"}', "default: unknown FP8 recipe 'fast' in precision 'fp8:fast'; valid: "
     "fp8:tensorwise, fp8:delayed, fp8:rowwise, fp8:blockwise, fp8:mxfp8"),
    ('{"version": 1, "default": "fp8_rowwise"}', r"unknown precision 'fp8_rowwise' \(an FP8 recipe per module is "
     r"written fp8:rowwise\)"),
    ('{"version": 1, "modules": {"decoder.layers.0.mlp.linear_fc1": 4}}', "precision must be a string"),
    ('{"version": 1, "modules": []}', "'modules' must be an object"),
    ('{"version": 1, "plan": {}}', "unknown key"),
])
def test_bad_files_name_the_file_and_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PlanError, match=message) as e:
        PrecisionPlan.load(path)
    assert str(e.value).startswith(f"{path}: ")


def test_with_ends_bf16():
    plan = PrecisionPlan.uniform("nvfp4").with_ends_bf16(num_layers=5, first_n=1, last_n=2)
    precisions = [plan[module_name(i, "mlp.linear_fc1")] for i in range(5)]
    assert precisions == [BF16, NV, NV, BF16, BF16]
    assert all(plan[module_name(4, m)] == BF16 for m in LINEAR_MODULES)
    assert PrecisionPlan.uniform("nvfp4").with_ends_bf16(5, 0, 0) == PrecisionPlan.uniform("nvfp4")
    with pytest.raises(ValueError, match="last_n"):
        PrecisionPlan.uniform("nvfp4").with_ends_bf16(2, 1, 3)


def test_diff_and_validate():
    a = PrecisionPlan.uniform("nvfp4")
    b = PrecisionPlan({module_name(1, "mlp.linear_fc2"): FP8}, NV)
    assert a.diff(b, num_layers=2) == {module_name(1, "mlp.linear_fc2"): (NV, FP8)}
    assert a.diff(a, 2) == {}
    b.validate(2)
    with pytest.raises(PlanError, match="the model has 1 layers"):
        b.validate(1)


# A small Llama: h=4, f=8, kv_channels=2, one query group, 2 layers. (in, out) per module:
# qkv (4, 4 + 2*2*1 = 8), proj (4, 4), fc1 (4, 2*8 = 16), fc2 (8, 4): in*out = 32, 16, 64, 32; 144 per layer.
DIMS = LlamaLinearDims(num_layers=2, hidden_size=4, ffn_hidden_size=8, kv_channels=2, num_query_groups=1)


def test_flop_fractions_hand_checked():
    assert [DIMS.in_out(m) for m in LINEAR_MODULES] == [(4, 8), (4, 4), (4, 16), (8, 4)]
    assert gemm_flops(10, 4, 16) == 1280
    plan = PrecisionPlan({module_name(0, "mlp.linear_fc1"): NV,
                          module_name(1, "self_attention.linear_qkv"): Precision("fp8", "bf16"),
                          module_name(1, "mlp.linear_fc2"): Precision("bf16", "mxfp4")})
    # Every module runs 3 GEMMs of 2*in*out FLOPs per token: total 3 * 2 * 144 * 2 layers = 1728.
    # FP4: all of layer 0's fc1 (3 * 2 * 64 = 384) + layer 1's fc2 backward (2 * 2 * 32 = 128).
    # FP8: layer 1's qkv forward only (2 * 32 = 64).
    totals = flops_by_format(plan, DIMS)
    assert totals == {**dict.fromkeys(PRECISION_NAMES, 0), "nvfp4": 384, "mxfp4": 128, "fp8": 64,
                      "bf16": 1728 - 384 - 128 - 64}
    f = flop_fractions(plan, DIMS)
    assert f.fp4 == pytest.approx(float(Fraction(512, 1728)))
    assert f.fp8 == pytest.approx(float(Fraction(64, 1728)))
    assert f.fp4 + f.fp8 + f.bf16 == pytest.approx(1.0)
    assert flops_by_format(plan, DIMS, tokens=10)["nvfp4"] == 3840
    # One pipeline stage's share: layer 0 only.
    assert flop_fractions(plan, DIMS, names=module_names(2)[:4]).fp4 == pytest.approx(384 / 864)


def test_flop_fractions_of_uniform_plans():
    assert flop_fractions(PrecisionPlan.uniform("mxfp4"), DIMS).fp4 == 1.0
    assert flop_fractions(PrecisionPlan.uniform("nvfp4/bf16"), DIMS).fp4 == pytest.approx(1 / 3)
    assert flop_fractions(PrecisionPlan.uniform("bf16"), DIMS).bf16 == 1.0


def test_a_plan_survives_pickling():
    """torch.distributed broadcasts a SNIP cycle's plan as a pickled object."""
    import pickle

    plan = PrecisionPlan({"decoder.layers.0.mlp.linear_fc1": Precision("nvfp4", "fp8")}, Precision.parse("fp8"))
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again["decoder.layers.0.mlp.linear_fc1"] == Precision("nvfp4", "fp8")

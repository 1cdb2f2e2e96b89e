"""The te backend's plan -> megatron-core per-module TE recipe mapping, and its refusals.

Transformer Engine itself cannot be installed on these CPU machines; what is tested
here is everything on our side of megatron-core's ``te_quant_params`` interface:
the recipes built per module (megatron-core's own dataclasses), plan switching through
the adapter, and the clear errors for what TE cannot run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import train_args
from megatron.core.enums import Fp4Recipe, Fp8Recipe

from megatron_snip.arguments import ArgumentError, parse_config
from megatron_snip.model.quantized.te_layers import TELinearPrecision, te_quant_params
from megatron_snip.numerics.recipes import Precision, RecipeConfig


@pytest.mark.parametrize("fp8_recipe", ["tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_fp8_maps_to_the_matching_te_recipe(fp8_recipe, fp8_format):
    params = te_quant_params(Precision.uniform("fp8"), RecipeConfig(fp8_recipe=fp8_recipe, fp8_format=fp8_format))
    recipe = params.training_recipe
    assert recipe.fp8_quantization_recipe == Fp8Recipe(fp8_recipe)
    assert recipe.fp4_quantization_recipe is None
    assert recipe.fp8_format == fp8_format
    # nothing opens a global autocast in our runs: the module must open its own
    assert recipe.override_nonquantized_autocast
    assert params.evaluation_recipe is None  # evaluation runs as training does


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="with TE installed its version decides whether nvfp4 is available")
def test_nvfp4_maps_to_te_nvfp4_and_bf16_to_no_recipe():
    recipe = te_quant_params(Precision.uniform("nvfp4"), RecipeConfig()).training_recipe
    assert recipe.fp4_quantization_recipe == Fp4Recipe.nvfp4 and recipe.fp8_quantization_recipe is None
    assert te_quant_params(Precision.uniform("bf16"), RecipeConfig()) is None


@pytest.mark.parametrize("precision,recipe,message", [
    ("fp8/bf16", RecipeConfig(), "one format for all three GEMMs"),
    ("mxfp4", RecipeConfig(), "no MXFP4 recipe"),
    ("fp8", RecipeConfig(fp8_recipe="delayed"), "do not support delayed scaling"),
])
def test_what_te_cannot_run_is_refused(precision, recipe, message):
    with pytest.raises(ValueError, match=message):
        te_quant_params(Precision.parse(precision), recipe)


class _TELinearStandIn(torch.nn.Module):
    """The attributes of megatron-core's TE linears the adapter touches (TE is not installable here;
    tests/test_snip_probes.py measures a whole model through the adapter)."""

    def __init__(self, parallel_mode="column"):
        super().__init__()
        self.config = object()
        self.te_quant_params = "left over"
        self.parallel_mode = parallel_mode
        self._tp_group = None
        self.weight = torch.nn.Parameter(torch.randn(8, 16))


def test_adapter_switches_the_module_recipe_and_names_the_module_on_errors():
    module = _TELinearStandIn()
    linear = TELinearPrecision(module)
    assert module.te_quant_params is None and str(linear.precision) == "bf16"
    linear.precision = Precision.uniform("fp8")
    assert module.te_quant_params.training_recipe.fp8_quantization_recipe == Fp8Recipe.tensorwise
    linear.set_recipe(RecipeConfig(fp8_recipe="mxfp8"))
    assert module.te_quant_params.training_recipe.fp8_quantization_recipe == Fp8Recipe.mxfp8
    linear.module_name = "decoder.layers.3.mlp.linear_fc2"
    with pytest.raises(ValueError, match=r"decoder.layers.3.mlp.linear_fc2: precision mxfp4"):
        linear.precision = Precision.uniform("mxfp4")
    assert str(linear.precision) == "fp8"  # a refused precision changes nothing
    with pytest.raises(TypeError, match="must be a Precision"):
        linear.precision = "bf16"
    linear.precision = Precision.uniform("bf16")
    assert module.te_quant_params is None


@pytest.mark.parametrize("extra,message", [
    (("--precision", "mxfp4"), "--precision mxfp4: default: precision mxfp4: Transformer Engine has no MXFP4"),
    (("--precision", "fp8", "--fp8-recipe", "delayed"), "do not support delayed scaling"),
])
def test_te_flags_are_checked_before_start(tiny_data, extra, message):
    argv = train_args(tiny_data, "--transformer-impl", "transformer_engine", *extra)
    with pytest.raises(ArgumentError, match=message):
        parse_config(argv, world_size=1, cuda=True)


def test_nvfp4_switches_become_transformer_engine_environment(monkeypatch):
    """TE reads NVTE_NVFP4_DISABLE_* when it is imported; the te backend sets them from the flags first."""
    from megatron_snip.model.quantized.te_layers import prepare_te_environment
    from megatron_snip.precision.execution import te_nvfp4_environment

    assert te_nvfp4_environment(RecipeConfig()) == {
        "NVTE_NVFP4_DISABLE_RHT": "0", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "0",
        "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0"}
    off = RecipeConfig(fp4_stochastic_rounding=False, nvfp4_random_hadamard=False, nvfp4_2d_weights=False)
    assert set(te_nvfp4_environment(off).values()) == {"1"}
    if importlib.util.find_spec("transformer_engine") is None:
        for variable in te_nvfp4_environment(off):
            monkeypatch.delenv(variable, raising=False)
        prepare_te_environment(off)
        import os

        assert {v: os.environ[v] for v in te_nvfp4_environment(off)} == te_nvfp4_environment(off)


def test_adapter_shows_the_probes_the_gemm_operands():
    column, row = TELinearPrecision(_TELinearStandIn("column")), TELinearPrecision(_TELinearStandIn("row"))
    assert column.sharded_operands == {"w", "dy"} and not column.row_parallel
    assert row.sharded_operands == {"x", "w"} and row.row_parallel
    assert column.forward_module is column.module and column.weight is column.module.weight
    x = torch.randn(3, 2, 16)
    assert column.gemm_input(x) is x  # no fused norm: the forward's input is the GEMM's


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fused_norm_output_is_the_norm_the_local_spec_runs(normalization, zero_centered):
    """The GEMM input of TE's LayerNormLinear, as the probes compute it, equals torch's norm (the local
    spec's) with TE's zero-centered gamma (weight + 1)."""
    from megatron_snip.model.quantized.te_layers import fused_norm_output

    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(5, 2, 32, generator=g), torch.randn(32, generator=g), torch.randn(32, generator=g)
    norm = {"RMSNorm": torch.nn.RMSNorm(32, eps=1e-5), "LayerNorm": torch.nn.LayerNorm(32, eps=1e-5)}[normalization]
    with torch.no_grad():
        norm.weight.copy_(weight + 1 if zero_centered else weight)
        if normalization == "LayerNorm":
            norm.bias.copy_(bias)
        expected = norm(x)
    got = fused_norm_output(x, weight, bias if normalization == "LayerNorm" else None, normalization=normalization,
                            eps=1e-5, zero_centered_gamma=zero_centered)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert fused_norm_output(x.bfloat16(), weight, None, normalization="RMSNorm", eps=1e-5,
                             zero_centered_gamma=False).dtype == torch.bfloat16


def test_snip_on_the_te_backend_drops_what_te_cannot_run(tiny_data):
    argv = train_args(tiny_data, "--transformer-impl", "transformer_engine", "--snip", "--snip-interval", "5",
                      "--snip-formats", "bf16", "fp8", "nvfp4", "mxfp4", "--snip-split-passes")
    config = parse_config(argv, world_size=1, cuda=True)
    assert config.snip.snip_formats == ("bf16", "fp8", "nvfp4") and not config.snip.snip_split_passes
    notes = " | ".join(config.precision.precision_notes)
    assert "SNIP candidate mxfp4 dropped on --transformer-impl transformer_engine" in notes
    assert "--snip-split-passes ignored" in notes


def test_snip_on_the_te_backend_keeps_the_fp8_recipes_te_runs_per_module(tiny_data):
    argv = train_args(tiny_data, "--transformer-impl", "transformer_engine", "--snip", "--snip-interval", "5",
                      "--snip-formats", "bf16", "fp8:tensorwise", "fp8:rowwise", "fp8:blockwise", "fp8:delayed",
                      "nvfp4")
    config = parse_config(argv, world_size=1, cuda=True)
    assert config.snip.snip_formats == ("bf16", "fp8:tensorwise", "fp8:blockwise", "nvfp4")
    notes = " | ".join(config.precision.precision_notes)
    assert ("SNIP candidate fp8:rowwise dropped on --transformer-impl transformer_engine (fp8:rowwise: Transformer "
            "Engine has no rowwise FP8 recipe") in notes
    assert "SNIP candidate fp8:delayed dropped" in notes and "do not support delayed scaling" in notes
    blockwise = te_quant_params(Precision.uniform("fp8:blockwise"), RecipeConfig()).training_recipe
    assert blockwise.fp8_quantization_recipe == Fp8Recipe.blockwise and blockwise.fp8_format == "hybrid"


def test_snip_on_the_te_backend_needs_an_fp4_format_te_runs(tiny_data):
    argv = train_args(tiny_data, "--transformer-impl", "transformer_engine", "--snip", "--snip-interval", "5",
                      "--fp4-recipe", "mxfp4")
    with pytest.raises(ArgumentError,
                       match="Transformer Engine runs none of --snip-formats mxfp4: use --fp4-recipe nvfp4"):
        parse_config(argv, world_size=1, cuda=True)


def test_snip_on_the_te_backend_without_a_gpu_says_what_it_needs(tiny_data):
    argv = train_args(tiny_data, "--transformer-impl", "transformer_engine", "--snip", "--snip-interval", "5")
    with pytest.raises(ArgumentError,
                       match="--transformer-impl transformer_engine needs a GPU with Transformer Engine"):
        parse_config(argv, world_size=1, cuda=False)


def test_te_nvfp4_is_dropped_below_blackwell():
    from megatron_snip.model.quantized.te_layers import te_runnable

    assert te_runnable(["bf16", "fp8", "nvfp4"], RecipeConfig(), (10, 0)) == (["bf16", "fp8", "nvfp4"], {})
    kept, dropped = te_runnable(["bf16", "fp8", "nvfp4"], RecipeConfig(), (9, 0))
    assert kept == ["bf16", "fp8"] and "compute capability 10.0 (Blackwell); this GPU has 9.0" in dropped["nvfp4"]

"""The format registry is the one vocabulary: every name resolves through it, the recipes and the
Transformer Engine table agree with it, and no code outside it tells formats apart by their names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from megatron.core.enums import Fp4Recipe, Fp8Recipe

from megatron_snip.numerics.fake_quant import FORMATS, element_bits
from megatron_snip.numerics.formats import ELEMENTS
from megatron_snip.numerics.health import element_format
from megatron_snip.numerics.recipes import FP8_RECIPES, GEMM_OPERANDS, RecipeConfig, operand_quantizer
from megatron_snip.numerics.registry import (
    FP8_RECIPE_SCHEMES,
    PRECISIONS,
    SCHEMES,
    precision_scheme,
    resolve_named,
)
from megatron_snip.precision.execution import TE_RECIPES
from megatron_snip.precision.te_precision_config import TE_FP4_PRECISIONS, TE_FP8_RECIPES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fp8_recipe", FP8_RECIPES)
def test_every_operand_quantizer_is_its_precisions_registered_scheme(fp8_recipe):
    recipe = RecipeConfig(fp8_recipe=fp8_recipe)
    for name, precision in PRECISIONS.items():
        scheme = precision_scheme(name, fp8_recipe)
        assert scheme.name == (precision.scheme or FP8_RECIPE_SCHEMES[fp8_recipe])
        assert scheme.quantized == precision.quantized and scheme.bits == precision.bits
        for gemm, operands in GEMM_OPERANDS.items():
            for operand in operands:
                q = operand_quantizer(name, gemm, operand, recipe)
                assert q.spec is scheme
                # a per-tensor FP8 quantizer carries its element, every other scheme stores one
                assert (q.element is not None) == scheme.per_tensor
                assert len(scheme.elements) == (2 if scheme.per_tensor else 1)
                assert element_format(q).name in scheme.elements  # what quantization health reads
                assert q.element is None or q.element.name in scheme.elements


def test_fake_quantize_names_resolve_to_schemes_and_elements():
    assert FORMATS == ("bf16", "fp8_e4m3", "fp8_e5m2", "fp8_rowwise", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
    assert resolve_named("fp8_e5m2") == (SCHEMES["fp8_tensorwise"], "e5m2")
    assert resolve_named("nvfp4") == (SCHEMES["nvfp4"], None)
    assert all(set(s.elements) <= set(ELEMENTS) for s in SCHEMES.values())
    assert [element_bits(f) for f in FORMATS] == [16, 8, 8, 8, 8, 8, 4, 4]
    # a scheme that needs a recipe's choice (the element) or state (an amax history) has no bare name
    for name in ("fp8_tensorwise", "fp8_delayed", "e4m3"):
        with pytest.raises(ValueError, match="valid formats: bf16, fp8_e4m3, fp8_e5m2, fp8_rowwise, fp8_block"):
            resolve_named(name)


def test_te_recipes_are_megatron_cores_and_cover_what_the_configs_write():
    for scheme, te in TE_RECIPES.items():
        assert SCHEMES[scheme].quantized
        assert (Fp8Recipe if te.kind == "fp8" else Fp4Recipe)(te.name).value == te.name
    assert set(TE_FP8_RECIPES) == {"tensorwise", "blockwise", "mxfp8"}  # megatron-core refuses delayed per module
    assert set(TE_FP8_RECIPES) <= set(FP8_RECIPES)
    assert TE_FP4_PRECISIONS == {"nvfp4": "nvfp4"}  # TE has no MXFP4 recipe


# Where a format's name may decide what code does: the registry, and the quantizers' own dispatch
# (one implementation per scheme). Elsewhere code asks the registry's records.
NAME_DISPATCH = re.compile(r'(==|!=)\s*"(bf16|fp8|nvfp4|mxfp4|mxfp8|fp8_[a-z0-9]+)"'
                           r'|in \("(bf16|fp8|nvfp4|mxfp4|mxfp8|fp8_[a-z0-9]+)"')
ALLOWED = {"megatron_snip/numerics/registry.py", "megatron_snip/numerics/quantize.py"}


def test_no_code_outside_the_registry_dispatches_on_a_format_name():
    found = []
    for path in sorted((ROOT / "megatron_snip").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_DISPATCH.search(line) and ".kind ==" not in line:  # TE's recipe kinds are TE's names
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "ask numerics.registry instead:\n" + "\n".join(found)

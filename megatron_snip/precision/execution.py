"""Which kernel runs each precision's GEMMs on this device: a real low-precision kernel or a simulation.

The start-up log says it for every precision a run can use (its plan and SNIP's candidates), so a
user can tell a plan that will run faster from one whose FP4 share is only simulated. The GEMM
time in logs and TensorBoard is an estimate from ``--gemm-speed-model`` either way; this says
whether any speed-up can be real.

A pure function of the backend, the recipe and the GPU's compute capability (None: no GPU), so
it is tested on CPU for every device. The Transformer Engine recipe each scheme runs as per module
(``TE_RECIPES``), why a precision has none (:func:`te_unsupported`) and TE's NVFP4 switches are here
too: the te backend's layers and the per-module precision files both state them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megatron_snip.numerics.recipes import RecipeConfig
from megatron_snip.numerics.registry import (
    ROW,
    SchemeFormat,
    fp8_recipe_precision,
    precision_format,
    precision_fp8_recipe,
    precision_scheme,
)

# Compute capabilities of the tensor cores each real kernel needs.
FP8_TENSOR_CORES = (8, 9)  # Ada / Hopper: per-tensor FP8 (torch._scaled_mm, TE)
HOPPER = (9, 0)  # TE's Float8BlockScaling
BLACKWELL = (10, 0)  # block-scaled MXFP8 / NVFP4 / MXFP4 tensor cores
ARCHITECTURES = {FP8_TENSOR_CORES: "Ada", HOPPER: "Hopper", BLACKWELL: "Blackwell"}



@dataclass(frozen=True)
class TERecipe:
    """A megatron-core per-module Transformer Engine recipe (``TEQuantizationRecipe``).

    Attributes:
        kind: "fp8" or "fp4": the recipe field that names it (``fp8_quantization_recipe`` /
            ``fp4_quantization_recipe``).
        name: the value there (megatron-core's ``Fp8Recipe`` / ``Fp4Recipe``).
        te_class: Transformer Engine's recipe class, for docs and the configs' comments.
        needs: the compute capability its kernels need.
    """

    kind: str
    name: str
    te_class: str
    needs: tuple[int, int]


# The TE recipe that runs each scheme per module. A scheme not here has none: delayed scaling
# (megatron-core refuses it per module) and MXFP4 (TE has no recipe for it).
TE_RECIPES = {
    "fp8_tensorwise": TERecipe("fp8", "tensorwise", "Float8CurrentScaling", FP8_TENSOR_CORES),
    "fp8_block": TERecipe("fp8", "blockwise", "Float8BlockScaling", HOPPER),
    "mxfp8": TERecipe("fp8", "mxfp8", "MXFP8BlockScaling", BLACKWELL),
    "nvfp4": TERecipe("fp4", "nvfp4", "NVFP4BlockScaling", BLACKWELL),
}


def te_unsupported(name: str, recipe: RecipeConfig) -> str:
    """Why no per-module Transformer Engine recipe runs precision ``name`` under ``recipe`` (one that has none)."""
    fp8 = precision_fp8_recipe(name, recipe.fp8_recipe)
    te_fp8 = [te.name for te in TE_RECIPES.values() if te.kind == "fp8"]
    if precision_format(name).fp8_recipe is None:  # plain fp8: the run's recipe
        what, instead = f"{name} with --fp8-recipe {recipe.fp8_recipe}", f"--fp8-recipe {_or(te_fp8)}"
    else:
        what, instead = name, _or([fp8_recipe_precision(r) for r in te_fp8])
    if fp8 is not None and precision_scheme(name, recipe.fp8_recipe).amax_history:
        return f"{what}: megatron-core's per-module TE recipes do not support delayed scaling; use {instead}"
    if fp8 is not None:
        return (f"{what}: Transformer Engine has no {fp8} FP8 recipe (rowwise is torchao's; this package's torch "
                f"backend, --transformer-impl local, runs it); use {instead}")
    return (f"precision {name}: Transformer Engine has no {name.upper()} recipe; use nvfp4 (--fp4-recipe nvfp4) or "
            "the torch backend (--transformer-impl local)")


def _or(names: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def te_nvfp4_environment(recipe: RecipeConfig) -> dict[str, str]:
    """Transformer Engine's NVFP4 switches for ``recipe``. TE reads them from the environment
    once, when it is imported (they are the defaults of ``NVFP4BlockScaling``'s fields, and
    megatron-core builds that recipe with its defaults), so they must be set before."""
    return {
        "NVTE_NVFP4_DISABLE_RHT": "0" if recipe.nvfp4_random_hadamard else "1",
        "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "0" if recipe.fp4_stochastic_rounding else "1",
        "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0" if recipe.nvfp4_2d_weights else "1",
    }


SIMULATED = "simulated (operands quantized and dequantized, GEMM in fp32/bf16: no faster than bf16)"


def gemm_execution(formats: Iterable[str], recipe: RecipeConfig, backend: str,
                   capability: tuple[int, int] | None) -> dict[str, str]:
    """precision -> how its GEMMs run: ``"real: <kernel>"`` or ``"simulated (...)"``.

    Args:
        formats: precision names (bf16, fp8, fp8:RECIPE, nvfp4, mxfp4).
        recipe: how plain fp8 is scaled (``recipe.fp8_recipe``) and whether the torch backend may use
            ``torch._scaled_mm`` (``recipe.fp8_gemm``).
        backend: "local" (this package's quantized linears) or "transformer_engine".
        capability: the GPU's compute capability, None without a GPU.
    """
    return {fmt: _execution(fmt, recipe, backend, capability) for fmt in dict.fromkeys(formats)}


def _execution(fmt: str, recipe: RecipeConfig, backend: str, capability: tuple[int, int] | None) -> str:
    if not precision_format(fmt).quantized:
        return "real: bf16 GEMM" if capability is not None else "real: fp32/bf16 GEMM on the CPU"
    if capability is None:
        return SIMULATED
    scheme = precision_scheme(fmt, recipe.fp8_recipe)
    if backend == "transformer_engine":
        return _te_execution(fmt, scheme, recipe, capability)
    scaled_mm = recipe.fp8_gemm == "scaled_mm" or (recipe.fp8_gemm == "auto" and capability >= FP8_TENSOR_CORES)
    if scaled_mm and (scheme.per_tensor or scheme.block == (1, ROW)):
        return "real: torch._scaled_mm FP8 tensor cores"
    if scaled_mm and scheme.block_gemm and capability == HOPPER:
        return ("real where torch's block-scaled GEMM agrees with the emulation at first use (checked per shape), "
                "else simulated")
    return SIMULATED


def _te_execution(fmt: str, scheme: SchemeFormat, recipe: RecipeConfig, capability: tuple[int, int]) -> str:
    te = TE_RECIPES.get(scheme.name)
    if te is None:
        return "not run by Transformer Engine"
    if capability < te.needs:
        return f"not run by Transformer Engine on this GPU (needs compute capability {te.needs[0]}.{te.needs[1]})"
    label = f"{fmt} ({recipe.fp8_recipe})" if precision_format(fmt).scheme is None else fmt  # fp8: the run's recipe
    return f"real: Transformer Engine {label} tensor cores"


# The FP8 recipes a --snip-time-target run chooses among by default where they run on a real kernel. Not
# delayed: its amax history would start empty whenever a plan switches a module to it.
STATELESS_FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def fast_precisions(fp4: str, recipe: RecipeConfig, backend: str, capability: tuple[int, int] | None) -> list[str]:
    """The precisions below bf16 whose GEMMs run on a real kernel on this device (:func:`gemm_execution`):
    ``fp8:RECIPE`` for each stateless FP8 recipe, then the FP4 format ``fp4`` (a run's --fp4-recipe); on
    Hopper with the torch backend fp8:tensorwise, fp8:rowwise and fp8:blockwise. The default candidates
    of a time-target SNIP run, which its measured speed table then prices."""
    names = [*map(fp8_recipe_precision, STATELESS_FP8_RECIPES), fp4]
    return [n for n, how in gemm_execution(names, recipe, backend, capability).items() if how.startswith("real")]


def describe_execution(execution: dict[str, str]) -> str:
    """One start-up line: ``precision: how`` for each."""
    return "GEMM kernels on this device: " + "; ".join(f"{fmt} {how}" for fmt, how in execution.items())

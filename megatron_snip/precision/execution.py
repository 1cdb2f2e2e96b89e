"""Which kernel runs each precision's GEMMs on this device: a real low-precision kernel or a simulation.

The start-up log says it for every precision a run can use (its plan and SNIP's candidates), so a
user can tell a plan that will run faster from one whose FP4 share is only simulated. The GEMM
time in logs and TensorBoard is an estimate from ``--gemm-speed-model`` either way; this says
whether any speed-up can be real.

A pure function of the backend, the recipe and the GPU's compute capability (None: no GPU), so
it is tested on CPU for every device.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_snip.numerics.recipes import RecipeConfig

# Compute capabilities of the tensor cores each real kernel needs.
FP8_TENSOR_CORES = (8, 9)  # Ada / Hopper: per-tensor FP8 (torch._scaled_mm, TE)
HOPPER = (9, 0)  # TE's Float8BlockScaling
BLACKWELL = (10, 0)  # block-scaled MXFP8 / NVFP4 / MXFP4 tensor cores

SIMULATED = "simulated (operands quantized and dequantized, GEMM in fp32/bf16: no faster than bf16)"


def gemm_execution(formats: Iterable[str], recipe: RecipeConfig, backend: str,
                   capability: tuple[int, int] | None) -> dict[str, str]:
    """precision -> how its GEMMs run: ``"real: <kernel>"`` or ``"simulated (...)"``.

    Args:
        formats: precision names (bf16, fp8, nvfp4, mxfp4).
        recipe: how fp8 is scaled (``recipe.fp8_recipe``) and whether the torch backend may use
            ``torch._scaled_mm`` (``recipe.fp8_gemm``).
        backend: "local" (this package's quantized linears) or "transformer_engine".
        capability: the GPU's compute capability, None without a GPU.
    """
    return {fmt: _execution(fmt, recipe, backend, capability) for fmt in dict.fromkeys(formats)}


def _execution(fmt: str, recipe: RecipeConfig, backend: str, capability: tuple[int, int] | None) -> str:
    if fmt == "bf16":
        return "real: bf16 GEMM" if capability is not None else "real: fp32/bf16 GEMM on the CPU"
    if capability is None:
        return SIMULATED
    if backend == "transformer_engine":
        return _te_execution(fmt, recipe, capability)
    per_tensor = fmt == "fp8" and recipe.fp8_recipe in ("tensorwise", "delayed")
    scaled_mm = recipe.fp8_gemm == "scaled_mm" or (recipe.fp8_gemm == "auto" and capability >= FP8_TENSOR_CORES)
    if per_tensor and scaled_mm:
        return "real: torch._scaled_mm FP8 tensor cores"
    return SIMULATED


def _te_execution(fmt: str, recipe: RecipeConfig, capability: tuple[int, int]) -> str:
    needs = {"nvfp4": BLACKWELL, "mxfp4": None}
    if fmt == "fp8":
        needs["fp8"] = {"mxfp8": BLACKWELL, "blockwise": HOPPER}.get(recipe.fp8_recipe, FP8_TENSOR_CORES)
    need = needs.get(fmt)
    if need is None:
        return "not run by Transformer Engine"
    if capability < need:
        return f"not run by Transformer Engine on this GPU (needs compute capability {need[0]}.{need[1]})"
    return f"real: Transformer Engine {fmt if fmt != 'fp8' else f'fp8 ({recipe.fp8_recipe})'} tensor cores"


def describe_execution(execution: dict[str, str]) -> str:
    """One start-up line: ``precision: how`` for each."""
    return "GEMM kernels on this device: " + "; ".join(f"{fmt} {how}" for fmt, how in execution.items())

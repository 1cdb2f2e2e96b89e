"""The ``te`` precision backend: megatron-core's Transformer Engine linears, one recipe per module.

With ``--transformer-impl transformer_engine`` the model is built from
megatron-core's TE layer spec (TELayerNormColumnParallelLinear for linear_qkv and
linear_fc1, TERowParallelLinear for linear_proj and linear_fc2). Since 0.16 each of
them reads its ``te_quant_params`` on every forward and, when set, enters
``fp8_autocast`` with that recipe around TE's GEMMs (FP8 and NVFP4 on tensor cores).
:class:`TELinearPrecision` gives such a module the interface the
``PrecisionController`` drives (``precision``, ``check_precision``, ``recipe``),
so plans, ``--precision``, ``--first-last-layers-bf16`` and plan switching work as
with the ``torch`` backend.

Every module runs its own recipe: ``fp8`` the run's ``--fp8-recipe``, ``fp8:RECIPE`` its own
(megatron-core's per-module ``fp8_quantization_recipe``), so one model can mix tensorwise,
blockwise and (on Blackwell) MXFP8 and NVFP4 modules. What TE cannot express is refused with the
module named: different formats for the forward and the backward GEMMs (a TE recipe covers all
three), MXFP4 (TE has no MXFP4 recipe), rowwise FP8 (TE has no such recipe) and delayed scaling
(megatron-core's per-module recipes leave it out); ``--snip`` drops such candidates from its ILP
(:func:`te_runnable`).

SNIP measures, TE executes: the adapter shows the probes the TE module's GEMM
operands (its weight, its input after the fused norm: :func:`fused_norm_output`,
its output gradient, noise at its output through a forward hook), and the probes
run this package's quantizers on them, bit-exact to TE's recipes' semantics.

Transformer Engine is imported only by megatron-core's TE modules; this file
builds megatron-core's own dataclasses and runs without TE installed.
"""

from __future__ import annotations

import os
import sys

import torch
from packaging.version import Version as PkgVersion

from megatron_snip.model.quantized.layers import PlanLinear
from megatron_snip.numerics.linear import QuantState
from megatron_snip.numerics.recipes import BF16, Precision, RecipeConfig
from megatron_snip.numerics.registry import (
    precision_format,
    precision_scheme,
)
from megatron_snip.precision.execution import ARCHITECTURES, TE_RECIPES, te_nvfp4_environment, te_unsupported

NVFP4_MIN_TE = "2.8.0"  # first Transformer Engine release with NVFP4BlockScaling


def te_quant_params(precision: Precision, recipe: RecipeConfig):
    """megatron-core's ``TEQuantizationParams`` running ``precision`` under ``recipe``
    (None for bf16: the module runs unquantized). Raises ValueError for what TE cannot run."""
    from megatron.core.enums import Fp4Recipe, Fp8Recipe
    from megatron.core.extensions.transformer_engine import TEQuantizationParams, TEQuantizationRecipe

    if precision.fwd != precision.bwd:
        raise ValueError(f"precision {precision}: the te backend runs one format for all three GEMMs of "
                         "a module (a TE recipe covers forward and backward); use the torch backend "
                         "(--transformer-impl local) for split precisions")
    name = precision.fwd
    if not precision_format(name).quantized:
        return None
    scheme = precision_scheme(name, recipe.fp8_recipe)
    te = TE_RECIPES.get(scheme.name)
    if te is None:
        raise ValueError(te_unsupported(name, recipe))
    if te.kind == "fp4":  # NVFP4BlockScaling, TE's one FP4 recipe
        _require_te_version(NVFP4_MIN_TE, te.name)
        _check_te_nvfp4_switches(recipe)
    te_recipe = TEQuantizationRecipe(
        fp8_quantization_recipe=Fp8Recipe(te.name) if te.kind == "fp8" else None,
        fp4_quantization_recipe=Fp4Recipe(te.name) if te.kind == "fp4" else None,
        fp8_format=recipe.fp8_format,
        override_nonquantized_autocast=True,  # no global autocast is open: this module opens its own
    )
    return TEQuantizationParams(training_recipe=te_recipe, evaluation_recipe=None)


def te_runnable(formats: tuple[str, ...] | list[str], recipe: RecipeConfig,
                capability: tuple[int, int] | None = None) -> tuple[list[str], dict[str, str]]:
    """Split candidate formats into those a TE recipe can run under ``recipe`` on a GPU of compute
    ``capability`` (None: not known, not checked) and the others, with why (format -> reason),
    for SNIP's candidates on the te backend."""
    kept, dropped = [], {}
    for fmt in formats:
        try:
            te_quant_params(Precision.uniform(fmt), recipe)
        except ValueError as e:
            dropped[fmt] = str(e)
            continue
        te = TE_RECIPES.get(precision_scheme(fmt, recipe.fp8_recipe).name)  # None: bf16, which needs nothing
        if te is not None and capability is not None and capability < te.needs:
            dropped[fmt] = (f"Transformer Engine's {fmt} needs compute capability {'.'.join(map(str, te.needs))} "
                            f"({ARCHITECTURES[te.needs]}); this GPU has {'.'.join(map(str, capability))}")
            continue
        kept.append(fmt)
    return kept, dropped


def fused_norm_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str,
                      eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """The input of a LayerNormLinear's GEMM: its fused norm applied to the forward's input.

    x: [..., h] (this rank's tokens); weight, bias: [h] (bias only for LayerNorm). Computed in
    fp32 and returned in x's dtype, as TE's norm kernels do; gamma is ``1 + weight`` with
    ``zero_centered_gamma``. Returns [..., h].
    """
    gamma = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    xf = x.float()
    if normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * gamma
    elif normalization == "LayerNorm":
        y = torch.nn.functional.layer_norm(xf, xf.shape[-1:], gamma, None if bias is None else bias.float(), eps)
    else:
        raise ValueError(f"normalization {normalization!r}: expected RMSNorm or LayerNorm")
    return y.to(x.dtype)


def prepare_te_environment(recipe: RecipeConfig) -> None:
    """Set :func:`te_nvfp4_environment` before Transformer Engine is imported (the te backend's
    model build calls this first). If TE is already imported, its recipe must already agree."""
    if "transformer_engine" not in sys.modules:
        os.environ.update(te_nvfp4_environment(recipe))
    _check_te_nvfp4_switches(recipe)


def _check_te_nvfp4_switches(recipe: RecipeConfig) -> None:
    """ValueError when the NVFP4 recipe TE would build differs from ``recipe`` (TE imported
    before :func:`prepare_te_environment` with other NVTE_NVFP4_* variables)."""
    te_recipe = sys.modules.get("transformer_engine.common.recipe")
    if te_recipe is None or not hasattr(te_recipe, "NVFP4BlockScaling"):
        return
    built = te_recipe.NVFP4BlockScaling()
    for field, (variable, wanted) in {
        "disable_rht": ("NVTE_NVFP4_DISABLE_RHT", not recipe.nvfp4_random_hadamard),
        "disable_stochastic_rounding": ("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", not recipe.fp4_stochastic_rounding),
        "disable_2d_quantization": ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", not recipe.nvfp4_2d_weights),
    }.items():
        if getattr(built, field, wanted) != wanted:
            raise ValueError(f"Transformer Engine was imported with {variable}={int(not wanted)} but the flags ask "
                             f"for {variable}={int(wanted)}; unset {variable} in the environment and use the "
                             "--fp4-disable-stochastic-rounding / --nvfp4-disable-rht / "
                             "--nvfp4-disable-2d-quantization flags")


def describe_te_backend() -> str:
    """One line for the start-up log."""
    from megatron.core.utils import get_te_version

    return (f"te: Transformer Engine {get_te_version()} linears (megatron-core's TE layer spec), "
            "each module's GEMMs under its own TE recipe from the plan")


def _require_te_version(version: str, what: str) -> None:
    from megatron.core.utils import get_te_version

    found = get_te_version()
    if found is None:
        return  # no TE here: building the TE layer spec fails first, and says so
    if found < PkgVersion(version):
        raise ValueError(f"{what} on the te backend needs Transformer Engine >= {version}, found {found}")


class TELinearPrecision(PlanLinear):
    """A megatron-core TE linear seen through the per-module precision interface (and, for
    SNIP's probes, through :class:`PlanLinear`'s measurement attributes).

    Attributes:
        module: the TE linear (its ``te_quant_params`` is what changes).
        config: the module's TransformerConfig.
        recipe: the :class:`RecipeConfig` realising ``precision``.
        quant_state: unused by TE (it keeps its own state); the probes' quantizers start
            their private states from it, as for the torch backend.
        module_name: the global plan name (set by the controller).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.config = module.config
        self.recipe = RecipeConfig()
        self.quant_state = QuantState()
        self.module_name = type(module).__name__
        self._precision = BF16
        module.te_quant_params = None
        # megatron-core's TE wrappers: TELayerNormColumnParallelLinear / TEColumnParallelLinear
        # run TE's parallel_mode "column", TERowParallelLinear "row".
        mode = getattr(module, "parallel_mode", "column")
        self.sharded_operands = frozenset({"x", "w"}) if mode == "row" else frozenset({"w", "dy"})

    @property
    def forward_module(self) -> torch.nn.Module:
        return self.module

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.module.weight

    @property
    def tp_group(self):
        return self.module._tp_group

    @property
    def sequence_parallel(self) -> bool:
        from megatron.core.utils import get_pg_size

        return bool(self.config.sequence_parallel) and get_pg_size(self.tp_group) > 1

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """After a LayerNormLinear's fused norm (its ``layer_norm_weight``); else ``x``."""
        norm_weight = getattr(self.module, "layer_norm_weight", None)
        if norm_weight is None:
            return x
        return fused_norm_output(x, norm_weight, getattr(self.module, "layer_norm_bias", None),
                                 normalization=self.config.normalization, eps=self.config.layernorm_epsilon,
                                 zero_centered_gamma=self.config.layernorm_zero_centered_gamma)

    def check_precision(self, precision: Precision, recipe: RecipeConfig) -> None:
        """Raise ValueError (naming the module) if TE cannot run ``precision`` under ``recipe``."""
        try:
            te_quant_params(precision, recipe)
        except ValueError as e:
            raise ValueError(f"{self.module_name}: {e}") from None
        self.check_tensor_parallel_blocks(precision, recipe)

    def _use(self, precision: Precision, recipe: RecipeConfig) -> None:
        self.module.te_quant_params = te_quant_params(precision, recipe)

"""The precision of a linear module and the recipe that turns it into operand quantizers.

A linear module ``Y = X W^T`` (X: tokens x in, W: out x in, dY: tokens x out)
runs three GEMMs, each on its own quantized copies of two operands:

    fprop  Y  = Q(X)  Q(W)^T     reduces over in
    dgrad  dX = Q(dY) Q(W)       reduces over out
    wgrad  dW = Q(dY)^T Q(X)     reduces over tokens

Its :class:`Precision` names one module-level format for the forward GEMM
and one for the two backward GEMMs. The recipe (:class:`RecipeConfig`,
following Transformer Engine's recipes) decides, per (format, GEMM, operand),
the exact quantizer: :func:`operand_quantizer`. Blocks always run along the
GEMM's reduction dimension, so the same operand is quantized along different
axes for different GEMMs ("columnwise" copies in TE's words), except where
the scaling group does not depend on the axis (per-tensor scales, square
2-D weight tiles): then the copies are identical and a caller may reuse one.
See docs/numerics.md, "Quantized linear layers", for the full table.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.numerics.formats import E4M3, E5M2, FloatFormat
from megatron_snip.numerics.registry import (
    FP4_NAMES,
    FP8_RECIPE_SCHEMES,
    PRECISION_NAMES,
    ROW,
    SCHEMES,
    SchemeFormat,
    precision_format,
    precision_scheme,
    scheme_format,
)

FP8_RECIPES = tuple(FP8_RECIPE_SCHEMES)
FP8_FORMATS = ("hybrid", "e4m3")
KERNELS = ("auto", "triton", "torch")
FP8_GEMMS = ("auto", "scaled_mm", "emulated")
GEMMS = ("fprop", "dgrad", "wgrad")
OPERANDS = ("x", "w", "dy")
# The two operands of each GEMM, in the order they enter it.
GEMM_OPERANDS = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}
__all__ = ["BF16", "FP4_NAMES", "PRECISION_NAMES", "SCHEMES", "OperandQuantizer", "Precision", "RecipeConfig",
           "operand_quantizer", "reduction_block", "token_block"]


def _check_name(name: str) -> str:
    precision_format(name)
    return name


@dataclass(frozen=True)
class Precision:
    """The formats of one linear module's GEMMs.

    Attributes:
        fwd: format of the fprop GEMM, one of ``PRECISION_NAMES``.
        bwd: format of the dgrad and wgrad GEMMs, one of ``PRECISION_NAMES``.

    Text form: ``"nvfp4"`` when both sides agree, else ``"fwd/bwd"`` (``"fp8/bf16"``).
    """

    fwd: str
    bwd: str

    def __post_init__(self):
        _check_name(self.fwd)
        _check_name(self.bwd)

    @classmethod
    def uniform(cls, name: str) -> Precision:
        """The same format for all three GEMMs."""
        return cls(name, name)

    @classmethod
    def parse(cls, text: str) -> Precision:
        """``"nvfp4"`` or ``"fp8/bf16"`` (forward/backward); inverse of ``str()``."""
        parts = text.strip().split("/")
        if len(parts) == 1:
            return cls.uniform(parts[0])
        if len(parts) == 2:
            return cls(parts[0], parts[1])
        raise ValueError(f"bad precision {text!r}: expected 'name' or 'fwd/bwd'")

    def __str__(self) -> str:
        return self.fwd if self.fwd == self.bwd else f"{self.fwd}/{self.bwd}"

    @property
    def is_bf16(self) -> bool:
        """True when no GEMM is quantized below bf16 (the module runs megatron-core's own path)."""
        return not (precision_format(self.fwd).quantized or precision_format(self.bwd).quantized)


BF16 = Precision.uniform("bf16")


@dataclass(frozen=True)
class RecipeConfig:
    """How each precision name is realised (Transformer Engine's recipes; Megatron's flag names).

    Attributes:
        fp8_recipe: "tensorwise" (current scaling, TE ``Float8CurrentScaling``; the default
            because it is stateless, so a module that switches to fp8 mid-run is scaled
            correctly from its first step), "delayed" (amax history, TE ``DelayedScaling``),
            "rowwise" (one power-of-two scale per row of each GEMM's reduction dim, E4M3 for every
            operand: torchao's float8 rowwise recipe), "blockwise" (TE ``Float8BlockScaling``),
            "mxfp8" (TE ``MXFP8BlockScaling``).
        fp8_format: "hybrid" (E4M3 for X and W, E5M2 for dY; TE's and Megatron's usual
            choice) or "e4m3" (E4M3 everywhere). Only the per-tensor recipes use it:
            rowwise, blockwise and mxfp8 are E4M3 for all operands (as torchao and TE).
        fp8_amax_history_len: delayed scaling: amaxes kept per operand.
        fp8_amax_compute_algo: delayed scaling: "max" or "most_recent" over the history.
        fp8_margin: delayed scaling: headroom in binades.
        fp4_stochastic_rounding: stochastic rounding of dY in both backward GEMMs
            (nvfp4 as TE, and mxfp4).
        nvfp4_random_hadamard: 16x16 random Hadamard transform of both wgrad operands
            along tokens before NVFP4 quantization (TE's default).
        nvfp4_2d_weights: 16x16 weight tiles (TE's default), else 1x16 blocks along
            each GEMM's reduction dim.
        kernels: how operands are quantized: "torch" (the reference quantizers), "triton"
            (fused kernels, bit-identical; CUDA, or Triton's interpreter), "auto" (triton
            for CUDA tensors when it imports, else torch). Changes speed, never bits.
        fp8_gemm: how per-tensor- and per-row-scaled FP8 GEMMs run: "emulated" (dequantize, fp32
            GEMM), "scaled_mm" (``torch._scaled_mm`` on the FP8 bytes: tensor cores on GPU), "auto"
            (scaled_mm on CUDA GPUs with FP8 tensor cores, compute capability >= 8.9).
            The two agree up to fp32 accumulation order.
    """

    fp8_recipe: str = "tensorwise"
    fp8_format: str = "hybrid"
    fp8_amax_history_len: int = 1  # Megatron-LM's defaults (--fp8-amax-history-len, --fp8-amax-compute-algo)
    fp8_amax_compute_algo: str = "most_recent"
    fp8_margin: int = 0
    fp4_stochastic_rounding: bool = True
    nvfp4_random_hadamard: bool = True
    nvfp4_2d_weights: bool = True
    kernels: str = "auto"
    fp8_gemm: str = "auto"

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)}, got {self.fp8_gemm!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"fp8_format must be one of {', '.join(FP8_FORMATS)}, got {self.fp8_format!r}")
        if self.fp8_amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("fp8_amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {self.fp8_amax_compute_algo!r}")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len must be >= 1, got {self.fp8_amax_history_len}")


@dataclass(frozen=True)
class OperandQuantizer:
    """How to quantize one operand for one GEMM.

    Attributes:
        scheme: one of ``SCHEMES`` ("bf16": round to bf16; the others name the quantizer).
        element: element format of the per-tensor FP8 schemes (E4M3 / E5M2), else None.
        block: (rows, cols) scaling block with the reduction dim last, None for per-tensor.
        columnwise: the operand's *first* dim is the GEMM's reduction dim (X and dY for
            wgrad, W for dgrad): quantize the transpose. Always False where the scaling
            groups do not depend on the axis (per tensor, square tiles), so two equal
            quantizers give identical results on the same tensor.
        stochastic: stochastic rounding of the E2M1 elements.
        hadamard: random Hadamard transform along tokens first (NVFP4 wgrad operands).
    """

    scheme: str
    element: FloatFormat | None = None
    block: tuple[int, int] | None = None
    columnwise: bool = False
    stochastic: bool = False
    hadamard: bool = False

    def __post_init__(self):
        scheme_format(self.scheme)  # a known scheme, or ValueError
        if self.block is None or self.block[0] == self.block[1]:
            object.__setattr__(self, "columnwise", False)

    @property
    def reduction_block(self) -> int:
        """Elements per scaling block along the reduction dim that a tensor-parallel split must respect
        (1 for per-tensor and bf16, and for per-row scales, whose row amaxes are all-reduced instead)."""
        return 1 if self.block is None or self.block[1] == ROW else self.block[1]

    @property
    def spec(self) -> SchemeFormat:
        """The registry's description of this quantizer's scheme."""
        return SCHEMES[self.scheme]


def _check_operand(gemm: str, operand: str) -> None:
    if gemm not in GEMM_OPERANDS:
        raise ValueError(f"unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")
    if operand not in GEMM_OPERANDS[gemm]:
        raise ValueError(f"GEMM {gemm!r} has operands {GEMM_OPERANDS[gemm]}, not {operand!r}")


def operand_quantizer(name: str, gemm: str, operand: str, recipe: RecipeConfig = RecipeConfig()) -> OperandQuantizer:
    """The quantizer of ``operand`` ("x", "w", "dy") in ``gemm`` ("fprop", "dgrad", "wgrad")
    when that GEMM runs in precision ``name`` under ``recipe`` (see the module docstring)."""
    _check_name(name)
    _check_operand(gemm, operand)
    columnwise = gemm == "wgrad" or (gemm == "dgrad" and operand == "w")
    grad = operand == "dy"
    weight = operand == "w"
    spec = precision_scheme(name, recipe.fp8_recipe)
    if not precision_format(name).quantized:
        return OperandQuantizer(spec.name)
    if spec.per_tensor:  # --fp8-format hybrid: E5M2 gradients
        element = E5M2 if grad and recipe.fp8_format == "hybrid" else E4M3
        return OperandQuantizer(spec.name, element=element)
    tile = weight and (not spec.weight_tiles_optional or recipe.nvfp4_2d_weights)
    return OperandQuantizer(
        spec.name,
        block=spec.weight_block if tile else spec.block,
        columnwise=columnwise,
        stochastic=grad and spec.stochastic_rounding and recipe.fp4_stochastic_rounding,
        hadamard=spec.wgrad_hadamard and gemm == "wgrad" and recipe.nvfp4_random_hadamard,
    )


def misaligned_split(precision: Precision, recipe: RecipeConfig, slice_size: int) -> tuple[str, int] | None:
    """The alignment rule of tensor parallelism, the one place it is written: where TP splits a
    module's weight, every rank's slice (``slice_size`` elements along the split dimension) must
    hold whole scaling blocks, so that every rank's blocks are blocks of the unsplit tensor.
    Returns the first format of ``precision`` that breaks it and its block, or None."""
    for name in dict.fromkeys((precision.fwd, precision.bwd)):
        block = reduction_block(name, recipe)
        if slice_size % block:
            return name, block
    return None


def token_block(name: str, recipe: RecipeConfig = RecipeConfig()) -> int:
    """Tokens per scaling block of the wgrad GEMM's operands (X and dY, reduced over tokens) in precision
    ``name``: a sequence split over context-parallel ranks must give each rank whole blocks, so that every
    rank's blocks are blocks of the unsplit batch (16 nvfp4, 32 mxfp4/mxfp8, 128 fp8 blockwise, 1 otherwise)."""
    return max(operand_quantizer(name, "wgrad", operand, recipe).reduction_block for operand in ("x", "dy"))


def reduction_block(name: str, recipe: RecipeConfig = RecipeConfig()) -> int:
    """Largest scaling block along any reduction dim for precision ``name``: a dimension
    split across tensor-parallel ranks must be a multiple of it per rank, so that every
    rank's blocks are blocks of the unsplit tensor (16 nvfp4, 32 mxfp4/mxfp8, 128 fp8
    blockwise, 1 otherwise)."""
    return max(
        operand_quantizer(name, gemm, operand, recipe).reduction_block
        for gemm, operands in GEMM_OPERANDS.items()
        for operand in operands
    )

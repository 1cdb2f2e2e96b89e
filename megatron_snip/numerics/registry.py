"""The number formats, registered once: everything the program knows about a format by name.

Two levels, each a frozen description read by every part that dispatches on a name:

* **Precisions** (:data:`PRECISIONS`): what a plan, a flag or the SNIP ILP gives a linear
  module's GEMMs: ``bf16``, ``fp8``, ``nvfp4``, ``mxfp4``. Their *family* (bf16 / fp8 / fp4)
  is what FLOP fractions, the ILP's FP4 budget and the plots count.
* **Schemes** (:data:`SCHEMES`): how one GEMM operand is quantized: ``bf16``,
  ``fp8_tensorwise``, ``fp8_delayed``, ``fp8_block``, ``mxfp8``, ``mxfp4``, ``nvfp4``. The recipe
  (``recipes.operand_quantizer``) picks one per (precision, GEMM, operand); the quantizers
  (``quantize.py``), the fused kernels and the GEMM speed model (``gemm_speed.py``) are keyed by it.

Element formats themselves (E4M3, E2M1, ...) are :class:`formats.FloatFormat`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Block lengths (elements along a GEMM's reduction dim) of the block-scaled formats; the quantizers
# (fp8.py, mx.py, nvfp4.py) take them from here, so naming a format needs no torch.
FP8_BLOCK = 128  # DeepSeek-V3 / TE Float8BlockScaling: 1x128 activations, 128x128 weights
MX_BLOCK = 32  # OCP MX
NVFP4_BLOCK = 16  # NVFP4: 1x16, or 16x16 weight tiles

@dataclass(frozen=True)
class PrecisionFormat:
    """A precision a module's GEMMs can run in.

    Attributes:
        name: the name in plans and flags.
        family: "bf16", "fp8" or "fp4": the element width class FLOP fractions count.
        bits: bits per element (scales excluded).
        summary: elements and scaling, for help texts and docs.
        colour: RGB of the format in plan images (Paul Tol's colour-blind-safe "bright").
    """

    name: str
    family: str
    bits: int
    summary: str
    colour: tuple[int, int, int]


@dataclass(frozen=True)
class SchemeFormat:
    """How one GEMM operand is quantized.

    Attributes:
        name: scheme name (``OperandQuantizer.scheme``).
        bits: bits per element.
        block: scaling block of activations and gradients as (rows, cols) with the GEMM's
            reduction dim last; None: one scale per tensor (or none, for bf16).
        weight_block: the block of weights (2-D tiles where the format has them).
        scale: what a scale is, for docs.
        stochastic_rounding: the scheme can round its elements stochastically (E2M1 gradients).
    """

    name: str
    bits: int
    block: tuple[int, int] | None
    weight_block: tuple[int, int] | None
    scale: str
    stochastic_rounding: bool = False


PRECISIONS: dict[str, PrecisionFormat] = {p.name: p for p in (
    PrecisionFormat("bf16", "bf16", 16, "bf16, unscaled (megatron-core's own GEMM)", (68, 119, 170)),
    PrecisionFormat("fp8", "fp8", 8, "E4M3 forward / E5M2 gradients, scaled per --fp8-recipe", (102, 204, 238)),
    PrecisionFormat("nvfp4", "fp4", 4, "E2M1, E4M3 scale per 16 elements (16x16 weight tiles) + fp32 per tensor",
                    (238, 102, 119)),
    PrecisionFormat("mxfp4", "fp4", 4, "E2M1, E8M0 scale per 32 elements", (204, 187, 68)),
)}
PRECISION_NAMES = tuple(PRECISIONS)
FP4_NAMES = tuple(n for n, p in PRECISIONS.items() if p.family == "fp4")

SCHEMES: dict[str, SchemeFormat] = {s.name: s for s in (
    SchemeFormat("bf16", 16, None, None, "none"),
    SchemeFormat("fp8_tensorwise", 8, None, None, "fp32 per tensor from its amax (current scaling)"),
    SchemeFormat("fp8_delayed", 8, None, None, "fp32 per tensor from an amax history (delayed scaling)"),
    SchemeFormat("fp8_block", 8, (1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK), "fp32 power of 2 per block"),
    SchemeFormat("mxfp8", 8, (1, MX_BLOCK), (1, MX_BLOCK), "E8M0 per block"),
    SchemeFormat("mxfp4", 4, (1, MX_BLOCK), (1, MX_BLOCK), "E8M0 per block", stochastic_rounding=True),
    SchemeFormat("nvfp4", 4, (1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK), "E4M3 per block x fp32 per tensor",
                 stochastic_rounding=True),
)}
SCHEME_NAMES = tuple(SCHEMES)


def precision_format(name: str) -> PrecisionFormat:
    """The registered precision ``name``; ValueError listing the valid ones."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; valid: {', '.join(PRECISION_NAMES)} "
                         "(or forward/backward, e.g. 'fp8/bf16')")
    return PRECISIONS[name]


def scheme_format(name: str) -> SchemeFormat:
    """The registered scheme ``name``; ValueError listing the valid ones."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; valid: {', '.join(SCHEME_NAMES)}")
    return SCHEMES[name]


def family(name: str) -> str:
    """"bf16", "fp8" or "fp4" for precision ``name``."""
    return precision_format(name).family


def is_fp4(name: str) -> bool:
    """Whether precision ``name`` runs in a 4-bit format (counts toward the FP4 budget)."""
    return family(name) == "fp4"

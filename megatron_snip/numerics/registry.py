"""The number formats, registered once: everything the program knows about a format by name.

Two levels, each a frozen description read by every part that dispatches on a name:

* **Precisions** (:data:`PRECISIONS`): what a plan, a flag or the SNIP ILP gives a linear
  module's GEMMs: ``bf16``, ``fp8`` (scaled per the run's ``--fp8-recipe``), ``fp8:RECIPE``
  (an FP8 recipe of its own, whatever the run's: ``fp8:tensorwise``, ``fp8:delayed``,
  ``fp8:rowwise``, ``fp8:blockwise``, ``fp8:mxfp8``; RECIPE is Megatron-LM's ``--fp8-recipe``
  value, the ``fp8_quantization_recipe`` of megatron-core's per-module configs, or ``rowwise``,
  ours), ``nvfp4``, ``mxfp4``. Their *family* (bf16 / fp8 / fp4) is what FLOP fractions, the
  ILP's FP4 budget and the plots count.
* **Schemes** (:data:`SCHEMES`): how one GEMM operand is quantized: ``bf16``,
  ``fp8_tensorwise``, ``fp8_delayed``, ``fp8_rowwise``, ``fp8_block``, ``mxfp8``, ``mxfp4``, ``nvfp4``. The recipe
  (``recipes.operand_quantizer``) picks one per (precision, GEMM, operand); the quantizers
  (``quantize.py``'s table), the fused kernels and the GEMM speed model (``gemm_speed.py``, through
  each scheme's ``speed_key``) are keyed by it.

Element formats themselves (E4M3, E2M1, ...) are :class:`formats.FloatFormat`, named here by
their ``name`` ("e4m3", "e5m2", "e2m1"). Code that must treat formats differently asks these
records (``is_fp4``, ``quantized``, ``per_tensor``, ``global_scale``, ...), not the names.
"""

from __future__ import annotations

from dataclasses import dataclass

# Block lengths (elements along a GEMM's reduction dim) of the block-scaled formats; the quantizers
# (fp8.py, mx.py, nvfp4.py) take them from here, so naming a format needs no torch.
FP8_BLOCK = 128  # DeepSeek-V3 / TE Float8BlockScaling: 1x128 activations, 128x128 weights
MX_BLOCK = 32  # OCP MX
NVFP4_BLOCK = 16  # NVFP4: 1x16, or 16x16 weight tiles
ROW = 0  # a block length meaning "the whole reduction dim": one scale per row (FP8 rowwise)

@dataclass(frozen=True)
class PrecisionFormat:
    """A precision a module's GEMMs can run in.

    Attributes:
        name: the name in plans and flags.
        family: "bf16", "fp8" or "fp4": the element width class FLOP fractions count.
        bits: bits per element (scales excluded).
        summary: elements and scaling, for help texts and docs.
        colour: RGB of the format in plan images (Paul Tol's colour-blind-safe "bright", and his
            "muted" and "light" for the FP8 recipes).
        scheme: the scheme every operand uses; None for ``fp8``, whose scheme ``--fp8-recipe`` picks.
        fp8_recipe: the FP8 recipe an ``fp8:RECIPE`` precision fixes (None for the others).
    """

    name: str
    family: str
    bits: int
    summary: str
    colour: tuple[int, int, int]
    scheme: str | None
    fp8_recipe: str | None = None

    @property
    def quantized(self) -> bool:
        """Whether the precision quantizes its GEMMs' operands below bf16."""
        return self.family != "bf16"


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
        elements: the element formats it can store (``FloatFormat.name``); per-tensor FP8 takes
            either, chosen per operand by ``--fp8-format``.
        per_tensor: one fp32 scale per tensor (FP8 current or delayed scaling), so the operand
            can travel as FP8 bytes to ``torch._scaled_mm``.
        amax_history: the scale comes from earlier steps' amaxes (delayed scaling).
        global_scale: a second-level fp32 scale from the whole tensor's amax (NVFP4), so a
            tensor-parallel shard needs the amax over every shard.
        weight_tiles_optional: its 2-D weight tiles are a recipe switch (``--nvfp4-2d-weights``)
            rather than always on.
        wgrad_hadamard: its wgrad operands may take the random Hadamard transform (NVFP4).
        stochastic_rounding: the scheme can round its elements stochastically (E2M1 gradients).
        block_gemm: torch's block-scaled GEMM (``F.scaled_mm`` with 1x128 / 128x128 scales, cuBLAS on
            Hopper) takes its FP8 bytes and block scales.
        speed_key: the class of tensor-core kernel its GEMMs need ("bf16", "fp8", "fp8_block", "mx8",
            "fp4"): the key of the published-peak speed tables (``precision/gemm_speed.py``).
    """

    name: str
    bits: int
    block: tuple[int, int] | None
    weight_block: tuple[int, int] | None
    scale: str
    speed_key: str
    elements: tuple[str, ...] = ()
    per_tensor: bool = False
    amax_history: bool = False
    global_scale: bool = False
    weight_tiles_optional: bool = False
    wgrad_hadamard: bool = False
    stochastic_rounding: bool = False
    block_gemm: bool = False

    @property
    def quantized(self) -> bool:
        """Whether the scheme quantizes below bf16."""
        return self.bits < 16


SCHEMES: dict[str, SchemeFormat] = {s.name: s for s in (
    SchemeFormat("bf16", 16, None, None, "none", "bf16", ("bf16",)),
    SchemeFormat("fp8_tensorwise", 8, None, None, "fp32 per tensor from its amax (current scaling)", "fp8",
                 ("e4m3", "e5m2"), per_tensor=True),
    SchemeFormat("fp8_delayed", 8, None, None, "fp32 per tensor from an amax history (delayed scaling)", "fp8",
                 ("e4m3", "e5m2"), per_tensor=True, amax_history=True),
    SchemeFormat("fp8_rowwise", 8, (1, ROW), (1, ROW), "fp32 power of 2 per row of the reduction dim", "fp8",
                 ("e4m3",)),
    SchemeFormat("fp8_block", 8, (1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK), "fp32 power of 2 per block", "fp8_block",
                 ("e4m3",), block_gemm=True),
    SchemeFormat("mxfp8", 8, (1, MX_BLOCK), (1, MX_BLOCK), "E8M0 per block", "mx8", ("e4m3",)),
    SchemeFormat("mxfp4", 4, (1, MX_BLOCK), (1, MX_BLOCK), "E8M0 per block", "fp4", ("e2m1",),
                 stochastic_rounding=True),
    SchemeFormat("nvfp4", 4, (1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK), "E4M3 per block x fp32 per tensor", "fp4",
                 ("e2m1",), global_scale=True, weight_tiles_optional=True, wgrad_hadamard=True,
                 stochastic_rounding=True),
)}

# --fp8-recipe -> the scheme of the fp8 precision's operands (TE's recipes; Megatron-LM's values).
# rowwise is ours (torchao's float8 rowwise recipe; Transformer Engine has none).
FP8_RECIPE_SCHEMES = {"tensorwise": "fp8_tensorwise", "delayed": "fp8_delayed", "rowwise": "fp8_rowwise",
                      "blockwise": "fp8_block", "mxfp8": "mxfp8"}
# Between "fp8" and its recipe in a precision's name ("/" separates forward from backward).
RECIPE_SEPARATOR = ":"
# The colours of the fp8:RECIPE precisions in plan images (Tol's muted teal, green, indigo, purple; his light cyan).
_FP8_RECIPE_COLOURS = {"tensorwise": (68, 170, 153), "delayed": (153, 221, 255), "rowwise": (17, 119, 51),
                       "blockwise": (51, 34, 136), "mxfp8": (170, 68, 153)}


def fp8_recipe_precision(recipe: str) -> str:
    """The name of the precision that runs FP8 under ``recipe`` whatever the run's --fp8-recipe:
    ``"fp8:rowwise"``."""
    if recipe not in FP8_RECIPE_SCHEMES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; valid: {', '.join(FP8_RECIPE_SCHEMES)}")
    return f"fp8{RECIPE_SEPARATOR}{recipe}"


def _fp8_recipe_format(recipe: str) -> PrecisionFormat:
    scheme = SCHEMES[FP8_RECIPE_SCHEMES[recipe]]
    elements = "E4M3 forward / E5M2 gradients per --fp8-format" if scheme.per_tensor else "E4M3"
    return PrecisionFormat(fp8_recipe_precision(recipe), "fp8", 8,
                           f"FP8 recipe {recipe} whatever --fp8-recipe: {elements}, scale {scheme.scale}",
                           _FP8_RECIPE_COLOURS[recipe], scheme.name, recipe)


PRECISIONS: dict[str, PrecisionFormat] = {p.name: p for p in (
    PrecisionFormat("bf16", "bf16", 16, "bf16, unscaled (megatron-core's own GEMM)", (68, 119, 170), "bf16"),
    PrecisionFormat("fp8", "fp8", 8, "E4M3 forward / E5M2 gradients, scaled per --fp8-recipe", (102, 204, 238),
                    None),
    *map(_fp8_recipe_format, FP8_RECIPE_SCHEMES),
    PrecisionFormat("nvfp4", "fp4", 4, "E2M1, E4M3 scale per 16 elements (16x16 weight tiles) + fp32 per tensor",
                    (238, 102, 119), "nvfp4"),
    PrecisionFormat("mxfp4", "fp4", 4, "E2M1, E8M0 scale per 32 elements", (204, 187, 68), "mxfp4"),
)}
PRECISION_NAMES = tuple(PRECISIONS)
FP4_NAMES = tuple(n for n, p in PRECISIONS.items() if p.family == "fp4")
# The fp8:RECIPE precisions, by recipe.
FP8_RECIPE_PRECISIONS = {p.fp8_recipe: n for n, p in PRECISIONS.items() if p.fp8_recipe is not None}
SPEED_KEYS = tuple(dict.fromkeys(s.speed_key for s in SCHEMES.values()))
SCHEME_NAMES = tuple(SCHEMES)


# fake_quantize names per-tensor FP8 by its element ("fp8_e4m3"), as no recipe is there to pick
# one: name -> (scheme, element). Every other scheme is its own name there, but delayed scaling,
# as a lone tensor has no amax history.
ELEMENT_NAMED = {f"fp8_{e}": ("fp8_tensorwise", e) for e in SCHEMES["fp8_tensorwise"].elements}
NAMED_SCHEMES = tuple(n for s in SCHEMES.values() if not s.amax_history
                      for n in ([f"fp8_{e}" for e in s.elements] if s.per_tensor else [s.name]))


def precision_format(name: str) -> PrecisionFormat:
    """The registered precision ``name``; ValueError saying what is wrong and listing the valid ones."""
    if name not in PRECISIONS:
        base, sep, recipe = name.partition(RECIPE_SEPARATOR)
        if sep and base == "fp8":
            raise ValueError(f"unknown FP8 recipe {recipe!r} in precision {name!r}; valid: "
                             f"{', '.join(FP8_RECIPE_PRECISIONS.values())} (Megatron-LM's --fp8-recipe values, and "
                             "rowwise)")
        recipe = name.removeprefix("fp8_").removeprefix("fp8-")
        hint = (f" (an FP8 recipe per module is written {fp8_recipe_precision(recipe)})"
                if recipe != name and recipe in FP8_RECIPE_SCHEMES else "")
        raise ValueError(f"unknown precision {name!r}{hint}; valid: {', '.join(PRECISION_NAMES)} "
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


def precision_scheme(name: str, fp8_recipe: str) -> SchemeFormat:
    """The scheme of precision ``name``'s operands under ``--fp8-recipe`` ``fp8_recipe`` (which only
    plain ``fp8`` follows; ``fp8:RECIPE`` keeps its own)."""
    scheme = precision_format(name).scheme or FP8_RECIPE_SCHEMES[fp8_recipe]
    return SCHEMES[scheme]


def precision_fp8_recipe(name: str, fp8_recipe: str) -> str | None:
    """The FP8 recipe precision ``name`` runs under ``--fp8-recipe`` ``fp8_recipe``: its own for
    ``fp8:RECIPE``, ``fp8_recipe`` for plain ``fp8``; None for the other families."""
    p = precision_format(name)
    if p.family != "fp8":
        return None
    return p.fp8_recipe or fp8_recipe


def resolve_named(name: str) -> tuple[SchemeFormat, str | None]:
    """A scheme named as ``fake_quantize`` names it: (the scheme, the element name for per-tensor
    FP8, else None); ValueError listing the valid names."""
    if name in ELEMENT_NAMED:
        scheme, element = ELEMENT_NAMED[name]
        return SCHEMES[scheme], element
    if name in SCHEMES and not SCHEMES[name].per_tensor:
        return SCHEMES[name], None
    raise ValueError(f"unknown format {name!r}; valid formats: {', '.join(NAMED_SCHEMES)}")

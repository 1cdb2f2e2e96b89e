"""OCP Microscaling (MX) quantizers: 32-element 1-D blocks with a shared E8M0 scale.

MXFP8 = E4M3 elements, MXFP4 = E2M1 elements. Blocks run along the last
dimension (partial blocks zero-padded, see blocks.py). With X = 2^(code - 127)
the block's decode scale:

    elements    = round(x / X)      # x * (1/X), exact: X is a power of two
    dequantized = elements * X

Two rules for the shared exponent, both bit-exact on fp32 amax bits (no log2):

* ``"ceil"`` (Transformer Engine's MXFP8): code = the smallest power of two
  >= ``amax * fl(1/elem_max)`` (TE's ``float_to_e8m0(amax * max_norm_rcp)``),
  so no element saturates; the scaled amax lies in (max/2, max].
* ``"ocp"`` (OCP MX v1.0, section 6.3): X = 2^(floor(log2 amax) - emax_elem),
  elements beyond the element max are clamped. The scaled amax lies in
  [2^emax, 2^(emax+1)): for E2M1 [4, 8), so amaxes in (6, 8)·X saturate to 6.

Codes are clamped to E8M0's range [0, 254] (2^-127 .. 2^127); an all-zero
block gets code 0; a block whose amax is NaN/Inf gets code 255 (NaN), so it
dequantizes to all-NaN, as the OCP spec prescribes for a NaN scale.

Defaults: MXFP8 uses "ceil" (matches TE bit for bit); MXFP4 uses "ocp"
(TE has no MXFP4 recipe; see docs/numerics.md for the trade-off).
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_snip.numerics.blocks import BlockScaled, block_amax, blocked_result, to_blocks
from megatron_snip.numerics.formats import E2M1, E4M3, FloatFormat, decode_e8m0, round_e2m1_stochastic, round_to_format
from megatron_snip.numerics.registry import MX_BLOCK

ScaleRule = Literal["ceil", "ocp"]

_MANT_MASK = (1 << 23) - 1
_MANT_OF_2_POW_MINUS_127 = 1 << 22  # 2^-127 is the fp32 subnormal with only the top mantissa bit


def e8m0_code_ceil(amax: torch.Tensor, elem: FloatFormat) -> torch.Tensor:
    """TE rule: E8M0 code of the power of two >= ``amax * fl(1/elem.max)`` (int32, same shape).

    Reads the fp32 bits of the quotient: the biased exponent, plus one if any
    mantissa bit is set (not beyond code 254; a subnormal quotient <= 2^-127 keeps code 0).
    """
    ratio = amax * (1.0 / elem.max)  # the Python scalar enters fp32 arithmetic as fl(1/max), as in TE
    bits = ratio.view(torch.int32)
    exp_field = bits >> 23
    mant = bits & _MANT_MASK
    round_up = (mant > 0) & (exp_field < 254) & ((exp_field > 0) | (mant > _MANT_OF_2_POW_MINUS_127))
    code = exp_field + round_up.to(torch.int32)
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, 255))


def e8m0_code_ocp(amax: torch.Tensor, elem: FloatFormat) -> torch.Tensor:
    """OCP rule: E8M0 code of 2^(floor(log2 amax) - elem.emax), clamped to [0, 254] (int32)."""
    exp_field = amax.view(torch.int32) >> 23  # = floor(log2 amax) + 127 for normal amax
    code = (exp_field - elem.emax).clamp_(0, 254)
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, 255))


_SCALE_RULES = {"ceil": e8m0_code_ceil, "ocp": e8m0_code_ocp}


def quantize_mx(
    x: torch.Tensor,
    elem: FloatFormat,
    *,
    scale_rule: ScaleRule,
    block_size: int = MX_BLOCK,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> BlockScaled:
    """Generic MX quantizer: 1-D blocks of ``block_size`` along the last dim, E8M0 scales.

    Args:
        x: tensor (..., C) of any float dtype (computed in fp32).
        elem: element format (E4M3 or E2M1).
        scale_rule: "ceil" (TE) or "ocp" (spec), see the module docstring.
        stochastic: stochastic rounding of the elements (E2M1 only).
        generator: RNG for stochastic rounding, on x's device.
    Returns:
        BlockScaled whose ``scales`` are the E8M0 values as fp32 (``encode_e8m0`` gives the bytes).
    """
    if scale_rule not in _SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {tuple(_SCALE_RULES)}, got {scale_rule!r}")
    if stochastic and elem != E2M1:
        raise ValueError("stochastic rounding is implemented for E2M1 elements only")
    xb, view = to_blocks(x.float(), (1, block_size))
    scales = decode_e8m0(_SCALE_RULES[scale_rule](block_amax(xb), elem))
    scaled = xb * torch.reciprocal(scales)  # exact: reciprocal of 2^k, k in [-127, 127]
    elements = round_e2m1_stochastic(scaled, generator) if stochastic else round_to_format(scaled, elem)
    return blocked_result(elements, scales, view)


def quantize_mxfp8(x: torch.Tensor, *, scale_rule: ScaleRule = "ceil") -> BlockScaled:
    """MXFP8 (TE ``MXFP8BlockScaling``): E4M3 elements, 32-blocks, E8M0 scales, TE's ceil rule."""
    return quantize_mx(x, E4M3, scale_rule=scale_rule)


def quantize_mxfp4(
    x: torch.Tensor,
    *,
    scale_rule: ScaleRule = "ocp",
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> BlockScaled:
    """MXFP4 (OCP MX v1.0): E2M1 elements, 32-blocks, E8M0 scales, the spec's floor rule."""
    return quantize_mx(x, E2M1, scale_rule=scale_rule, stochastic=stochastic, generator=generator)

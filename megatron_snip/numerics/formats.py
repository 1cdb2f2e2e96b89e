"""Element and scale formats: rounding fp32 values onto FP8 / FP4 grids, and bit codecs.

Element formats (all "satfinite": finite values beyond the largest magnitude
saturate to +-max, as the ``cvt.*.satfinite`` conversions Transformer Engine
uses on GPU; NaN propagates):

==========  ====  ====  =======  ===========  ============  ==============
format      exp   man   max      min normal   min subnorm.  non-finite
==========  ====  ====  =======  ===========  ============  ==============
E4M3 (fn)   4     3     448      2^-6         2^-9          NaN only
E5M2        5     2     57344    2^-14        2^-16         Inf and NaN
E2M1        2     1     6        1            0.5           none
==========  ====  ====  =======  ===========  ============  ==============

E2M1 has no NaN encoding. ``round_to_format(x, E2M1)`` keeps a NaN input as NaN
in its fp32 result so a NaN is never silently turned into a number; inside the
block-scaled FP4 quantizers a NaN is carried by the block scale (E4M3 0x7F or
E8M0 0xFF) instead, which is how the real formats represent a NaN block.

Scale format E8M0 (OCP MX): an unsigned biased exponent, value 2^(code - 127)
for code 0..254 (code 0 is 2^-127, an fp32 subnormal), code 255 is NaN.

All functions are pure, elementwise and vectorised; they work on CPU and CUDA
tensors alike and never synchronise with the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_F32_EXP_BIAS = 127
_F32_MANT_BITS = 23
_F32_EXP_MASK = 0x7F800000


@dataclass(frozen=True)
class FloatFormat:
    """A small binary floating-point element format.

    Attributes:
        name: short name ("e4m3", "e5m2", "e2m1").
        exp_bits, mant_bits: field widths (the sign bit is implicit).
        emin: exponent of the smallest normal number (subnormals share its ulp).
        emax: exponent of the binade holding ``max``.
        max: largest finite magnitude.
        torch_dtype: torch's dtype with exactly these semantics, if it has one;
            used as a fast, bit-exact cast (verified against an independent
            oracle in tests/test_quantizers.py).
    """

    name: str
    exp_bits: int
    mant_bits: int
    emin: int
    emax: int
    max: float
    torch_dtype: torch.dtype | None = None


E4M3 = FloatFormat("e4m3", 4, 3, emin=-6, emax=8, max=448.0, torch_dtype=torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", 5, 2, emin=-14, emax=15, max=57344.0, torch_dtype=torch.float8_e5m2)
E2M1 = FloatFormat("e2m1", 2, 1, emin=0, emax=2, max=6.0)
# bf16 itself, for what asks any operand's element format (quantization health: a bf16 operand of
# a split precision such as fp8/bf16).
BF16 = FloatFormat("bf16", 8, 7, emin=-126, emax=127, max=3.3895313892515355e38, torch_dtype=torch.bfloat16)
ELEMENTS = {f.name: f for f in (E4M3, E5M2, E2M1, BF16)}  # the registry names elements by these names

#: The 8 non-negative E2M1 values, indexed by the 3 magnitude bits of the code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def div_rn(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``numerator / denominator``, elementwise.

    Needed because torch evaluates ``float / Tensor`` as ``float * (1 / Tensor)``
    (two roundings), which differs from TE's ``max / amax`` in the last bit.
    """
    return torch.div(torch.full_like(denominator, numerator), denominator)


def _ulp(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Spacing of ``fmt``'s grid at each non-negative fp32 ``a``: 2^(clamp(floor(log2 a), emin, emax) - mant_bits).

    ``bits & 0x7F800000`` is the fp32 power of two <= a (exact, no log2);
    clamping it to [2^emin, 2^emax] makes the subnormals share the ulp of the
    smallest binade, and sends NaN (exponent field 255) harmlessly to emax.
    """
    power = (a.view(torch.int32) & _F32_EXP_MASK).clamp_(
        (fmt.emin + _F32_EXP_BIAS) << _F32_MANT_BITS, (fmt.emax + _F32_EXP_BIAS) << _F32_MANT_BITS
    )
    return power.sub_(fmt.mant_bits << _F32_MANT_BITS).view(torch.float32)


def to_elements(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """:func:`round_to_format` stored in ``fmt``'s torch dtype (the FP8 formats): the bytes an FP8
    GEMM reads, without the round trip through fp32.

    Args:
        x: float32 tensor (already scaled), any shape and device.
        fmt: an element format with a torch dtype (E4M3, E5M2).
    Returns:
        ``fmt.torch_dtype`` tensor of ``x``'s shape.
    """
    if fmt.torch_dtype is None:
        raise ValueError(f"{fmt.name} has no torch dtype; round_to_format gives its values in fp32")
    # Clamp keeps NaN and maps +-Inf to +-max; torch's fp32 -> float8 cast is RNE but not
    # saturating, so after the clamp it is exact.
    return x.float().clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)


def round_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round an fp32 tensor (already scaled) to the nearest value of ``fmt``.

    Round-to-nearest-even; finite values beyond ``fmt.max`` and +-Inf saturate
    to +-max; NaN stays NaN (also for E2M1, see the module docstring); -0 stays -0.

    Args:
        x: float32 tensor, any shape and device.
        fmt: target element format.
    Returns:
        float32 tensor of ``x``'s shape whose values lie on ``fmt``'s grid.
    """
    if fmt.torch_dtype is not None:
        return to_elements(x, fmt).to(torch.float32)
    a = x.float().clamp(-fmt.max, fmt.max).abs_()  # clamp keeps NaN, maps +-Inf to +-max
    ulp = _ulp(a, fmt)
    # a / ulp is exact (power of two); round_ is half-to-even, and even multiples
    # of the ulp are exactly the codes with a zero mantissa LSB.
    return a.div_(ulp).round_().mul_(ulp).copysign_(x)


def round_e2m1_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastically round an fp32 tensor (already scaled) to E2M1.

    Each |x| <= 6 between neighbouring grid points lo < hi rounds up to hi with
    probability (|x| - lo) / (hi - lo), so E[result] = x: unbiased up to the
    2^-24 granularity of the uniform samples. |x| > 6 saturates to +-6 (biased,
    unavoidable); NaN stays NaN; grid values are returned unchanged.

    Args:
        x: float32 tensor, any shape and device.
        generator: torch.Generator on ``x``'s device, or None for the default RNG.
    Returns:
        float32 tensor of ``x``'s shape on the E2M1 grid.
    """
    a = x.float().clamp(-E2M1.max, E2M1.max).abs_()
    ulp = _ulp(a, E2M1)
    units = a.div_(ulp)  # exact: distance from 0 in ulps of this binade
    lower = torch.floor(units)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    round_up = u < units.sub_(lower)
    return lower.add_(round_up).mul_(ulp).copysign_(x)


# ---------------------------------------------------------------------------
# Bit codecs (uint8). Encoders expect values already on the format's grid
# (they round with round_to_format first, so any fp32 input is accepted).
# ---------------------------------------------------------------------------


def encode_e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 (fn) byte: sign<<7 | exponent(4, bias 7)<<3 | mantissa(3). NaN -> 0x7F/0xFF."""
    return round_to_format(values.float(), E4M3).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) byte -> fp32 value."""
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def encode_e5m2(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> E5M2 byte: sign<<7 | exponent(5, bias 15)<<2 | mantissa(2)."""
    return round_to_format(values.float(), E5M2).to(torch.float8_e5m2).view(torch.uint8)


def decode_e5m2(codes: torch.Tensor) -> torch.Tensor:
    """E5M2 byte -> fp32 value."""
    return codes.to(torch.uint8).view(torch.float8_e5m2).to(torch.float32)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 nibble in a uint8 (0..15): sign<<3 | exponent(2, bias 1)<<1 | mantissa(1).

    Raises ValueError on NaN: E2M1 has no NaN code (a NaN block is encoded by its scale).
    """
    if torch.isnan(values).any():
        raise ValueError("E2M1 has no NaN encoding; a NaN block is carried by its scale")
    v = round_to_format(values.float(), E2M1)
    m = v.abs()
    # Grid index: 2m on [0, 2), m + 2 on [2, 4), m / 2 + 4 on [4, 6].
    index = torch.where(m < 2, m * 2, torch.where(m < 4, m + 2, m / 2 + 4)).to(torch.uint8)
    return index | (torch.signbit(v).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibble (uint8 0..15) -> fp32 value (code 8 is -0)."""
    codes = codes.to(torch.int64)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[codes & 7]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def encode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scale 2^k (k in [-127, 127]) -> E8M0 byte k + 127; NaN -> 0xFF."""
    bits = scales.float().view(torch.int32)
    exp_field = (bits >> _F32_MANT_BITS) & 0xFF
    # 2^-127 is the fp32 subnormal with only the top mantissa bit set: E8M0 code 0.
    code = torch.where(exp_field == 0, torch.zeros_like(exp_field), exp_field)
    return torch.where(torch.isnan(scales), torch.full_like(code, 255), code).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> fp32 scale: 2^(code - 127) exactly (code 0 -> 2^-127), 255 -> NaN."""
    codes = codes.to(torch.int32)
    normal = (codes.clamp(1, 254) << _F32_MANT_BITS).view(torch.float32)  # 2^(code - 127)
    tiny = torch.full_like(normal, 2.0**-127)
    value = torch.where(codes == 0, tiny, normal)
    return torch.where(codes == 255, torch.full_like(value, float("nan")), value)

"""``fake_quantize``: quantize-dequantize a tensor in a named format, the emulation entry point.

Formats (``FORMATS``) and what they mean here:

===========  ========  ======================================================  =====================
name         bits      scaling                                                 quantizer
===========  ========  ======================================================  =====================
bf16         16        none (round to bf16 and back)                           ``Tensor.to``
fp8_e4m3     8         per tensor, current scaling from this tensor's amax     quantize_fp8_tensorwise
fp8_e5m2     8         per tensor, current scaling from this tensor's amax     quantize_fp8_tensorwise
fp8_block    8 (E4M3)  1x128 blocks (128x128 for weights), pow-2 fp32 scales   quantize_fp8_block
mxfp8        8 (E4M3)  1x32 blocks, E8M0 scales (TE rule)                       quantize_mxfp8
mxfp4        4 (E2M1)  1x32 blocks, E8M0 scales (OCP rule)                      quantize_mxfp4
nvfp4        4 (E2M1)  1x16 blocks (16x16 for weights), E4M3 + fp32 scales      quantize_nvfp4
===========  ========  ======================================================  =====================

Blocks run along the last dimension; ``role="weight"`` selects 2-D tiles
where the format has them (fp8_block, nvfp4). ``stochastic=True`` applies to
the E2M1 elements of the 4-bit formats (``is_fp4``); the 8-bit and bf16
formats always round to nearest even, as in TE where stochastic rounding
exists only for NVFP4. No Hadamard transform is applied here.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_BLOCK, quantize_fp8_block, quantize_fp8_tensorwise
from .formats import E4M3, E5M2
from .mx import quantize_mxfp4, quantize_mxfp8
from .nvfp4 import NVFP4_BLOCK, quantize_nvfp4

FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
ROLES = ("activation", "weight", "grad")

_ELEMENT_BITS = {
    "bf16": 16,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "fp8_block": 8,
    "mxfp8": 8,
    "mxfp4": 4,
    "nvfp4": 4,
}


def _check_format(fmt: str) -> str:
    if fmt not in _ELEMENT_BITS:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    return fmt


def element_bits(fmt: str) -> int:
    """Bits per element of ``fmt`` (16, 8 or 4), excluding scale overhead."""
    return _ELEMENT_BITS[_check_format(fmt)]


def is_fp4(fmt: str) -> bool:
    """True for the 4-bit (E2M1) formats: mxfp4, nvfp4."""
    return element_bits(fmt) == 4


def is_fp8(fmt: str) -> bool:
    """True for the 8-bit formats: fp8_e4m3, fp8_e5m2, fp8_block, mxfp8."""
    return element_bits(fmt) == 8


def fake_quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    role: str = "activation",
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Quantize then dequantize ``x`` in format ``fmt``.

    Args:
        x: floating tensor of any shape (blocks along the last dim), CPU or CUDA.
        fmt: one of ``FORMATS``.
        role: one of ``ROLES``; "weight" uses 2-D blocks for fp8_block (128x128) and nvfp4 (16x16).
        stochastic: stochastic rounding of E2M1 elements (mxfp4, nvfp4); no effect otherwise.
        generator: RNG for stochastic rounding, on x's device (None: the default RNG).
    Returns:
        Tensor of ``x``'s shape and dtype: computed in fp32, the dequantized value is
        rounded to ``x.dtype`` on return (as a dequantize-to-bf16 would).
    Raises:
        ValueError: unknown ``fmt`` or ``role``.
    """
    _check_format(fmt)
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if x.numel() == 0:
        return x.clone()
    weight = role == "weight"
    sr = dict(stochastic=stochastic, generator=generator)
    if fmt == "bf16":
        out = x.float().to(torch.bfloat16)
    elif fmt == "fp8_e4m3":
        out = quantize_fp8_tensorwise(x, E4M3).dequantized
    elif fmt == "fp8_e5m2":
        out = quantize_fp8_tensorwise(x, E5M2).dequantized
    elif fmt == "fp8_block":
        out = quantize_fp8_block(x, block=(FP8_BLOCK, FP8_BLOCK) if weight else (1, FP8_BLOCK)).dequantized
    elif fmt == "mxfp8":
        out = quantize_mxfp8(x).dequantized
    elif fmt == "mxfp4":
        out = quantize_mxfp4(x, **sr).dequantized
    else:  # nvfp4
        block = (NVFP4_BLOCK, NVFP4_BLOCK) if weight else (1, NVFP4_BLOCK)
        out = quantize_nvfp4(x, block=block, **sr).dequantized
    return out.to(x.dtype)

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
the E2M1 elements of the 4-bit formats; the 8-bit and bf16
formats always round to nearest even, as in TE where stochastic rounding
exists only for NVFP4. No Hadamard transform is applied here.
"""

from __future__ import annotations

import torch

from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import E4M3, E5M2
from megatron_snip.numerics.fp8 import fp8_scale_from_amax
from megatron_snip.numerics.quantize import quantize_dequantize
from megatron_snip.numerics.recipes import OperandQuantizer
from megatron_snip.numerics.registry import SCHEMES

# fake_quantize's names: the registry's schemes, with the per-tensor FP8 one named by its element.
_SCHEME_OF = {"bf16": "bf16", "fp8_e4m3": "fp8_tensorwise", "fp8_e5m2": "fp8_tensorwise", "fp8_block": "fp8_block",
              "mxfp8": "mxfp8", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
_ELEMENT = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
FORMATS = tuple(_SCHEME_OF)
ROLES = ("activation", "weight", "grad")


def _check_format(fmt: str) -> str:
    if fmt not in _SCHEME_OF:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    return fmt


def element_bits(fmt: str) -> int:
    """Bits per element of ``fmt`` (16, 8 or 4), excluding scale overhead."""
    return SCHEMES[_SCHEME_OF[_check_format(fmt)]].bits


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
    spec = SCHEMES[_SCHEME_OF[fmt]]
    q = OperandQuantizer(spec.name, element=_ELEMENT.get(fmt),
                         block=spec.weight_block if role == "weight" else spec.block,
                         stochastic=stochastic and spec.stochastic_rounding)
    scale = None
    if fmt in _ELEMENT:
        scale = fp8_scale_from_amax(tensor_amax(x.float()), q.element)
    return quantize_dequantize(x, q, scale=scale, generator=generator).to(x.dtype)

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
from megatron_snip.numerics.formats import ELEMENTS
from megatron_snip.numerics.fp8 import fp8_scale_from_amax
from megatron_snip.numerics.quantize import quantize_dequantize
from megatron_snip.numerics.recipes import OperandQuantizer
from megatron_snip.numerics.registry import NAMED_SCHEMES, resolve_named

FORMATS = NAMED_SCHEMES  # the registry's schemes, per-tensor FP8 named by its element
ROLES = ("activation", "weight", "grad")


def element_bits(fmt: str) -> int:
    """Bits per element of ``fmt`` (16, 8 or 4), excluding scale overhead."""
    return resolve_named(fmt)[0].bits


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
    spec, element = resolve_named(fmt)
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if x.numel() == 0:
        return x.clone()
    q = OperandQuantizer(spec.name, element=ELEMENTS[element] if element else None,
                         block=spec.weight_block if role == "weight" else spec.block,
                         stochastic=stochastic and spec.stochastic_rounding)
    scale = fp8_scale_from_amax(tensor_amax(x.float()), q.element) if spec.per_tensor else None
    return quantize_dequantize(x, q, scale=scale, generator=generator).to(x.dtype)

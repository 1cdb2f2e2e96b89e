"""NVFP4 quantizer (TE ``NVFP4BlockScaling``): E2M1 elements, E4M3 block scales, fp32 tensor scale.

Arithmetic, in the order TE's CUDA kernels and its ``NVFP4QuantizerRef``
perform it (all fp32, ``fl`` = round to fp32):

    S_enc   = min(fl(448 * 6 / global_amax), fp32 max)    # 1 if global_amax == 0
    S_dec   = fl(1 / S_enc)
    s_b     = E4M3_rne_satfinite(block_amax * fl(S_enc * fl(1/6)))   # block decode scale
    enc_b   = min(fl(1 / fl(s_b * S_dec)), fp32 max)      # block encode scale
    element = E2M1(clamp(x * enc_b, -6, 6))                # RNE or stochastic
    dequant = fl(fl(element * s_b) / S_enc)               # element * s_b is exact

TE never materialises ``dequant`` (its GEMM multiplies e2m1 * s_b products
and applies alpha = amax_a * amax_b / (6*448)^2; its standalone dequantize
kernel uses s_b * amax / 2688). Those differ from the formula above only in
the last fp32 ulp; the bits that must match TE are the element codes and
the E4M3 scale bytes, which do.

Blocks: 1x16 along the last dim (activations, gradients) or 16x16 tiles
(weights, so the rowwise and columnwise copies of W are identical).
A block with s_b == 0 (all zero, or so small relative to the tensor that its
scale underflows E4M3) dequantizes to 0, as in TE.

Non-finite data: a NaN/Inf global amax makes S_enc NaN (TE would silently use
1), and a block with a non-finite amax gets a NaN scale, so non-finite inputs
always come out NaN (never saturated to a finite value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_snip.numerics.blocks import block_amax, from_blocks, tensor_amax, to_blocks, to_grid
from megatron_snip.numerics.formats import E2M1, E4M3, div_rn, round_e2m1_stochastic, round_to_format
from megatron_snip.numerics.registry import NVFP4_BLOCK

_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class NVFP4Quantized:
    """Result of :func:`quantize_nvfp4`.

    Attributes:
        dequantized: float32, shape of the input.
        elements: float32 E2M1 values (scaled domain), shape of the input.
        block_scales: float32 E4M3 block decode scales s_b, shape ``BlockView.grid_shape``
            (``encode_e4m3`` gives the bytes).
        global_scale: 0-d float32 S_enc (global encode scale); the tensor-level decode
            scale is 1 / S_enc.
        global_amax: 0-d float32 amax S_enc was derived from.
        block: (block_rows, block_cols) used.
    """

    dequantized: torch.Tensor
    elements: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    global_amax: torch.Tensor
    block: tuple[int, int]


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax (fp32), capped at fp32 max; 1 if amax == 0; NaN if amax is not finite."""
    scale = torch.clamp(div_rn(E4M3.max * E2M1.max, global_amax), max=_FP32_MAX)
    scale = torch.where(global_amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(global_amax), scale, torch.full_like(scale, float("nan")))


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, NVFP4_BLOCK),
    amax: torch.Tensor | float | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Quantized:
    """Quantize to NVFP4.

    Args:
        x: tensor (..., R, C) of any float dtype (computed in fp32).
        block: (1, 16) for activations/gradients, (16, 16) for weights.
        amax: global amax override (e.g. max|x| all-reduced across tensor-parallel
            shards, so every shard uses the same S_enc); default max|x|.
        stochastic: stochastic rounding of the E2M1 elements (scales stay RNE, as in TE).
        generator: RNG for stochastic rounding, on x's device.
    """
    x = x.float()
    global_amax = tensor_amax(x, amax)
    s_enc = nvfp4_global_scale(global_amax)
    s_dec = torch.reciprocal(s_enc)
    xb, view = to_blocks(x, block)
    b_amax = block_amax(xb)
    s_b = round_to_format(b_amax * (s_enc * (1.0 / E2M1.max)), E4M3)  # fl(S_enc * fl(1/6)) first, as TE
    s_b = torch.where(torch.isfinite(b_amax), s_b, torch.full_like(s_b, float("nan")))
    enc_b = torch.clamp(torch.reciprocal(s_b * s_dec), max=_FP32_MAX)
    scaled = xb * enc_b
    elements = round_e2m1_stochastic(scaled, generator) if stochastic else round_to_format(scaled, E2M1)
    return NVFP4Quantized(
        dequantized=from_blocks(elements * s_b / s_enc, view),
        elements=from_blocks(elements, view),
        block_scales=to_grid(s_b, view),
        global_scale=s_enc,
        global_amax=global_amax,
        block=view.block,
    )

"""FP8 quantizers with fp32 scales: per-tensor current scaling, delayed scaling, block scaling.

Scale convention (Transformer Engine): the *encode* scale is
``scale = fmt.max / amax`` (so the amax maps onto the format's largest value),
the *decode* scale is ``scale_inv = 1 / scale`` (an fp32 reciprocal), and

    elements    = round_to_format(x * scale)     # RNE, satfinite
    dequantized = elements * scale_inv           # as TE dequantizes / feeds its GEMMs

Edge cases, as in TE's ``compute_scale_from_amax``: amax == 0 gives scale 1;
an amax so small that fmt.max / amax overflows gives scale = fp32 max.
Where TE has no single answer we choose (see docs/numerics.md): a scaling
group whose amax is NaN or +-Inf gets a NaN scale, so the whole group
dequantizes to NaN instead of silently saturating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_snip.numerics.blocks import BlockScaled, block_amax, blocked_result, tensor_amax, to_blocks
from megatron_snip.numerics.formats import E4M3, FloatFormat, div_rn, round_to_format
from megatron_snip.numerics.registry import FP8_BLOCK

_FP32_MAX = torch.finfo(torch.float32).max
_SIGN_AND_EXPONENT = -(1 << 23)  # int32 0xFF800000: keeps sign and exponent bits


def fp8_scale_from_amax(
    amax: torch.Tensor, fmt: FloatFormat, *, pow2: bool = False, margin: int = 0
) -> torch.Tensor:
    """Encode scale(s) ``fmt.max / amax / 2**margin`` from fp32 amax(es), elementwise.

    Args:
        amax: float32 tensor of amaxes, any shape (one per scaling group).
        fmt: element format (E4M3 or E5M2).
        pow2: round the scale *down* to a power of two (TE ``force_pow_2_scales``),
            so ``amax * scale <= fmt.max`` still holds and scaling is exact.
        margin: extra headroom in binades (TE ``margin``).
    Returns:
        float32 scales, shape of ``amax``: 1 where amax == 0, fp32 max where the
        quotient overflows, NaN where amax is not finite.
    """
    scale = div_rn(fmt.max, amax)
    if margin:
        scale = scale / 2.0**margin
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    if pow2:
        scale = (scale.view(torch.int32) & _SIGN_AND_EXPONENT).view(torch.float32)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


@dataclass(frozen=True)
class TensorScaled:
    """Result of a per-tensor FP8 quantizer.

    Attributes:
        dequantized: float32, shape of the input: ``elements * scale_inv``.
        elements: float32 values on the FP8 grid (``round(x * scale)``), shape of the input.
        scale: 0-d float32 encode scale (TE ``scale``).
        scale_inv: 0-d float32 decode scale ``1 / scale`` (TE ``scale_inv``).
    """

    dequantized: torch.Tensor
    elements: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor


def _apply_tensor_scale(x: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat) -> TensorScaled:
    scale_inv = torch.reciprocal(scale)
    elements = round_to_format(x * scale, fmt)
    return TensorScaled(elements * scale_inv, elements, scale, scale_inv)


def quantize_fp8_tensorwise(
    x: torch.Tensor,
    fmt: FloatFormat = E4M3,
    *,
    amax: torch.Tensor | float | None = None,
    pow2_scale: bool = False,
    margin: int = 0,
) -> TensorScaled:
    """FP8 per-tensor current scaling (TE ``Float8CurrentScaling``).

    Args:
        x: tensor of any shape/float dtype (computed in fp32).
        fmt: E4M3 or E5M2.
        amax: override for max|x| (e.g. all-reduced over tensor-parallel ranks);
            NaN/Inf detection then follows this amax, not the local data.
        pow2_scale: round the scale down to a power of two.
        margin: headroom in binades.
    """
    x = x.float()
    scale = fp8_scale_from_amax(tensor_amax(x, amax), fmt, pow2=pow2_scale, margin=margin)
    return _apply_tensor_scale(x, scale, fmt)


class FP8DelayedScaling:
    """Stateful per-tensor FP8 quantizer with an amax history (TE ``DelayedScaling``).

    Step t quantizes with the scale computed *before* step t (from the amaxes
    of steps < t; 1 at the first step), then records step t's amax and updates
    the scale for step t+1. The history holds the last ``history_len`` amaxes,
    most recent first. Scale update (TE ``_default_sf_compute``):
    ``fmt.max / amax / 2**margin`` with amax = max(history) ("max") or the
    newest amax ("most_recent"); the previous scale is kept when that amax is 0
    or not finite; an overflowing scale becomes fp32 max.

    A tensor whose own amax is NaN/Inf dequantizes to all-NaN (the group rule
    of this package); as in TE, such an amax then freezes the scale for as long
    as it stays in the history window.

    State lives in ``scale`` (0-d) and ``amax_history`` (history_len,) fp32
    tensors, moved to the device of the tensors being quantized.
    """

    def __init__(
        self,
        fmt: FloatFormat = E4M3,
        *,
        history_len: int = 1024,
        algo: Literal["max", "most_recent"] = "max",
        margin: int = 0,
    ):
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.fmt = fmt
        self.algo = algo
        self.margin = margin
        self.scale = torch.ones((), dtype=torch.float32)
        self.amax_history = torch.zeros(history_len, dtype=torch.float32)

    def quantize(self, x: torch.Tensor) -> TensorScaled:
        """Quantize ``x`` with the current scale, then record its amax and update the scale."""
        x = x.float()
        amax = tensor_amax(x)
        result = _apply_tensor_scale(x, self.scale_for(amax), self.fmt)
        self.record(amax)
        return result

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The encode scale for this step's tensor of amax ``amax`` (0-d fp32, on its device):
        the current scale, or NaN when ``amax`` is not finite (the whole tensor becomes NaN)."""
        self.scale = self.scale.to(amax.device)
        self.amax_history = self.amax_history.to(amax.device)
        return torch.where(torch.isfinite(amax), self.scale, torch.full_like(self.scale, float("nan")))

    def record(self, amax: torch.Tensor) -> None:
        """Push this step's amax (0-d fp32; the all-shard amax under TP) and update the scale."""
        self.amax_history = torch.cat([amax.reshape(1), self.amax_history[:-1]])
        ref = self.amax_history.amax() if self.algo == "max" else self.amax_history[0]
        new = div_rn(self.fmt.max, ref) / 2.0**self.margin
        keep = (ref == 0) | ~torch.isfinite(ref)
        new = torch.where(keep, self.scale, new)
        self.scale = torch.where(torch.isinf(new), torch.full_like(new, _FP32_MAX), new)


def quantize_fp8_block(
    x: torch.Tensor,
    fmt: FloatFormat = E4M3,
    *,
    block: tuple[int, int] = (1, FP8_BLOCK),
    pow2_scale: bool = True,
    amax: torch.Tensor | None = None,
) -> BlockScaled:
    """FP8 block scaling (TE ``Float8BlockScaling``, DeepSeek-V3): one fp32 scale per block.

    Args:
        x: tensor (..., R, C) of any float dtype (computed in fp32).
        fmt: element format (TE uses E4M3 for all roles).
        block: (1, 128) along the last dim for activations/grads, (128, 128) tiles
            for weights, (1, ``ROW``) one block per row (FP8 rowwise). Partial blocks are
            zero-padded (see blocks.py).
        pow2_scale: power-of-two scales (TE's default); False keeps exact fp32 scales.
        amax: override of the block amaxes (any shape with one per block, in block order), e.g.
            row amaxes all-reduced over the tensor-parallel shards of each row.
    """
    xb, view = to_blocks(x.float(), block)
    amax = block_amax(xb) if amax is None else amax.float().reshape(xb.shape[0], xb.shape[1], 1, xb.shape[3], 1)
    scale = fp8_scale_from_amax(amax, fmt, pow2=pow2_scale)
    return blocked_result(round_to_format(xb * scale, fmt), torch.reciprocal(scale), view)

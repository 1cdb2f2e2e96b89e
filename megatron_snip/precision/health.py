"""Quantization health: cheap per-operand scalars of what a quantizer did to a tensor.

For every quantized GEMM operand (``fprop.x``, ``fprop.w``, ``dgrad.dy``, ``dgrad.w``,
``wgrad.dy``, ``wgrad.x``) a module accumulates, over the micro-batches of a step and on
the device (no host sync):

- ``nonfinite``: elements of the operand that are NaN or Inf;
- ``amax``: the largest magnitude;
- ``saturated``: elements clipped at the top of the format: their magnitude exceeds the
  largest quantized magnitude of their scaling block (the tensor, for per-tensor scales)
  by more than half a step of the element format (a full step under stochastic rounding);
  clipping by less cannot be told apart from rounding in the dequantized values, so this is
  a lower bound;
- ``underflow``: non-zero elements that quantize to zero (flushed);
- ``err2`` / ``ref2``: sums of squared quantization error and of squared values, whose ratio
  is the relative quantization MSE.

All but ``nonfinite`` count only elements whose value and quantized value are finite.

That full measurement costs about as much as the quantization itself, so the trainer asks for
it only on the steps it logs; every other step records the cheap :func:`nonfinite_row`.

They are computed only when a module's :class:`HealthStats` exists (``--quant-health``).
Rows from tensor-parallel shards of one operand combine with :func:`combine` (sums, and
MAX for the amax), so the reduced numbers describe the whole tensor.
"""

from __future__ import annotations

import math

import torch

from .blocks import tensor_amax, to_blocks
from .formats import E2M1, E4M3, FloatFormat
from .recipes import OperandQuantizer
from .registry import scheme_format

# The operands of a linear module's three GEMMs, in the order of tables and logs.
OPERANDS = ("fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.dy", "wgrad.x")
# One row per operand; amax combines by MAX, the rest by SUM.
FIELDS = ("numel", "nonfinite", "amax", "saturated", "underflow", "err2", "ref2")
AMAX = FIELDS.index("amax")


def element_format(q: OperandQuantizer) -> FloatFormat:
    """The element format of a (non-bf16) quantizer: FP8 per-tensor schemes carry it, block FP8 is
    E4M3, 4-bit schemes are E2M1."""
    if q.element is not None:
        return q.element
    return E2M1 if scheme_format(q.scheme).bits == 4 else E4M3


def clip_tolerance(fmt: FloatFormat, stochastic: bool) -> float:
    """How far above its block's largest quantized magnitude an unclipped element can lie, relative
    to it: half the largest relative step between normal values (a full step when rounding is stochastic)."""
    return 2.0 ** -fmt.mant_bits * (1.0 if stochastic else 0.5)


def operand_health(x: torch.Tensor, q: torch.Tensor, quantizer: OperandQuantizer) -> torch.Tensor:
    """The :data:`FIELDS` row (fp32, on x's device) of quantizing ``x`` (blocks along the last dim) to ``q``."""
    x = x.float()
    finite = torch.isfinite(x)
    valid = finite & torch.isfinite(q)  # a NaN in a tensor or block makes its quantized values NaN
    zero = torch.zeros((), device=x.device)
    ax = torch.where(valid, x.abs(), zero)
    aq = torch.where(valid, q.abs(), zero)
    tolerance = 1.0 + clip_tolerance(element_format(quantizer), quantizer.stochastic)
    if quantizer.block is None:
        clipped = (ax > aq.amax() * tolerance).sum()
    else:  # padding is zero on both sides and never counts
        bx, _ = to_blocks(ax, quantizer.block)
        bq, _ = to_blocks(aq, quantizer.block)
        clipped = (bx > bq.amax(dim=(2, 4), keepdim=True) * tolerance).sum()
    err = torch.where(valid, q - x, zero).reshape(-1)
    return torch.stack([
        torch.tensor(float(x.numel()), device=x.device),
        (~finite).sum().float(),
        ax.amax() if x.numel() else zero,
        clipped.float(),
        ((aq == 0) & (ax != 0)).sum().float(),
        torch.dot(err, err),
        torch.dot(ax.reshape(-1), ax.reshape(-1)),
    ])


def nonfinite_row(x: torch.Tensor) -> torch.Tensor:
    """The cheap row of a step that is not measured in full: one max-abs pass (NaN propagates through it);
    ``nonfinite`` is 1 if any element is NaN/Inf (a flag, not a count), ``numel`` 0 marks the row as partial."""
    amax = tensor_amax(x).float() if x.numel() else torch.zeros((), device=x.device)
    bad = ~torch.isfinite(amax)
    zero = torch.zeros((), device=x.device)
    return torch.stack([zero, bad.float(), torch.where(bad, zero, amax), zero, zero, zero, zero])


def combine(rows: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Two stacked rows (..., len(FIELDS)) of the same operands combined: sums, and MAX for the amax."""
    out = rows + other
    out[..., AMAX] = torch.maximum(rows[..., AMAX], other[..., AMAX])
    return out


class HealthStats:
    """Per-operand rows of one module, accumulated on the device since the last :meth:`reset`.

    ``full``: measure everything (:func:`operand_health`); otherwise only whether each operand
    was finite (:func:`nonfinite_row`, one cheap pass), which is enough to name where a NaN entered.
    """

    def __init__(self):
        self.rows: dict[str, torch.Tensor] = {}
        self.full = True

    def record(self, key: str, x: torch.Tensor, q: torch.Tensor, quantizer: OperandQuantizer) -> None:
        row = operand_health(x.detach(), q.detach(), quantizer) if self.full else nonfinite_row(x.detach())
        self.rows[key] = combine(self.rows[key], row) if key in self.rows else row

    def reset(self, full: bool = True) -> None:
        self.rows = {}
        self.full = full


def summarize(row: list[float]) -> dict[str, float]:
    """A combined row as the logged quantities: counts, amax and fractions of the elements."""
    v = dict(zip(FIELDS, row))
    n = max(v["numel"], 1.0)
    return {"nonfinite": v["nonfinite"], "amax": v["amax"], "saturated": v["saturated"] / n,
            "underflow": v["underflow"] / n, "relative mse": v["err2"] / v["ref2"] if v["ref2"] > 0 else math.nan}

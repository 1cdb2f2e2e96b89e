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
it only on the steps it logs; every other step keeps only a max-abs per operand (:class:`HealthStats`).

They are computed only when a module's :class:`HealthStats` exists (``--quant-health``).
Rows from tensor-parallel shards of one operand combine with :func:`combine` (sums, and
MAX for the amax), so the reduced numbers describe the whole tensor.
"""

from __future__ import annotations

import math

import torch

from .blocks import to_blocks
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


def nonfinite_row(amax: torch.Tensor) -> torch.Tensor:
    """The row of an operand on a step not measured in full, from its NaN-propagating max-abs: ``nonfinite``
    is 1 if any element was NaN/Inf (a flag, not a count), ``numel`` 0 marks the row as partial."""
    bad = ~torch.isfinite(amax)
    zero = torch.zeros((), device=amax.device)
    return torch.stack([zero, bad.float(), torch.where(bad, zero, amax.float()), zero, zero, zero, zero])


def combine(rows: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Two stacked rows (..., len(FIELDS)) of the same operands combined: sums, and MAX for the amax."""
    out = rows + other
    out[..., AMAX] = torch.maximum(rows[..., AMAX], other[..., AMAX])
    return out


# On steps not measured in full these are not checked again: W was checked by fprop (weights do not
# change within a step), X by fprop (wgrad's X is the same tensor, or its Hadamard transform), and dY by
# dgrad where it ran.
_SEEN_ELSEWHERE = {"dgrad.w": "fprop.w", "wgrad.x": "fprop.x", "wgrad.dy": "dgrad.dy"}


class HealthStats:
    """Per-operand health of one module, accumulated on the device since the last :meth:`reset`.

    ``full``: measure everything (:func:`operand_health`, about as costly as quantizing).
    Otherwise keep only each operand's running max-abs (two cheap ops per operand, the
    weight once per step), which is enough to name where a NaN entered.
    """

    def __init__(self):
        self.full = True
        self._rows: dict[str, torch.Tensor] = {}
        self._amax: dict[str, torch.Tensor] = {}

    def record(self, key: str, x: torch.Tensor, q: torch.Tensor, quantizer: OperandQuantizer) -> None:
        if self.full:
            row = operand_health(x.detach(), q.detach(), quantizer)
            self._rows[key] = combine(self._rows[key], row) if key in self._rows else row
            return
        if _SEEN_ELSEWHERE.get(key) in self._amax or (key == "fprop.w" and key in self._amax):
            return
        amax = torch.linalg.vector_norm(x.detach(), ord=math.inf)  # NaN propagates through max
        self._amax[key] = torch.maximum(self._amax[key], amax) if key in self._amax else amax

    @property
    def rows(self) -> dict[str, torch.Tensor]:
        """Operand -> :data:`FIELDS` row (partial rows on steps not measured in full)."""
        return self._rows if self.full else {k: nonfinite_row(a) for k, a in self._amax.items()}

    def reset(self, full: bool = True) -> None:
        self._rows, self._amax = {}, {}
        self.full = full


def summarize(row: list[float]) -> dict[str, float]:
    """A combined row as the logged quantities: counts, amax and fractions of the elements."""
    v = dict(zip(FIELDS, row))
    n = max(v["numel"], 1.0)
    return {"nonfinite": v["nonfinite"], "amax": v["amax"], "saturated": v["saturated"] / n,
            "underflow": v["underflow"] / n, "relative mse": v["err2"] / v["ref2"] if v["ref2"] > 0 else math.nan}

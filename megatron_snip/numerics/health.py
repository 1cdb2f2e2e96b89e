"""Quantization health: cheap per-operand scalars of what a quantizer did to a tensor.

For every quantized GEMM operand (``fprop.x``, ``fprop.w``, ``dgrad.dy``, ``dgrad.w``,
``wgrad.dy``, ``wgrad.x``) a module keeps, on the device (no host sync):

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

The outputs of the forward and dgrad GEMMs (``fprop.y``, ``dgrad.dx``: :data:`OUTPUTS`) keep
``numel``, ``nonfinite`` and ``amax`` only (nothing is quantized there). They tell a module whose
GEMM made non-finite values from finite operands (an overflow, a bad scale) from one that received
them; the wgrad output is the parameter's gradient, which the trainer checks by name.

That full measurement costs more than the quantization itself, so the trainer asks for it only on
the steps it logs, and there only for the first micro-batch that reaches each GEMM; every other
micro-batch and step keeps only a max-abs per operand (:class:`HealthStats`).

They are computed only when a module's :class:`HealthStats` exists (``--quant-health``).
Rows from tensor-parallel shards of one operand combine with :func:`combine` (sums, and
MAX for the amax), so the reduced numbers describe the whole tensor.
"""

from __future__ import annotations

import math

import torch

from megatron_snip.numerics.blocks import to_blocks
from megatron_snip.numerics.formats import ELEMENTS, FloatFormat
from megatron_snip.numerics.recipes import OperandQuantizer

# The operands of a linear module's three GEMMs, in the order of tables and logs.
OPERANDS = ("fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.dy", "wgrad.x")
# The GEMM outputs that flow on to other modules (activations forward, activation gradients backward).
OUTPUTS = ("fprop.y", "dgrad.dx")
# Every row a module keeps: its operands, then its outputs.
POINTS = OPERANDS + OUTPUTS
# One row per operand; amax combines by MAX, the rest by SUM.
FIELDS = ("numel", "nonfinite", "amax", "saturated", "underflow", "err2", "ref2")
AMAX = FIELDS.index("amax")


def element_format(q: OperandQuantizer) -> FloatFormat:
    """The element format of a quantizer: FP8 per-tensor schemes carry it (either of two); every
    other scheme stores one (bf16: bf16, block FP8 and MXFP8: E4M3, 4-bit schemes: E2M1)."""
    if q.element is not None:
        return q.element
    (element,) = q.spec.elements
    return ELEMENTS[element]


def clip_tolerance(fmt: FloatFormat, stochastic: bool) -> float:
    """How far above its block's largest quantized magnitude an unclipped element can lie, relative
    to it: half the largest relative step between normal values (a full step when rounding is stochastic)."""
    return 2.0 ** -fmt.mant_bits * (1.0 if stochastic else 0.5)


def operand_health(x: torch.Tensor, q: torch.Tensor, quantizer: OperandQuantizer) -> torch.Tensor:
    """The :data:`FIELDS` row (fp32, on x's device) of quantizing ``x`` (blocks along the last dim) to ``q``."""
    x = x.float()
    # err is non-finite exactly where x or q is (a NaN in a tensor or block makes its quantized values NaN; a
    # quantized value never has the opposite sign of its input, so two finite values cannot overflow).
    err = q - x
    invalid = ~torch.isfinite(err)
    ax = x.abs().masked_fill_(invalid, 0.0)
    aq = q.abs().masked_fill_(invalid, 0.0)
    err = err.masked_fill_(invalid, 0.0).reshape(-1)
    tolerance = 1.0 + clip_tolerance(element_format(quantizer), quantizer.stochastic)
    if quantizer.block is None:
        clipped = torch.count_nonzero(ax > aq.amax() * tolerance)
    else:  # padding is zero on both sides and never counts
        bx, _ = to_blocks(ax, quantizer.block)
        bq, _ = to_blocks(aq, quantizer.block)
        clipped = torch.count_nonzero(bx > bq.amax(dim=(2, 4), keepdim=True) * tolerance)
    numel = torch.tensor(float(x.numel()), device=x.device)
    return torch.stack([
        numel,
        numel - torch.count_nonzero(torch.isfinite(x)),
        ax.amax() if x.numel() else torch.zeros((), device=x.device),
        clipped.float(),
        (torch.count_nonzero(ax) - torch.count_nonzero(aq)).float(),  # flushed: q is 0 wherever x is
        torch.dot(err, err),
        torch.dot(ax.reshape(-1), ax.reshape(-1)),
    ])


def output_health(y: torch.Tensor) -> torch.Tensor:
    """The :data:`FIELDS` row of a GEMM output: its size, non-finite count and finite amax (the rest zero)."""
    y = y.float()
    finite = torch.isfinite(y)
    zero = torch.zeros((), device=y.device)
    amax = y.abs().masked_fill_(~finite, 0.0).amax() if y.numel() else zero
    numel = torch.tensor(float(y.numel()), device=y.device)
    return torch.stack([numel, numel - torch.count_nonzero(finite), amax, zero, zero, zero, zero])


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


# Max-abs checks skipped because the same values were checked already: W by fprop (weights do not change
# within a step), X by fprop (wgrad's X is the same tensor, or its Hadamard transform), and dY by dgrad
# where it ran.
_SEEN_ELSEWHERE = {"fprop.w": "fprop.w", "dgrad.w": "fprop.w", "wgrad.x": "fprop.x", "wgrad.dy": "dgrad.dy"}


class HealthStats:
    """Per-operand health of one module, accumulated on the device since the last :meth:`reset`.

    ``full``: measure everything (:func:`operand_health`, about as costly as quantizing) for the first
    micro-batch that reaches each GEMM operand and output, and only check the later ones for
    non-finite values. Otherwise (or for those later micro-batches) keep only each operand's running
    max-abs (one cheap reduction, the weight once per step), which is enough to name where a NaN entered.
    """

    def __init__(self):
        self.full = True
        self._rows: dict[str, torch.Tensor] = {}
        self._amax: dict[str, list[torch.Tensor]] = {}  # key -> the min and max of each check

    def record(self, key: str, x: torch.Tensor, q: torch.Tensor, quantizer: OperandQuantizer) -> None:
        if self.full and key not in self._rows:
            self._rows[key] = operand_health(x.detach(), q.detach(), quantizer)
        elif not any(_SEEN_ELSEWHERE.get(key) in seen for seen in (self._rows, self._amax)):
            self._max_abs(key, x)

    def record_output(self, key: str, y: torch.Tensor) -> None:
        """Keep a GEMM output's row (``key`` in :data:`OUTPUTS`): in full, or its max-abs only."""
        if self.full and key not in self._rows:
            self._rows[key] = output_health(y.detach())
        else:
            self._max_abs(key, y)

    def _max_abs(self, key: str, t: torch.Tensor) -> None:
        # One aminmax per check (NaN propagates; one pass, no temporary; 20x vector_norm(inf) on CPU), combined
        # when the rows are read: a check is one op on the hot path.
        if t.numel():
            self._amax.setdefault(key, []).extend(torch.aminmax(t.detach()))

    @property
    def rows(self) -> dict[str, torch.Tensor]:
        """Operand or output (:data:`POINTS`) -> :data:`FIELDS` row: the measured micro-batch's, plus one
        ``nonfinite`` per later check that found any (rows of max-abs checks alone have ``numel`` 0)."""
        rows = dict(self._rows)
        for key, extremes in self._amax.items():
            flags = nonfinite_row(torch.stack(extremes).abs().amax())
            rows[key] = combine(rows[key], flags) if key in rows else flags
        return rows

    def reset(self, full: bool = True) -> None:
        self._rows, self._amax = {}, {}
        self.full = full


def summarize(row: list[float]) -> dict[str, float]:
    """A combined row as the logged quantities: counts, amax and fractions of the elements."""
    v = dict(zip(FIELDS, row))
    n = max(v["numel"], 1.0)
    return {"nonfinite": v["nonfinite"], "amax": v["amax"], "saturated": v["saturated"] / n,
            "underflow": v["underflow"] / n, "relative mse": v["err2"] / v["ref2"] if v["ref2"] > 0 else math.nan}

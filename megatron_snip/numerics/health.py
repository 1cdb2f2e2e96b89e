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
the steps it logs, and there only for the first micro-batch that reaches each GEMM. Every other
micro-batch and step keeps only non-finite flags (:class:`HealthStats`), and where it can, at no
cost on the hot path (no kernel, no read of the tensor; references to tensors that exist anyway,
reduced only when the rows are read, i.e. on logged steps and on faults):

- an operand whose quantizer computed its max-abs anyway (per-tensor FP8 scales, FP8 rowwise, the
  NVFP4 global scale) is flagged from that amax;
- a GEMM output computed from FP8 bytes is flagged by the bound its operands' scales put on it
  (:class:`OutputBound`): ``|y| <= K * max|a| * max|b|``, so it is finite when its operands are and
  the bound lies below its dtype's largest value (a NaN in an operand makes its scale NaN);
- elsewhere (block-scaled and emulated formats, bf16 sides of a split precision, emulated GEMM
  outputs) one ``aminmax`` per operand or output, small beside the emulated quantization itself.

They are computed only when a module's :class:`HealthStats` exists (``--quant-health``).
Rows from tensor-parallel shards of one operand combine with :func:`combine` (sums, and
MAX for the amax), so the reduced numbers describe the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class OutputBound:
    """What bounds a GEMM output computed from FP8 bytes, kept instead of reading the output:
    ``|y| <= elements * max(a_scale_inv) * max(b_scale_inv)``, with ``elements`` = K times the two
    element formats' largest values. Reduced only when rows are read."""

    a_scale_inv: torch.Tensor
    b_scale_inv: torch.Tensor
    elements: float  # K * max element of a * max element of b
    out_max: float  # the output dtype's largest finite value

    def flag(self) -> torch.Tensor:
        """0-d: 1 where the output may be non-finite (NaN scale: a non-finite operand; or a bound within
        a factor 2 of overflow, which leaves room for the accumulation's rounding), else 0."""
        bound = self.a_scale_inv.float().amax() * self.b_scale_inv.float().amax() * self.elements
        return (~(bound * 2 < self.out_max)).float()


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
        self._amax: dict[str, list[torch.Tensor]] = {}  # key -> max-abs tensors (or aminmax extremes) of each check
        self._bounds: dict[str, list[OutputBound]] = {}

    def record(self, key: str, x: torch.Tensor, q: torch.Tensor | Callable[[], torch.Tensor],
               quantizer: OperandQuantizer, amax: torch.Tensor | None = None) -> None:
        """Keep operand ``key``'s health: ``x`` quantized to ``q`` (or a function giving the dequantized
        values, called only when it is measured in full); ``amax``: x's max-abs (0-d or per row) if the
        quantizer computed it, which then serves as the non-finite check at no cost."""
        if self.full and key not in self._rows:
            self._rows[key] = operand_health(x.detach(), (q() if callable(q) else q).detach(), quantizer)
        elif not any(_SEEN_ELSEWHERE.get(key) in seen for seen in (self._rows, self._amax)):
            if amax is not None:
                self._amax.setdefault(key, []).append(amax.detach())
            else:
                self._max_abs(key, x)

    def record_output(self, key: str, y: torch.Tensor, bound: OutputBound | None = None) -> None:
        """Keep a GEMM output's row (``key`` in :data:`OUTPUTS`): in full, else from ``bound`` (a GEMM on
        FP8 bytes) or its max-abs."""
        if self.full and key not in self._rows:
            self._rows[key] = output_health(y.detach())
        elif bound is not None:
            self._bounds.setdefault(key, []).append(bound)
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
            flags = nonfinite_row(torch.cat([t.reshape(-1) for t in extremes]).abs().amax())
            rows[key] = combine(rows[key], flags) if key in rows else flags
        for key, bounds in self._bounds.items():
            flags = nonfinite_row(torch.zeros((), device=bounds[0].a_scale_inv.device))
            flags[FIELDS.index("nonfinite")] = torch.stack([b.flag() for b in bounds]).amax().to(flags.device)
            rows[key] = combine(rows[key], flags.to(rows[key].device)) if key in rows else flags
        return rows

    def reset(self, full: bool = True) -> None:
        self._rows, self._amax, self._bounds = {}, {}, {}
        self.full = full


def summarize(row: list[float]) -> dict[str, float]:
    """A combined row as the logged quantities: counts, amax and fractions of the elements."""
    v = dict(zip(FIELDS, row))
    n = max(v["numel"], 1.0)
    return {"nonfinite": v["nonfinite"], "amax": v["amax"], "saturated": v["saturated"] / n,
            "underflow": v["underflow"] / n, "relative mse": v["err2"] / v["ref2"] if v["ref2"] > 0 else math.nan}

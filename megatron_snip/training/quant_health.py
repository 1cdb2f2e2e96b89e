"""Quantization health of the whole model: gathered from every rank, logged, and used to name
(and with ``--promote-on-fault`` promote) the modules behind a non-finite step or a loss spike.

Each rank's quantized linears keep per-operand rows (``numerics/health.py``). One table
``[module, operand, field]`` over all layers is summed (amax: MAX) over all ranks: TP shards
make whole tensors, DP and CP ranks the whole global batch (the weight counted once:
``PrecisionController.health_rows``), PP stages the whole model. Every rank holds the same
table afterwards, so decisions taken from it agree everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_snip.compat.device import current_device
from megatron_snip.numerics.health import AMAX, FIELDS, OPERANDS, POINTS, summarize
from megatron_snip.numerics.recipes import Precision
from megatron_snip.numerics.registry import family
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_names, parse_module_name
from megatron_snip.training import tags

NONFINITE, NUMEL = FIELDS.index("nonfinite"), FIELDS.index("numel")
LOGGED = ("saturated", "underflow", "relative mse")
_LISTED = 6  # modules named in one message before "and N more"
# Each module's points in the order a step reaches them (wgrad's operands are dgrad's dY and fprop's X).
_FORWARD = ("fprop.x", "fprop.w", "fprop.y")
_BACKWARD = ("dgrad.dy", "wgrad.dy", "dgrad.w", "wgrad.x", "dgrad.dx")
_HOW = {"y": "made by its quantized forward GEMM (its inputs were finite)",
        "dx": "made by its quantized dgrad GEMM (its inputs were finite)",
        "w": "a non-finite weight", "x": "entered its input from outside the quantized GEMMs",
        "dy": "entered its output gradient from outside the quantized GEMMs"}
# The points where a module's own quantized GEMM made the non-finite values: only these blame it (a weight
# made non-finite by an earlier update, or an input from outside, would follow it to any precision).
_MADE = ("y", "dx")


@dataclass(frozen=True)
class HealthTable:
    """Whole-model health since the last reset: ``table[m, i]`` is module ``names[m]``'s row of operand or
    GEMM output ``POINTS[i]`` (all zeros where the module did not quantize that operand)."""

    names: list[str]
    table: np.ndarray

    def _summary(self, rows: np.ndarray) -> dict[str, float]:
        return summarize(rows.tolist())

    @property
    def full(self) -> bool:
        """Whether this step was measured in full (else only non-finite flags: see ``HealthStats``)."""
        return bool((self.table[..., NUMEL] > 0).any())

    def nonfinite(self) -> dict[str, dict[str, int]]:
        """Module -> operand or output -> count of non-finite elements (on steps not measured in full: of
        ranks and micro-batches where it had any), for modules that had any."""
        out = {}
        for m, name in enumerate(self.names):
            bad = {p: int(self.table[m, i, NONFINITE]) for i, p in enumerate(POINTS) if self.table[m, i, NONFINITE] > 0}
            if bad:
                out[name] = bad
        return out

    def origin(self) -> tuple[str, str] | None:
        """(module, point) where non-finite values first appear in the order the step ran them: the forward
        pass in layer order (input, weight, output of each module), else, for a backward-only fault, the
        backward pass in reverse layer order. A point in :data:`OUTPUTS` means that module's GEMM made
        them from finite operands; an input means they came from outside the quantized GEMMs."""
        bad = self.nonfinite()
        for points, names in ((_FORWARD, self.names), (_BACKWARD, self.names[::-1])):
            for name in names:
                first = next((p for p in points if p in bad.get(name, {})), None)
                if first is not None:
                    return name, first
        return None

    def fault_modules(self, nonfinite: bool) -> tuple[list[str], str]:
        """The modules to blame for a non-finite step (its origin, when that module's quantized GEMM made the
        values: not when they entered from outside the quantized GEMMs) or a spike (the worst relative MSE),
        and one sentence saying what the numbers show (empty when no GEMM was quantized)."""
        if not self.table.any():
            return [], ""
        if nonfinite:
            bad = self.nonfinite()
            origin = self.origin()
            if origin is None:
                return [], "no quantized GEMM had non-finite operands or outputs (the fault lies outside them)"
            name, point = origin
            listed = [f"{n} ({', '.join(bad[n])})" for n in sorted(bad, key=lambda n: n != name)]
            made_here = point.split(".")[1] in _MADE
            return [name] if made_here else [], (
                f"quantized modules with non-finite values: {_truncated(listed, '; ')}; "
                f"first: {name} {point}, {_HOW[point.split('.')[1]]}"
                + ("" if made_here else " (no quantized GEMM made them: nothing to promote)"))
        worst = self.worst()
        if worst is None:
            return [], ""
        return [worst[0]], f"largest relative quantization MSE: {worst[0]} {worst[1]} {worst[2]:.3g}"

    def worst(self) -> tuple[str, str, float] | None:
        """(module, operand, relative MSE) of the largest relative quantization MSE, if any was measured."""
        best = None
        for m, name in enumerate(self.names):
            for o, op in enumerate(OPERANDS):
                if self.table[m, o, NUMEL] > 0:
                    mse = self._summary(self.table[m, o])["relative mse"]
                    if np.isfinite(mse) and (best is None or mse > best[2]):
                        best = (name, op, mse)
        return best

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars: per module type and per layer, each GEMM operand's saturated and
        underflow fractions and relative MSE (and per module type its non-finite count and amax)."""
        layers = [parse_module_name(n)[0] for n in self.names]
        kinds = [parse_module_name(n)[1] for n in self.names]
        out = {}
        for o, op in enumerate(OPERANDS):
            for kind in LINEAR_MODULES:
                s = self._combined([m for m, k in enumerate(kinds) if k == kind], o)
                if s is not None:
                    out.update({tags.quant_health(stat, kind, op): s[stat] for stat in (*LOGGED, "nonfinite", "amax")})
            for layer in sorted(set(layers)):
                s = self._combined([m for m, i in enumerate(layers) if i == layer], o)
                if s is not None:
                    out.update({tags.quant_health(stat, f"{layer:03d}", op, per_layer=True): s[stat]
                                for stat in LOGGED})
        return out

    def _combined(self, modules: list[int], o: int) -> dict[str, float] | None:
        rows = self.table[modules, o]
        if not (rows[:, NUMEL] > 0).any():
            return None
        combined = rows.sum(axis=0)
        combined[AMAX] = rows[:, AMAX].max()
        return self._summary(combined)


def _truncated(items: list[str], sep: str) -> str:
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return sep.join(items[:_LISTED]) + more


def gather_health(controller, num_layers: int) -> HealthTable:
    """Collective over all ranks: the whole model's :class:`HealthTable` (same on every rank)."""
    names = module_names(num_layers)
    index = {n: i for i, n in enumerate(names)}
    device = current_device()
    table = torch.zeros(len(names), len(POINTS), len(FIELDS), device=device)
    for name, rows in controller.health_rows().items():
        for key, row in rows.items():
            table[index[name], POINTS.index(key)] = row.to(device)
    amax = table[..., AMAX].clone()
    table[..., AMAX] = 0.0
    dist.all_reduce(table)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    table[..., AMAX] = amax
    return HealthTable(names, table.double().cpu().numpy())


_PROMOTED = {"fp4": "fp8", "fp8": "bf16"}


def promote(plan: PrecisionPlan, names: list[str]) -> tuple[PrecisionPlan, dict[str, tuple[Precision, Precision]]]:
    """``plan`` with each of ``names`` one step up in precision per pass (FP4 -> FP8 -> BF16), and the changes."""
    def up(name: str) -> str:
        return _PROMOTED.get(family(name), name)

    changes = {}
    for name in names:
        old = plan[name]
        new = Precision(up(old.fwd), up(old.bwd))
        if new != old:
            changes[name] = (old, new)
    return PrecisionPlan({**plan.modules, **{n: new for n, (_, new) in changes.items()}}, plan.default), changes

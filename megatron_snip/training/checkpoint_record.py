"""The replicated, non-tensor state every checkpoint carries: one typed, versioned record.

dist_checkpointing stores it in the checkpoint's ``common.pt`` beside the sharded tensors. The
trainer writes it at every save (the HF import and the fp32-master export write model-only ones);
argument validation reads it before the process group exists (the saved flags, the plan to resume);
the trainer reads where to continue; the Hugging Face export reads the flags and the plan.

Each field is stored under its own name, as checkpoints did before the record existed, so those
(``version`` 0: no version key) load with the fields they lack at their defaults. The plan history is
kept as :class:`PlanChange` records and stored as the plain dicts checkpoints have always held
(``PlanChange.to_dict``), so every checkpoint with a history reads, and older programs read ours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the numerics import torch; the flags' --help reads this module without it
    from megatron_snip.numerics.recipes import Precision

CHECKPOINT_RECORD_VERSION = 1
VERSION_KEY = "checkpoint_record_version"


class PlanEvent(str, Enum):
    """Why the plan changed (the stored text is the value)."""

    SNIP_CYCLE = "snip cycle"
    PROMOTION = "promotion"  # --promote-on-fault, at a non-finite step or a loss spike


@dataclass(frozen=True)
class PlanChange:
    """One change of the run's plan: at which iteration, why, and each module's (old, new) precision."""

    iteration: int
    event: PlanEvent
    modules: Mapping[str, tuple[Precision, Precision]]
    reason: str | None = None  # a promotion's fault (Verdict.describe())

    def to_dict(self) -> dict[str, Any]:
        """The stored form: ``{"iteration", "event", ["reason",] "modules": {name: "old -> new"}}``."""
        out: dict[str, Any] = {"iteration": self.iteration, "event": self.event.value}
        if self.reason is not None:
            out["reason"] = self.reason
        out["modules"] = {name: f"{old} -> {new}" for name, (old, new) in self.modules.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str) -> PlanChange:
        """Inverse of :meth:`to_dict`; ValueError naming ``source`` for an entry this program cannot read."""
        from megatron_snip.numerics.recipes import Precision

        try:
            modules = {}
            for name, change in data["modules"].items():
                old, new = change.split(" -> ")
                modules[name] = (Precision.parse(old), Precision.parse(new))
            return cls(int(data["iteration"]), PlanEvent(data["event"]), modules, data.get("reason"))
        except (KeyError, ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"{source}: unreadable plan history entry {dict(data)!r} ({e})") from None


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint records besides its tensors."""

    iteration: int
    # The run's flags (``RunConfig.to_flags()``): a resumed run takes the ones it does not set from here.
    args: Mapping[str, Any] = field(default_factory=dict)
    consumed_samples: int = 0
    precision_plan: Mapping[str, Any] | None = None  # PrecisionPlan.to_dict() of the step after the save
    precision_schedule: list[str] | None = None  # PrecisionSchedule.to_list()
    numerical_safety: Mapping[str, Any] | None = None  # NumericalGuard.state_dict()
    precision_history: tuple[PlanChange, ...] = ()  # SNIP cycles and promotions so far, oldest first
    # tp, pp, dp (and vpp with interleaving) at the save; per-rank states only load into the same layout.
    layout: Mapping[str, int] = field(default_factory=dict)
    model_only: bool = False  # weights only (an import or an export): no optimizer, scheduler or RNG state
    no_optimizer_state: bool = False  # saved with --no-save-optim
    no_rng_state: bool = False  # saved with --no-save-rng
    hf_import: Mapping[str, Any] | None = None  # the Hugging Face directory an imported checkpoint came from
    version: int = CHECKPOINT_RECORD_VERSION

    def to_common(self) -> dict[str, Any]:
        """The entries of the checkpoint's common state."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "version"}
        out["precision_history"] = [change.to_dict() for change in self.precision_history]
        return {**out, VERSION_KEY: self.version}

    @classmethod
    def from_common(cls, common: Mapping[str, Any], source: str) -> CheckpointRecord:
        """The record in a checkpoint's common state (other entries, such as the scheduler's, are ignored).

        Raises ValueError naming ``source`` for a record newer than this program or without an iteration.
        """
        version = int(common.get(VERSION_KEY, 0))
        if version > CHECKPOINT_RECORD_VERSION:
            raise ValueError(f"{source}: checkpoint record version {version} is newer than this program's "
                             f"{CHECKPOINT_RECORD_VERSION}; load it with the megatron-snip that wrote it")
        if "iteration" not in common:
            raise ValueError(f"{source}: not a megatron-snip checkpoint (its common state has no iteration)")
        known = {f.name for f in dataclasses.fields(cls)} - {"version"}
        values = {k: v for k, v in common.items() if k in known and v is not None}
        history = values.get("precision_history", ())
        values["precision_history"] = tuple(PlanChange.from_dict(entry, source) for entry in history)
        return cls(**values, version=version)

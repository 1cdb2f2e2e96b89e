"""The replicated, non-tensor state every checkpoint carries: one typed, versioned record.

dist_checkpointing stores it in the checkpoint's ``common.pt`` beside the sharded tensors. The
trainer writes it at every save (the HF import and the fp32-master export write model-only ones);
argument validation reads it before the process group exists (the saved flags, the plan to resume);
the trainer reads where to continue; the Hugging Face export reads the flags and the plan.

Each field is stored under its own name, as checkpoints did before the record existed, so those
(``version`` 0: no version key) load with the fields they lack at their defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CHECKPOINT_RECORD_VERSION = 1
VERSION_KEY = "checkpoint_record_version"


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
    precision_history: list[dict] = field(default_factory=list)  # SNIP cycles and promotions so far
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
        return cls(**values, version=version)

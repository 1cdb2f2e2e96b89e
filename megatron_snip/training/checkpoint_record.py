"""The replicated, non-tensor state every checkpoint carries: one typed, versioned record.

dist_checkpointing stores it in the checkpoint's ``common.pt`` beside the sharded tensors. The
trainer writes it at every save (the HF import and the fp32-master export write model-only ones);
argument validation reads it before the process group exists (the saved flags, the plan to resume);
the trainer reads where to continue; the Hugging Face export reads the flags and the plan.

Since version 2 a checkpoint is Megatron-LM's: ``common.pt`` holds Megatron-LM's own fields (``args``
as a Namespace, ``iteration``, ``opt_param_scheduler`` in samples, ...; written and read by
``training/megatron_lm_checkpoint.py``) and this program's part of the record under its own key,
:data:`RECORD_KEY` (:meth:`CheckpointRecord.stored` / :meth:`CheckpointRecord.from_stored`).

Versions 0 and 1 stored each field under its own name at the top of ``common.pt`` (``args`` as a dict
of this program's flags, the scheduler in iterations, NullTokenizer's ``--vocab-size`` counting the
end-of-document id); :meth:`CheckpointRecord.from_legacy` reads them as the current version means
them. The plan history is kept as :class:`PlanChange` records and stored as the plain dicts
checkpoints have always held (``PlanChange.to_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the numerics import torch; the flags' --help reads this module without it
    from megatron_snip.numerics.recipes import Precision

CHECKPOINT_RECORD_VERSION = 2
VERSION_KEY = "checkpoint_record_version"
# The key of this program's part of the record in common.pt (version 2 on); Megatron-LM ignores it.
RECORD_KEY = "megatron_snip"
# Who wrote a checkpoint (CheckpointRecord.saved_by).
SAVED_BY_US = "megatron-snip"
SAVED_BY_MEGATRON_LM = "Megatron-LM"


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
    """What a checkpoint records besides its tensors (Megatron-LM's common fields and this program's)."""

    iteration: int
    # The run's flags (``RunConfig.to_flags()``): a resumed run takes the ones it does not set from here. A
    # checkpoint Megatron-LM wrote gives the ones its ``args`` fix (training/megatron_lm_checkpoint.py).
    args: Mapping[str, Any] = field(default_factory=dict)
    consumed_samples: int = 0  # training samples consumed (Megatron-LM's consumed_train_samples)
    # Megatron-LM's position in the validation data and its samples skipped by a decreased batch size, carried
    # through (evaluation here always reads the first --eval-iters batches; no batch is ever decreased here).
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations: float = 0.0  # model FLOPs trained so far (num_floating_point_operations_so_far)
    # OptimizerParamScheduler.state_dict(), steps in samples as Megatron-LM counts them; None: not saved.
    scheduler: Mapping[str, Any] | None = None
    # How the optimizer's state is sharded (dist_checkpointing's content metadata: distrib_optim_sharding_type, ...).
    content_metadata: Mapping[str, Any] | None = None
    precision_plan: Mapping[str, Any] | None = None  # PrecisionPlan.to_dict() of the step after the save
    precision_schedule: list[str] | None = None  # PrecisionSchedule.to_list()
    numerical_safety: Mapping[str, Any] | None = None  # NumericalGuard.state_dict()
    precision_history: tuple[PlanChange, ...] = ()  # SNIP cycles and promotions so far, oldest first
    # tp, pp, dp, cp (and vpp with interleaving) at the save; per-rank states only load into the same layout.
    layout: Mapping[str, int] = field(default_factory=dict)
    model_only: bool = False  # weights only (an import or an export): no optimizer, scheduler or RNG state
    no_optimizer_state: bool = False  # saved with --no-save-optim
    no_rng_state: bool = False  # saved with --no-save-rng
    hf_import: Mapping[str, Any] | None = None  # the Hugging Face directory an imported checkpoint came from
    saved_by: str = SAVED_BY_US  # or SAVED_BY_MEGATRON_LM: no record of ours, its args translated
    dropped: tuple[str, ...] = ()  # Megatron-LM state the checkpoint holds that is not resumed here (not stored)
    version: int = CHECKPOINT_RECORD_VERSION

    @property
    def legacy(self) -> bool:
        """Saved before checkpoints were Megatron-LM's (version 0 or 1): RNG and quantization states in one
        object sharded over (pp, tp, dp), the scheduler in iterations (converted on reading)."""
        return self.version < 2 and self.saved_by == SAVED_BY_US

    def stored(self) -> dict[str, Any]:
        """This program's part of the record, stored under :data:`RECORD_KEY` (the fields Megatron-LM has its
        own place for are written there: ``training/megatron_lm_checkpoint.py``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in (*_MEGATRON_FIELDS, "dropped")}
        out["precision_history"] = [change.to_dict() for change in self.precision_history]
        return out

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any], megatron: Mapping[str, Any], source: str) -> CheckpointRecord:
        """The record from its stored part (:meth:`stored`) and ``megatron``, the values of Megatron-LM's own
        fields (:data:`_MEGATRON_FIELDS`); ValueError naming ``source`` for a record newer than this program."""
        version = int(stored.get("version", 0))
        if version > CHECKPOINT_RECORD_VERSION:
            raise ValueError(f"{source}: checkpoint record version {version} is newer than this program's "
                             f"{CHECKPOINT_RECORD_VERSION}; load it with the megatron-snip that wrote it")
        return cls._of({**stored, **megatron, "version": version}, source)

    @classmethod
    def from_legacy(cls, common: Mapping[str, Any], source: str) -> CheckpointRecord:
        """The record of a checkpoint saved before version 2 (every field at the top of ``common``), as the
        current version means it: the scheduler's steps and NullTokenizer's vocabulary converted."""
        version = int(common.get(VERSION_KEY, 0))
        if version > 1:
            raise ValueError(f"{source}: checkpoint record version {version} is stored at the top of its common "
                             f"state, where only versions 0 and 1 are; the checkpoint is not this program's")
        if "iteration" not in common or not isinstance(common.get("args", {}), Mapping):
            raise ValueError(f"{source}: not a megatron-snip checkpoint (its common state has no iteration)")
        args = dict(common.get("args", {}))
        if args.get("tokenizer_type") == "NullTokenizer" and args.get("vocab_size") is not None:
            args["vocab_size"] -= 1  # it counted the end-of-document id, which Megatron-LM's --vocab-size does not
        scheduler = common.get("opt_param_scheduler")
        if scheduler is not None:
            scheduler = iterations_to_samples(scheduler, int(args.get("global_batch_size") or 1))
        content = None if common.get("no_optimizer_state") or common.get("model_only") else LEGACY_CONTENT_METADATA
        return cls._of({**common, "args": args, "scheduler": scheduler, "content_metadata": content,
                        "version": version}, source)

    @classmethod
    def _of(cls, values: Mapping[str, Any], source: str) -> CheckpointRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in values.items() if k in known and v is not None}
        kept["precision_history"] = tuple(PlanChange.from_dict(entry, source)
                                          for entry in kept.get("precision_history", ()))
        kept.pop("dropped", None)
        return cls(**kept)


# Fields Megatron-LM's common.pt holds in its own places (its top-level keys, its args Namespace, the content
# metadata dist_checkpointing stores): not repeated in this program's stored part.
_MEGATRON_FIELDS = ("iteration", "consumed_samples", "consumed_valid_samples", "skipped_train_samples",
                    "floating_point_operations", "scheduler", "content_metadata")
# How checkpoints before version 2 sharded the optimizer (what they passed to sharded_state_dict).
LEGACY_CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# OptimizerParamScheduler.state_dict() entries counted in steps.
SCHEDULER_STEP_FIELDS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def iterations_to_samples(scheduler: Mapping[str, Any], global_batch_size: int) -> dict[str, Any]:
    """A scheduler state stepped once per iteration (checkpoints before version 2) as Megatron-LM steps it: by the
    samples of each iteration, ``global_batch_size``."""
    return {k: (v * global_batch_size if k in SCHEDULER_STEP_FIELDS and v is not None else v)
            for k, v in scheduler.items()}

"""The whole run's configuration: one frozen section per concern, built once by ``arguments.py``.

Components receive their own section (the model builder a :class:`ModelConfig`, SNIP a
:class:`SnipConfig`, ...); only the trainer, which wires them together, holds the
:class:`RunConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_snip.data.config import DataConfig
from megatron_snip.flags import from_flags, to_flags
from megatron_snip.model.config import ModelConfig, ParallelConfig
from megatron_snip.precision.config import PrecisionConfig
from megatron_snip.snip.config import SnipConfig
from megatron_snip.training.safety import SafetyConfig


@dataclass(frozen=True)
class TrainingConfig:
    """Batches, iterations, optimizer and LR / weight-decay schedules."""

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int  # derived: global batch / (micro batch x DP)
    train_iters: int
    seed: int
    exit_interval: int | None
    exit_duration_in_mins: float | None  # wall time since start-up
    skip_train: bool
    manual_gc: bool  # Megatron-LM's: automatic GC off, collections at fixed iterations on every rank
    manual_gc_interval: int  # iterations between collections (0: only around evaluations)
    manual_gc_eval: bool  # collect before and after each evaluation
    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int
    lr_warmup_iters: int  # --lr-warmup-fraction resolved
    lr_wsd_decay_iters: int | None
    lr_wsd_decay_style: str
    weight_decay: float
    start_weight_decay: float
    end_weight_decay: float
    weight_decay_incr_style: str
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    no_load_optim: bool
    no_load_rng: bool
    no_save_optim: bool  # checkpoints without optimizer and LR-scheduler state
    no_save_rng: bool  # checkpoints without RNG and quantization state
    finetune: bool  # load the weights only, start at iteration 0

    @property
    def resumes(self) -> bool:
        """Whether the run continues a checkpoint's state (not only its weights)."""
        return self.load is not None and not self.finetune


@dataclass(frozen=True)
class LoggingConfig:
    eval_interval: int
    eval_iters: int  # global batches per evaluation
    log_interval: int
    tensorboard_dir: str | None
    peak_tflops: float | None  # per GPU, for MFU


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    precision: PrecisionConfig
    snip: SnipConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    safety: SafetyConfig

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> RunConfig:
        """Every section from validated flat flag values (``arguments.parse_config`` is the one caller
        with a command line; tests and tools pass a checkpoint's saved values)."""
        return cls(**{name: from_flags(section, flags) for name, section in _SECTIONS.items()})

    def to_flags(self) -> dict[str, Any]:
        """The flat flag values of every section: what a checkpoint saves as its arguments."""
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            out.update(to_flags(getattr(self, name)))
        return out


_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
             "precision": PrecisionConfig, "snip": SnipConfig, "data": DataConfig,
             "checkpoint": CheckpointConfig, "logging": LoggingConfig, "safety": SafetyConfig}

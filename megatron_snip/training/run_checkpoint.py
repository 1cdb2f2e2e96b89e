"""The run's checkpoints: the trainer's state saved as a Megatron-LM torch_dist checkpoint with the run's files
beside it (its resolved flags, the plan in force as megatron-core precision configs), and loaded back on resume.
The trainer calls :func:`save` and :func:`resume` with itself (``training/trainer.py``'s ``Trainer``);
``training/checkpointing.py`` does the reading and writing."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.precision.te_precision_config import megatron_config_files
from megatron_snip.training import checkpointing
from megatron_snip.training.checkpoint_record import CheckpointRecord
from megatron_snip.training.setup import use_fused_adam

RUN_CONFIG_FILE = "run_config.yaml"  # in every checkpoint's directory
# The plan in force, as megatron-core's per-module precision config (Megatron-LM's --te-precision-config-file),
# in every checkpoint's directory: TE_PRECISION_CONFIG_FILE, and under PP > 1 also one file per model chunk
# (te_precision_config.pp<stage>[.vp<chunk>].yaml).
TE_PRECISION_CONFIG_FILE = "te_precision_config.yaml"


@dataclass
class TrainState:
    """Where training is: saved in every checkpoint (Megatron-LM's counters), restored on resume."""

    iteration: int = 0
    consumed_samples: int = 0
    floating_point_operations: float = 0.0  # model FLOPs so far (Megatron-LM's num_floating_point_operations_so_far)
    consumed_valid_samples: int = 0  # carried from a Megatron-LM checkpoint (evaluation here reads its first batches)
    skipped_train_samples: int = 0  # carried likewise (no batch is ever decreased here)


def resume(trainer) -> None:
    """Load --load's checkpoint (or --pretrained-checkpoint's weights) into the trainer, and say what was loaded."""
    ckpt = trainer.config.checkpoint
    expected = trainer.scheduler.state_dict()  # the flags' schedule, before a checkpoint's replaces it
    loaded = checkpointing.load_checkpoint(
        ckpt.load_dir, [chunk.module for chunk in trainer.model], trainer.optimizer, trainer.scheduler,
        load_optim=not (ckpt.no_load_optim or ckpt.weights_only),
        load_rng=not (ckpt.no_load_rng or ckpt.weights_only),
        fully_parallel=ckpt.ckpt_fully_parallel_load, iteration=ckpt.load_iteration,
        run_args=trainer.config.to_flags())
    if loaded is None:
        trainer.logger.text(f"no checkpoint in {ckpt.load_dir}: starting from scratch")
        return
    record = loaded.record
    if not ckpt.weights_only:  # Megatron-LM's --finetune: iteration 0, no counters
        trainer.state = TrainState(record.iteration, record.consumed_samples, record.floating_point_operations,
                                record.consumed_valid_samples, record.skipped_train_samples)
        if record.numerical_safety is not None:  # absent in older checkpoints
            trainer.guard.load_state_dict(record.numerical_safety)
        trainer.plans.apply(trainer.state.iteration + 1)  # the plan itself was chosen at start-up (initial_plan)
    trainer.precision.load_quant_states(loaded.quantization)
    use_fused_adam(trainer.optimizer)  # the loaded parameter groups carry the saving run's choice
    for line in (*record.dropped, *_schedule_notice(trainer, expected, loaded)):
        trainer.logger.text(f"notice: {line}")
    saved_by = "" if record.saved_by == "megatron-snip" else f" (saved by {record.saved_by})"
    if ckpt.from_pretrained:
        why = "no --load" if ckpt.load is None else f"--load {ckpt.load} holds no checkpoint"
        trainer.logger.text(f"{why}: starting from the weights of --pretrained-checkpoint {ckpt.load_dir}{saved_by} "
                         f"(its iteration {record.iteration}) at iteration 0")
        return
    trainer.logger.text(f"resumed from {ckpt.load_dir}{saved_by} at iteration {record.iteration} "
                     f"(consumed samples {record.consumed_samples}); continuing at {trainer.state.iteration}")

def _schedule_notice(trainer, expected: dict, loaded: checkpointing.Loaded) -> list[str]:
    """Where the loaded checkpoint's LR / weight-decay schedule differs from the flags': it continues (as
    Megatron-LM's --use-checkpoint-opt_param-scheduler; Megatron-LM without that flag refuses to resume)."""
    saved = loaded.record.scheduler
    ckpt = trainer.config.checkpoint
    if (not loaded.optimizer or saved is None or ckpt.override_opt_param_scheduler
            or ckpt.use_checkpoint_opt_param_scheduler):
        return []
    differ = [f"{key} {saved[key]} (flags: {value})" for key, value in expected.items()
              if key != "num_steps" and key in saved and saved[key] != value]
    if not differ:
        return []
    return [f"the LR schedule continues the checkpoint's, whose {', '.join(differ)} differ from this run's "
            f"flags (steps in samples); Megatron-LM would refuse this resume without "
            f"--use-checkpoint-opt_param-scheduler; pass --override-opt_param-scheduler for the flags' schedule"]

def save(trainer) -> None:
    """Save the trainer's state as a Megatron-LM torch_dist checkpoint in --save, with the run's files beside it."""
    ckpt = trainer.config.checkpoint
    if trainer.config.parallel.overlap_param_gather:
        # As Megatron-LM: a step's updated parameter shards reach the other DP ranks in the next forward's
        # all-gather; gathered now, or the checkpoint would hold the previous step's weights there.
        for chunk in trainer.model:
            chunk.start_param_sync(force_sync=True)
    state = trainer.state
    path = checkpointing.save_checkpoint(
        ckpt.save, CheckpointRecord(
            state.iteration, {**trainer.config.to_flags(), "padded_vocab_size": trainer.vocab_rows},
            state.consumed_samples, state.consumed_valid_samples, state.skipped_train_samples,
            state.floating_point_operations, precision_plan=trainer.plans.plan.to_dict(),
            precision_schedule=trainer.plans.schedule.to_list(), numerical_safety=trainer.guard.state_dict(),
            precision_history=tuple(trainer.plans.history)),
        [chunk.module for chunk in trainer.model], trainer.optimizer, trainer.scheduler,
        quantization=trainer.precision.quant_states(), save_optim=not ckpt.no_save_optim,
        save_rng=not ckpt.no_save_rng, files={RUN_CONFIG_FILE: trainer.config_yaml, **_plan_files(trainer)},
        fully_parallel=ckpt.ckpt_fully_parallel_save, retain_interval=ckpt.save_retain_interval,
        fully_reshardable=ckpt.dist_ckpt_optim_fully_reshardable)
    trainer.logger.text(f"saved checkpoint {path}")

def _plan_files(trainer) -> dict[str, str]:
    """The plan in force as megatron-core per-module precision configs (TE_PRECISION_CONFIG_FILE, and one
    per model chunk under PP > 1), for Megatron-LM's --te-precision-config-file; none where the plan holds
    what such a config cannot state (mxfp4, delayed scaling, ...: said once)."""
    c = trainer.config
    try:
        files = megatron_config_files(trainer.plans.plan, c.precision.recipe(),
                                      c.parallel.pipeline_layout(c.model.num_layers),
                                      source=f"the plan of iteration {trainer.state.iteration}")
    except ValueError as e:
        if not trainer._plan_file_notice:
            trainer.logger.text(f"notice: no {TE_PRECISION_CONFIG_FILE} beside the checkpoints: {e}")
            trainer._plan_file_notice = True
        return {}
    stem = TE_PRECISION_CONFIG_FILE.removesuffix(".yaml")
    return {f"{stem}{suffix}.yaml": text for suffix, text in files.items()}


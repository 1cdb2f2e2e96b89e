"""The training loop: build, (resume,) train, evaluate, checkpoint.

Read :func:`pretrain` top to bottom. Everything parallel is megatron-core's:
the pipeline schedule from ``get_forward_backward_func``, DDP, the optimizer,
``dist_checkpointing``. This file only sequences them.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_snip.compat.device import current_device, has_cuda
from megatron_snip.data.datasets import megatron_num_samples
from megatron_snip.data.loader import micro_batches
from megatron_snip.data.tokenizer import build_tokenizer
from megatron_snip.model.llama import build_model, flops_per_token, num_parameters, transformer_config
from megatron_snip.model.precision.controller import PrecisionController
from megatron_snip.model.precision.te_layers import describe_te_backend, prepare_te_environment
from megatron_snip.model.step import forward_step, mean_loss
from megatron_snip.numerics.linear import describe_backend
from megatron_snip.numerics.registry import PRECISION_NAMES
from megatron_snip.precision.execution import describe_execution, gemm_execution
from megatron_snip.precision.flops import LlamaLinearDims, estimated_time_ratio, flop_fractions
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.plan_image import plan_image
from megatron_snip.snip.planner import PlannerConfig
from megatron_snip.snip.replanner import CycleReport, SnipReplanner, StepShape
from megatron_snip.training import checkpointing, requeue, tags
from megatron_snip.training.checkpoint_record import CheckpointRecord
from megatron_snip.training.config import RunConfig
from megatron_snip.training.cycle_log import log_cycle
from megatron_snip.training.data import build_datasets
from megatron_snip.training.logger import (
    MetricsLogger,
    RunFilesError,
    hms,
    peak_tflops,
    progress_line,
    setup_console,
)
from megatron_snip.training.precision import describe_speed_model, speed_model
from megatron_snip.training.profiling import StepProfiler
from megatron_snip.training.quant_health import HealthTable, gather_health, promote
from megatron_snip.training.safety import NumericalGuard, Verdict
from megatron_snip.training.setup import (
    build_optimizer,
    build_scheduler,
    initialize_distributed,
    use_fused_adam,
    wrap_ddp,
)
from megatron_snip.training.signals import RUN_FILES_FAILED, ExitSignalHandler
from megatron_snip.training.timers import Timers

RUN_CONFIG_FILE = "run_config.yaml"  # in every checkpoint's directory


@dataclass
class TrainState:
    """Where training is: saved in every checkpoint, restored on resume."""

    iteration: int = 0
    consumed_samples: int = 0


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports to the logs. The loss stays on the device until a log reads it
    (:attr:`loss`): the step itself waits for the device only where Megatron-LM's does."""

    loss_tensor: torch.Tensor | None  # mean over micro-batches and DP ranks (fp32 scalar); None off the last stage
    grad_norm: float | None   # before clipping; None when the update was skipped
    num_zeros: int | None     # zero gradient entries (--log-num-zeros-in-grad), None without
    applied: bool             # False: the update was skipped (non-finite step)
    seconds: float            # wall time of the step

    @cached_property
    def loss(self) -> float | None:
        """The loss as a number (a host sync on a GPU: read where it is logged)."""
        return None if self.loss_tensor is None else self.loss_tensor.item()


@dataclass
class LogWindow:
    """The iterations since the last progress line, which it averages over (as Megatron-LM's). Their losses
    are kept on the device and read once, by the progress line (:attr:`loss_sum`, :attr:`nan`)."""

    iterations: int = 0
    seconds: float = 0.0
    advanced: int = 0  # iterations whose update was applied: their losses are averaged
    skipped: int = 0
    losses: list[tuple[torch.Tensor, bool]] = field(default_factory=list)  # (loss, applied) on the last stage

    def add(self, step: StepResult) -> None:
        self.iterations += 1
        self.seconds += step.seconds
        if step.applied:
            self.advanced += 1
        else:
            self.skipped += 1
        if step.loss_tensor is not None:
            self.losses.append((step.loss_tensor, step.applied))

    @cached_property
    def _values(self) -> list[tuple[float, bool]]:
        """The window's losses as numbers (one host sync), once all iterations are in."""
        if not self.losses:
            return []
        return list(zip(torch.stack([t for t, _ in self.losses]).tolist(), (a for _, a in self.losses)))

    @property
    def loss_sum(self) -> float:
        """Sum of the applied iterations' losses (0 off the last stage)."""
        return sum(v for v, applied in self._values if applied)

    @property
    def nan(self) -> int:
        """Iterations with a non-finite loss."""
        return sum(not math.isfinite(v) for v, _ in self._values)


class Trainer:
    """Owns the model chunks, optimizer, scheduler and data for one run."""

    def __init__(self, config: RunConfig):
        self.config = c = config
        self.start_time = time.time()  # --exit-duration-in-mins counts from start-up, as in Megatron-LM
        self.tokenizer = build_tokenizer(c.data.tokenizer_type, c.data.tokenizer_model, c.model.vocab_size)
        self.datasets = build_datasets(
            c.data, self.tokenizer, seq_length=c.model.seq_length, seed=c.training.seed,
            num_samples=megatron_num_samples(max(c.training.train_iters, 1), c.logging.eval_iters,
                                             c.logging.eval_interval, c.training.global_batch_size))
        self.transformer_config = transformer_config(c.model, c.parallel)
        recipe = c.precision.recipe()
        if c.model.transformer_impl == "transformer_engine":
            prepare_te_environment(recipe)
        self.model = wrap_ddp(c.parallel, self.transformer_config,
                              build_model(c.model, c.parallel, self.transformer_config, self.tokenizer.vocab_size))
        self.precision = PrecisionController(self.model, recipe=recipe, seed=c.training.seed)
        self.linear_dims = LlamaLinearDims.from_config(self.transformer_config)
        self.speed_model = speed_model(c, self.linear_dims)
        self.speeds = self.speed_model.precision_speeds(recipe)
        self.state = TrainState()
        start = c.start  # decided once by arguments.resolve
        self.schedule, self.schedule_source = start.schedule, start.schedule_source
        self.plan_source = start.plan_source
        self.set_plan(start.plan)
        self.optimizer = build_optimizer(c.training, c.model, c.parallel, self.model,
                                         count_zeros=c.logging.log_num_zeros_in_grad)
        self.scheduler = build_scheduler(c.training, self.optimizer)
        self.pins_text = start.pins_text
        self.snip = SnipReplanner(
            c.snip, PlannerConfig.from_snip(c.snip, recipe, self.speed_model, dict(start.pins)), chunks=self.model,
            optimizer=self.optimizer, controller=self.precision, dims=self.linear_dims, speed_model=self.speed_model,
            step=StepShape(c.training.num_microbatches, c.training.micro_batch_size, c.model.seq_length,
                           c.parallel.data_parallel_size),
            pipeline_stages=c.parallel.pipeline_model_parallel_size, virtual_stages=c.parallel.chunks_per_stage,
            seed=c.training.seed, recipe=recipe) if c.snip.enabled else None
        self.forward_backward = get_forward_backward_func()
        self.logger = MetricsLogger(c.logging, c.checkpoint.save, c.to_flags())
        self.timers = Timers(c.logging.timing_log_level)
        self.step_seconds: deque[float] = deque(maxlen=100)  # the recent iterations' times, for the ETA
        self.guard = NumericalGuard(c.safety)
        self.last_verdict: Verdict | None = None
        if c.safety.quant_health:
            self.precision.enable_health()
        # Plan changes with their reasons (SNIP cycles, promotions), saved in checkpoints.
        self.plan_history: list[dict] = list(start.resumed.precision_history if start.resumed else [])
        self._logged_plan: PrecisionPlan | None = None
        self._measured: tuple[int, HealthTable] | None = None  # the last fully measured health, and when
        # The resolved flags, beside every checkpoint and on TensorBoard's text panel.
        self.config_yaml = c.to_yaml(f"pretrain_llama.py's flags, resolved at start-up. Rerun with --yaml-cfg "
                                     f"{RUN_CONFIG_FILE} (flags given on the command line override it).")
        self.tokens_per_iteration = c.training.global_batch_size * c.model.seq_length
        self.flops_per_iteration = flops_per_token(c.model, self.tokenizer.vocab_size) * self.tokens_per_iteration

    # -- precision ---------------------------------------------------------
    def set_plan(self, plan: PrecisionPlan) -> None:
        """Make ``plan`` the run's plan (with the precision schedule on top) from the next step on;
        all ranks call this at the same iteration."""
        self.plan = plan
        self.apply_precision()

    def apply_precision(self) -> None:
        """Apply the plan, with the schedule's entries for the next step imposed, to every linear module."""
        effective = self.schedule.apply(self.plan, self.state.iteration + 1, self.linear_dims.num_layers)
        self.precision.apply(effective)
        self.effective_plan = effective
        self.flop_fractions = flop_fractions(effective, self.linear_dims)
        self.time_ratio = estimated_time_ratio(effective, self.linear_dims, self.speeds,
                                               module_speeds=self.speed_model.module_speeds())

    def formats_in_use(self) -> list[str]:
        """The precisions this run's GEMMs can take: its plan's, its schedule's and SNIP's candidates."""
        used = {side for p in (self.plan.default, *self.plan.modules.values()) for side in (p.fwd, p.bwd)}
        if self.snip is not None:
            used |= set(self.config.snip.snip_formats)
        used |= {entry.precision for entry in self.schedule.entries}
        return [f for f in PRECISION_NAMES if f in used]

    # -- checkpoints -------------------------------------------------------
    def resume(self) -> None:
        ckpt = self.config.checkpoint
        loaded = checkpointing.load_checkpoint(
            ckpt.load, [chunk.module for chunk in self.model], self.optimizer, self.scheduler,
            load_optim=not (ckpt.no_load_optim or ckpt.finetune), load_rng=not (ckpt.no_load_rng or ckpt.finetune),
            fully_parallel=ckpt.ckpt_fully_parallel_load, iteration=ckpt.load_iteration)
        if loaded is None:
            self.logger.text(f"no checkpoint in {ckpt.load}: starting from scratch")
            return
        record = loaded.record
        if not ckpt.finetune:
            self.state = TrainState(record.iteration, record.consumed_samples)
            if record.numerical_safety is not None:  # absent in older checkpoints
                self.guard.load_state_dict(record.numerical_safety)
            self.apply_precision()  # the plan itself was chosen at start-up (initial_plan)
        self.precision.load_quant_states(loaded.quantization)
        use_fused_adam(self.optimizer)  # the loaded parameter groups carry the saving run's choice
        self.logger.text(f"resumed from {ckpt.load} at iteration {record.iteration} "
                         f"(consumed samples {record.consumed_samples}); continuing at {self.state.iteration}")

    def save(self) -> None:
        ckpt = self.config.checkpoint
        path = checkpointing.save_checkpoint(
            ckpt.save, CheckpointRecord(
                self.state.iteration, self.config.to_flags(), self.state.consumed_samples,
                precision_plan=self.plan.to_dict(), precision_schedule=self.schedule.to_list(),
                numerical_safety=self.guard.state_dict(), precision_history=self.plan_history),
            [chunk.module for chunk in self.model], self.optimizer, self.scheduler,
            quantization=self.precision.quant_states(), save_optim=not ckpt.no_save_optim,
            save_rng=not ckpt.no_save_rng, files={RUN_CONFIG_FILE: self.config_yaml},
            fully_parallel=ckpt.ckpt_fully_parallel_save, retain_interval=ckpt.save_retain_interval)
        self.logger.text(f"saved checkpoint {path}")

    # -- steps -------------------------------------------------------------
    def batches(self, split: str, consumed: int) -> Iterator[dict]:
        """This DP rank's micro-batches of ``split`` from sample ``consumed`` on (a fresh loader)."""
        return micro_batches(getattr(self.datasets, split), self.config.training.micro_batch_size,
                             parallel_state.get_data_parallel_rank(),
                             parallel_state.get_data_parallel_world_size(), consumed, self.config.data.num_workers)

    def _run(self, data: Iterator[dict], forward_only: bool) -> list[dict]:
        if len(self.model) > 1:
            # The interleaved schedule reads one iterator per chunk, each the same micro-batches:
            # tee'd for this step, so ``data`` moves on by exactly one global batch.
            data = list(itertools.tee(data, len(self.model)))
        return self.forward_backward(
            forward_step_func=forward_step, data_iterator=data, model=self.model,
            num_microbatches=self.config.training.num_microbatches, seq_length=self.config.model.seq_length,
            micro_batch_size=self.config.training.micro_batch_size, forward_only=forward_only)

    def train_step(self, data: Iterator[dict]) -> StepResult:
        """One optimizer step over a global batch.

        Between the backward pass and the optimizer, every rank agrees on whether the step is
        finite (:class:`NumericalGuard`): a non-finite step raises on every rank (policy ``fail``)
        or is skipped (``skip``: weights, optimizer state and LR schedule untouched, data consumed).
        """
        start = time.perf_counter()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.config.safety.quant_health:  # everything on logged steps, else only the non-finite flags
            self.precision.reset_health(full=(self.state.iteration + 1) % self.config.logging.log_interval == 0)
        with self.timers.time("forward-backward"):
            losses = self._run(data, forward_only=False)
        self._release_memory(1)
        loss = mean_loss(losses)
        verdict = self.guard.check(self.model, loss, self.state.iteration + 1)
        self.last_verdict = verdict
        blamed, detail = self._blame(verdict)
        # The blamed modules one step up, if --promote-on-fault and any of them can go up.
        promoted, changes = promote(self.plan, blamed) if self.config.safety.promote_on_fault else (self.plan, {})
        if verdict.spike:
            self.logger.text(f"[safety] {verdict.describe()}{detail} (--check-for-spiky-loss; the update is applied)")
        # A non-finite step whose quantized culprit can be promoted is skipped, whatever the policy.
        applied = not verdict.nonfinite if changes else self.guard.should_apply(verdict, detail)
        grad_norm = num_zeros = None
        if applied:
            with self.timers.time("optimizer"):
                updated, grad_norm, num_zeros = self.optimizer.step()
            if updated:
                self.scheduler.step(increment=1)
        else:
            why = "--promote-on-fault" if changes else "--non-finite-grad-policy skip"
            self.logger.text(f"[safety] {verdict.describe()}{detail}; {why}: update skipped "
                             f"({self.guard.consecutive + 1} in a row, {self.guard.skipped + 1} in the run)")
        self.guard.record(verdict, applied)
        if changes:
            self._promote(promoted, changes, verdict)
        self.state.iteration += 1
        self.state.consumed_samples += self.config.training.global_batch_size
        self._release_memory(2)
        return StepResult(loss, None if grad_norm is None else float(grad_norm),
                          None if num_zeros is None else int(num_zeros), applied, time.perf_counter() - start)

    def _release_memory(self, level: int) -> None:
        """Megatron-LM's --empty-unused-memory-level: at ``level`` and above, hand the CUDA caching
        allocator's unused blocks back (for other processes on the GPU, or against fragmentation)."""
        if self.config.training.empty_unused_memory_level >= level and has_cuda():
            torch.cuda.empty_cache()

    def _blame(self, verdict: Verdict) -> tuple[list[str], str]:
        """On a non-finite step or a spike (all ranks): the quantized modules the health numbers blame, and
        "; " + what they show (nothing without --quant-health)."""
        if not self.config.safety.quant_health or not (verdict.nonfinite or verdict.spike):
            return [], ""
        table = gather_health(self.precision, self.linear_dims.num_layers)
        note = ""
        if verdict.spike and not table.full and self._measured is not None:  # errors are measured on logged steps
            table, note = self._measured[1], f" (measured at iteration {self._measured[0]})"
        blamed, detail = table.fault_modules(verdict.nonfinite)
        return blamed, f"; {detail}{note}" if detail else ""

    def _promote(self, plan: PrecisionPlan, changes: dict, verdict: Verdict) -> None:
        """Switch to the promoted ``plan`` (all ranks, the same) and record why in the plan history."""
        self.set_plan(plan)
        until = "the next SNIP cycle" if self.snip is not None else "the end of the run"
        self.plan_history.append({"iteration": verdict.iteration, "event": "promotion", "reason": verdict.describe(),
                                  "modules": {n: f"{old} -> {new}" for n, (old, new) in changes.items()}})
        self.logger.text(f"[safety] promoted {', '.join(f'{n} {old} -> {new}' for n, (old, new) in changes.items())} "
                         f"until {until} (--promote-on-fault)")

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over ``--eval-iters`` global batches (the same batches every time)."""
        eval_iters = self.config.logging.eval_iters
        if eval_iters == 0:
            return None
        for chunk in self.model:
            chunk.eval()
        data = self.batches("valid", 0)
        losses = []
        for _ in range(eval_iters):
            losses.append(self._run(data, forward_only=True))
            self._release_memory(1)
        for chunk in self.model:
            chunk.train()
        per_batch = [mean_loss(x) for x in losses]
        return None if per_batch[0] is None else sum(torch.stack(per_batch).tolist()) / len(per_batch)

    # -- the loop ----------------------------------------------------------
    def train(self, until: int | None = None) -> None:
        """Train to ``--train-iters`` (or to iteration ``until``), evaluating, re-planning and saving on the way.
        With --save, a run that stops (finished, a signal, --exit-duration-in-mins, --exit-interval) saves
        and then leaves its exit record for the SLURM script (training/requeue.py)."""
        c = self.config
        last = c.training.train_iters if until is None else until
        duration = c.training.exit_duration_in_mins
        exit_signal = ExitSignalHandler(None if duration is None else self.start_time + 60 * duration)
        if c.checkpoint.save and dist.get_rank() == 0:
            requeue.clear_record(c.checkpoint.save)  # an earlier run's: this run writes its own when it stops
        data = self.batches("train", self.state.consumed_samples)
        peak = peak_tflops(c.logging.peak_tflops)
        if peak is not None:
            self.logger.text(f"MFU is reported against a peak of {peak:g} TFLOP/s per GPU "
                             f"(dense BF16 of this GPU, or --peak-tflops)")
        # Time only the training steps: evaluation and checkpoint time would
        # otherwise deflate tokens/s.
        window = LogWindow()
        saved_at = self.state.iteration if c.checkpoint.load else None
        reason = None  # why the run stops, once it does (requeue.ExitRecord)
        if c.training.manual_gc:  # Megatron-LM's --manual-gc: every rank collects at the same iterations
            gc.disable()
            gc.collect()
        profiler = StepProfiler(c.logging, dist.get_rank())  # --profile
        while self.state.iteration < last:
            if self.state.iteration + 1 in self.schedule.starts():
                self.apply_precision()
                self.logger.text(f"precision schedule: from step {self.state.iteration + 1} on "
                                 f"{', '.join(map(str, self.schedule.active(self.state.iteration + 1)))}: "
                                 f"{self.flop_fractions.fp4:.1%} of linear FLOPs in FP4")
            profiler.before_step(self.state.iteration)
            step = self.train_step(data)
            profiler.after_step(self.state.iteration)
            window.add(step)
            self.step_seconds.append(step.seconds)
            it = self.state.iteration
            logged = it % c.logging.log_interval == 0
            params_norm = (self.params_norm() if c.logging.log_params_norm
                           and (logged or it % c.logging.tensorboard_log_interval == 0) else None)
            if it % c.logging.tensorboard_log_interval == 0:
                self._log_iteration(it, step, params_norm)
            if logged:
                self._log_progress(it, step, params_norm, window, peak)
                window = LogWindow()
                self._log_precision(it)
            if it % c.logging.eval_interval == 0 or it == c.training.train_iters:
                self._log_validation(it)
            if c.snip.due(it):
                self._snip_cycle(it)
            if c.training.manual_gc and c.training.manual_gc_interval and it % c.training.manual_gc_interval == 0:
                gc.collect()
            if c.checkpoint.save and c.checkpoint.save_interval and it % c.checkpoint.save_interval == 0:
                self.save()
                saved_at = it
            exit_signal.failed = self.logger.failure is not None
            reason = exit_signal.should_exit()
            if reason == RUN_FILES_FAILED:  # a full disk or a revoked mount on some rank: stop, all together
                exit_signal.close()
                raise RunFilesError(self.logger.failure or "another rank could not write a run file",
                                    own=self.logger.failure is not None)
            if reason == requeue.EXIT_DURATION:
                self.logger.text(f"--exit-duration-in-mins {duration:g}: {(time.time() - self.start_time) / 60:.2f} "
                                 f"minutes since start-up; saving at iteration {it} and exiting")
                break
            if reason is not None:
                self.logger.text(f"exit signal received: saving at iteration {it} and exiting ({reason})")
                break
            if c.training.exit_interval and it % c.training.exit_interval == 0:
                self.logger.text(f"--exit-interval {c.training.exit_interval}: exiting at iteration {it}")
                reason = requeue.EXIT_INTERVAL
                break
        exit_signal.close()
        profiler.close()
        if c.training.manual_gc:
            gc.enable()  # for whatever runs in this process after training (tools, tests)
        if self.state.iteration >= c.training.train_iters:  # whatever else asked to stop at the last one
            reason = requeue.FINISHED
        if c.checkpoint.save and saved_at != self.state.iteration:
            self.save()
        if c.checkpoint.save and reason is not None and dist.get_rank() == 0:  # the save above is complete
            try:
                requeue.write_record(c.checkpoint.save, requeue.ExitRecord(
                    self.state.iteration, reason, c.training.train_iters, time.time()))
            except OSError as e:  # reported after the last collective (pretrain)
                self.logger.run_file_failed(requeue.record_path(c.checkpoint.save), e)

    def _log_precision(self, iteration: int) -> None:
        """TensorBoard: the last step's quantization health (collective) and the plan image when it changed."""
        if self.config.safety.quant_health:
            table = gather_health(self.precision, self.linear_dims.num_layers)
            self._measured = (iteration, table)
            self.logger.scalars(table.scalars(), iteration)
        if self.effective_plan != self._logged_plan:
            self.logger.image(tags.PLAN_IMAGE, plan_image(
                self.effective_plan, self.linear_dims.num_layers,
                title=f"in force from iteration {iteration}: FP4 {self.flop_fractions.fp4:.1%}"), iteration)
            self._logged_plan = self.effective_plan

    def replan(self, iteration: int) -> CycleReport | None:
        """One SNIP cycle (all ranks) on the next global batch, its plan applied from the next step on;
        None when the precision schedule fixes every GEMM."""
        fixed = self.schedule.fixed(iteration + 1)
        if fixed["fwd"] and fixed["bwd"]:
            return None
        report = self.snip.cycle(iteration, self.batches("train", self.state.consumed_samples), self.plan, fixed)
        self.set_plan(report.plan)
        return report

    def _snip_cycle(self, iteration: int) -> None:
        """Re-plan (all ranks), report, and keep the statistics next to the checkpoints."""
        before = self.plan
        report = self.replan(iteration)
        if report is None:
            self.logger.text(f"[snip] iteration {iteration}: the precision schedule fixes every GEMM; no cycle")
            return
        self.plan_history.append({"iteration": iteration, "event": "snip cycle", "modules": {
            n: f"{old} -> {new}" for n, (old, new) in before.diff(self.plan, self.linear_dims.num_layers).items()}})
        log_cycle(self.logger, report, self.linear_dims.num_layers)
        if self.config.checkpoint.save:
            directory = os.path.join(self.config.checkpoint.save, "snip")
            try:
                path = self.snip.write_statistics(directory, iteration)
            except OSError as e:  # every rank stops at the next iteration
                self.logger.run_file_failed(directory, e)
                return
            if path:
                logging.getLogger(__name__).info("SNIP statistics written to %s", path)

    def params_norm(self) -> float:
        """Megatron-LM's params-norm (collective over the model-parallel ranks): the L2 norm of every
        trainable parameter counted once (no tensor-parallel duplicates, the tied output weight once)."""
        squares = torch.zeros((), dtype=torch.float64, device=current_device())
        for chunk in self.model:
            for p in chunk.module.parameters():
                if p.requires_grad and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                    squares += p.detach().double().square().sum()
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        return squares.sqrt().item()

    def learning_rate(self) -> float:
        """The scheduler's current learning rate (of the first parameter group)."""
        return self.scheduler.get_lr(self.optimizer.param_groups[0])

    def _log_iteration(self, iteration: int, step: StepResult, params_norm: float | None) -> None:
        """Every --tensorboard-log-interval: Megatron-LM's per-iteration scalars (with their ``vs samples``
        twins) and the precision and safety scalars, on TensorBoard and W&B."""
        if not self.logger.active:
            return
        c = self.config.logging
        megatron = {tags.LEARNING_RATE: self.learning_rate(), tags.BATCH_SIZE: self.config.training.global_batch_size}
        if step.applied and step.loss is not None:  # a skipped iteration has no loss to show, as in Megatron-LM
            megatron[tags.LM_LOSS] = step.loss
        if c.log_loss_scale_to_tensorboard:
            megatron[tags.LOSS_SCALE] = float(self.optimizer.get_loss_scale())
        if c.log_world_size_to_tensorboard:
            megatron[tags.WORLD_SIZE] = dist.get_world_size()
        if step.grad_norm is not None:
            megatron[tags.GRAD_NORM] = step.grad_norm
        if step.num_zeros is not None:
            megatron[tags.NUM_ZEROS] = step.num_zeros
        if params_norm is not None:
            megatron[tags.PARAMS_NORM] = params_norm
        self.logger.wandb_scalars({tags.SAMPLES_VS_STEPS: self.state.consumed_samples}, iteration)
        self.logger.scalars(megatron, iteration, samples=self.state.consumed_samples)
        ours = {tags.FP4_FRACTION: self.flop_fractions.fp4, tags.FP8_FRACTION: self.flop_fractions.fp8,
                tags.GEMM_TIME: self.time_ratio}
        if self.guard.config.check_nan:
            ours[tags.SKIPPED_ITERATIONS] = self.guard.skipped
        if self.guard.config.check_spiky_loss:
            ours[tags.SPIKY_LOSSES] = self.guard.spikes
        if c.log_memory_to_tensorboard and has_cuda():
            stats = torch.cuda.memory_stats()
            ours.update({tags.MEM_RESERVED: stats["reserved_bytes.all.current"],
                         tags.MEM_ALLOCATED: stats["allocated_bytes.all.current"],
                         tags.MEM_MAX_ALLOCATED: stats["allocated_bytes.all.peak"],
                         tags.MEM_ALLOCATED_COUNT: stats["allocation.all.current"]})
        self.logger.scalars(ours, iteration)

    def _log_progress(self, iteration: int, step: StepResult, params_norm: float | None, window: LogWindow,
                      peak: float | None) -> None:
        """Every --log-interval: the progress line (Megatron-LM's fields, then this program's, elapsed time and
        ETA) and the interval's timing scalars. Collective with --timing-log-level >= 1."""
        timers = self.timers.min_max(window.iterations)
        if not self.logger.active:
            return
        c, lc = self.config, self.config.logging
        per_iter = window.seconds / window.iterations
        tflops = self.flops_per_iteration / per_iter / dist.get_world_size() / 1e12
        device = "GPU" if has_cuda() else "process"
        fields = [("", f"iteration {iteration:8d}/{c.training.train_iters:8d}"),
                  ("consumed samples", f"{self.state.consumed_samples:12d}"),
                  ("elapsed time per iteration (ms)", f"{per_iter * 1000:.1f}")]
        if lc.log_throughput:
            fields.append((f"throughput per {device} (TFLOP/s/{device})", f"{tflops:.3g}"))
        fields += [("learning rate", f"{self.learning_rate():.6E}"),
                   ("global batch size", f"{c.training.global_batch_size:5d}")]
        if window.advanced and step.loss is not None:
            fields.append(("lm loss", f"{window.loss_sum / window.advanced:.6E}"))
        fields.append(("loss scale", f"{float(self.optimizer.get_loss_scale()):.1f}"))
        if step.grad_norm is not None:
            fields.append(("grad norm", f"{step.grad_norm:.3f}"))
        if step.num_zeros is not None:
            fields.append(("num zeros", str(step.num_zeros)))
        if params_norm is not None:
            fields.append(("params norm", f"{params_norm:.3f}"))
        fields += [("number of skipped iterations", f"{window.skipped:3d}"),
                   ("number of nan iterations", f"{window.nan:3d}"),
                   ("tokens per second", f"{self.tokens_per_iteration / per_iter:.0f}")]
        ours = {tags.TOKENS_PER_SECOND: self.tokens_per_iteration / per_iter}
        if peak is not None:
            ours[tags.MFU] = tflops / peak
            fields.append(("MFU", f"{tflops / peak:.1%}"))
        fields += [("fp4 flops fraction", f"{self.flop_fractions.fp4:.3f}"),
                   ("fp8 flops fraction", f"{self.flop_fractions.fp8:.3f}"),
                   (self.speed_model.ratio_label, f"{self.time_ratio:.3f}")]
        if self.guard.config.check_nan:
            fields.append(("skipped iterations in the run", str(self.guard.skipped)))
        if self.guard.config.check_spiky_loss:
            fields.append(("spiky losses in the run", str(self.guard.spikes)))
        if has_cuda():
            fields.append(("max memory allocated (GiB)", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"))
        else:
            import psutil

            rss = psutil.Process().memory_info().rss
            fields.append(("rss (GiB)", f"{rss / 2**30:.2f}"))
            if lc.log_memory_to_tensorboard:
                ours[tags.RSS] = rss
        recent = sum(self.step_seconds) / len(self.step_seconds)
        fields += [("elapsed", hms(time.time() - self.start_time)),
                   ("ETA", hms(recent * (c.training.train_iters - iteration)))]
        self.logger.text(progress_line("train", fields))
        if timers:
            self.logger.text("[train] (min, max) time across ranks (ms):" + "".join(
                f"\n    {(name + ' ').ljust(48, '.')}: ({low * 1000:.2f}, {high * 1000:.2f})"
                for name, (low, high) in timers.items()))
        megatron = {}
        if lc.log_timers_to_tensorboard:
            megatron[tags.ITERATION_TIME] = per_iter
            if lc.log_throughput:
                megatron[tags.THROUGHPUT] = tflops
            megatron.update({tags.timer(name): high for name, (_, high) in timers.items()})
        self.logger.scalars(megatron, iteration)
        self.logger.scalars(ours, iteration)

    def _log_validation(self, iteration: int) -> None:
        """Evaluate (all ranks) and log Megatron-LM's validation scalars."""
        c = self.config
        manual_gc = c.training.manual_gc and c.training.manual_gc_eval and c.logging.eval_iters > 0
        if manual_gc:
            gc.collect()
        val = self.evaluate()
        if manual_gc:
            gc.collect(generation=0)  # what the evaluation left, as in Megatron-LM
        if val is None or not self.logger.active:
            return
        ppl = math.exp(min(20.0, val))  # Megatron-LM's clamp
        line = (f"[valid] validation loss at iteration {iteration} | lm loss value: {val:.6E} | lm loss PPL: "
                f"{ppl:.6E} | unigram entropy: {self.datasets.unigram_entropy:.4f} |")
        self.logger.text("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        values = {tags.LM_LOSS_VALIDATION: val}
        if c.logging.log_validation_ppl_to_tensorboard:
            values[tags.LM_LOSS_VALIDATION_PPL] = ppl
        self.logger.scalars(values, iteration, samples=self.state.consumed_samples)
        self.logger.scalars({tags.UNIGRAM_ENTROPY: self.datasets.unigram_entropy}, iteration)




def build_trainer(config: RunConfig) -> Trainer:
    """Console logging, process groups and seeds, then the trainer (the entry point has set up the device)."""
    setup_console()
    initialize_distributed(config.parallel, config.training.seed)
    return Trainer(config)


def pretrain(config: RunConfig, on_build: Callable[[Trainer], None] | None = None) -> TrainState:
    """Build everything, resume if asked, train, and return the final state. The entry point has set
    up the device (``compat.device.setup_device``).

    ``on_build`` sees the built trainer before anything runs (test drivers instrument it there).
    """
    c = config
    trainer = build_trainer(c)
    if on_build is not None:
        on_build(trainer)
    log = trainer.logger
    par = c.parallel
    dtype = "bf16 (fp32 masters in the optimizer)" if c.model.bf16 else "fp32 (no --bf16)"
    log.text(f"model: {c.model.model_preset} shape, {num_parameters(c.model, trainer.tokenizer.vocab_size) / 1e6:.2f}M "
             f"parameters in {dtype}; TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} "
             f"DP={par.data_parallel_size}; global batch {c.training.global_batch_size} x {c.model.seq_length} tokens; "
             f"device {'cuda' if has_cuda() else 'cpu (megatron_snip.compat.cpu)'}")
    log.text(f"unigram entropy of the training data: {trainer.datasets.unigram_entropy:.4f} nats/token "
             f"(a model without context cannot beat this)")
    if dist.get_rank() == 0:  # partial saves, a damaged checkpoint --ckpt-fallback passes over
        for line in checkpointing.tidy(c.checkpoint.save, c.checkpoint.load, c.checkpoint.load_iteration):
            print(line, flush=True)
    dist.barrier()
    if c.checkpoint.load:
        trainer.resume()
    preformatted = "    " + trainer.config_yaml.replace("\n", "\n    ")
    log.panel(tags.CONFIG, preformatted, trainer.state.iteration)
    if c.model.transformer_impl == "transformer_engine":
        log.text(f"precision backend {describe_te_backend()}")
    else:
        log.text(f"precision backend {describe_backend(c.precision.recipe(), current_device())}")
    log.text(describe_execution(gemm_execution(trainer.formats_in_use(), c.precision.recipe(), c.model.transformer_impl,
                                               torch.cuda.get_device_capability() if has_cuda() else None)))
    fractions = trainer.flop_fractions
    prec = c.precision
    log.text(f"precision: plan {trainer.plan_source}: {fractions.fp4:.1%} of linear-layer FLOPs in FP4, "
             f"{fractions.fp8:.1%} in FP8; fp8 recipe {prec.fp8_recipe}/{prec.fp8_format}, fp4 {prec.fp4_recipe}"
             + "".join(f"; {note}" for note in prec.precision_notes))
    if trainer.pins_text:
        log.text(f"{trainer.pins_text}: never re-planned, counted in the budgets")
    for notice in c.logging.notices:  # flags accepted that change nothing here
        log.text(f"notice: {notice}")
    if trainer.schedule:
        log.text(f"precision schedule ({trainer.schedule_source}): {' '.join(trainer.schedule.to_list())}")
    log.text(describe_speed_model(c, trainer.speed_model, trainer.time_ratio))
    if c.training.skip_train:
        trainer._log_validation(trainer.state.iteration)
    else:
        trainer.train()
    log.close()
    dist.barrier()
    if log.failure is not None:  # after the last collective: the exit record (the others finished)
        raise RunFilesError(log.failure, own=True)
    return trainer.state


"""The training loop: build, (resume,) train, evaluate, checkpoint.

Read :func:`pretrain` top to bottom. Everything parallel is megatron-core's:
the pipeline schedule from ``get_forward_backward_func``, DDP, the optimizer,
``dist_checkpointing``. This file only sequences them; helpers own the rest: the logs
(``training/progress.py``), the plan in force and its history (``training/plan_state.py``),
numerical safety (``training/safety.py``), SNIP (``snip/replanner.py``), the run's checkpoints
(``training/run_checkpoint.py``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_snip.compat.device import has_cuda
from megatron_snip.data.datasets import megatron_num_samples
from megatron_snip.data.loader import micro_batches
from megatron_snip.data.tokenizer import build_tokenizer
from megatron_snip.model.compile import CompileLog
from megatron_snip.model.llama import (
    build_model,
    flops_per_token,
    num_parameters,
    padded_vocab_size,
    transformer_config,
)
from megatron_snip.model.quantized.controller import PrecisionController
from megatron_snip.model.quantized.te_layers import prepare_te_environment
from megatron_snip.model.step import forward_step, mean_loss
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.planner import PlannerConfig
from megatron_snip.snip.replanner import CycleReport, SnipReplanner, StepShape
from megatron_snip.training import checkpointing, requeue, run_checkpoint
from megatron_snip.training.config import RunConfig
from megatron_snip.training.cycle_log import log_cycle
from megatron_snip.training.data import build_datasets
from megatron_snip.training.logger import RunFilesError, setup_console
from megatron_snip.training.plan_state import PlanState
from megatron_snip.training.precision_setup import speed_model
from megatron_snip.training.profiling import StepProfiler
from megatron_snip.training.progress import StepResult, TrainingLogger, model_params_norm
from megatron_snip.training.run_checkpoint import TrainState
from megatron_snip.training.safety import NumericalGuard
from megatron_snip.training.setup import (
    build_optimizer,
    build_scheduler,
    initialize_distributed,
    wrap_ddp,
)
from megatron_snip.training.signals import RUN_FILES_FAILED, ExitSignalHandler
from megatron_snip.training.time_check import TimeTargetCheck
from megatron_snip.training.timers import Timers


class Trainer:
    """Owns the model chunks, optimizer, scheduler and data for one run."""

    def __init__(self, config: RunConfig):
        self.config = c = config
        self.start_time = time.time()  # --exit-duration-in-mins counts from start-up, as in Megatron-LM
        self.tokenizer = build_tokenizer(c.data.tokenizer_type, c.data.tokenizer_model, c.model.vocab_size)
        self.datasets = build_datasets(
            c.data, self.tokenizer, seq_length=c.model.seq_length, seed=c.training.seed,
            num_samples=megatron_num_samples(max(c.training.train_iters, 1), c.logging.eval_iters,
                                             c.logging.eval_interval, c.training.global_batch_size,
                                             c.training.train_samples))
        if c.model.deterministic_mode:  # as Megatron-LM: deterministic kernels for everything torch runs
            torch.use_deterministic_algorithms(True)
        self.transformer_config = transformer_config(c.model, c.parallel)
        recipe = c.precision.recipe()
        if c.model.transformer_impl == "transformer_engine":
            prepare_te_environment(recipe)
        self.model = wrap_ddp(c.parallel, self.transformer_config,
                              build_model(c.model, c.parallel, self.transformer_config, self.tokenizer.vocab_size),
                              check_for_large_grads=c.safety.check_for_large_grads)
        self.precision = PrecisionController(self.model, recipe=recipe, seed=c.training.seed)
        self.linear_dims = LlamaLinearDims.from_config(self.transformer_config)
        self.speed_model = speed_model(c, self.linear_dims)
        self.state = TrainState()
        start = c.start  # decided once by arguments.resolve
        self.plans = PlanState(self.precision, start.plan, start.schedule, self.linear_dims, self.speed_model,
                               self.speed_model.precision_speeds(recipe),
                               history=start.resumed.precision_history if start.resumed else ())
        self.optimizer = build_optimizer(c.training, c.model, c.parallel, self.model,
                                         count_zeros=c.logging.log_num_zeros_in_grad)
        self.scheduler = build_scheduler(c.training, self.optimizer,
                                         override=c.checkpoint.override_opt_param_scheduler)
        self.snip = SnipReplanner(
            c.snip, PlannerConfig.from_snip(c.snip, recipe, self.speed_model, dict(start.pins)), chunks=self.model,
            optimizer=self.optimizer, controller=self.precision, dims=self.linear_dims, speed_model=self.speed_model,
            step=StepShape(c.training.num_microbatches, c.training.micro_batch_size, c.model.seq_length,
                           c.parallel.data_parallel_size),
            layout=c.parallel.pipeline_layout(c.model.num_layers),
            seed=c.training.seed, recipe=recipe) if c.snip.enabled else None
        self.time_check = TimeTargetCheck.of_run(c, self.speed_model, self.precision.module_names())
        self.forward_backward = get_forward_backward_func()
        self.timers = Timers(c.logging.timing_log_level)
        self.guard = NumericalGuard(c.safety)
        self.compile_log = CompileLog() if c.model.torch_compile else None
        if c.safety.quant_health:
            self.precision.enable_health()
        # The resolved flags, beside every checkpoint and on TensorBoard's text panel.
        self.config_yaml = c.to_yaml(f"pretrain_llama.py's flags, resolved at start-up. Rerun with --yaml-cfg "
                                     f"{run_checkpoint.RUN_CONFIG_FILE} (flags given on the command line override it).")
        # The output layer's rows (the vocabulary padded as megatron-core pads it, or the checkpoint's).
        self.vocab_rows = c.model.padded_vocab_size or padded_vocab_size(
            self.tokenizer.vocab_size, c.model.make_vocab_size_divisible_by, c.parallel.tensor_model_parallel_size)
        # Model FLOPs of one global batch, as Megatron-LM's num_floating_point_operations counts them.
        self.flops_per_iteration = (flops_per_token(c.model, self.vocab_rows)
                                    * c.training.global_batch_size * c.model.seq_length)
        self._plan_file_notice = False  # said once: the plan has no --te-precision-config-file form
        self.logger = TrainingLogger(c, optimizer=self.optimizer, scheduler=self.scheduler, guard=self.guard,
                                     plans=self.plans, flops_per_iteration=self.flops_per_iteration,
                                     start_time=self.start_time)

    def set_plan(self, plan: PrecisionPlan) -> None:
        """Make ``plan`` the run's plan (with the precision schedule on top) from the next step on;
        all ranks call this at the same iteration."""
        self.plans.set_plan(plan, self.state.iteration + 1)

    # -- checkpoints (training/run_checkpoint.py) ---------------------------
    def resume(self) -> None:
        run_checkpoint.resume(self)

    def save(self) -> None:
        run_checkpoint.save(self)

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
        promoted, changes, detail = self.plans.fault_response(verdict, self.config.safety)
        if verdict.spike:
            self.logger.text(f"[safety] {verdict.describe()}{detail} (--check-for-spiky-loss; the update is applied)")
        # A non-finite step whose quantized culprit can be promoted is skipped, whatever the policy.
        applied = not verdict.nonfinite if changes else self.guard.should_apply(verdict, detail)
        grad_norm = num_zeros = None
        if applied:
            with self.timers.time("optimizer"):
                updated, grad_norm, num_zeros = self.optimizer.step()
            if updated:  # Megatron-LM counts the schedule in samples
                self.scheduler.step(increment=self.config.training.global_batch_size)
        else:
            why = "--promote-on-fault" if changes else "--non-finite-grad-policy skip"
            self.logger.text(f"[safety] {verdict.describe()}{detail}; {why}: update skipped "
                             f"({self.guard.consecutive + 1} in a row, {self.guard.skipped + 1} in the run)")
        self.guard.record(verdict, applied)
        if changes:
            until = "the next SNIP cycle" if self.snip is not None else "the end of the run"
            self.logger.text(self.plans.promote(promoted, changes, verdict, until))
        self.state.iteration += 1
        self.state.consumed_samples += self.config.training.global_batch_size
        self.state.floating_point_operations += self.flops_per_iteration  # every iteration, as Megatron-LM counts
        self._release_memory(2)
        return StepResult(loss, None if grad_norm is None else float(grad_norm),
                          None if num_zeros is None else int(num_zeros), applied, time.perf_counter() - start)

    def _release_memory(self, level: int) -> None:
        """Megatron-LM's --empty-unused-memory-level: at ``level`` and above, hand the CUDA caching
        allocator's unused blocks back (for other processes on the GPU, or against fragmentation)."""
        if self.config.training.empty_unused_memory_level >= level and has_cuda():
            torch.cuda.empty_cache()

    @torch.no_grad()
    def evaluate(self, iteration: int) -> None:
        """The mean validation loss over ``--eval-iters`` global batches (the same batches every time; all
        ranks), logged as Megatron-LM's."""
        c = self.config
        if c.logging.eval_iters == 0:
            return
        if c.training.manual_gc and c.training.manual_gc_eval:
            gc.collect()
        for chunk in self.model:
            chunk.eval()
        data = self.batches("valid", 0)
        losses = []
        for _ in range(c.logging.eval_iters):
            losses.append(self._run(data, forward_only=True))
            self._release_memory(1)
        for chunk in self.model:
            chunk.train()
        per_batch = [mean_loss(x) for x in losses]
        if c.training.manual_gc and c.training.manual_gc_eval:
            gc.collect(generation=0)  # what the evaluation left, as in Megatron-LM
        if per_batch[0] is not None:  # the last stage
            self.logger.validation(iteration, sum(torch.stack(per_batch).tolist()) / len(per_batch),
                                   self.datasets.unigram_entropy, self.state.consumed_samples)

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
        # Time only the training steps: evaluation and checkpoint time would otherwise deflate tokens/s.
        self.logger.training_starts()
        saved_at = self.state.iteration if c.checkpoint.load_dir else None
        reason = None  # why the run stops, once it does (requeue.ExitRecord)
        if c.training.manual_gc:  # Megatron-LM's --manual-gc: every rank collects at the same iterations
            gc.disable()
            gc.collect()
        profiler = StepProfiler(c.logging, dist.get_rank())  # --profile
        while self.state.iteration < last:
            if self.state.iteration + 1 in self.plans.schedule.starts():
                self.logger.text(self.plans.schedule_starts(self.state.iteration + 1))
            profiler.before_step(self.state.iteration)
            step = self.train_step(data)
            profiler.after_step(self.state.iteration)
            self.logger.add(step)
            it = self.state.iteration
            logged = it % c.logging.log_interval == 0
            params_norm = (model_params_norm(self.model) if c.logging.log_params_norm
                           and (logged or it % c.logging.tensorboard_log_interval == 0) else None)
            if it % c.logging.tensorboard_log_interval == 0:
                self.logger.iteration(it, step, self.state.consumed_samples, params_norm)
            if logged:
                window = self.logger.progress(it, step, self.state.consumed_samples, params_norm, self.timers)
                self.logger.precision(it, self.plans.health(it) if c.safety.quant_health else None)
                if self.compile_log is not None:
                    self.logger.text(self.compile_log.line())
                if self.time_check is not None:
                    self.logger.text(self.time_check.window(it, window, self.plans.since, self.plans.all_bf16))
            if it % c.logging.eval_interval == 0 or it == c.training.train_iters:
                self.evaluate(it)
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

    def replan(self, iteration: int) -> CycleReport | None:
        """One SNIP cycle (all ranks) on the next global batch, its plan applied from the next step on;
        None when the precision schedule fixes every GEMM."""
        fixed = self.plans.schedule.fixed(iteration + 1)
        if fixed["fwd"] and fixed["bwd"]:
            return None
        report = self.snip.cycle(iteration, self.batches("train", self.state.consumed_samples), self.plans.plan, fixed)
        self.plans.replanned(iteration, report.plan)
        return report

    def _snip_cycle(self, iteration: int) -> None:
        """Re-plan (all ranks), report, and keep the statistics next to the checkpoints."""
        report = self.replan(iteration)
        if report is None:
            self.logger.text(f"[snip] iteration {iteration}: the precision schedule fixes every GEMM; no cycle")
            return
        log_cycle(self.logger, report, self.linear_dims.num_layers)
        if self.time_check is not None:
            self.logger.text(self.time_check.replanned(iteration, self.plans.all_bf16))
        if self.config.checkpoint.save:
            directory = os.path.join(self.config.checkpoint.save, "snip")
            try:
                path = self.snip.write_statistics(directory, iteration)
            except OSError as e:  # every rank stops at the next iteration
                self.logger.run_file_failed(directory, e)
                return
            if path:
                logging.getLogger(__name__).info("SNIP statistics written to %s", path)



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
    log.model_lines(num_parameters(c.model, trainer.tokenizer.vocab_size), trainer.datasets.unigram_entropy,
                    c.parallel.pipeline_layout(c.model.num_layers).layers_per_stage())
    if dist.get_rank() == 0:  # partial saves, a damaged checkpoint --ckpt-fallback passes over
        for line in checkpointing.tidy(c.checkpoint.save, c.checkpoint.load_dir, c.checkpoint.load_iteration):
            print(line, flush=True)
    dist.barrier()
    if c.checkpoint.load_dir:
        trainer.resume()
    log.precision_lines(trainer.state.iteration, trainer.config_yaml, c.start.plan_source, c.start.schedule_source,
                        c.start.pins_text)
    if c.training.skip_train:
        trainer.evaluate(trainer.state.iteration)
    else:
        trainer.train()
    log.close()
    dist.barrier()
    if log.failure is not None:  # after the last collective: the exit record (the others finished)
        raise RunFilesError(log.failure, own=True)
    return trainer.state

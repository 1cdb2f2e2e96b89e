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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

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
from megatron_snip.snip.replanner import CycleReport, SnipReplanner, StepShape, log_cycle
from megatron_snip.training import checkpointing, requeue
from megatron_snip.training.checkpoint_record import CheckpointRecord
from megatron_snip.training.config import RunConfig
from megatron_snip.training.data import build_datasets
from megatron_snip.training.logger import MetricsLogger, peak_tflops, setup_console
from megatron_snip.training.precision import speed_model
from megatron_snip.training.quant_health import HealthTable, gather_health, promote
from megatron_snip.training.safety import NumericalGuard, Verdict
from megatron_snip.training.setup import build_optimizer, build_scheduler, initialize_distributed, wrap_ddp
from megatron_snip.training.signals import ExitSignalHandler

RUN_CONFIG_FILE = "run_config.yaml"  # in every checkpoint's directory


@dataclass
class TrainState:
    """Where training is: saved in every checkpoint, restored on resume."""

    iteration: int = 0
    consumed_samples: int = 0


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
        self.optimizer = build_optimizer(c.training, c.model, c.parallel, self.model)
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
        self.logger = MetricsLogger(c.logging.tensorboard_dir)
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
        self.time_ratio = estimated_time_ratio(effective, self.linear_dims, self.speeds)

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
            fully_parallel=ckpt.ckpt_fully_parallel_load)
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

    def train_step(self, data: Iterator[dict]) -> tuple[float | None, float]:
        """One optimizer step over a global batch. Returns (loss or None off the last stage, grad norm).

        Between the backward pass and the optimizer, every rank agrees on whether the step is
        finite (:class:`NumericalGuard`): a non-finite step raises on every rank (policy ``fail``)
        or is skipped (``skip``: weights, optimizer state and LR schedule untouched, data consumed).
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.config.safety.quant_health:  # everything on logged steps, else only the non-finite flags
            self.precision.reset_health(full=(self.state.iteration + 1) % self.config.logging.log_interval == 0)
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
        grad_norm = math.nan
        if applied:
            updated, grad_norm, _ = self.optimizer.step()
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
        return loss, float(grad_norm or 0.0)

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
        return None if per_batch[0] is None else sum(per_batch) / len(per_batch)

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
        window_loss, window_iters, window_seconds = 0.0, 0, 0.0
        saved_at = self.state.iteration if c.checkpoint.load else None
        reason = None  # why the run stops, once it does (requeue.ExitRecord)
        if c.training.manual_gc:  # Megatron-LM's --manual-gc: every rank collects at the same iterations
            gc.disable()
            gc.collect()
        while self.state.iteration < last:
            if self.state.iteration + 1 in self.schedule.starts():
                self.apply_precision()
                self.logger.text(f"precision schedule: from step {self.state.iteration + 1} on "
                                 f"{', '.join(map(str, self.schedule.active(self.state.iteration + 1)))}: "
                                 f"{self.flop_fractions.fp4:.1%} of linear FLOPs in FP4")
            start = time.perf_counter()
            loss, grad_norm = self.train_step(data)
            window_seconds += time.perf_counter() - start
            window_iters += 1
            window_loss += loss or 0.0
            it = self.state.iteration
            if it % c.logging.log_interval == 0:
                self.logger.log(it, self._metrics(window_loss / window_iters, grad_norm,
                                                  window_seconds / window_iters, peak))
                window_loss, window_iters, window_seconds = 0.0, 0, 0.0
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
            reason = exit_signal.should_exit()
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
        if c.training.manual_gc:
            gc.enable()  # for whatever runs in this process after training (tools, tests)
        if self.state.iteration >= c.training.train_iters:  # whatever else asked to stop at the last one
            reason = requeue.FINISHED
        if c.checkpoint.save and saved_at != self.state.iteration:
            self.save()
        if c.checkpoint.save and reason is not None and dist.get_rank() == 0:  # the save above is complete
            requeue.write_record(c.checkpoint.save, requeue.ExitRecord(
                self.state.iteration, reason, c.training.train_iters, time.time()))

    def _log_precision(self, iteration: int) -> None:
        """TensorBoard: the last step's quantization health (collective) and the plan image when it changed."""
        if self.config.safety.quant_health:
            table = gather_health(self.precision, self.linear_dims.num_layers)
            self._measured = (iteration, table)
            self.logger.scalars(table.scalars(), iteration)
        if self.effective_plan != self._logged_plan:
            self.logger.image("precision/plan", plan_image(
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
            path = self.snip.write_statistics(os.path.join(self.config.checkpoint.save, "snip"), iteration)
            if path:
                logging.getLogger(__name__).info("SNIP statistics written to %s", path)

    def _metrics(self, loss: float, grad_norm: float, seconds_per_iter: float, peak: float | None) -> dict:
        world = dist.get_world_size()
        tflops_per_device = self.flops_per_iteration / seconds_per_iter / world / 1e12
        device = "GPU" if has_cuda() else "process"
        m = {
            "consumed samples": self.state.consumed_samples,
            "lm loss": loss,
            "learning rate": self.scheduler.get_lr(self.optimizer.param_groups[0]),
            "grad norm": grad_norm,
            "tokens per second": self.tokens_per_iteration / seconds_per_iter,
            "seconds per iteration": seconds_per_iter,
            f"TFLOPs per {device}": tflops_per_device,
            "fp4 flops fraction": self.flop_fractions.fp4,
            "fp8 flops fraction": self.flop_fractions.fp8,
            "estimated gemm time vs bf16": self.time_ratio,
        }
        if self.guard.config.check_nan:
            m["skipped iterations"] = self.guard.skipped
        if self.guard.config.check_spiky_loss:
            m["spiky losses"] = self.guard.spikes
        if peak is not None:
            m["MFU"] = tflops_per_device / peak
        if has_cuda():
            m["max memory allocated GiB"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            import psutil

            m["rss GiB"] = psutil.Process().memory_info().rss / 2**30
        return m

    def _log_validation(self, iteration: int) -> None:
        c = self.config
        manual_gc = c.training.manual_gc and c.training.manual_gc_eval and c.logging.eval_iters > 0
        if manual_gc:
            gc.collect()
        val = self.evaluate()
        if manual_gc:
            gc.collect(generation=0)  # what the evaluation left, as in Megatron-LM
        if val is not None:
            self.logger.log(iteration, {"lm loss": val, "ppl": math.exp(min(val, 50.0)),
                                        "unigram entropy": self.datasets.unigram_entropy}, prefix="valid")


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
    if c.checkpoint.load:
        trainer.resume()
    log.panel("config", "    " + trainer.config_yaml.replace("\n", "\n    "), trainer.state.iteration)  # preformatted
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
    if trainer.schedule:
        log.text(f"precision schedule ({trainer.schedule_source}): {' '.join(trainer.schedule.to_list())}")
    log.text(f"GEMM speed model {trainer.speed_model.describe()}"
             + "".join(f"; {note}" for note in trainer.speed_model.notes)
             + f". Estimated linear-GEMM time of the plan: {trainer.time_ratio:.3f} of all-bf16 (an estimate: "
               "'estimated gemm time vs bf16' in the logs)")
    if c.training.skip_train:
        trainer._log_validation(trainer.state.iteration)
    else:
        trainer.train()
    log.close()
    dist.barrier()
    return trainer.state


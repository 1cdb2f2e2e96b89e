"""What a training run tells its user: the start-up lines, Megatron-LM's progress line and per-iteration
scalars, validation, and the precision panels, written by :class:`TrainingLogger` to the sinks of
:class:`~megatron_snip.training.logger.MetricsLogger` (console, TensorBoard, W&B, ``SAVE/metrics.jsonl``).

Tags are ``training/tags.py``'s; field names and formats are Megatron-LM's (``training_log`` and
``evaluate_and_print_results`` in ``megatron/training/training.py``), this program's fields after them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_snip.compat.device import current_device, has_cuda
from megatron_snip.model.quantized.te_layers import describe_te_backend
from megatron_snip.numerics.linear import describe_backend
from megatron_snip.precision.execution import describe_execution, gemm_execution
from megatron_snip.snip.plan_image import plan_image
from megatron_snip.training import tags
from megatron_snip.training.config import RunConfig
from megatron_snip.training.logger import MetricsLogger, hms, peak_tflops, progress_line
from megatron_snip.training.plan_state import PlanState
from megatron_snip.training.precision_setup import describe_speed_model
from megatron_snip.training.quant_health import HealthTable
from megatron_snip.training.safety import NumericalGuard
from megatron_snip.training.timers import Timers


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


def model_params_norm(chunks) -> float:
    """Megatron-LM's params-norm of the model ``chunks`` (collective over the model-parallel ranks): the L2
    norm of every trainable parameter counted once (no tensor-parallel duplicates, the tied output weight
    once)."""
    squares = torch.zeros((), dtype=torch.float64, device=current_device())
    for chunk in chunks:
        for p in chunk.module.parameters():
            if p.requires_grad and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                squares += p.detach().double().square().sum()
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return squares.sqrt().item()


class TrainingLogger(MetricsLogger):
    """The run's logging: the sinks of :class:`MetricsLogger`, and every line and scalar the trainer reports
    (it reads the learning rate, the loss scale, the plan in force and the safety counts itself). It keeps
    the current :class:`LogWindow` and the recent step times (the ETA) on every rank; it writes on the
    logging rank only."""

    def __init__(self, config: RunConfig, *, optimizer, scheduler, guard: NumericalGuard, plans: PlanState,
                 flops_per_iteration: float, start_time: float):
        """``flops_per_iteration``: model FLOPs of one global batch; ``start_time``: the run's start-up
        (``time.time()``), for the elapsed time."""
        super().__init__(config.logging, config.checkpoint.save, config.to_flags())
        self.config = config
        self.optimizer, self.scheduler, self.guard, self.plans = optimizer, scheduler, guard, plans
        self.tokens_per_iteration = config.training.global_batch_size * config.model.seq_length
        self.flops_per_iteration = flops_per_iteration
        self.start_time = start_time
        self.window = LogWindow()
        self.step_seconds: deque[float] = deque(maxlen=100)  # the recent iterations' times, for the ETA
        self.peak = peak_tflops(config.logging.peak_tflops)
        self._logged_plan = None  # the plan the last plan image shows

    # -- start-up ---------------------------------------------------------
    def model_lines(self, parameters: int, unigram_entropy: float) -> None:
        """The model, layout and batch; the data's unigram entropy."""
        c = self.config
        par = c.parallel
        dtype = "bf16 (fp32 masters in the optimizer)" if c.model.bf16 else "fp32 (no --bf16)"
        self.text(f"model: {c.model.model_preset} shape, {parameters / 1e6:.2f}M "
                  f"parameters in {dtype}; TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} "
                  f"{f'CP={par.context_parallel_size} ' if par.context_parallel_size > 1 else ''}"
                  f"DP={par.data_parallel_size}; global batch {c.training.global_batch_size} x {c.model.seq_length} "
                  f"tokens; device {'cuda' if has_cuda() else 'cpu (megatron_snip.compat.cpu)'}")
        self.text(f"unigram entropy of the training data: {unigram_entropy:.4f} nats/token "
                  f"(a model without context cannot beat this)")

    def precision_lines(self, iteration: int, config_yaml: str, plan_source: str, schedule_source: str,
                        pins_text: str) -> None:
        """After a resume: the flags on TensorBoard's text panel, then the precision backend and its kernels,
        the plan, the pins, the notices, the schedule and the GEMM speed model."""
        c, plans = self.config, self.plans
        self.panel(tags.CONFIG, "    " + config_yaml.replace("\n", "\n    "), iteration)
        if c.model.transformer_impl == "transformer_engine":
            self.text(f"precision backend {describe_te_backend()}")
        else:
            self.text(f"precision backend {describe_backend(c.precision.recipe(), current_device())}")
        formats = plans.formats_in_use(c.snip.snip_formats if c.snip.enabled else ())
        self.text(describe_execution(gemm_execution(formats, c.precision.recipe(), c.model.transformer_impl,
                                                    torch.cuda.get_device_capability() if has_cuda() else None)))
        fractions, prec = plans.flop_fractions, c.precision
        self.text(f"precision: plan {plan_source}: {fractions.fp4:.1%} of linear-layer FLOPs in FP4, "
                  f"{fractions.fp8:.1%} in FP8; fp8 recipe {prec.fp8_recipe}/{prec.fp8_format}, fp4 {prec.fp4_recipe}"
                  + "".join(f"; {note}" for note in prec.precision_notes))
        if pins_text:
            self.text(f"{pins_text}: never re-planned, counted in the budgets")
        for notice in c.logging.notices:  # flags accepted that change nothing here
            self.text(f"notice: {notice}")
        if plans.schedule:
            self.text(f"precision schedule ({schedule_source}): {' '.join(plans.schedule.to_list())}")
        self.text(describe_speed_model(c, plans.speed_model, plans.time_ratio))

    def training_starts(self) -> None:
        """At each start of the loop: a fresh window (evaluation and checkpoint time stay out of it), and
        what MFU is measured against."""
        self.window = LogWindow()
        if self.peak is not None:
            self.text(f"MFU is reported against a peak of {self.peak:g} TFLOP/s per GPU "
                      f"(dense BF16 of this GPU, or --peak-tflops)")

    def add(self, step: StepResult) -> None:
        """Count a training step in the window and the ETA."""
        self.window.add(step)
        self.step_seconds.append(step.seconds)

    def learning_rate(self) -> float:
        """The scheduler's current learning rate (of the first parameter group)."""
        return self.scheduler.get_lr(self.optimizer.param_groups[0])

    # -- every --tensorboard-log-interval, every --log-interval ----------------
    def iteration(self, iteration: int, step: StepResult, consumed_samples: int, params_norm: float | None) -> None:
        """Every --tensorboard-log-interval: Megatron-LM's per-iteration scalars (with their ``vs samples``
        twins) and the precision and safety scalars, on TensorBoard and W&B."""
        if not self.active:
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
        self.wandb_scalars({tags.SAMPLES_VS_STEPS: consumed_samples}, iteration)
        self.scalars(megatron, iteration, samples=consumed_samples)
        fractions = self.plans.flop_fractions
        ours = {tags.FP4_FRACTION: fractions.fp4, tags.FP8_FRACTION: fractions.fp8,
                tags.GEMM_TIME: self.plans.time_ratio}
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
        self.scalars(ours, iteration)

    def progress(self, iteration: int, step: StepResult, consumed_samples: int, params_norm: float | None,
                 timers: Timers) -> LogWindow:
        """Every --log-interval: the progress line (Megatron-LM's fields, then this program's, elapsed time and
        ETA) and the interval's timing scalars; a fresh window, and the one it closed. Collective with
        --timing-log-level >= 1 (the timers' min and max over ranks)."""
        window, self.window = self.window, LogWindow()
        ranked = timers.min_max(window.iterations)
        if self.active:
            self._progress(iteration, step, consumed_samples, params_norm, window, ranked)
        return window

    def _progress(self, iteration: int, step: StepResult, consumed_samples: int, params_norm: float | None,
                  window: LogWindow, timers: dict[str, tuple[float, float]]) -> None:
        c, lc, peak = self.config, self.config.logging, self.peak
        per_iter = window.seconds / window.iterations
        tflops = self.flops_per_iteration / per_iter / dist.get_world_size() / 1e12
        device = "GPU" if has_cuda() else "process"
        fields = [("", f"iteration {iteration:8d}/{c.training.train_iters:8d}"),
                  ("consumed samples", f"{consumed_samples:12d}"),
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
        fractions = self.plans.flop_fractions
        fields += [("fp4 flops fraction", f"{fractions.fp4:.3f}"),
                   ("fp8 flops fraction", f"{fractions.fp8:.3f}"),
                   (self.plans.speed_model.ratio_label, f"{self.plans.time_ratio:.3f}")]
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
        self.text(progress_line("train", fields))
        if timers:
            self.text("[train] (min, max) time across ranks (ms):" + "".join(
                f"\n    {(name + ' ').ljust(48, '.')}: ({low * 1000:.2f}, {high * 1000:.2f})"
                for name, (low, high) in timers.items()))
        megatron = {}
        if lc.log_timers_to_tensorboard:
            megatron[tags.ITERATION_TIME] = per_iter
            if lc.log_throughput:
                megatron[tags.THROUGHPUT] = tflops
            megatron.update({tags.timer(name): high for name, (_, high) in timers.items()})
        self.scalars(megatron, iteration)
        self.scalars(ours, iteration)

    def precision(self, iteration: int, health: HealthTable | None) -> None:
        """TensorBoard: the last step's quantization ``health`` (with --quant-health) and the plan image
        when the plan in force changed."""
        if health is not None:
            self.scalars(health.scalars(), iteration)
        plans = self.plans
        if plans.effective_plan != self._logged_plan:
            self.image(tags.PLAN_IMAGE, plan_image(
                plans.effective_plan, plans.dims.num_layers,
                title=f"in force from iteration {iteration}: FP4 {plans.flop_fractions.fp4:.1%}"), iteration)
            self._logged_plan = plans.effective_plan

    def validation(self, iteration: int, loss: float, unigram_entropy: float, consumed_samples: int) -> None:
        """Megatron-LM's validation lines and scalars for the mean validation ``loss``."""
        if not self.active:
            return
        ppl = math.exp(min(20.0, loss))  # Megatron-LM's clamp
        line = (f"[valid] validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: "
                f"{ppl:.6E} | unigram entropy: {unigram_entropy:.4f} |")
        self.text("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        values = {tags.LM_LOSS_VALIDATION: loss}
        if self.config.logging.log_validation_ppl_to_tensorboard:
            values[tags.LM_LOSS_VALIDATION_PPL] = ppl
        self.scalars(values, iteration, samples=consumed_samples)
        self.scalars({tags.UNIGRAM_ENTROPY: unigram_entropy}, iteration)

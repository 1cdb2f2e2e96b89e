"""The training loop: build, (resume,) train, evaluate, checkpoint.

Read :func:`pretrain` top to bottom. Everything parallel is megatron-core's:
the pipeline schedule from ``get_forward_backward_func``, DDP, the optimizer,
``dist_checkpointing``. This file only sequences them.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_snip.data.loader import micro_batches
from megatron_snip.data.tokenizer import build_tokenizer
from megatron_snip.model.llama import build_model, flops_per_token, num_parameters, transformer_config
from megatron_snip.model.precision_control import PrecisionController
from megatron_snip.model.te_precision import describe_te_backend, prepare_te_environment
from megatron_snip.precision.flops import LlamaLinearDims, estimated_time_ratio, flop_fractions
from megatron_snip.precision.linear import describe_backend
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.manager import PrecisionManager, log_cycle
from megatron_snip.snip.plan_image import plan_image
from megatron_snip.training import checkpointing
from megatron_snip.training.data import build_datasets_from_args
from megatron_snip.training.logger import MetricsLogger, peak_tflops, setup_console
from megatron_snip.training.quant_health import HealthTable, gather_health, promote
from megatron_snip.training.safety import NonFiniteError, NumericalGuard, SafetyConfig, Verdict
from megatron_snip.training.setup import build_optimizer, build_scheduler, initialize_distributed, wrap_ddp
from megatron_snip.training.precision import (
    initial_plan,
    initial_schedule,
    planner_config_from_args,
    recipe_from_args,
    speed_model_from_args,
)
from megatron_snip.training.signals import ExitSignalHandler


@dataclass
class TrainState:
    """Where training is: saved in every checkpoint, restored on resume."""

    iteration: int = 0
    consumed_samples: int = 0


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch; the reported value is averaged over DP ranks."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    reported /= parallel_state.get_data_parallel_world_size()
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model):
    """One micro-batch through this stage; the schedule feeds the stage input itself."""
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _mean_loss(losses: list[dict]) -> float | None:
    """Mean of the micro-batch losses on the last stage (None elsewhere)."""
    if not losses:
        return None
    return torch.stack([d["lm loss"] for d in losses]).mean().item()


class Trainer:
    """Owns the model chunks, optimizer, scheduler and data for one run."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        self.datasets = build_datasets_from_args(args, self.tokenizer)
        self.config = transformer_config(args)
        if args.transformer_impl == "transformer_engine":
            prepare_te_environment(recipe_from_args(args))
        self.model = wrap_ddp(args, self.config, build_model(args, self.config, self.tokenizer.vocab_size))
        self.precision = PrecisionController(self.model, recipe=recipe_from_args(args), seed=args.seed)
        self.linear_dims = LlamaLinearDims.from_config(self.config)
        self.speed_model = speed_model_from_args(args, self.linear_dims)
        self.speeds = self.speed_model.precision_speeds(recipe_from_args(args))
        self.state = TrainState()
        resumed = checkpointing.read_common_state(args.load) if args.load and not args.finetune else None
        self.schedule, self.schedule_source = initial_schedule(args, resumed)
        plan, self.plan_source = initial_plan(args, resumed)
        self.set_plan(plan)
        self.snip = (PrecisionManager(self, args, planner_config_from_args(args, self.speed_model))
                     if args.snip else None)
        self.optimizer = build_optimizer(args, self.model)
        self.scheduler = build_scheduler(args, self.optimizer)
        self.forward_backward = get_forward_backward_func()
        self.logger = MetricsLogger(args.tensorboard_dir)
        self.guard = NumericalGuard(SafetyConfig.from_args(args))
        self.last_verdict: Verdict | None = None
        if args.quant_health:
            self.precision.enable_health()
        # Plan changes with their reasons (SNIP cycles, promotions), saved in checkpoints.
        self.plan_history: list[dict] = list((resumed or {}).get("precision_history", []))
        self._logged_plan: PrecisionPlan | None = None
        self._measured: tuple[int, HealthTable] | None = None  # the last fully measured health, and when
        self.tokens_per_iteration = args.global_batch_size * args.seq_length
        self.flops_per_iteration = flops_per_token(args, self.tokenizer.vocab_size) * self.tokens_per_iteration

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

    # -- checkpoints -------------------------------------------------------
    def resume(self) -> None:
        args = self.args
        loaded = checkpointing.load_checkpoint(
            args.load, [chunk.module for chunk in self.model], self.optimizer, self.scheduler,
            load_optim=not (args.no_load_optim or args.finetune), load_rng=not (args.no_load_rng or args.finetune))
        if loaded is None:
            self.logger.text(f"no checkpoint in {args.load}: starting from scratch")
            return
        if not args.finetune:
            self.state = TrainState(loaded["iteration"], loaded["consumed_samples"])
            if "numerical_safety" in loaded:  # absent in older checkpoints
                self.guard.load_state_dict(loaded["numerical_safety"])
            self.apply_precision()  # the plan itself was chosen at start-up (initial_plan)
        self.precision.load_quant_states(loaded["quantization"])
        self.logger.text(f"resumed from {args.load} at iteration {loaded['iteration']} "
                         f"(consumed samples {loaded['consumed_samples']}); continuing at {self.state.iteration}")

    def save(self) -> None:
        path = checkpointing.save_checkpoint(
            self.args.save, self.state.iteration, [chunk.module for chunk in self.model], self.optimizer,
            self.scheduler,
            extra={"consumed_samples": self.state.consumed_samples, "args": vars(self.args),
                   "precision_plan": self.plan.to_dict(), "precision_schedule": self.schedule.to_list(),
                   "numerical_safety": self.guard.state_dict(), "precision_history": self.plan_history},
            quantization=self.precision.quant_states())
        self.logger.text(f"saved checkpoint {path}")

    # -- steps -------------------------------------------------------------
    def batches(self, split: str, consumed: int) -> Iterator[dict]:
        """This DP rank's micro-batches of ``split`` from sample ``consumed`` on (a fresh loader)."""
        return micro_batches(getattr(self.datasets, split), self.args.micro_batch_size,
                             parallel_state.get_data_parallel_rank(),
                             parallel_state.get_data_parallel_world_size(), consumed, self.args.num_workers)

    def _run(self, data: Iterator[dict], forward_only: bool) -> list[dict]:
        if len(self.model) > 1:
            # The interleaved schedule reads one iterator per chunk, each the same micro-batches:
            # tee'd for this step, so ``data`` moves on by exactly one global batch.
            data = list(itertools.tee(data, len(self.model)))
        return self.forward_backward(
            forward_step_func=forward_step, data_iterator=data, model=self.model,
            num_microbatches=self.args.num_microbatches, seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=forward_only)

    def train_step(self, data: Iterator[dict]) -> tuple[float | None, float]:
        """One optimizer step over a global batch. Returns (loss or None off the last stage, grad norm).

        Between the backward pass and the optimizer, every rank agrees on whether the step is
        finite (:class:`NumericalGuard`): a non-finite step raises on every rank (policy ``fail``)
        or is skipped (``skip``: weights, optimizer state and LR schedule untouched, data consumed).
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.args.quant_health:  # everything on logged steps, else only the non-finite flags
            self.precision.reset_health(full=(self.state.iteration + 1) % self.args.log_interval == 0)
        losses = self._run(data, forward_only=False)
        loss = _mean_loss(losses)
        verdict = self.guard.check(self.model, loss, self.state.iteration + 1)
        self.last_verdict = verdict
        blamed, detail = self._blame(verdict)
        # The blamed modules one step up, if --promote-on-fault and any of them can go up.
        promoted, changes = promote(self.plan, blamed) if self.args.promote_on_fault else (self.plan, {})
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
        self.state.consumed_samples += self.args.global_batch_size
        return loss, float(grad_norm or 0.0)

    def _blame(self, verdict: Verdict) -> tuple[list[str], str]:
        """On a non-finite step or a spike (all ranks): the quantized modules the health numbers blame, and
        "; " + what they show (nothing without --quant-health)."""
        if not self.args.quant_health or not (verdict.nonfinite or verdict.spike):
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
        if self.args.eval_iters == 0:
            return None
        for chunk in self.model:
            chunk.eval()
        data = self.batches("valid", 0)
        losses = [self._run(data, forward_only=True) for _ in range(self.args.eval_iters)]
        for chunk in self.model:
            chunk.train()
        per_batch = [_mean_loss(x) for x in losses]
        return None if per_batch[0] is None else sum(per_batch) / len(per_batch)

    # -- the loop ----------------------------------------------------------
    def train(self) -> None:
        args = self.args
        exit_signal = ExitSignalHandler()
        data = self.batches("train", self.state.consumed_samples)
        peak = peak_tflops(args.peak_tflops)
        if peak is not None:
            self.logger.text(f"MFU is reported against a peak of {peak:g} TFLOP/s per GPU "
                             f"(dense BF16 of this GPU, or --peak-tflops)")
        # Time only the training steps: evaluation and checkpoint time would
        # otherwise deflate tokens/s.
        window_loss, window_iters, window_seconds = 0.0, 0, 0.0
        saved_at = self.state.iteration if args.load else None
        while self.state.iteration < args.train_iters:
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
            if it % args.log_interval == 0:
                self.logger.log(it, self._metrics(window_loss / window_iters, grad_norm,
                                                  window_seconds / window_iters, peak))
                window_loss, window_iters, window_seconds = 0.0, 0, 0.0
                self._log_precision(it)
            if it % args.eval_interval == 0 or it == args.train_iters:
                self._log_validation(it)
            if self.snip is not None and self.snip.due(it):
                self._snip_cycle(it)
            if args.save and args.save_interval and it % args.save_interval == 0:
                self.save()
                saved_at = it
            if exit_signal.should_exit():
                self.logger.text(f"exit signal received: saving at iteration {it} and exiting")
                break
            if args.exit_interval and it % args.exit_interval == 0:
                self.logger.text(f"--exit-interval {args.exit_interval}: exiting at iteration {it}")
                break
        exit_signal.close()
        if args.save and saved_at != self.state.iteration:
            self.save()

    def _log_precision(self, iteration: int) -> None:
        """TensorBoard: the last step's quantization health (collective) and the plan image when it changed."""
        if self.args.quant_health:
            table = gather_health(self.precision, self.linear_dims.num_layers)
            self._measured = (iteration, table)
            self.logger.scalars(table.scalars(), iteration)
        if self.effective_plan != self._logged_plan:
            self.logger.image("precision/plan (rows: layers; qkv, proj, fc1, fc2 x fwd|bwd)",
                              plan_image(self.effective_plan, self.linear_dims.num_layers), iteration)
            self._logged_plan = self.effective_plan

    def _snip_cycle(self, iteration: int) -> None:
        """Re-plan (all ranks), report, and keep the statistics next to the checkpoints."""
        before = self.plan
        report = self.snip.cycle(iteration)
        if report is None:
            self.logger.text(f"[snip] iteration {iteration}: the precision schedule fixes every GEMM; no cycle")
            return
        self.plan_history.append({"iteration": iteration, "event": "snip cycle", "modules": {
            n: f"{old} -> {new}" for n, (old, new) in before.diff(self.plan, self.linear_dims.num_layers).items()}})
        log_cycle(self.logger, report, self.args.num_layers)
        if self.args.save:
            path = self.snip.write_statistics(os.path.join(self.args.save, "snip"), iteration)
            if path:
                logging.getLogger(__name__).info("SNIP statistics written to %s", path)

    def _metrics(self, loss: float, grad_norm: float, seconds_per_iter: float, peak: float | None) -> dict:
        world = dist.get_world_size()
        tflops_per_device = self.flops_per_iteration / seconds_per_iter / world / 1e12
        device = "GPU" if torch.cuda.is_available() else "process"
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
        if torch.cuda.is_available():
            m["max memory allocated GiB"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            import psutil

            m["rss GiB"] = psutil.Process().memory_info().rss / 2**30
        return m

    def _log_validation(self, iteration: int) -> None:
        val = self.evaluate()
        if val is not None:
            self.logger.log(iteration, {"lm loss": val, "ppl": math.exp(min(val, 50.0)),
                                        "unigram entropy": self.datasets.unigram_entropy}, prefix="valid")


def pretrain(args: argparse.Namespace, on_build: Callable[[Trainer], None] | None = None) -> TrainState:
    """Build everything, resume if asked, train, and return the final state.

    ``on_build`` sees the built trainer before anything runs (test drivers instrument it there).
    """
    setup_console()
    initialize_distributed(args)
    trainer = Trainer(args)
    if on_build is not None:
        on_build(trainer)
    log = trainer.logger
    log.text(f"model: {args.model_preset} shape, {num_parameters(args, trainer.tokenizer.vocab_size) / 1e6:.2f}M "
             f"parameters; TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
             f"DP={args.data_parallel_size}; global batch {args.global_batch_size} x {args.seq_length} tokens; "
             f"device {'cuda' if torch.cuda.is_available() else 'cpu (megatron_snip.compat.cpu)'}")
    log.text(f"unigram entropy of the training data: {trainer.datasets.unigram_entropy:.4f} nats/token "
             f"(a model without context cannot beat this)")
    if args.load:
        trainer.resume()
    if args.transformer_impl == "transformer_engine":
        log.text(f"precision backend {describe_te_backend()}")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.text(f"precision backend {describe_backend(recipe_from_args(args), device)}")
    fractions = trainer.flop_fractions
    log.text(f"precision: plan {trainer.plan_source}: {fractions.fp4:.1%} of linear-layer FLOPs in FP4, "
             f"{fractions.fp8:.1%} in FP8; fp8 recipe {args.fp8_recipe}/{args.fp8_format}, fp4 {args.fp4_recipe}"
             + "".join(f"; {note}" for note in args.precision_notes))
    if trainer.schedule:
        log.text(f"precision schedule ({trainer.schedule_source}): {' '.join(trainer.schedule.to_list())}")
    log.text(f"GEMM speed model {trainer.speed_model.describe()}"
             + "".join(f"; {note}" for note in trainer.speed_model.notes)
             + f". Estimated linear-GEMM time of the plan: {trainer.time_ratio:.3f} of all-bf16 (an estimate: "
               "'estimated gemm time vs bf16' in the logs)")
    if args.skip_train:
        trainer._log_validation(trainer.state.iteration)
    else:
        trainer.train()
    log.close()
    dist.barrier()
    return trainer.state


def _error(e: Exception) -> None:
    # One write call: with unbuffered stderr, print() issues the message and its newline as two writes, and
    # ranks sharing torchrun's stderr interleave their lines (seen in CI).
    sys.stderr.write(f"pretrain_llama.py: error: {e}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None, on_build: Callable[[Trainer], None] | None = None) -> int:
    from megatron_snip.arguments import ArgumentError, parse_args

    try:
        args = parse_args(argv)
    except ArgumentError as e:
        _error(e)
        return 2
    try:
        pretrain(args, on_build)
    except checkpointing.CheckpointError as e:
        _error(e)
        return 1
    except NonFiniteError as e:
        _error(e)
        dist.barrier()  # every rank raised at this iteration: let each print before the first exit ends the job
        return 1
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0

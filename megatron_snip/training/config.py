"""The whole run's configuration: one frozen section per concern, each field defined once.

Every section's fields are its command-line flags (``megatron_snip.flags``): ``arguments.py``
generates the command line from them and validates the values once into a :class:`RunConfig`.
Components receive their own section (the model builder a :class:`ModelConfig`, SNIP a
:class:`SnipConfig`, ...); only the trainer, which wires them together, holds the
:class:`RunConfig`. Light on purpose (no torch): ``--help`` imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_snip.data.config import DataConfig
from megatron_snip.flags import derived, flag, flag_values, from_flags, sections_to_yaml, to_flags
from megatron_snip.model.config import ModelConfig, ParallelConfig
from megatron_snip.precision.config import PrecisionConfig
from megatron_snip.snip.config import SnipConfig
from megatron_snip.training.checkpoint_record import CheckpointRecord

if TYPE_CHECKING:
    from megatron_snip.numerics.recipes import Precision
    from megatron_snip.precision.plan import PrecisionPlan
    from megatron_snip.precision.schedule import PrecisionSchedule


@dataclass(frozen=True)
class TrainingConfig:
    """Batches, iterations, optimizer and LR / weight-decay schedules."""

    micro_batch_size: int = flag(4, "Samples per micro-batch on each rank.")
    global_batch_size: int | None = flag(None, "Samples per optimizer step. Default: micro-batch-size x "
                                         "data-parallel size.")
    num_microbatches: int = derived(1)  # global batch / (micro batch x DP)
    train_iters: int | None = flag(None, "Iterations (global batches) to train; required unless --train-samples is "
                                   "given.")
    train_samples: int | None = flag(
        None, "Train on this many samples instead of --train-iters (Megatron-LM's sample-based training): "
        "--train-samples // --global-batch-size iterations (a partial last batch is not trained), the LR and "
        "weight-decay schedules in samples (--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples), "
        "the training data sized to it.")
    seed: int = flag(1234, "Seed of initialisation, data order, dropout and SNIP's probes.")
    exit_interval: int | None = flag(None, "Save (if --save) and exit after an iteration divisible by this value.")
    exit_duration_in_mins: float | None = flag(
        None, "Save (if --save) and exit once the run's wall time since start-up passes this many minutes (fractions "
        "accepted). Checked at every iteration; all ranks agree (an all-reduce) and stop one iteration after it "
        "passes. The run's exit record (SAVE/exit_record.json) then asks the SLURM script for a requeue (python -m "
        "megatron_snip.training.requeue).")
    skip_train: bool = flag(False, "Bypass the training loop: only evaluate the (loaded) model on the validation "
                            "data.")
    manual_gc: bool = flag(
        False, "Disable Python's automatic garbage collector (collections then happen at the same iterations on "
        "every rank): collect every --manual-gc-interval iterations and around evaluations.")
    manual_gc_interval: int = flag(0, "With --manual-gc: iterations between collections (0: only around "
                                   "evaluations).")
    manual_gc_eval: bool = flag(True, "With --manual-gc: no collection before and after each evaluation.",
                                option="--no-manual-gc-eval", aliases=("--disable-manual-gc-eval",))
    optimizer: str = flag("adam", "Optimizer (adam: AdamW with decoupled weight decay).", choices=("adam", "sgd"))
    lr: float = flag(3e-4, "Peak learning rate.")
    min_lr: float = flag(0.0, "Learning rate at the end of the decay.")
    lr_decay_style: str = flag("linear", "Shape of the decay after warm-up.",
                               choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    decoupled_lr: float | None = flag(None, "Peak learning rate of the input embedding and output layer (their own "
                                      "schedule; default: --lr).")
    decoupled_min_lr: float | None = flag(None, "With --decoupled-lr: their minimum learning rate (default: --min-lr).")
    lr_decay_iters: int | None = flag(None, "Iterations over which the learning rate decays. Default: --train-iters.")
    lr_warmup_iters: int = flag(0, "Linear warm-up iterations.")
    lr_warmup_fraction: float | None = flag(None, "Warm-up as a fraction of --lr-decay-iters (instead of "
                                            "--lr-warmup-iters).")
    lr_wsd_decay_iters: int | None = flag(None, "WSD: iterations of the final decay.")
    lr_decay_samples: int | None = flag(None, "With --train-samples: samples over which the learning rate decays. "
                                        "Default: --train-samples.")
    lr_warmup_samples: int = flag(0, "With --train-samples: linear warm-up samples.")
    lr_warmup_init: float = flag(0.0, "Learning rate the linear warm-up starts from.")
    lr_wsd_decay_samples: int | None = flag(None, "With --train-samples, WSD: samples of the final decay.")
    lr_wsd_decay_style: str = flag("exponential", "WSD: shape of the final decay.",
                                   choices=("linear", "cosine", "exponential", "minus_sqrt"))
    weight_decay: float = flag(0.01, "Decoupled weight decay.")
    start_weight_decay: float | None = flag(None, "Weight decay at the start (default: --weight-decay).")
    end_weight_decay: float | None = flag(None, "Weight decay at the end (default: --weight-decay).")
    weight_decay_incr_style: str = flag("constant", "How weight decay moves from start to end.",
                                        choices=("constant", "linear", "cosine"))
    clip_grad: float = flag(1.0, "Clip the global gradient norm to this value.")
    adam_beta1: float = flag(0.9, "Adam's beta1.")
    adam_beta2: float = flag(0.999, "Adam's beta2.")
    adam_eps: float = flag(1e-8, "Adam's epsilon.")
    sgd_momentum: float = flag(0.9, "Momentum of --optimizer sgd.")
    empty_unused_memory_level: int = flag(
        0, "Release the CUDA caching allocator's unused memory: 1 after each forward-backward and evaluation step, 2 "
        "also after each optimizer step (nothing to release without CUDA).", choices=(0, 1, 2))

    def file_values(self) -> dict:
        """The flag values a config file states: with --train-samples the iterations follow from it, so
        --train-iters (which goes with it only as its result) is left out."""
        values = flag_values(self)
        if self.train_samples is not None:
            del values["train_iters"]
        return values


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and what they hold."""

    save: str | None = flag(None, "Directory to save checkpoints in.")
    load: str | None = flag(
        None, "Checkpoint directory to resume from. If it equals --save and holds no checkpoint yet, training starts "
        "fresh (the resume-or-start pattern).")
    save_interval: int | None = flag(None, "Iterations between checkpoints.", aliases=("--persistent-save-interval",))
    save_retain_interval: int | None = flag(
        None, "Keep only the newest checkpoint and those of iterations divisible by this (a multiple of "
        "--save-interval): once a save is complete, the checkpoint it replaces as the newest is deleted unless its "
        "iteration is divisible by this or is 0 (Megatron-LM's rule). Default: keep every checkpoint.")
    ckpt_fully_parallel_save: bool = flag(
        True, "Write every shard from the first data-parallel rank instead of spreading the writes over the "
        "data-parallel ranks (megatron-core's fully parallel save, Megatron-LM's default).",
        option="--no-ckpt-fully-parallel-save", aliases=("--disable-ckpt-fully-parallel-save",))
    ckpt_fully_parallel_load: bool = flag(False, "Spread the checkpoint reads over the data-parallel ranks and "
                                          "exchange the shards (megatron-core's fully parallel load).")
    no_load_optim: bool = flag(False, "Do not load the optimizer and LR-scheduler state.")
    no_load_rng: bool = flag(False, "Do not load the RNG state.")
    no_save_optim: bool = flag(False, "Save no optimizer or LR-scheduler state (a run resuming from it starts them "
                               "afresh, as with --no-load-optim).")
    no_save_rng: bool = flag(False, "Save no RNG or quantization state (a run resuming from it keeps its own).")
    finetune: bool = flag(False, "Load model weights only and start at iteration 0.")
    pretrained_checkpoint: str | None = flag(
        None, "A checkpoint to start from while --load holds none (or without --load): its weights only, at "
        "iteration 0, as --finetune. Once --load (= --save) holds this run's own checkpoint, a relaunch (a requeued "
        "job) resumes that one instead.")
    override_opt_param_scheduler: bool = flag(
        False, "With --load: schedule the learning rate and weight decay by these flags, not by the checkpoint's "
        "saved settings (its step count is kept). Without it the checkpoint's settings continue, with a notice "
        "where the flags differ (Megatron-LM refuses such a resume unless --use-checkpoint-opt_param-scheduler).",
        option="--override-opt_param-scheduler", aliases=("--override-opt-param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, "With --load: take the learning-rate and weight-decay schedule from the checkpoint, as this program "
        "does without the flag too (it only silences the notice where the flags differ).",
        option="--use-checkpoint-opt_param-scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler",))
    dist_ckpt_optim_fully_reshardable: bool = flag(
        False, "With --use-distributed-optimizer: save its state in Megatron-LM's fully_reshardable format "
        "(gathered per parameter; it loads into any TP / PP) instead of dp_reshardable (sharded as the buffers "
        "are; it loads only where TP and PP are the saved ones).")
    ckpt_fallback: bool = flag(
        False, "If the checkpoint the tracker in --load names is damaged (a file missing, or shorter than its index "
        "says, or common.pt unreadable), load the newest intact earlier one instead, saying so at start-up; with "
        "--load = --save the damaged one is kept as iter_N.damaged and the tracker names the one loaded. Without it "
        "such a checkpoint is refused, naming the damaged file.", ours=True)
    load_iteration: int | None = derived(None)  # the checkpoint validation chose in load_dir (None: none there)
    from_pretrained: bool = derived(False)  # --load held no checkpoint: the run starts from --pretrained-checkpoint

    @property
    def load_dir(self) -> str | None:
        """The directory the run loads from: --load, or --pretrained-checkpoint where --load held no checkpoint."""
        return self.pretrained_checkpoint if self.from_pretrained else self.load

    @property
    def weights_only(self) -> bool:
        """Whether the load takes the model's weights only, at iteration 0 (--finetune, --pretrained-checkpoint)."""
        return self.finetune or self.from_pretrained

    @property
    def resumes(self) -> bool:
        """Whether the run continues a checkpoint's state (not only its weights)."""
        return self.load_dir is not None and not self.weights_only


@dataclass(frozen=True)
class LoggingConfig:
    """Evaluation, the console's progress line, TensorBoard and W&B (docs/logging.md: every tag and its flag)."""

    eval_interval: int = flag(1000, "Iterations between evaluations.")
    eval_iters: int = flag(100, "Global batches per evaluation.")
    log_interval: int = flag(100, "Iterations between progress lines (and the timing scalars, quantization "
                             "health and the plan image on TensorBoard).")
    tensorboard_dir: str | None = flag(None, "Write TensorBoard events here.")
    tensorboard_log_interval: int = flag(1, "Iterations between the per-iteration TensorBoard (and W&B) scalars "
                                         "(lm loss, learning-rate, grad-norm, ...).")
    tensorboard_queue_size: int = flag(1000, "Events TensorBoard's writer queues before it writes them to disk.")
    log_throughput: bool = flag(False, "Print the model TFLOP/s per GPU (per process on CPU) on the progress line; "
                                "with --log-timers-to-tensorboard also the scalar throughput.")
    log_timers_to_tensorboard: bool = flag(
        False, "Write iteration-time (seconds per iteration), throughput (with --log-throughput) and, with "
        "--timing-log-level 1 or 2, the <timer>-time scalars.")
    timing_log_level: int = flag(
        0, "0: time only the iteration. 1 or 2: also time forward-backward and optimizer on every rank, print their "
        "(min, max) over ranks in ms every --log-interval, and write the max as <timer>-time (seconds per iteration) "
        "with --log-timers-to-tensorboard (level 2's per-micro-batch timers are not measured here).",
        choices=(0, 1, 2))
    log_memory_to_tensorboard: bool = flag(
        False, "Write mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes and mem-allocated-count "
        "(CUDA; memory/rss-bytes, the process's resident memory, without CUDA).")
    log_validation_ppl_to_tensorboard: bool = flag(False, "Also write the validation perplexity, lm loss validation "
                                                   "ppl = exp(min(20, loss)).")
    log_params_norm: bool = flag(False, "Compute the parameters' global L2 norm (a collective over the "
                                 "model-parallel ranks) and log it as params-norm.")
    log_num_zeros_in_grad: bool = flag(False, "Count the zero entries of the gradients and log them as num-zeros.")
    log_world_size_to_tensorboard: bool = flag(False, "Write the number of processes as world-size.")
    log_loss_scale_to_tensorboard: bool = flag(
        True, "Do not write loss-scale (1.0: bf16 and fp32 need no loss scaling).",
        option="--no-log-loss-scale-to-tensorboard", aliases=("--disable-log-loss-scale-to-tensorboard",))
    wandb_project: str | None = flag(None, "Log the same scalars to this Weights & Biases project (needs the wandb "
                                     "package; WANDB_MODE=offline writes the run locally).")
    wandb_exp_name: str | None = flag(None, "The W&B run's name (default: W&B's).")
    wandb_save_dir: str | None = flag(None, "Directory of the W&B run's local files (default: --save/wandb).")
    wandb_entity: str | None = flag(None, "The W&B entity (team or user) the project belongs to.")
    peak_tflops: float | None = flag(None, "Peak dense TFLOP/s per GPU for MFU (default: looked up from the GPU "
                                     "name).", ours=True)
    profile: bool = flag(
        False, "Profile iterations --profile-step-start to --profile-step-end on --profile-ranks: with "
        "--use-pytorch-profiler a torch.profiler trace into --tensorboard-dir, else (CUDA) an nsys capture range "
        "(cudaProfilerStart/Stop; run under nsys profile --capture-range=cudaProfilerApi).")
    profile_step_start: int = flag(10, "With --profile: the iteration profiling starts at.")
    profile_step_end: int = flag(12, "With --profile: the iteration profiling stops after.")
    use_pytorch_profiler: bool = flag(False, "With --profile: torch.profiler (a trace TensorBoard's profiler plugin "
                                      "and chrome://tracing read) instead of an nsys range.")
    profile_ranks: tuple[int, ...] = flag((0,), "With --profile: the global ranks profiled.")
    notices: tuple[str, ...] = derived(())  # flags accepted that change nothing here: one start-up line each


@dataclass(frozen=True)
class SafetyConfig:
    """What a non-finite step or a loss spike does (docs/faults.md)."""

    check_nan: bool = flag(
        True, "Before every optimizer step, all ranks check the loss and every gradient for NaN/Inf and act together "
        "by --non-finite-grad-policy (default on, as in Megatron-LM).", dest="check_for_nan_in_loss_and_grad",
        negatable=True)
    policy: str = flag(
        "fail", "fail: every rank raises at that iteration, naming the parameters and ranks; nothing is applied or "
        "saved. skip: the update is skipped (weights, optimizer state and LR schedule untouched, the batch consumed) "
        "and counted.", choices=("fail", "skip"), dest="non_finite_grad_policy", ours=True)
    max_consecutive_skips: int = flag(
        10, "With --non-finite-grad-policy skip: raise after this many skipped iterations in a row.", ours=True)
    check_for_large_grads: bool = flag(
        False, "Before each gradient reduction, every rank compares each gradient bucket's norm with the largest of "
        "its first 100 and warns (not fatal) where it is 10x that (megatron-core's DDP check, without Megatron-LM's "
        "rerun of the iteration).")
    check_spiky_loss: bool = flag(
        False, "Report a loss above --spiky-loss-factor x the median of the last --spiky-loss-window applied losses "
        "(not fatal, as in Megatron-LM).", dest="check_for_spiky_loss")
    spiky_loss_factor: float = flag(2.0, "A loss above this factor x the recent median is a spike.", ours=True)
    spiky_loss_window: int = flag(10, "Applied losses the spike median is taken over.", ours=True)
    # Per-operand health scalars in the quantized linears (off on --transformer-impl transformer_engine).
    quant_health: bool = flag(
        True, "Quantized linears keep per-operand health scalars on the device (non-finite count, amax, saturated "
        "and flushed-to-zero fractions, relative quantization MSE), logged to TensorBoard every --log-interval and "
        "used to name the modules behind a non-finite step or a spike (--transformer-impl local only).",
        negatable=True, ours=True)
    promote_on_fault: bool | None = flag(
        None, "On a non-finite step or a loss spike, raise the precision of the quantized module the health numbers "
        "name (a non-finite step: only a module whose own GEMM made the values) (FP4 -> FP8 -> BF16) until the "
        "next SNIP cycle (for the rest of the run without --snip); a non-finite step is then skipped instead of "
        "failing. Default: on with --snip. Needs --quant-health.", negatable=True, ours=True)


@dataclass(frozen=True)
class StartPoint:
    """What the run starts from, decided once by validation: the record of the checkpoint it
    resumes (None: a fresh start or --finetune), the plan and precision schedule of its first step,
    where each comes from (for the start-up log), and the modules SNIP never re-plans (by global
    name) with the start-up line naming them ("" without)."""

    resumed: CheckpointRecord | None
    plan: PrecisionPlan
    plan_source: str
    schedule: PrecisionSchedule
    schedule_source: str
    pins: Mapping[str, Precision]
    pins_text: str


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
    start: StartPoint | None = None  # None only for configurations built without files (converters, checks)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], start: StartPoint | None = None) -> RunConfig:
        """Every section from validated flat flag values (``arguments.resolve`` is the one caller
        with a command line; tests and tools pass a checkpoint's saved values)."""
        return cls(**{name: from_flags(section, flags) for name, section in SECTIONS.items()}, start=start)

    def to_flags(self) -> dict[str, Any]:
        """The flat flag values of every section: what a checkpoint saves as its arguments."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(to_flags(getattr(self, name)))
        return out

    def to_yaml(self, header: str = "") -> str:
        """The run's flag values, resolved, one mapping per section: ``--yaml-cfg`` reads this back
        into the same configuration (given the same launch and files)."""
        return sections_to_yaml({name: getattr(self, name) for name in SECTIONS}, header)


# The sections, in the order of the command line's help and of the written configuration.
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
            "precision": PrecisionConfig, "snip": SnipConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig, "safety": SafetyConfig}

"""Validation of ``pretrain_llama.py``'s flags into the run's typed configuration.

:func:`resolve` checks everything that can be checked before any process-group work (the flags
against each other, the launch, the files and the checkpoint, read once), raising
:class:`ArgumentError` naming the flag and the fix. It fills what the flags leave open (the architecture
from ``--model-preset``, the checkpoint or Megatron-LM's flags, batch arithmetic, Megatron-LM's sample counts, recipe
values a resumed checkpoint keeps, SNIP's defaults), decides the start point (the checkpoint state
resumed, the first plan and precision schedule) and returns the frozen
:class:`~megatron_snip.training.config.RunConfig`. This is the edge: nothing below it reads an
argparse ``Namespace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

from megatron_snip.fileio import check_writable
from megatron_snip.model import checkpoint_shape

from .architecture import checkpoint_flag, resolve_architecture
from .checkpoint import fill_from_checkpoint, read_checkpoint
from .context_parallel import check_token_blocks, validate_context_parallel
from .data import check_data_and_tokenizer, validate_data_source, validate_split
from .errors import ArgumentError, HostProblem, Problems, require
from .megatron_lm import refuse_megatron_lm, validate_megatron_lm
from .parser import parse_args
from .pipeline import validate_pipeline
from .precision import validate_precision
from .snip import validate_snip, validate_solver

if TYPE_CHECKING:  # imported where used: --help and flag errors need no megatron-core (seconds of imports)
    from megatron_snip.training.checkpoint_record import CheckpointRecord
    from megatron_snip.training.config import RunConfig, StartPoint


def _validate_compile(args: argparse.Namespace, cuda: bool) -> None:
    if args.torch_compile is None:  # the default: on where it pays and the run allows it
        from megatron_snip.model.config import COMPILE_BY_DEFAULT

        args.torch_compile_by_default = args.torch_compile = (
            COMPILE_BY_DEFAULT["cuda" if cuda else "cpu"] and args.transformer_impl == "local"
            and args.hidden_dropout == 0 and args.attention_dropout == 0)
    if not args.torch_compile:
        return
    require(args.transformer_impl == "local", "--torch-compile compiles megatron-core's local layers; drop it with "
            "--transformer-impl transformer_engine (Transformer Engine fuses its own kernels)")
    require(args.hidden_dropout == 0 and args.attention_dropout == 0,
            f"--torch-compile with dropout (--hidden-dropout {args.hidden_dropout}, --attention-dropout "
            f"{args.attention_dropout}): inside compiled layers dropout would not draw from megatron-core's "
            "per-rank random streams; set both to 0 (Llama pretrains without dropout) or drop --torch-compile")


def _validate_safety(args: argparse.Namespace) -> None:
    require(args.max_consecutive_skips >= 0, "--max-consecutive-skips must be >= 0")
    require(args.spiky_loss_factor > 1.0, f"--spiky-loss-factor {args.spiky_loss_factor} must be > 1")
    require(args.spiky_loss_window >= 3, f"--spiky-loss-window {args.spiky_loss_window} must be >= 3")
    require(args.check_for_nan_in_loss_and_grad or args.non_finite_grad_policy == "fail",
            "--non-finite-grad-policy skip needs the check: drop --no-check-for-nan-in-loss-and-grad")
    if args.transformer_impl != "local":
        args.quant_health = False  # Transformer Engine's GEMMs keep no health numbers of ours
    if args.promote_on_fault is None:
        args.promote_on_fault = args.snip and args.quant_health
    require(not args.promote_on_fault or args.quant_health,
            "--promote-on-fault needs --quant-health (with --transformer-impl local) to know which module to promote")


def checkpoint_config(saved: dict, *, bf16: bool, tokenizer: tuple[str | None, str | None] = (None, None)) -> RunConfig:
    """A one-process configuration of the model a checkpoint's saved arguments describe (no data, no
    training: for the Hugging Face converters). ``tokenizer``: (type, model) to record, if known."""
    args = parse_args(["--train-iters", "0"])
    fill_from_checkpoint(args, saved, "the conversion")
    args.bf16 = bf16
    args.tokenizer_type = tokenizer[0] or args.tokenizer_type
    args.tokenizer_model = tokenizer[1]
    return resolve(args, world_size=1, cuda=False, check_files=False)


def resolve(parsed: argparse.Namespace, world_size: int | None = None, cuda: bool | None = None,
            check_files: bool = True) -> RunConfig:
    """Check the parsed flags against each other and the launch, derive the dependent values and
    build the run's configuration; ``parsed`` is left as it is.

    ``world_size`` defaults to ``$WORLD_SIZE``, ``cuda`` to whether torch sees a GPU.
    ``check_files=False`` skips the data/tokenizer/checkpoint paths and the optional
    packages the flags need (for checking launch scripts on a machine without their
    data or GPU software).

    Derived: the data-parallel size, ``global_batch_size`` (if unset), the number of
    micro-batches, ``train_iters`` (also from Megatron-LM's ``--train-samples``) and the LR schedule's
    defaults, the virtual pipeline size, ``eval_iters`` 0 for a ``--split`` without validation,
    the recipe values a resumed checkpoint keeps, SNIP's defaults and the distributed backend.

    Every problem is found before any is reported: :class:`ArgumentError` holds them all (``problems``).
    ``notices``: flags accepted that change nothing here, one line each for the start-up log.
    """

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda is None:
        from megatron_snip.compat.device import has_cuda

        cuda = has_cuda()
    args = argparse.Namespace(**{**dict.fromkeys(checkpoint_shape.CARRIED), **vars(parsed)})  # the working copy
    args.notices, args.load_iteration, args.from_pretrained = [], None, False
    problems = Problems()  # every step runs; all their problems are reported together
    checkpoint = None
    with problems.step() as unreadable:
        checkpoint = read_checkpoint(args) if check_files else None
    if args.load is not None and args.model_preset is None and not check_files:
        args.model_preset = "tiny"  # a stand-in for the shape of the checkpoint, which is not read here
    with problems.step():
        refuse_megatron_lm(args)
    with problems.step():
        resolve_architecture(args)
    with problems.step():
        _validate_layout(args, world_size)
        validate_pipeline(args)
    with problems.step():
        validate_megatron_lm(args)
    with problems.step():
        _validate_training(args, cuda)
    with problems.step():
        validate_context_parallel(args)  # needs the layout and the backend (--transformer-impl filled above)
    with problems.step():
        _validate_logging(args, cuda)
    with problems.step():
        _validate_checkpointing(args)
    resumed = None if args.finetune or args.from_pretrained else checkpoint  # the weights only
    with problems.step():
        validate_precision(args, cuda, resumed)
    with problems.step():
        validate_snip(args, cuda)
    with problems.step():
        _validate_safety(args)
    with problems.step() as data_source:
        validate_data_source(args)
        validate_split(args)
    if check_files:
        with problems.step():
            validate_solver(args)
        if not data_source:  # the files are read with the tokenizer type and data source checked above
            with problems.step():
                _validate_files(args, checkpoint is not None, read=not unreadable)
        with problems.step():
            _validate_output_folders(args)
    with problems.step():
        _validate_backend(args, cuda)
    problems.raise_if_any()
    args.precision_notes = tuple(args.precision_notes)
    args.notices = tuple(args.notices)
    from megatron_snip.training.config import RunConfig

    config = RunConfig.from_flags(vars(args))
    config = dataclasses.replace(config, start=_start_point(config, resumed, check_files))
    check_token_blocks(config)
    return config


def _validate_backend(args: argparse.Namespace, cuda: bool) -> None:
    """The collectives' backend (default nccl with CUDA, gloo without) and what needs NCCL."""
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    nccl = args.distributed_backend == "nccl"
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    if not nccl and interleaved and args.overlap_p2p_comm and args.pipeline_model_parallel_size == 2:
        # model/llama.py keeps them apart
        args.notices.append("the interleaved schedule's pipeline messages are not overlapped with computation at "
                            "--pipeline-model-parallel-size 2 over gloo (overlapped, an activation and a gradient "
                            "sent to the one peer can be received in each other's place); each completes before "
                            "the next, the same values")
    require(not nccl or cuda, "--distributed-backend nccl needs CUDA; use --distributed-backend gloo on CPU")
    require(nccl or not args.ddp_average_in_collective,
            "--ddp-average-in-collective averages with ReduceOp.AVG, which NCCL has and gloo has not; drop it with "
            "--distributed-backend gloo")
    if args.deterministic_mode:
        require(not args.cross_entropy_loss_fusion, "--deterministic-mode with --cross-entropy-loss-fusion: the fused "
                "cross entropy is not deterministic (as in Megatron-LM); drop one of them")
        algorithms = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
        require(not nccl or os.environ.get("NCCL_ALGO") in algorithms,
                f"--deterministic-mode with NCCL needs NCCL_ALGO set to one of {', '.join(algorithms)} (as in "
                f"Megatron-LM): NCCL's other algorithms reduce in a varying order")
        require(not cuda or os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8"),
                "--deterministic-mode on a GPU needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) in the environment "
                "(torch.use_deterministic_algorithms refuses cuBLAS without it)")


def _validate_layout(args: argparse.Namespace, world_size: int) -> None:
    """The parallel layout against the launch and the model's shape, and the batch arithmetic."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    require(tp >= 1 and pp >= 1 and cp >= 1, "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
            "--context-parallel-size must be >= 1")
    model = tp * pp * cp
    cp_text = f" x --context-parallel-size {cp}" if cp > 1 else ""
    require(world_size % model == 0,
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}{cp_text} = {model}; launch a multiple of {model} "
            f"processes (e.g. torchrun --nproc-per-node {model}) or change the parallel sizes")
    args.data_parallel_size = dp = world_size // model
    require(args.num_attention_heads % tp == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; choose a TP size that divides the head count")
    require(args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}")
    require(args.num_query_groups % tp == 0,
            f"--num-query-groups {args.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; choose a TP size that divides the query-group count")
    require(args.padded_vocab_size is None or args.padded_vocab_size % tp == 0,
            f"the checkpoint's vocabulary of {args.padded_vocab_size} rows (padded) is not divisible by "
            f"--tensor-model-parallel-size {tp}; re-import it with --make-vocab-size-divisible-by a multiple "
            f"of {tp}, or choose a TP size that divides {args.padded_vocab_size}")
    require(args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    require(args.seq_length <= args.max_position_embeddings,
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    require(args.micro_batch_size >= 1, "--micro-batch-size must be >= 1")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    require(args.global_batch_size % per_step == 0,
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}; use a multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    require(not args.overlap_param_gather or args.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the all-gather of the "
            "optimizer's parameter shards); add it, or drop --overlap-param-gather")
    require(not args.overlap_param_gather or args.overlap_grad_reduce,
            "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it, or drop "
            "--overlap-param-gather")
    _validate_ddp_buckets(args)
    if tp == 1:
        args.sequence_parallel = False  # Megatron-LM's rule: nothing to shard over, so no change in numerics


def _validate_ddp_buckets(args: argparse.Namespace) -> None:
    """Megatron-LM's DDP bucket flags (the averaging collective is checked with the backend)."""
    require(args.ddp_bucket_size is None or args.ddp_num_buckets is None,
            "give --ddp-bucket-size or --ddp-num-buckets, not both (as in Megatron-LM)")
    require(args.ddp_bucket_size is None or args.ddp_bucket_size >= 1, "--ddp-bucket-size must be >= 1")
    require(args.ddp_num_buckets is None or args.ddp_num_buckets >= 1, "--ddp-num-buckets must be >= 1")
    require(not args.ddp_reduce_scatter_with_fp32_accumulation or args.use_distributed_optimizer,
            "--ddp-reduce-scatter-with-fp32-accumulation changes the distributed optimizer's reduce-scatter; add "
            "--use-distributed-optimizer, or drop it")


def _validate_training(args: argparse.Namespace, cuda: bool) -> None:
    """The backend, recompute, the LR and weight-decay schedules (``--train-iters`` already derived)."""
    require(args.train_iters >= 0, "--train-iters must be >= 0")
    if args.transformer_impl is None:
        args.transformer_impl = "local"
        if cuda:
            args.notices.append("--transformer-impl not given: megatron-core's local layers run (this program's "
                                "default; Megatron-LM's is transformer_engine); pass --transformer-impl "
                                "transformer_engine for Transformer Engine's layers")
    require(args.transformer_impl == "local" or cuda,
            "--transformer-impl transformer_engine needs a GPU with Transformer Engine; use --transformer-impl local")
    _validate_compile(args, cuda)
    if args.recompute_granularity == "full":
        require(args.recompute_method is not None,
                "--recompute-granularity full needs --recompute-method uniform|block")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    require(args.lr_warmup_fraction is None or 0.0 <= args.lr_warmup_fraction <= 1.0,
            "--lr-warmup-fraction must lie in [0, 1]")
    if args.train_samples is None:  # with --train-samples the schedule is in samples (validate_megatron_lm)
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        if args.lr_warmup_fraction is not None:
            args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
        require(args.train_iters == 0 or args.lr_warmup_iters < args.lr_decay_iters,
                f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
                f"{args.lr_decay_iters} (default: --train-iters)")
    require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    require(0.0 <= args.lr_warmup_init <= args.lr,
            f"--lr-warmup-init {args.lr_warmup_init} must lie between 0 and --lr {args.lr}")
    require(args.decoupled_min_lr is None or args.decoupled_lr is not None,
            "--decoupled-min-lr goes with --decoupled-lr (the embedding and output layer's own schedule)")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.num_workers is None:
        args.num_workers = 2 if cuda else 0
    require(args.num_workers >= 0, "--num-workers must be >= 0")
    require(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
            f"--exit-duration-in-mins {args.exit_duration_in_mins} must be > 0 (minutes of wall time)")


def _validate_logging(args: argparse.Namespace, cuda: bool) -> None:
    _validate_profile(args, cuda)
    for flag in ("log_interval", "eval_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
        require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1")
    require(not args.wandb_project or args.wandb_save_dir or args.save,
            "--wandb-project needs a directory for the W&B run's files: --wandb-save-dir DIR (or --save, whose "
            "wandb/ subdirectory is the default)")
    require(args.eval_iters >= 0, "--eval-iters must be >= 0")


def _validate_profile(args: argparse.Namespace, cuda: bool) -> None:
    """Megatron-LM's --profile flags (training/profiling.py)."""
    if not args.profile:
        if args.use_pytorch_profiler:
            args.notices.append("--use-pytorch-profiler without --profile: nothing is profiled (as in Megatron-LM); "
                                "add --profile")
        return
    start, end = args.profile_step_start, args.profile_step_end
    require(0 <= start < end, f"--profile-step-start {start} and --profile-step-end {end}: profiling needs "
            f"0 <= start < end (the iterations from start on, up to end)")
    require(not args.use_pytorch_profiler or args.tensorboard_dir,
            "--profile --use-pytorch-profiler writes its trace into --tensorboard-dir, as in Megatron-LM: add "
            "--tensorboard-dir DIR")
    if not args.use_pytorch_profiler and not cuda:
        args.notices.append("--profile without --use-pytorch-profiler marks an nsys capture range "
                            "(cudaProfilerStart/Stop), which needs CUDA: nothing is profiled here; add "
                            "--use-pytorch-profiler for a torch.profiler trace")


def _validate_checkpointing(args: argparse.Namespace) -> None:
    require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other (the "
            "flags' schedule or the checkpoint's); give one")
    if args.save_interval is not None:
        require(args.save_interval >= 1, "--save-interval must be >= 1")
        require(args.save is not None, "--save-interval needs --save DIR")
    _validate_retention(args)


def _validate_retention(args: argparse.Namespace) -> None:
    """Megatron-LM's --save-retain-interval: a positive multiple of --save-interval, with --save."""
    keep = args.save_retain_interval
    if keep is None:
        return
    require(args.save is not None and args.save_interval is not None,
            f"--save-retain-interval {keep} needs --save DIR and --save-interval N (it thins out those checkpoints)")
    require(keep >= 1 and keep % args.save_interval == 0,
            f"--save-retain-interval {keep} must be a positive multiple of --save-interval {args.save_interval} "
            f"(the iterations whose checkpoints are kept)")


def _start_point(config: RunConfig, resumed: CheckpointRecord | None, check_files: bool) -> StartPoint | None:
    """The plan and precision schedule the run starts with, decided here once (None without
    ``check_files``: plan files are not read then). Budgets no plan can meet, a bad plan file or
    schedule, or conflicting plan flags fail here, before any process group."""
    from megatron_snip.precision.plan import PlanError
    from megatron_snip.training.config import StartPoint
    from megatron_snip.training.precision_setup import check_snip_budgets, initial_plan, initial_schedule, snip_pins

    try:
        pins = snip_pins(config) if config.snip.enabled else ({}, "")
        if config.snip.enabled:
            check_snip_budgets(config, pins)
        if not check_files:
            return None
        plan, plan_source = initial_plan(config, resumed, pins)
        schedule, schedule_source = initial_schedule(config, resumed)
    except (FileNotFoundError, PlanError) as e:
        raise ArgumentError(str(e)) from e
    return StartPoint(resumed, plan, plan_source, schedule, schedule_source, *pins)


def _validate_files(args: argparse.Namespace, from_checkpoint: bool, read: bool) -> None:
    """The data, the tokenizer and --load's checkpoint (``read``: its record was read, or there is none)."""
    check_data_and_tokenizer(args, from_checkpoint, checkpoint_flag(args))
    if args.load is not None and (args.load_iteration is None or args.from_pretrained) and read:
        require(args.from_pretrained or not args.exit_on_missing_checkpoint,
                f"--load {args.load!r} holds no checkpoint (no latest_checkpointed_iteration.txt) and "
                f"--exit-on-missing-checkpoint is given; fix the path, or drop the flag to start fresh")
        require(os.path.abspath(args.load) == os.path.abspath(args.save or ""),
                f"--load {args.load!r} holds no checkpoint (no latest_checkpointed_iteration.txt); "
                f"fix the path, or pass the same directory to --save and --load to resume-or-start")


def _validate_output_folders(args: argparse.Namespace) -> None:
    """Every rank can create, write, rename and delete files where the run writes, or in the parent that
    would hold a folder not made yet (a read-only or foreign folder found here, not at the first save or
    log line)."""
    folders = {"--save": args.save, "--tensorboard-dir": args.tensorboard_dir}
    if args.wandb_project:
        folders["--wandb-save-dir"] = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    for flag, folder in folders.items():
        if folder is not None:
            failure = check_writable(folder)
            require(failure is None, HostProblem(f"{flag} {folder}: {failure}; give a folder this job can write"))


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 cuda: bool | None = None) -> RunConfig:
    """Parse ``argv`` (default: the command line), fill presets and checkpoint shapes, validate."""
    return resolve(parse_args(argv), world_size, cuda)

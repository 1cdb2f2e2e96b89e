"""The run's precision from the command line: the recipe and the plan the model starts with."""

from __future__ import annotations

import argparse

import torch

from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import GemmSpeedModel, measure_gemm_speed, peak_speed_model
from megatron_snip.precision.plan import LINEAR_MODULES as LINEAR_MODULE_TYPES
from megatron_snip.precision.plan import PlanError, PrecisionPlan, module_names, parse_module_name
from megatron_snip.precision.recipes import PRECISION_NAMES, Precision, RecipeConfig, reduction_block
from megatron_snip.precision.registry import is_fp4
from megatron_snip.precision.schedule import PrecisionSchedule

# Row-parallel modules split their input dimension across TP ranks; the others their output.
_ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")


def recipe_from_args(args: argparse.Namespace) -> RecipeConfig:
    """How fp8 / nvfp4 / mxfp4 are realised (Megatron's flag names)."""
    return RecipeConfig(
        fp8_recipe=args.fp8_recipe,
        fp8_format=args.fp8_format,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_margin=args.fp8_margin,
        fp4_stochastic_rounding=not args.fp4_disable_stochastic_rounding,
        nvfp4_random_hadamard=not args.nvfp4_disable_rht,
        nvfp4_2d_weights=not args.nvfp4_disable_2d_quantization,
        kernels=args.quant_kernels,
        fp8_gemm=args.fp8_gemm,
    )


def initial_plan(args: argparse.Namespace, resumed: dict | None = None) -> tuple[PrecisionPlan, str]:
    """The plan training starts (or resumes) with, and where it comes from (for the start-up log).

    Precedence: ``--precision-plan FILE``, then ``--precision NAME`` (giving both is an error),
    then, resuming (``resumed``: the checkpoint's replicated state), the checkpoint's plan, with
    its FP4 modules in ``--fp4-recipe`` when that flag replaces the checkpoint's; then with
    ``--snip`` the ``--snip-warmup-plan`` (not with ``--precision``); else bf16.
    ``--first-last-layers-bf16`` applies on top. Raises PlanError (a ValueError) naming the
    flags or the file.
    """
    if args.precision is not None and args.precision_plan is not None:
        raise PlanError(f"--precision {args.precision} and --precision-plan {args.precision_plan} both set the plan; "
                        "give one of them")
    if args.snip and args.precision is not None and args.snip_warmup_plan is not None:
        raise PlanError(f"--precision {args.precision} and --snip-warmup-plan {args.snip_warmup_plan} both set the "
                        "plan before the first SNIP cycle; give one of them")
    if args.precision_plan is not None:
        plan, source = _load(args.precision_plan, "--precision-plan", args.num_layers), \
            f"--precision-plan {args.precision_plan}"
    elif args.precision is not None:
        plan, source = PrecisionPlan.uniform(_fp4_alias(args.precision, args)), f"--precision {args.precision}"
    elif resumed is not None and "precision_plan" in resumed:
        plan = PrecisionPlan.from_dict(resumed["precision_plan"], source=f"checkpoint {args.load}")
        source = (f"the checkpoint's (iteration {resumed['iteration']} in {args.load}; --precision or "
                  "--precision-plan would replace it)")
        saved_fp4 = resumed.get("args", {}).get("fp4_recipe", "nvfp4")
        if args.fp4_recipe != saved_fp4:
            plan = _fp4_modules_in(plan, args.fp4_recipe)
            source += f", its FP4 modules in --fp4-recipe {args.fp4_recipe}"
    elif args.snip:
        spec = args.snip_warmup_plan or "bf16"
        name = _fp4_alias(spec, args)
        plan = (PrecisionPlan.uniform(name) if name in PRECISION_NAMES
                else _load(spec, "--snip-warmup-plan", args.num_layers))
        source = f"--snip-warmup-plan {spec}"
    else:
        plan, source = PrecisionPlan.uniform("bf16"), "bf16 (the default)"
    if args.first_last_layers_bf16:
        plan = plan.with_ends_bf16(args.num_layers, args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16)
        source += ", --first-last-layers-bf16"
    if args.transformer_impl == "transformer_engine":
        _check_te(plan, recipe_from_args(args), source)
    else:
        _check_tensor_parallel_blocks(plan, args, source)
    return plan, source


def initial_schedule(args: argparse.Namespace, resumed: dict | None = None) -> tuple[PrecisionSchedule, str]:
    """``--precision-schedule``, else on resume the checkpoint's, else none; and where it comes from.
    PlanError for a malformed entry."""
    try:
        if args.precision_schedule is not None:
            return PrecisionSchedule.parse(args.precision_schedule, args.train_iters), "--precision-schedule"
        if resumed is not None and resumed.get("precision_schedule"):
            return (PrecisionSchedule.parse(resumed["precision_schedule"], args.train_iters),
                    f"the checkpoint's ({args.load})")
    except ValueError as e:
        raise PlanError(str(e)) from None
    return PrecisionSchedule(), "none"


def _fp4_alias(name: str, args: argparse.Namespace) -> str:
    return args.fp4_recipe if name == "fp4" else name


def _fp4_modules_in(plan: PrecisionPlan, fp4: str) -> PrecisionPlan:
    """``plan`` with every FP4 GEMM in ``fp4`` (another FP4 recipe replaces the checkpoint's)."""
    def swap(p: Precision) -> Precision:
        return Precision(*(fp4 if is_fp4(side) else side for side in (p.fwd, p.bwd)))

    return PrecisionPlan({n: swap(p) for n, p in plan.modules.items()}, swap(plan.default))


def _check_tensor_parallel_blocks(plan: PrecisionPlan, args: argparse.Namespace, source: str) -> None:
    """Where tensor parallelism splits a module's reduction dimension, every rank's slice must
    hold whole scaling blocks (the layers check the same at start-up; this says it before any
    process starts). PlanError naming the module, the sizes and the block."""
    tp = args.tensor_model_parallel_size
    if tp == 1:
        return
    recipe = recipe_from_args(args)
    from megatron_snip.model.llama import transformer_config

    dims = LlamaLinearDims.from_config(transformer_config(args))
    for name in module_names(args.num_layers):
        module = parse_module_name(name)[1]
        in_features, out_features = dims.in_out(module)
        row = module in _ROW_PARALLEL
        # SwiGLU's fc1 holds gate and up slices per rank, each of which must start on a block.
        slices = 2 if module == "mlp.linear_fc1" else 1
        per_slice = (in_features if row else out_features) // tp // slices
        for fmt in dict.fromkeys((plan[name].fwd, plan[name].bwd)):
            block = reduction_block(fmt, recipe)
            if per_slice % block:
                raise PlanError(
                    f"{source}: {name} cannot run {fmt} at --tensor-model-parallel-size {tp}: its "
                    f"{'input' if row else 'output'} dimension is split into slices of {per_slice}, not a "
                    f"multiple of the {fmt} block of {block}; give it another precision in a --precision-plan, "
                    f"choose a recipe with smaller blocks, or use a smaller TP size")


def _check_te(plan: PrecisionPlan, recipe: RecipeConfig, source: str) -> None:
    """Every precision of ``plan`` must be one the te backend can run (PlanError naming it)."""
    from megatron_snip.model.te_precision import te_quant_params

    for name, precision in [("default", plan.default), *plan.modules.items()]:
        try:
            te_quant_params(precision, recipe)
        except ValueError as e:
            raise PlanError(f"{source}: {name}: {e} (--transformer-impl transformer_engine)") from None


def _load(path: str, flag: str, num_layers: int) -> PrecisionPlan:
    try:
        plan = PrecisionPlan.load(path)
        plan.validate(num_layers, source=path)
    except FileNotFoundError:
        raise PlanError(f"{flag} {path}: file not found (expected a plan JSON file"
                        f"{' or a precision name' if flag == '--snip-warmup-plan' else ''})") from None
    except PlanError as e:  # its message starts with the file name
        raise PlanError(f"{flag} {e}") from None
    return plan


def speed_model_from_args(args: argparse.Namespace, dims: LlamaLinearDims | None = None) -> GemmSpeedModel:
    """The ``--gemm-speed-model``: a published-peak table, or (``measured``) this device's GEMMs
    timed at the model's per-rank shapes, averaged over all ranks so every rank plans alike
    (collective: call on every rank at once)."""
    if args.gemm_speed_model != "measured":
        return peak_speed_model(args.gemm_speed_model)
    import torch.distributed as dist

    tp = args.tensor_model_parallel_size
    tokens = args.micro_batch_size * args.seq_length
    shapes = []
    for module in LINEAR_MODULE_TYPES:
        fan_in, fan_out = dims.in_out(module)
        row = module in _ROW_PARALLEL
        shapes.append((tokens, fan_in // tp if row else fan_in, fan_out if row else fan_out // tp))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = measure_gemm_speed(shapes, recipe_from_args(args), device=device,
                               dtype=torch.bfloat16 if args.bf16 else torch.float32)
    if not dist.is_initialized():
        return model
    values = torch.tensor(list(model.throughput.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return GemmSpeedModel(model.name, dict(zip(model.throughput, values.tolist())),
                          f"{model.source}, mean over {dist.get_world_size()} ranks")


def check_snip_budgets(args: argparse.Namespace) -> None:
    """Solve SNIP's ILP once at start-up with zero costs, so budgets no plan can meet (an FP4 share
    the candidates cannot reach, a time target below what they can run at, or the two together)
    fail before training instead of at the first cycle. PlanError naming the flags."""
    from megatron_snip.model.llama import transformer_config
    from megatron_snip.snip.estimators import CostTables
    from megatron_snip.snip.ilp import InfeasibleBudgetError
    from megatron_snip.snip.planner import build_problem, linear_modules, solve_plan

    if args.gemm_speed_model == "measured":
        return  # measured at start-up; the first cycle's solve checks the budgets
    dims = LlamaLinearDims.from_config(transformer_config(args))
    config = planner_config_from_args(args, peak_speed_model(args.gemm_speed_model))
    modules = linear_modules(dims, 1, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1)
    zero = {m.name: dict.fromkeys(config.formats, 0.0) for m in modules}
    try:
        solve_plan(build_problem(modules, CostTables(zero, zero, zero), config), config)
    except InfeasibleBudgetError as e:
        raise PlanError(f"--snip budgets: {e}") from None


def planner_config_from_args(args: argparse.Namespace, speed_model: GemmSpeedModel):
    """SNIP's ILP settings from the ``--snip-*`` flags and the run's GEMM speed model."""
    from megatron_snip.snip.planner import PlannerConfig

    return PlannerConfig(formats=tuple(args.snip_formats), fp4_target=args.snip_fp4_target,
                         per_stage=args.snip_budget == "per-stage", split_passes=args.snip_split_passes,
                         switch_penalty=args.snip_switch_penalty, solver=args.snip_solver,
                         speed=speed_model.precision_speeds(recipe_from_args(args), args.snip_formats),
                         time_target=args.snip_time_target)

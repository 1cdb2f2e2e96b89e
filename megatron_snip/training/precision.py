"""The run's precision at start-up: the plan the model starts with, the GEMM speed model, SNIP's budgets.

These join several sections of the :class:`RunConfig` (precision flags, SNIP flags, the model's
shape, the checkpoint being resumed), so they live here, above the sections themselves.
"""

from __future__ import annotations

import torch

from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import GemmSpeedModel, measure_gemm_speed, peak_speed_model
from megatron_snip.precision.plan import LINEAR_MODULES as LINEAR_MODULE_TYPES
from megatron_snip.precision.plan import PlanError, PrecisionPlan, module_names, parse_module_name
from megatron_snip.precision.recipes import PRECISION_NAMES, Precision, RecipeConfig, misaligned_split
from megatron_snip.precision.registry import is_fp4
from megatron_snip.precision.schedule import PrecisionSchedule
from megatron_snip.training.config import RunConfig


def initial_plan(config: RunConfig, resumed: dict | None = None) -> tuple[PrecisionPlan, str]:
    """The plan training starts (or resumes) with, and where it comes from (for the start-up log).

    Precedence: ``--precision-plan FILE``, then ``--precision NAME`` (giving both is an error),
    then, resuming (``resumed``: the checkpoint's replicated state), the checkpoint's plan, with
    its FP4 modules in ``--fp4-recipe`` when that flag replaces the checkpoint's; then with
    ``--snip`` the ``--snip-warmup-plan`` (not with ``--precision``); else bf16.
    ``--first-last-layers-bf16`` applies on top. Raises PlanError (a ValueError) naming the
    flags or the file.
    """
    prec, snip, layers, load = config.precision, config.snip, config.model.num_layers, config.checkpoint.load
    if prec.precision is not None and prec.precision_plan is not None:
        raise PlanError(f"--precision {prec.precision} and --precision-plan {prec.precision_plan} both set the plan; "
                        "give one of them")
    if snip.enabled and prec.precision is not None and snip.snip_warmup_plan is not None:
        raise PlanError(f"--precision {prec.precision} and --snip-warmup-plan {snip.snip_warmup_plan} both set the "
                        "plan before the first SNIP cycle; give one of them")
    if prec.precision_plan is not None:
        plan, source = _load(prec.precision_plan, "--precision-plan", layers), \
            f"--precision-plan {prec.precision_plan}"
    elif prec.precision is not None:
        plan, source = PrecisionPlan.uniform(prec.alias(prec.precision)), f"--precision {prec.precision}"
    elif resumed is not None and "precision_plan" in resumed:
        plan = PrecisionPlan.from_dict(resumed["precision_plan"], source=f"checkpoint {load}")
        source = (f"the checkpoint's (iteration {resumed['iteration']} in {load}; --precision or "
                  "--precision-plan would replace it)")
        saved_fp4 = resumed.get("args", {}).get("fp4_recipe", "nvfp4")
        if prec.fp4_recipe != saved_fp4:
            plan = _fp4_modules_in(plan, prec.fp4_recipe)
            source += f", its FP4 modules in --fp4-recipe {prec.fp4_recipe}"
    elif snip.enabled:
        spec = snip.snip_warmup_plan or "bf16"
        name = prec.alias(spec)
        plan = (PrecisionPlan.uniform(name) if name in PRECISION_NAMES
                else _load(spec, "--snip-warmup-plan", layers))
        source = f"--snip-warmup-plan {spec}"
    else:
        plan, source = PrecisionPlan.uniform("bf16"), "bf16 (the default)"
    if prec.first_last_layers_bf16:
        plan = plan.with_ends_bf16(layers, prec.num_layers_at_start_in_bf16, prec.num_layers_at_end_in_bf16)
        source += ", --first-last-layers-bf16"
    if config.model.transformer_impl == "transformer_engine":
        _check_te(plan, prec.recipe(), source)
    else:
        _check_tensor_parallel_blocks(plan, config, source)
    return plan, source


def initial_schedule(config: RunConfig, resumed: dict | None = None) -> tuple[PrecisionSchedule, str]:
    """``--precision-schedule``, else on resume the checkpoint's, else none; and where it comes from.
    PlanError for a malformed entry."""
    iters = config.training.train_iters
    try:
        if config.precision.precision_schedule is not None:
            return PrecisionSchedule.parse(list(config.precision.precision_schedule), iters), "--precision-schedule"
        if resumed is not None and resumed.get("precision_schedule"):
            return (PrecisionSchedule.parse(resumed["precision_schedule"], iters),
                    f"the checkpoint's ({config.checkpoint.load})")
    except ValueError as e:
        raise PlanError(str(e)) from None
    return PrecisionSchedule(), "none"


def _fp4_modules_in(plan: PrecisionPlan, fp4: str) -> PrecisionPlan:
    """``plan`` with every FP4 GEMM in ``fp4`` (another FP4 recipe replaces the checkpoint's)."""
    def swap(p: Precision) -> Precision:
        return Precision(*(fp4 if is_fp4(side) else side for side in (p.fwd, p.bwd)))

    return PrecisionPlan({n: swap(p) for n, p in plan.modules.items()}, swap(plan.default))


def _check_tensor_parallel_blocks(plan: PrecisionPlan, config: RunConfig, source: str) -> None:
    """Where tensor parallelism splits a module's reduction dimension, every rank's slice must
    hold whole scaling blocks (the layers check the same at start-up; this says it before any
    process starts). PlanError naming the module, the sizes and the block."""
    tp = config.parallel.tensor_model_parallel_size
    if tp == 1:
        return
    recipe = config.precision.recipe()
    dims = LlamaLinearDims.from_config(config.model)
    for name in module_names(dims.num_layers):
        dim, per_slice = dims.tp_slice(parse_module_name(name)[1], tp)
        bad = misaligned_split(plan[name], recipe, per_slice)
        if bad is not None:
            fmt, block = bad
            raise PlanError(
                f"{source}: {name} cannot run {fmt} at --tensor-model-parallel-size {tp}: its {dim} dimension "
                f"is split into slices of {per_slice}, not a multiple of the {fmt} block of {block}; give it "
                f"another precision in a --precision-plan, choose a recipe with smaller blocks, or use a smaller "
                f"TP size")


def _check_te(plan: PrecisionPlan, recipe: RecipeConfig, source: str) -> None:
    """Every precision of ``plan`` must be one the te backend can run (PlanError naming it)."""
    from megatron_snip.precision.te_layers import te_quant_params

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


def speed_model(config: RunConfig, dims: LlamaLinearDims) -> GemmSpeedModel:
    """The ``--gemm-speed-model``: a published-peak table, or (``measured``) this device's GEMMs
    timed at the model's per-rank shapes, averaged over all ranks so every rank plans alike
    (collective: call on every rank at once)."""
    if config.precision.gemm_speed_model != "measured":
        return peak_speed_model(config.precision.gemm_speed_model)
    import torch.distributed as dist

    from megatron_snip.compat.device import current_device

    tp = config.parallel.tensor_model_parallel_size
    tokens = config.training.micro_batch_size * config.model.seq_length
    shapes = []
    for module in LINEAR_MODULE_TYPES:
        shapes.append((tokens, *dims.tp_shape(module, tp)))
    device = current_device()
    model = measure_gemm_speed(shapes, config.precision.recipe(), device=device, dtype=config.model.params_dtype)
    if not dist.is_initialized():
        return model
    values = torch.tensor(list(model.throughput.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return GemmSpeedModel(model.name, dict(zip(model.throughput, values.tolist())),
                          f"{model.source}, mean over {dist.get_world_size()} ranks")


def check_snip_budgets(config: RunConfig) -> None:
    """Solve SNIP's ILP once at start-up with zero costs, so budgets no plan can meet (an FP4 share
    the candidates cannot reach, a time target below what they can run at, or the two together)
    fail before training instead of at the first cycle. PlanError naming the flags."""
    from megatron_snip.snip.estimators import CostTables
    from megatron_snip.snip.ilp import InfeasibleBudgetError
    from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, solve_plan

    if config.precision.gemm_speed_model == "measured":
        return  # measured at start-up; the first cycle's solve checks the budgets
    dims = LlamaLinearDims.from_config(config.model)
    planner = PlannerConfig.from_snip(config.snip, config.precision.recipe(),
                                       peak_speed_model(config.precision.gemm_speed_model))
    modules = linear_modules(dims, 1, config.parallel.pipeline_model_parallel_size, config.parallel.chunks_per_stage)
    zero = {m.name: dict.fromkeys(planner.formats, 0.0) for m in modules}
    try:
        solve_plan(build_problem(modules, CostTables(zero, zero, zero), planner), planner)
    except InfeasibleBudgetError as e:
        raise PlanError(f"--snip budgets: {e}") from None


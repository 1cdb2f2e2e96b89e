"""The run's precision from the command line: the recipe and the plan the model starts with."""

from __future__ import annotations

import argparse

from megatron_snip.precision.plan import PlanError, PrecisionPlan
from megatron_snip.precision.recipes import PRECISION_NAMES, RecipeConfig


def recipe_from_args(args: argparse.Namespace) -> RecipeConfig:
    """How fp8 / nvfp4 / mxfp4 are realised (Megatron's flag names)."""
    return RecipeConfig(
        fp8_recipe=args.fp8_recipe,
        fp8_format=args.fp8_format,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_margin=args.fp8_margin,
        kernels=args.quant_kernels,
        fp8_gemm=args.fp8_gemm,
    )


def initial_plan(args: argparse.Namespace) -> PrecisionPlan:
    """The plan training starts with, then ``--first-last-layers-bf16`` on top.

    ``--precision-plan FILE``, else with ``--snip`` the ``--snip-warmup-plan`` (a
    precision name or a file), else uniform ``--precision``. Raises PlanError (a
    ValueError) naming the flag and the file for a bad plan file.
    """
    if args.precision_plan is not None:
        plan = _load(args.precision_plan, "--precision-plan", args.num_layers)
    elif args.snip:
        spec = args.snip_warmup_plan
        name = args.fp4_recipe if spec == "fp4" else spec
        plan = PrecisionPlan.uniform(name) if name in PRECISION_NAMES else _load(spec, "--snip-warmup-plan",
                                                                                  args.num_layers)
    else:
        plan = PrecisionPlan.uniform(args.precision)
    if args.first_last_layers_bf16:
        plan = plan.with_ends_bf16(args.num_layers, args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16)
    if args.transformer_impl == "transformer_engine":
        _check_te(plan, recipe_from_args(args), args.precision_plan or f"--precision {args.precision}")
    return plan


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

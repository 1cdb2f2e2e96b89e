"""The run's precision from the command line: the recipe and the plan the model starts with."""

from __future__ import annotations

import argparse

from megatron_snip.precision.plan import PlanError, PrecisionPlan
from megatron_snip.precision.recipes import RecipeConfig


def recipe_from_args(args: argparse.Namespace) -> RecipeConfig:
    """How fp8 / nvfp4 / mxfp4 are realised (Megatron's flag names)."""
    return RecipeConfig(
        fp8_recipe=args.fp8_recipe,
        fp8_format=args.fp8_format,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_margin=args.fp8_margin,
    )


def initial_plan(args: argparse.Namespace) -> PrecisionPlan:
    """``--precision-plan FILE``, else uniform ``--precision``; then ``--first-last-layers-bf16``.

    Raises PlanError (a ValueError) naming the file for a bad plan file.
    """
    if args.precision_plan is not None:
        try:
            plan = PrecisionPlan.load(args.precision_plan)
            plan.validate(args.num_layers, source=args.precision_plan)
        except FileNotFoundError:
            raise PlanError(f"--precision-plan {args.precision_plan}: file not found") from None
        except PlanError as e:  # its message starts with the file name
            raise PlanError(f"--precision-plan {e}") from None
    else:
        plan = PrecisionPlan.uniform(args.precision)
    if args.first_last_layers_bf16:
        plan = plan.with_ends_bf16(args.num_layers, args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16)
    return plan

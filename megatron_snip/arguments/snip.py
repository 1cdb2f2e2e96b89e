"""The ``--snip-*`` flags: SNIP's defaults (the FP4 target, the candidate formats, the re-plan interval),
its candidates checked against the registry and the backend, its objective's weights, and the solver."""

from __future__ import annotations

import argparse
import math

from megatron_snip.numerics.registry import FP4_NAMES
from megatron_snip.snip.config import DEFAULT_FP4_TARGET

from .errors import require


def validate_snip(args: argparse.Namespace, cuda: bool) -> None:
    """Fill SNIP's defaults (the FP4 target, the candidates, the re-plan interval: --save-interval) and check
    its flags; without --snip only the candidates a plan file may name are filled."""
    if not args.snip:
        if args.snip_formats is None:
            args.snip_formats = ["bf16", "fp8", args.fp4_recipe]
        return
    fp4_target_given = args.snip_fp4_target is not None
    if args.snip_fp4_target is None:
        args.snip_fp4_target = 0.0 if args.snip_time_target is not None else DEFAULT_FP4_TARGET
    if args.snip_formats is None:
        args.snip_formats = _default_snip_formats(args, cuda, fp4_target_given)
    require(0.0 <= args.snip_fp4_target <= 1.0, f"--snip-fp4-target {args.snip_fp4_target} must lie in [0, 1]")
    require(args.snip_time_target is None or args.snip_time_target > 0,
            f"--snip-time-target {args.snip_time_target} must be > 0 (a ratio to the all-bf16 GEMM time)")
    if args.snip_interval is None:
        require(args.save_interval is not None,
                "--snip needs --snip-interval N or --save-interval N (SNIP re-plans at checkpoint intervals)")
        args.snip_interval = args.save_interval
    require(args.snip_interval >= 1, "--snip-interval must be >= 1")
    _check_snip_formats(args.snip_formats, args.fp8_recipe)
    require(any(f in FP4_NAMES for f in args.snip_formats) or args.snip_fp4_target == 0,
            "--snip-formats has no FP4 format (nvfp4 or mxfp4) but --snip-fp4-target is above 0")
    require(args.snip_probe_passes >= 1, "--snip-probe-passes must be >= 1")
    require(not args.calculate_per_token_loss,
            "--calculate-per-token-loss with --snip: SNIP's probe passes measure each micro-batch's mean loss; "
            "drop one of the two")
    for flag in ("snip_loss_weight", "snip_update_weight", "snip_switch_penalty"):
        value = getattr(args, flag)
        require(math.isfinite(value) and value >= 0,
                f"--{flag.replace('_', '-')} {value} must be a finite number >= 0 (a weight of the ILP's objective)")
    require(args.snip_loss_weight > 0 or args.snip_update_weight > 0,
            "--snip-loss-weight and --snip-update-weight are both 0: the ILP would have nothing to minimise; "
            "keep one of them above 0 (defaults 1, 1)")
    if args.transformer_impl == "transformer_engine":
        _te_snip_candidates(args)


def _check_snip_formats(formats: list[str], fp8_recipe: str) -> None:
    """Every candidate a registered precision, each quantizing its own way (ArgumentError naming the flag)."""
    from megatron_snip.numerics.registry import precision_format, precision_scheme

    for f in formats:
        try:
            precision_format(f)
            unknown = None
        except ValueError as e:
            unknown = str(e)
        require(unknown is None, f"--snip-formats {f}: {unknown}")
    twice = sorted({f for f in formats if formats.count(f) > 1})
    require(not twice, f"--snip-formats lists {' '.join(twice)} more than once: give each candidate once")
    seen: dict[str, str] = {}
    for f in formats:
        same = seen.setdefault(precision_scheme(f, fp8_recipe).name, f)
        require(same == f, f"--snip-formats lists {same} and {f}, the same quantizers under --fp8-recipe {fp8_recipe}: "
                "give one of them (fp8 runs the run's --fp8-recipe, fp8:RECIPE its own)")


def _default_snip_formats(args: argparse.Namespace, cuda: bool, fp4_target_given: bool) -> list[str]:
    """--snip-formats when not given: the research default (bf16, fp8 and --fp4-recipe) for an FP4 share;
    with --snip-time-target on a GPU, bf16 and the precisions with a real kernel there
    (``execution.fast_precisions``: on Hopper fp8:tensorwise fp8:rowwise fp8:blockwise), with --fp4-recipe
    where it has one or --snip-fp4-target is given; the research default where none has."""
    research = ["bf16", "fp8", args.fp4_recipe]
    if args.snip_time_target is None or not cuda:
        return research
    import torch

    from megatron_snip.numerics.recipes import RecipeConfig
    from megatron_snip.precision.execution import fast_precisions

    recipe = RecipeConfig(fp8_recipe=args.fp8_recipe, fp8_format=args.fp8_format, fp8_gemm=args.fp8_gemm)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    fast = fast_precisions(args.fp4_recipe, recipe, args.transformer_impl, capability)
    if not fast:
        return research
    fp4 = [args.fp4_recipe] if fp4_target_given and args.fp4_recipe not in fast else []
    return ["bf16", *fast, *fp4]


def _te_snip_candidates(args: argparse.Namespace) -> None:
    """SNIP on the te backend: candidates no TE recipe can run are dropped from the ILP, and forward
    and backward are planned together (one TE recipe covers a module's three GEMMs), each with a
    notice for the start-up log (``args.precision_notes``)."""
    import torch

    from megatron_snip.model.quantized.te_layers import te_runnable
    from megatron_snip.numerics.recipes import RecipeConfig

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    kept, dropped = te_runnable(args.snip_formats, RecipeConfig(fp8_recipe=args.fp8_recipe, fp8_format=args.fp8_format),
                                capability)
    for fmt, why in dropped.items():
        args.precision_notes.append(f"SNIP candidate {fmt} dropped on --transformer-impl transformer_engine ({why})")
    args.snip_formats = kept
    require(any(f in FP4_NAMES for f in kept) or args.snip_fp4_target == 0,
            f"--snip-fp4-target {args.snip_fp4_target} needs an FP4 candidate, but Transformer Engine runs none of "
            f"--snip-formats {' '.join(dropped)}: use --fp4-recipe nvfp4 (or --transformer-impl local for mxfp4)")
    if args.snip_split_passes:
        args.snip_split_passes = False
        args.precision_notes.append("--snip-split-passes ignored on --transformer-impl transformer_engine (one TE "
                                    "recipe covers a module's forward and backward GEMMs): SNIP plans them together")


def validate_solver(args: argparse.Namespace) -> None:
    """``--snip-solver gurobi`` needs a Gurobi that starts (a bad license would fail at the first re-plan)."""
    if not (args.snip and args.snip_solver == "gurobi"):
        return
    from megatron_snip.snip.solvers import gurobi_unavailable

    reason = gurobi_unavailable()
    require(reason is None, f"--snip-solver gurobi: {reason}; use --snip-solver highs, or auto (Gurobi when usable, "
            f"else HiGHS)")

"""The run's precision from the command line: the recipe and the plan the model starts with."""

from __future__ import annotations

import argparse

from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.plan import PlanError, PrecisionPlan, module_names, parse_module_name
from megatron_snip.precision.recipes import PRECISION_NAMES, RecipeConfig, reduction_block

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
    source = args.precision_plan or (f"--snip-warmup-plan {args.snip_warmup_plan}" if args.snip
                                     else f"--precision {args.precision}")
    if args.transformer_impl == "transformer_engine":
        _check_te(plan, recipe_from_args(args), source)
    else:
        _check_tensor_parallel_blocks(plan, args, source)
    return plan


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

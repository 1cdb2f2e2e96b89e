"""The run's precision at start-up: the plan the model starts with, the GEMM speed model, SNIP's budgets.

These join several sections of the :class:`RunConfig` (precision flags, SNIP flags, the model's
shape, the checkpoint being resumed), so they live here, above the sections themselves.
"""

from __future__ import annotations

import os
import time

import torch

from megatron_snip.compat.device import has_cuda
from megatron_snip.numerics.recipes import BF16, PRECISION_NAMES, Precision, RecipeConfig, misaligned_split
from megatron_snip.numerics.registry import is_fp4, precision_format
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import DEFAULT_TIMED, GemmSpeedModel, peak_speed_model
from megatron_snip.precision.plan import LINEAR_MODULES as LINEAR_MODULE_TYPES
from megatron_snip.precision.plan import (
    PlanError,
    PrecisionPlan,
    end_layers,
    module_name,
    module_names,
    parse_module_name,
)
from megatron_snip.precision.schedule import PrecisionSchedule
from megatron_snip.precision.te_precision_config import read_megatron_config
from megatron_snip.training.checkpoint_record import CheckpointRecord
from megatron_snip.training.config import RunConfig


def initial_plan(config: RunConfig, resumed: CheckpointRecord | None = None,
                 pins: tuple[dict[str, Precision], str] | None = None) -> tuple[PrecisionPlan, str]:
    """The plan training starts (or resumes) with, and where it comes from (for the start-up log).

    Precedence: ``--precision-plan FILE``, then ``--precision NAME`` (giving both is an error),
    then without ``--snip`` a ``--te-precision-config-file`` (over bf16: it replaces a checkpoint's
    plan, as ``--precision-plan`` does; not with ``--precision-plan``), then, resuming (``resumed``:
    the checkpoint's record), the checkpoint's plan, with its FP4 modules in
    ``--fp4-recipe`` when that flag replaces the checkpoint's; then with ``--snip`` the
    ``--snip-warmup-plan`` (not with ``--precision``); else bf16. On top: without ``--snip``,
    ``--first-last-layers-bf16`` and then the config file, as Megatron-LM applies them (a config
    replaces a module's precision where it overrides that autocast); with ``--snip``, the pins
    (``pins``, :func:`snip_pins`'s result, computed here if not given). Raises PlanError (a ValueError)
    naming the flags or the file.
    """
    prec, snip, layers, load = config.precision, config.snip, config.model.num_layers, config.checkpoint.load
    te_file = prec.te_precision_config_file
    if prec.precision is not None and prec.precision_plan is not None:
        raise PlanError(f"--precision {prec.precision} and --precision-plan {prec.precision_plan} both set the plan; "
                        "give one of them")
    if not snip.enabled and te_file is not None and prec.precision_plan is not None:
        raise PlanError(f"--te-precision-config-file {te_file} and --precision-plan {prec.precision_plan} both set "
                        "the plan; give one of them (with --snip the config file's modules are pins instead)")
    if snip.enabled and prec.precision is not None and snip.snip_warmup_plan is not None:
        raise PlanError(f"--precision {prec.precision} and --snip-warmup-plan {snip.snip_warmup_plan} both set the "
                        "plan before the first SNIP cycle; give one of them")
    if prec.precision_plan is not None:
        plan, source = _load(prec.precision_plan, "--precision-plan", layers), \
            f"--precision-plan {prec.precision_plan}"
    elif prec.precision is not None:
        plan, source = PrecisionPlan.uniform(prec.alias(prec.precision)), f"--precision {prec.precision}"
    elif te_file is not None and not snip.enabled:
        plan, source = PrecisionPlan.uniform("bf16"), "bf16"
    elif resumed is not None and resumed.precision_plan is not None:
        plan = PrecisionPlan.from_dict(resumed.precision_plan, source=f"checkpoint {load}")
        source = (f"the checkpoint's (iteration {resumed.iteration} in {load}; --precision or "
                  "--precision-plan would replace it)")
        saved_fp4 = resumed.args.get("fp4_recipe", "nvfp4")
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
    if snip.enabled:
        pinned, _ = pins if pins is not None else snip_pins(config)
        if pinned:
            plan = _with(plan, pinned)
            source += ", with the SNIP pins"
    else:
        if prec.first_last_layers_bf16:
            plan = plan.with_ends_bf16(layers, prec.num_layers_at_start_in_bf16, prec.num_layers_at_end_in_bf16)
            source += ", --first-last-layers-bf16"
        if te_file is not None:
            base = {n: plan[n] for n in module_names(layers)}
            plan = _with(plan, _read_config_file(config, base))
            source += f", --te-precision-config-file {te_file}"
    if config.model.transformer_impl == "transformer_engine":
        _check_te(plan, prec.recipe(), source)
    else:
        _check_tensor_parallel_blocks(plan, config, source)
    return plan, source


def snip_pins(config: RunConfig) -> tuple[dict[str, Precision], str]:
    """The modules SNIP never re-plans, by global name, and the start-up line naming them ("" without
    any): with ``--first-last-layers-bf16`` the first ``--num-layers-at-start-in-bf16`` and last
    ``--num-layers-at-end-in-bf16`` layers in bf16, and the modules a ``--te-precision-config-file``
    sets (on those end layers, where its config overrides their bf16, as in Megatron-LM). PlanError
    naming the flag for a pin SNIP cannot hold: a precision outside ``--snip-formats``, or a config
    whose effect would depend on SNIP's own choice (``read_megatron_config``)."""
    prec, layers = config.precision, config.model.num_layers
    sources: list[tuple[str, dict[str, Precision]]] = []
    ends: dict[str, Precision] = {}
    if prec.first_last_layers_bf16:
        ends = {module_name(i, m): BF16 for i in end_layers(layers, prec.num_layers_at_start_in_bf16,
                                                             prec.num_layers_at_end_in_bf16)
                for m in LINEAR_MODULE_TYPES}
        sources.append(("--first-last-layers-bf16", ends))
    if prec.te_precision_config_file is not None:
        sources.append((f"--te-precision-config-file {prec.te_precision_config_file}",
                        _read_config_file(config, ends)))
    pins = {name: precision for _, set_ in sources for name, precision in set_.items()}
    formats = config.snip.snip_formats
    for flag, set_ in sources:
        outside = sorted({f for p in set_.values() for f in (p.fwd, p.bwd)} - set(formats))
        if outside:
            raise PlanError(f"{flag} pins modules to {outside[0]}, which is not among --snip-formats "
                            f"{' '.join(formats)}: SNIP holds pins in candidate precisions only; add {outside[0]} "
                            "to --snip-formats")
    return pins, describe_pins(sources)


def describe_pins(sources: list[tuple[str, dict[str, Precision]]]) -> str:
    """e.g. "SNIP pins: 8 modules (layers 0, 3) in bf16 (--first-last-layers-bf16)"; ``sources``: (flag,
    module -> precision) in the order they apply, a later one taking a module from an earlier one."""
    owner = {name: (flag, precision) for flag, set_ in sources for name, precision in set_.items()}
    parts = []
    for flag, _ in sources:
        by_precision: dict[Precision, list[str]] = {}
        for name, (f, precision) in owner.items():
            if f == flag:
                by_precision.setdefault(precision, []).append(name)
        for precision, names in by_precision.items():
            found = sorted({parse_module_name(n)[0] for n in names})
            parts.append(f"{len(names)} module{'s' if len(names) > 1 else ''} "
                         f"(layer{'s' if len(found) > 1 else ''} {_ranges(found)}) in {precision} ({flag})")
    return "SNIP pins: " + "; ".join(parts) if parts else ""


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _read_config_file(config: RunConfig, base: dict[str, Precision]) -> dict[str, Precision]:
    """The modules ``--te-precision-config-file`` sets, over ``base`` (Megatron-LM's reading: one file
    for every pipeline stage, stage-local paths). PlanError naming the flag and the file."""
    try:
        return read_megatron_config(config.precision.te_precision_config_file,
                                    config.parallel.pipeline_layout(config.model.num_layers),
                                    recipe=config.precision.recipe(), base=base)
    except PlanError as e:  # its message starts with the file name
        raise PlanError(f"--te-precision-config-file {e}") from None


def _with(plan: PrecisionPlan, modules: dict[str, Precision]) -> PrecisionPlan:
    """``plan`` with ``modules`` set to their precisions."""
    return PrecisionPlan({**plan.modules, **modules}, plan.default)


def initial_schedule(config: RunConfig, resumed: CheckpointRecord | None = None) -> tuple[PrecisionSchedule, str]:
    """``--precision-schedule``, else on resume the checkpoint's, else none; and where it comes from.
    PlanError for a malformed entry."""
    iters = config.training.train_iters
    try:
        if config.precision.precision_schedule is not None:
            return PrecisionSchedule.parse(list(config.precision.precision_schedule), iters), "--precision-schedule"
        if resumed is not None and resumed.precision_schedule:
            return (PrecisionSchedule.parse(resumed.precision_schedule, iters),
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
    from megatron_snip.model.quantized.te_layers import te_quant_params

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


def linear_shapes(config: RunConfig, dims: LlamaLinearDims) -> dict[str, tuple[int, int, int]]:
    """Module type -> (tokens, in, out) of its GEMMs on one rank for one micro-batch: the shapes a
    measured speed table times (every layer's modules of a type share theirs). A context-parallel rank's
    GEMMs see its S / CP tokens of each sequence."""
    tp = config.parallel.tensor_model_parallel_size
    tokens = config.training.micro_batch_size * config.model.seq_length // config.parallel.context_parallel_size
    return {module: (tokens, *dims.tp_shape(module, tp)) for module in LINEAR_MODULE_TYPES}


def speed_model(config: RunConfig, dims: LlamaLinearDims) -> GemmSpeedModel:
    """The ``--gemm-speed-model``: a published-peak estimate, or (``measured``, the default) this
    device's linears timed at the model's per-rank shapes in every precision
    (``gemm_speed.cached_times``: read from the cache when this device, software, recipe and shapes were
    timed before), averaged over all ranks so every rank plans alike (collective:
    call on every rank at once).

    Start-up cost when not cached: per module type (4) and precision (:func:`timed_precisions`: 4, and each
    ``fp8:RECIPE`` the run can use whose scheme is not one of theirs), 1 + 3 forwards and 1 + 3
    forward + backward passes of one micro-batch's linear on a GPU (about 128 single-linear steps: a
    few seconds at 8B shapes), 1 + 1 of each on a CPU, where one process per machine times (the
    quickstart's shapes: about 3 s on the 2-core machine) and the others read its file. The start-up
    log says which and how long it took."""
    if config.precision.gemm_speed_model != "measured":
        return peak_speed_model(config.precision.gemm_speed_model)
    if config.model.transformer_impl == "transformer_engine":  # the table times this package's linears, not TE's
        auto = peak_speed_model("auto")
        return GemmSpeedModel(auto.name, auto.throughput, auto.source, notes=(
            *auto.notes, "--gemm-speed-model measured times this package's quantized linears, not Transformer "
            "Engine's: the peak estimate serves with --transformer-impl transformer_engine"))
    import torch.distributed as dist

    from megatron_snip.compat.device import current_device
    from megatron_snip.precision.execution import SIMULATED, gemm_execution
    from megatron_snip.precision.gemm_speed import cached_times, device_label, speed_model_from_times

    shapes = linear_shapes(config, dims)
    device, recipe, names = current_device(), config.precision.recipe(), timed_precisions(config)
    start = time.perf_counter()

    def table():
        return cached_times(shapes, recipe, device=device, dtype=config.model.params_dtype, names=names,
                            repeats=3 if device.type == "cuda" else 1)

    if dist.is_initialized() and device.type == "cpu":
        # Ranks on one machine share its cores: its first rank times, the others then read its cache file.
        first = int(os.environ.get("LOCAL_RANK", "0")) == 0
        times, cached, path = table() if first else (None, None, None)
        dist.barrier()
        if not first:
            times, cached, path = table()
    else:
        times, cached, path = table()
    seconds = time.perf_counter() - start
    ranks = 1
    if dist.is_initialized():
        ranks = dist.get_world_size()
        flat = torch.tensor([v for m in times for p in times[m] for v in times[m][p]], dtype=torch.float64,
                            device=device)
        dist.all_reduce(flat)
        values = iter((flat / ranks).tolist())
        times = {m: {p: (next(values), next(values)) for p in times[m]} for m in times}
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    emulated = [p for p, how in gemm_execution(names, recipe, config.model.transformer_impl,
                                               capability).items() if how == SIMULATED]
    how = f"read from {path}" if cached else f"timed in {seconds:.1f} s, cached in {path}"
    source = (f"forward + backward of each linear shape ({len(shapes)}) in each precision, {how}"
              + (f", mean over {ranks} ranks" if ranks > 1 else "")
              + (f"; emulated, capped at bf16's speed: {', '.join(emulated)}" if emulated else ""))
    return speed_model_from_times(times, shapes, recipe, device=device_label(device), source=source,
                                  emulated=emulated)


def run_precisions(config: RunConfig) -> list[str]:
    """The precision names the run can put on a module's GEMMs: SNIP's candidates, its first plan's and its
    schedule's (the start point's, when decided), and fp8 where --promote-on-fault lifts FP4 modules to it."""
    used = [*(config.snip.snip_formats if config.snip.enabled else ())]
    if config.start is not None:
        plan = config.start.plan
        used += [side for p in (plan.default, *plan.modules.values()) for side in (p.fwd, p.bwd)]
        used += [entry.precision for entry in config.start.schedule.entries]
    if config.safety.promote_on_fault:
        used.append("fp8")
    return list(dict.fromkeys(used))


def timed_precisions(config: RunConfig) -> list[str]:
    """The precisions a measured speed table times for this run: bf16, fp8 (the run's --fp8-recipe) and the
    FP4 formats, and every ``fp8:RECIPE`` the run can use (:func:`run_precisions`)."""
    used = run_precisions(config)
    return list(dict.fromkeys([*DEFAULT_TIMED, *(n for n in used if precision_format(n).fp8_recipe is not None)]))


def bf16_gemm_seconds(model: GemmSpeedModel, module_names: list[str], micro_batches: int) -> float | None:
    """Seconds a step's linear GEMMs take in bf16 on this rank by a measured speed table (``module_names``: this
    rank's modules; ``micro_batches`` per step); None for a peak estimate, which knows no seconds."""
    if model.bf16_seconds is None:
        return None
    return micro_batches * sum(model.bf16_seconds[parse_module_name(n)[1]] for n in module_names)


def missed_time_target(time_target: float, bf16_step: float, bf16_gemm: float, step: float,
                       tolerance: float = 0.10) -> str | None:
    """A re-plan's check against the device: the GEMM time ratio its steps actually ran at, inferred from the
    measured step ``step`` (s), the bf16 steps before it ``bf16_step`` (s) and the table's bf16 GEMM seconds
    of such a step ``bf16_gemm`` (everything but the linear GEMMs taken as unchanged), compared with
    ``time_target``. A sentence for the log when it misses the target by more than ``tolerance`` (relative),
    else None."""
    ratio = (step - bf16_step + bf16_gemm) / bf16_gemm
    if ratio <= time_target * (1 + tolerance):
        return None
    return (f"SNIP plan missed --snip-time-target {time_target:g}: its steps took {step * 1e3:.1f} ms against "
            f"{bf16_step * 1e3:.1f} ms in bf16, whose linear GEMMs take {bf16_gemm * 1e3:.1f} ms by the speed "
            f"table: a GEMM time of {ratio:.3f} of bf16, {ratio / time_target - 1:+.0%} over the target "
            f"(more than {tolerance:.0%})")


def describe_speed_model(config: RunConfig, model: GemmSpeedModel, time_ratio: float) -> str:
    """The start-up line about GEMM time: what the time ratios of the logs rest on, and, in SNIP's
    research mode (an FP4 share without --snip-time-target), that its planned time is a proxy."""
    from megatron_snip.snip.planner import proxy_speed_model

    line = (f"GEMM speed model {model.describe()}" + "".join(f"; {note}" for note in model.notes)
            + f". Linear-GEMM time of the plan: {time_ratio:.3f} of all-bf16 ({model.basis}: "
            f"'{model.ratio_label}' in the logs)")
    if config.snip.enabled and config.snip.snip_time_target is None:
        proxy = proxy_speed_model(model)
        line += (f". SNIP research mode (--snip-fp4-target {config.snip.snip_fp4_target:g}): its plans' time is a "
                 f"proxy under the {proxy.basis}; give --snip-time-target to budget measured time")
    return line


def time_target_refusal(config: RunConfig, capability: tuple[int, int] | None) -> str | None:
    """Why ``--snip-time-target`` below 1 cannot be met under a measured speed model on a device where every
    quantized candidate runs emulated (no GPU, or a GPU without their tensor cores), else None. Emulation
    is never faster than bf16, so the fastest feasible target is 1 (every module in bf16), or above 1
    when bf16 is not a candidate."""
    from megatron_snip.precision.execution import SIMULATED, gemm_execution

    target, formats = config.snip.snip_time_target, config.snip.snip_formats
    if target is None or target >= 1 or config.precision.gemm_speed_model != "measured":
        return None
    execution = gemm_execution(formats, config.precision.recipe(), config.model.transformer_impl, capability)
    if any(how != SIMULATED for f, how in execution.items() if precision_format(f).quantized):
        return None  # a real low-precision kernel: the measured table decides (the first solve checks it)
    low = [f for f in formats if precision_format(f).quantized]
    fastest = ("1 (every module in bf16)" if len(low) < len(formats)
               else "above 1 (bf16 is not among --snip-formats)")
    where = "no GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    return (f"--snip-time-target {target:g} cannot be met: on this device ({where}) every candidate precision "
            f"below bf16 ({', '.join(low)}) runs emulated, no faster than bf16, so "
            f"the fastest feasible target is {fastest}; give --snip-time-target 1 or more, or "
            "--gemm-speed-model blackwell to plan for hardware with FP8/FP4 tensor cores")


def check_snip_budgets(config: RunConfig, pins: tuple[dict[str, Precision], str] | None = None) -> None:
    """Solve SNIP's ILP once at start-up with zero costs and the run's ``pins`` (:func:`snip_pins`'s
    result, computed here if not given), so
    budgets no plan can meet (an FP4 share the candidates and pins cannot reach, a time target below
    what they can run at, or the two together) fail before training instead of at the first cycle.
    With ``--gemm-speed-model measured`` the speeds are not known yet: a time target below 1 is refused
    where every candidate runs emulated (:func:`time_target_refusal`), otherwise only the FP4 share is
    checked here and the first cycle's solve checks the time. PlanError naming the flags and the pins."""
    from dataclasses import replace

    from megatron_snip.snip.estimators import CostTables
    from megatron_snip.snip.feasibility import InfeasibleBudgetError
    from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, solve_plan

    dims = LlamaLinearDims.from_config(config.model)
    pins, described = pins if pins is not None else snip_pins(config)
    measured = config.precision.gemm_speed_model == "measured"
    refusal = time_target_refusal(config, torch.cuda.get_device_capability() if has_cuda() else None)
    if refusal is not None:
        raise PlanError(refusal)
    planner = PlannerConfig.from_snip(config.snip, config.precision.recipe(),
                                       peak_speed_model("auto" if measured else config.precision.gemm_speed_model),
                                       pins=pins)
    if measured:
        planner = replace(planner, speed=None, time_target=None)
    modules = linear_modules(dims, 1, config.parallel.pipeline_layout(config.model.num_layers))
    zero = {m.name: dict.fromkeys(planner.formats, 0.0) for m in modules}
    try:
        solve_plan(build_problem(modules, CostTables(zero, zero, zero), planner), planner)
    except InfeasibleBudgetError as e:
        raise PlanError(f"--snip budgets: {e}" + (f" ({described})" if described else "")) from None

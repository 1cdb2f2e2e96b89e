"""Precision plans as megatron-core per-module precision configs (Megatron-LM's ``--te-precision-config-file``).

megatron-core (``megatron/core/quantization/quant_config.py``) reads a YAML file of named
``configs``, each a ``TEQuantizationParams`` (the Transformer Engine recipe a module's three GEMMs
run in: none = bf16, an FP8 recipe, or NVFP4), and ordered ``matchers``: glob patterns over module
paths, the first enabled one that matches choosing the config. ``GPTModel`` resolves every TE
linear's config from its path in ``named_modules()`` (``quantization.utils.get_quant_config_or_none``)
and the module enters that recipe's autocast around its GEMMs.

Those paths are *stage-local*: ``decoder.layers.N`` is the layer's index within its model chunk
(megatron-core's ``TransformerBlock`` numbers its ``ModuleList`` from 0 on every pipeline stage and
virtual chunk; only ``TransformerLayer.layer_number`` is global, and 1-based). A plan's global
``decoder.layers.{i}`` is therefore one file only when one chunk holds every layer
(``--pipeline-model-parallel-size 1``); under PP / VPP each model chunk needs its own file
(:func:`megatron_config_files`), and Megatron-LM, which gives every rank the same file, can replay
it only where each rank is given its stage's file (docs/snip.md, "Plans as Megatron-LM precision
configs").

An FP8 recipe per module is what these configs are for: ``fp8`` (the run's ``--fp8-recipe``) and
``fp8:RECIPE`` both become ``fp8_quantization_recipe: RECIPE`` (megatron-core 0.16 runs
tensorwise, blockwise and mxfp8 per module, with ``fp8_format`` the run's ``--fp8-format``), and
reading maps a module's recipe back to ``fp8`` where it is the run's, else to ``fp8:RECIPE``.
What a TE recipe cannot state is refused (ValueError naming the module): mxfp4 (TE has no MXFP4
recipe), rowwise FP8 (TE has none; it is torchao's), delayed scaling (megatron-core's per-module
configs refuse it), different forward and backward precisions (a recipe covers all three GEMMs).
The NVFP4 switches (``--nvfp4-disable-rht`` ...) are TE environment variables, not config fields:
each file's header names them.

Files written here carry a ``megatron_snip_layout`` key (the layout and chunk they are for), which
megatron-core ignores (it reads ``configs`` and ``matchers`` only) and :func:`read_megatron_config`
checks. Reading goes through megatron-core's own parser and matchers; only its names are mapped back
to this program's precisions.
"""

from __future__ import annotations

import enum
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from megatron_snip.numerics.recipes import BF16, Precision, RecipeConfig
from megatron_snip.numerics.registry import (
    FP8_RECIPE_SCHEMES,
    PRECISIONS,
    SCHEMES,
    fp8_recipe_precision,
    precision_format,
    precision_scheme,
)
from megatron_snip.precision.execution import TE_RECIPES, te_nvfp4_environment, te_unsupported
from megatron_snip.precision.pipeline_layout import ModelChunk, PipelineLayout
from megatron_snip.precision.plan import LINEAR_MODULES, PlanError, PrecisionPlan, module_name

LAYOUT_KEY = "megatron_snip_layout"
CONFIG_TYPE = "TEQuantizationParams"  # megatron-core's TransformerEngineConfigType
# megatron-core's per-module FP8 recipes (TEQuantizationRecipe; "delayed" is refused there).
TE_FP8_RECIPES = tuple(te.name for te in TE_RECIPES.values() if te.kind == "fp8")
# fp4_quantization_recipe -> the precision it runs (a precision whose own scheme has a TE recipe).
TE_FP4_PRECISIONS = {TE_RECIPES[p.scheme].name: p.name for p in PRECISIONS.values()
                     if p.scheme in TE_RECIPES and TE_RECIPES[p.scheme].kind == "fp4"}


def te_config(precision: Precision, recipe: RecipeConfig) -> dict:
    """megatron-core's ``TEQuantizationParams`` config (as the YAML holds it) that runs ``precision``
    under ``recipe``. ValueError for what a TE recipe cannot state.

    Quantized configs set ``override_nonquantized_autocast`` and bf16 keeps the default
    ``override_quantized_autocast``, so a file that matches every module sets every module's
    precision whatever the run's own --fp8-format / --fp4-format / --first-last-layers-bf16 say.
    """
    if precision.fwd != precision.bwd:
        raise ValueError(f"{precision} gives the forward and backward GEMMs different precisions; a Transformer "
                         "Engine recipe covers all three GEMMs of a module")
    name = precision.fwd
    te = TE_RECIPES.get(precision_scheme(name, recipe.fp8_recipe).name)
    if not precision_format(name).quantized:
        training = {}
    elif te is None:
        raise ValueError(te_unsupported(name, recipe))
    elif te.kind == "fp8":
        training = {"fp8_quantization_recipe": te.name, "fp8_format": recipe.fp8_format,
                    "override_nonquantized_autocast": True}
    else:
        training = {"fp4_quantization_recipe": te.name, "override_nonquantized_autocast": True}
    return {"transformer_engine_config_type": CONFIG_TYPE, "training_recipe": training}


def to_megatron_config(plan: PrecisionPlan, recipe: RecipeConfig, layout: PipelineLayout,
                       chunk: tuple[int, int] = (0, 0), source: str = "megatron-snip") -> str:
    """The YAML text of ``plan`` for one model chunk (``chunk`` = (pipeline stage, virtual stage)) of
    ``layout`` (at PP 1, the whole model in one chunk).

    Matchers, in order: a layer's four modules together (``decoder.layers.{i}.*``) where they agree,
    else each module that differs from the default; last the default (``decoder.layers.*``, the
    most common precision), so every linear module is matched. ``source`` names the plan in the
    header. ValueError naming the module for a precision a TE recipe cannot state.
    """
    import yaml

    plan.validate(layout.num_layers, source=source)
    this = layout.chunk(*chunk)
    names = [module_name(layer, m) for layer in this.layers for m in LINEAR_MODULES]
    configs: dict[str, dict] = {}
    for name in names:
        key = str(plan[name])
        if key not in configs:
            try:
                configs[key] = te_config(plan[name], recipe)
            except ValueError as e:
                raise ValueError(f"{source}: {name}: {e}, so it cannot be stated in a Megatron-LM precision "
                                 "config") from None
    default = Counter(str(plan[n]) for n in names).most_common(1)[0][0]
    matchers: dict[str, dict] = {}
    for local, layer in enumerate(this.layers):
        precisions = {m: str(plan[module_name(layer, m)]) for m in LINEAR_MODULES}
        if len(set(precisions.values())) == 1:
            if precisions[LINEAR_MODULES[0]] != default:
                matchers[f"layer_{local}"] = _glob(f"decoder.layers.{local}.*", precisions[LINEAR_MODULES[0]])
            continue
        for m, key in precisions.items():
            if key != default:
                matchers[f"layer_{local}_{m.split('.')[-1]}"] = _glob(module_name(local, m), key)
    matchers["default"] = _glob("decoder.layers.*", default)
    written = {**layout.to_dict(), "pipeline_stage": this.stage, "virtual_pipeline_stage": this.virtual_stage,
               "global_layers": list(this.layers)}
    body = yaml.safe_dump({"configs": configs, "matchers": matchers, LAYOUT_KEY: written}, sort_keys=False,
                          default_flow_style=None, width=1000)  # one line per matcher
    return _header(source, recipe, list(configs), this, layout) + body


def _glob(pattern: str, config: str) -> dict:
    return {"type": "glob", "pattern": pattern, "config": config, "enabled": True}


def _header(source: str, recipe: RecipeConfig, configs: list[str], chunk: ModelChunk, layout: PipelineLayout) -> str:
    """The file's comment: what it states, for which chunk, what it cannot state, how to replay it."""
    import textwrap

    first, last = chunk.layers[0], chunk.layers[-1]
    if layout.chunk_count == 1:
        where = (f"Model: {layout.num_layers} layers in one model chunk. Valid at --pipeline-model-parallel-size 1 "
                 "(any TP, DP): megatron-core numbers layers within each pipeline stage and virtual chunk, so under "
                 "PP every chunk needs a file of its own (megatron-snip writes them as "
                 "<name>.pp<stage>[.vp<chunk>].yaml).")
    else:
        vp = f", virtual stage {chunk.virtual_stage} of {layout.virtual_stages}" if layout.virtual_stages > 1 else ""
        uneven = "".join(f" --decoder-{which}-pipeline-num-layers {n}" for which, n in
                         (("first", layout.first_stage_layers), ("last", layout.last_stage_layers)) if n is not None)
        where = (f"Model: {layout.num_layers} layers. This file: pipeline stage {chunk.stage} of "
                 f"{layout.pipeline_stages}{vp}" + (f" (uneven stages:{uneven})" if uneven else "")
                 + f", global layers {_span(first, last)} as decoder.layers.{_span(0, last - first)} (megatron-core "
                 "numbers layers within each model chunk). Valid only on that stage's ranks: Megatron-LM gives all "
                 "ranks one file, so each rank needs its stage's file"
                 + ("; the chunks of one rank share it, so per-chunk files replay only where they agree."
                    if layout.virtual_stages > 1 else "."))
    paragraphs = [
        f"Precision plan ({source}) as a megatron-core per-module precision config (Megatron-LM "
        "--te-precision-config-file; parsed by megatron/core/quantization/quant_config.py).",
        where,
        f"Configs: {'; '.join(_describe_config(c, recipe) for c in configs)}. Every linear module is matched and "
        "every config overrides the run's own autocast, so this file alone sets their precision. Not expressible "
        "here: mxfp4 (TE has no MXFP4 recipe), rowwise and delayed FP8 (no per-module TE recipe) and different "
        "forward and backward precisions (a TE recipe covers all three GEMMs of a module).",
        "NVFP4's switches are TE environment variables, read when TE is imported. Replay in Megatron-LM: set",
    ]
    lines = [line for text in paragraphs for line in textwrap.wrap(text, 100, break_on_hyphens=False)]
    lines += ["  " + " ".join(f"{k}={v}" for k, v in te_nvfp4_environment(recipe).items()),
              "and add to the run's model and parallelism flags",
              "  --transformer-impl transformer_engine --bf16 --te-precision-config-file THIS_FILE",
              f"({LAYOUT_KEY} records the layout for megatron-snip's reader; megatron-core ignores it.)"]
    return "".join(f"# {line}\n" for line in lines)


def _describe_config(key: str, recipe: RecipeConfig) -> str:
    """e.g. "fp8:blockwise = TE Float8BlockScaling (--fp8-format hybrid)" for the header."""
    name = Precision.parse(key).fwd
    if not precision_format(name).quantized:
        return f"{key} = no quantization"
    te = TE_RECIPES[precision_scheme(name, recipe.fp8_recipe).name]
    if te.kind == "fp8":
        run = f"--fp8-recipe {recipe.fp8_recipe}, " if precision_format(name).fp8_recipe is None else ""
        return f"{key} = TE {te.te_class} ({run}--fp8-format {recipe.fp8_format})"
    return f"{key} = TE {te.te_class}"


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}..{last}"


def megatron_config_files(plan: PrecisionPlan, recipe: RecipeConfig, layout: PipelineLayout,
                          source: str = "megatron-snip") -> dict[str, str]:
    """File-name suffix -> YAML text: ``""`` the whole model in one chunk (the plan at PP 1), and under
    PP > 1 one file per model chunk of ``layout``, ``".pp{stage}"`` (``".pp{stage}.vp{virtual stage}"``
    with virtual stages). ValueError as :func:`to_megatron_config`."""
    files = {"": to_megatron_config(plan, recipe, PipelineLayout(layout.num_layers), source=source)}
    if layout.chunk_count > 1:
        for c in layout.chunks():
            suffix = f".pp{c.stage}" + (f".vp{c.virtual_stage}" if layout.virtual_stages > 1 else "")
            files[suffix] = to_megatron_config(plan, recipe, layout, (c.stage, c.virtual_stage), source=source)
    return files


def read_megatron_config(path: str | os.PathLike, layout: PipelineLayout, *, recipe: RecipeConfig,
                         chunk: tuple[int, int] | None = None,
                         base: Mapping[str, Precision] | None = None) -> dict[str, Precision]:
    """Global module name -> precision for every linear module the file sets, read as megatron-core
    reads it: its own parser and glob matchers, on each module's stage-local path in ``layout``.

    ``chunk`` None: the file applies to every model chunk, as Megatron-LM's flag gives every rank
    the same file; (stage, virtual stage): the file is that chunk's, and only its modules are read.

    ``base``: the precision a module runs without the file (Megatron-LM: the autocast of its layer,
    from --fp8-format / --fp4-format and --first-last-layers-bf16). A config replaces it only where
    megatron-core lets it override that autocast (``override_quantized_autocast`` where the base is
    quantized, ``override_nonquantized_autocast`` where it is bf16); else the module is left out.
    A module absent from ``base`` has no known base (SNIP re-plans it): a config whose effect would
    depend on it is refused.

    ``recipe``: the run's; an fp8 config reads as ``fp8`` where it names the run's --fp8-recipe, else as
    ``fp8:RECIPE``, and its fp8_format must be the run's --fp8-format (a precision carries no format of
    its own). PlanError (a ValueError) naming the file, on one line, for a file
    megatron-core cannot parse, a recipe this program does not run (custom, delayed, an FP4 recipe
    other than nvfp4), evaluation precisions other than the training ones, a matcher that matches
    no linear module of this layout, or a file written for another layout.
    """
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.quant_config import MatchContext
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    source = str(path)
    raw = _load_yaml(source)
    try:
        parsed = load_quantization_recipe(source)
    except (AssertionError, NotImplementedError, AttributeError, TypeError, ValueError) as e:
        raise PlanError(f"{source}: not a megatron-core precision config ({type(e).__name__}: {e})") from None
    chunks = layout.chunks() if chunk is None else [layout.chunk(*chunk)]
    _check_layout(raw.get(LAYOUT_KEY), source, layout, chunk)
    paths = {module_name(layer, m): c.local_path(module_name(layer, m))
             for c in chunks for layer in c.layers for m in LINEAR_MODULES}
    for matcher in parsed.matchers:
        if not any(matcher.match(MatchContext(p, None)) for p in paths.values()):
            local = max(len(c.layers) for c in chunks) - 1
            raise PlanError(f"{source}: matcher {matcher!r} matches none of this model's linear modules "
                            f"(decoder.layers.0..{local}.{{{','.join(LINEAR_MODULES)}}}: megatron-core numbers layers "
                            "within each pipeline stage)")
    out: dict[str, Precision] = {}
    for name, local_path in paths.items():
        quant = get_quant_config_or_none(local_path, parsed)
        if quant is None:
            continue
        where = f"{source}: config {quant.config_key!r} (matched by {local_path})"
        try:
            params = TEQuantizationParams.parse_from_config(quant)
        except (AssertionError, KeyError, TypeError, ValueError, NotImplementedError) as e:
            raise PlanError(f"{where}: {type(e).__name__}: {e}") from None
        precision = _precision(params.training_recipe, recipe, where)
        if params.evaluation_recipe is not None and _precision(params.evaluation_recipe, recipe, where) != precision:
            raise PlanError(f"{where}: an evaluation_recipe other than the training one; this program runs one "
                            "precision per module in training and evaluation")
        train = params.training_recipe
        over = {False: train.override_nonquantized_autocast, True: train.override_quantized_autocast}
        if base is not None and name in base:
            if over[not base[name].is_bf16]:
                out[name] = precision
        elif over[True] and (over[False] or precision.is_bf16):
            out[name] = precision
        else:
            flag = "override_quantized_autocast" if not over[True] else "override_nonquantized_autocast"
            raise PlanError(f"{where}: {flag} is false, so {name} would run {precision} or keep the precision it "
                            f"has without the file, which SNIP chooses; set {flag}: true to fix it")
    return out


def _load_yaml(source: str) -> dict:
    import yaml

    try:
        raw = yaml.safe_load(Path(source).read_text())
    except FileNotFoundError:
        raise PlanError(f"{source}: file not found (expected a megatron-core precision config YAML)") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{source}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("matchers"), dict) or not isinstance(raw.get("configs"),
                                                                                                dict):
        raise PlanError(f"{source}: a megatron-core precision config has 'configs' and 'matchers' mappings")
    return raw


def _check_layout(written, source: str, layout: PipelineLayout, chunk: tuple[int, int] | None) -> None:
    """A file this module wrote names the layout and chunk it is for: refuse it elsewhere."""
    if written is None:
        return
    try:
        its = PipelineLayout.from_dict(written)
        its_chunk = (written["pipeline_stage"], written["virtual_pipeline_stage"])
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"{source}: malformed {LAYOUT_KEY} (written by megatron-snip: num_layers, "
                        "pipeline_model_parallel_size, ...)") from None
    one_file = layout.chunk_count == 1
    if its != layout or (chunk is None and not one_file and its.chunk_count > 1) \
            or (chunk is not None and its_chunk != chunk):
        what = (f"pipeline stage {its_chunk[0]}" + (f", virtual stage {its_chunk[1]}" if its.virtual_stages > 1 else "")
                if its.chunk_count > 1 else "the whole model in one chunk")
        here = (f"chunk {chunk}" if chunk is not None else
                "every stage (one file for all ranks, as in Megatron-LM)" if not one_file else "the whole model")
        raise PlanError(f"{source}: written for {what} of {its}, but read here for {here} of {layout}: megatron-core "
                        "numbers layers within each stage, so it would set other layers; give a JSON plan "
                        "(--precision-plan, layout-free) instead")


def _value(x):
    """A megatron-core enum member or the string YAML gave (TEQuantizationRecipe keeps either)."""
    return x.value if isinstance(x, enum.Enum) else x


def _precision(te, recipe: RecipeConfig, where: str) -> Precision:
    """This program's precision for megatron-core's ``TEQuantizationRecipe`` ``te`` (PlanError when none)."""
    fp8, fp4 = _value(te.fp8_quantization_recipe), _value(te.fp4_quantization_recipe)
    if fp8 is None and fp4 is None:
        return BF16
    if fp4 is not None:
        if fp4 not in TE_FP4_PRECISIONS:
            raise PlanError(f"{where}: fp4_quantization_recipe {fp4!r} is not one this program runs "
                            f"({', '.join(TE_FP4_PRECISIONS)})")
        return Precision.uniform(TE_FP4_PRECISIONS[fp4])
    if fp8 not in TE_FP8_RECIPES:
        raise PlanError(f"{where}: fp8_quantization_recipe {fp8!r} is not one this program runs per module "
                        f"({', '.join(TE_FP8_RECIPES)})")
    if te.fp8_format != recipe.fp8_format:
        raise PlanError(f"{where}: fp8_format {te.fp8_format}, but every FP8 module runs the run's --fp8-format "
                        f"{recipe.fp8_format}; give --fp8-format {te.fp8_format}")
    run = precision_scheme("fp8", recipe.fp8_recipe) == SCHEMES[FP8_RECIPE_SCHEMES[fp8]]
    return Precision.uniform("fp8" if run else fp8_recipe_precision(fp8))

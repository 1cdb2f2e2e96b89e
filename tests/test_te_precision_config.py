"""Plans as megatron-core per-module precision configs (Megatron-LM's --te-precision-config-file), read
back with megatron-core's own parser: ``quantization.utils.get_quant_config_or_none`` on the module
paths ``GPTModel.named_modules()`` gives them, and ``TEQuantizationParams.parse_from_config``."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from conftest import ROOT, launch, run_config, train_args

from megatron_snip.arguments import ArgumentError
from megatron_snip.numerics.recipes import BF16, Precision, RecipeConfig
from megatron_snip.numerics.registry import precision_fp8_recipe
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.precision.plan import LINEAR_MODULES, PlanError, PrecisionPlan, module_name, module_names
from megatron_snip.precision.te_precision_config import megatron_config_files, read_megatron_config, to_megatron_config
from megatron_snip.training.precision_setup import initial_plan

RECIPE = RecipeConfig()


def random_plan(num_layers: int, seed: int, formats=("bf16", "fp8", "nvfp4")) -> PrecisionPlan:
    rng = random.Random(seed)
    return PrecisionPlan({n: Precision.uniform(rng.choice(formats)) for n in module_names(num_layers)})


def megatron_core_reads(path, local_path: str):
    """What megatron-core resolves for the module at ``local_path``: (TEQuantizationParams or None, whether
    the module then runs quantized inside a bf16 autocast, and inside a quantized one)."""
    from megatron.core.extensions.transformer_engine import (
        TEQuantizationParams,
        _get_should_context_be_quantized_params,
    )
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    config = get_quant_config_or_none(local_path, load_quantization_recipe(str(path)))
    if config is None:
        return None, False, True
    params = TEQuantizationParams.parse_from_config(config)
    return params, *(_get_should_context_be_quantized_params(params, True, ctx) for ctx in (False, True))


def assert_resolves_to(path, plan: PrecisionPlan, recipe: RecipeConfig, paths: dict[str, str]):
    """Every global module in ``paths`` (global name -> path in its chunk) resolves, through megatron-core,
    to the plan's format and the run's recipe, whatever autocast the run opens around it."""
    for name, local in paths.items():
        params, in_bf16, in_quantized = megatron_core_reads(path, local)
        assert params is not None, name
        want = plan[name].fwd
        assert in_bf16 == in_quantized == (want != "bf16"), name
        te = params.training_recipe
        assert te.fp4_quantization_recipe == ("nvfp4" if want == "nvfp4" else None), name
        fp8 = precision_fp8_recipe(want, recipe.fp8_recipe)  # fp8: the run's recipe; fp8:RECIPE its own
        assert te.fp8_quantization_recipe == fp8, name
        if fp8 is not None:
            assert te.fp8_format == recipe.fp8_format, name
        assert params.evaluation_recipe is None


@pytest.mark.parametrize("recipe", [RECIPE, RecipeConfig(fp8_recipe="mxfp8", fp8_format="e4m3")], ids=["tensorwise",
                                                                                                     "mxfp8"])
def test_megatron_core_resolves_every_module_to_the_plans_format_and_recipe(tmp_path, recipe):
    plan = random_plan(12, seed=3)
    path = tmp_path / "plan.yaml"
    path.write_text(to_megatron_config(plan, recipe, PipelineLayout(12)))
    assert_resolves_to(path, plan, recipe, {n: n for n in module_names(12)})  # one chunk: global = local paths


@pytest.mark.parametrize("run_recipe", ["tensorwise", "blockwise", "rowwise"])
def test_fp8_recipes_per_module_round_trip_through_megatron_core(tmp_path, run_recipe):
    """fp8 and fp8:RECIPE both become megatron-core's per-module fp8_quantization_recipe; reading maps the
    run's --fp8-recipe back to fp8 and every other recipe to fp8:RECIPE, so a plan that names the run's recipe
    as fp8 comes back unchanged (under --fp8-recipe rowwise, which TE lacks, plain fp8 cannot be written)."""
    recipe = RecipeConfig(fp8_recipe=run_recipe)
    te = [r for r in ("tensorwise", "blockwise", "mxfp8") if r != run_recipe]
    formats = ("bf16", "nvfp4", *(f"fp8:{r}" for r in te), *(("fp8",) if run_recipe != "rowwise" else ()))
    plan = random_plan(8, seed=5, formats=formats)
    assert {str(p) for p in plan.modules.values()} | {str(plan.default)} == set(formats)
    path = tmp_path / "plan.yaml"
    path.write_text(to_megatron_config(plan, recipe, PipelineLayout(8)))
    assert_resolves_to(path, plan, recipe, {n: n for n in module_names(8)})
    assert PrecisionPlan(read_megatron_config(path, PipelineLayout(8), recipe=recipe)) == PrecisionPlan(
        {n: plan[n] for n in module_names(8)})
    configs = __import__("yaml").safe_load(path.read_text())["configs"]
    assert configs[f"fp8:{te[0]}"]["training_recipe"]["fp8_quantization_recipe"] == te[0]
    header = " ".join(line[2:] for line in path.read_text().splitlines() if line.startswith("# "))
    assert f"fp8:{te[0]} = TE " in header and "(--fp8-format hybrid)" in header
    # fp8:RECIPE naming the run's recipe is the same config, read back as plain fp8
    if run_recipe != "rowwise":
        same = PrecisionPlan.uniform(f"fp8:{run_recipe}")
        path.write_text(to_megatron_config(same, recipe, PipelineLayout(8)))
        assert set(read_megatron_config(path, PipelineLayout(8), recipe=recipe).values()) == {Precision.uniform("fp8")}


# (PP, VPP, --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers) of an 8-layer model
@pytest.mark.parametrize("pp,vpp,first,last", [(2, 1, None, None), (2, 2, None, None), (4, 1, None, None),
                                               (2, 1, 1, None), (3, 1, 2, 1), (2, 2, 2, None), (3, 2, None, 4)])
def test_per_chunk_files_resolve_the_stage_local_paths(tmp_path, pp, vpp, first, last):
    """Even and uneven stages: each chunk's file, read by megatron-core on the chunk's stage-local paths
    (``decoder.layers.0`` the chunk's first layer), gives the plan's precision of the global module, and
    read back here gives the plan."""
    layout = PipelineLayout(8, pp, vpp, first, last)
    plan = random_plan(8, seed=pp * 10 + vpp + 100 * (first or 0) + 1000 * (last or 0))
    files = megatron_config_files(plan, RECIPE, layout, source="test")
    expected = {""} | {f".pp{c.stage}" + (f".vp{c.virtual_stage}" if vpp > 1 else "") for c in layout.chunks()}
    assert set(files) == expected
    covered = set()
    for chunk in layout.chunks():
        suffix = f".pp{chunk.stage}" + (f".vp{chunk.virtual_stage}" if vpp > 1 else "")
        path = tmp_path / f"plan{suffix}.yaml"
        path.write_text(files[suffix])
        paths = {module_name(layer, m): chunk.local_path(module_name(layer, m)) for layer in chunk.layers
                 for m in LINEAR_MODULES}
        assert all(p.startswith(f"decoder.layers.{i // 4}.") for i, p in enumerate(paths.values()))  # stage-local
        assert_resolves_to(path, plan, RECIPE, paths)
        assert read_megatron_config(path, layout, recipe=RECIPE, chunk=(chunk.stage, chunk.virtual_stage)) \
            == {n: plan[n] for n in paths}
        covered |= set(paths)
    assert covered == set(module_names(8))


@pytest.mark.parametrize("seed", range(5))
def test_round_trip(tmp_path, seed):
    plan = random_plan(6, seed)
    path = tmp_path / "plan.yaml"
    path.write_text(to_megatron_config(plan, RECIPE, PipelineLayout(6)))
    assert PrecisionPlan(read_megatron_config(path, PipelineLayout(6), recipe=RECIPE)) == plan


def test_matchers_are_compact_and_ordered():
    """Uniform layers get one matcher, the most common precision is the default, last."""
    import yaml

    plan = PrecisionPlan({**{module_name(1, m): Precision.uniform("bf16") for m in LINEAR_MODULES},
                          module_name(2, "mlp.linear_fc2"): Precision.uniform("fp8")}, Precision.uniform("nvfp4"))
    data = yaml.safe_load(to_megatron_config(plan, RECIPE, PipelineLayout(4)))
    assert [(m["pattern"], m["config"]) for m in data["matchers"].values()] == [
        ("decoder.layers.1.*", "bf16"), ("decoder.layers.2.mlp.linear_fc2", "fp8"), ("decoder.layers.*", "nvfp4")]
    assert data["configs"]["bf16"] == {"transformer_engine_config_type": "TEQuantizationParams",
                                       "training_recipe": {}}
    uniform = yaml.safe_load(to_megatron_config(PrecisionPlan.uniform("fp8"), RECIPE, PipelineLayout(4)))
    assert list(uniform["matchers"]) == ["default"]


def test_layer_glob_does_not_catch_two_digit_layers(tmp_path):
    plan = PrecisionPlan({module_name(1, m): BF16 for m in LINEAR_MODULES}, Precision.uniform("nvfp4"))
    path = tmp_path / "plan.yaml"
    path.write_text(to_megatron_config(plan, RECIPE, PipelineLayout(12)))
    assert_resolves_to(path, plan, RECIPE, {n: n for n in module_names(12)})  # layers 10, 11 stay nvfp4


@pytest.mark.parametrize("plan,recipe,message", [
    (PrecisionPlan({"decoder.layers.1.mlp.linear_fc1": Precision.uniform("mxfp4")}), RECIPE,
     "decoder.layers.1.mlp.linear_fc1: precision mxfp4: Transformer Engine has no MXFP4 recipe"),
    (PrecisionPlan({"decoder.layers.0.mlp.linear_fc2": Precision("nvfp4", "fp8")}), RECIPE,
     "decoder.layers.0.mlp.linear_fc2: nvfp4/fp8 gives the forward and backward GEMMs different precisions"),
    (PrecisionPlan.uniform("fp8"), RecipeConfig(fp8_recipe="delayed"),
     "decoder.layers.0.self_attention.linear_qkv: fp8 with --fp8-recipe delayed"),
    (PrecisionPlan({"decoder.layers.1.mlp.linear_fc2": Precision.uniform("fp8:delayed")}), RECIPE,
     "decoder.layers.1.mlp.linear_fc2: fp8:delayed: megatron-core's per-module TE recipes do not support delayed "
     "scaling; use fp8:tensorwise, fp8:blockwise or fp8:mxfp8"),
    (PrecisionPlan({"decoder.layers.0.mlp.linear_fc1": Precision.uniform("fp8:rowwise")}), RECIPE,
     "decoder.layers.0.mlp.linear_fc1: fp8:rowwise: Transformer Engine has no rowwise FP8 recipe"),
])
def test_what_te_cannot_state_is_refused(plan, recipe, message):
    with pytest.raises(ValueError, match="cannot be stated in a Megatron-LM precision config") as e:
        to_megatron_config(plan, recipe, PipelineLayout(2), source="plan.json")
    assert str(e.value).startswith(f"plan.json: {message}")


# -- reading files written for Megatron-LM ---------------------------------------------------------------

def config_file(tmp_path, configs: dict, matchers: list[tuple[str, str]] | dict, name="te.yaml"):
    import yaml

    if isinstance(matchers, list):
        matchers = {f"m{i}": {"type": "glob", "pattern": p, "config": c, "enabled": True}
                    for i, (p, c) in enumerate(matchers)}
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"configs": configs, "matchers": matchers}))
    return path


def te(**training):
    return {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": training}


def test_megatron_lms_override_rules_over_the_base(tmp_path):
    """The documented Megatron-LM use: a quantized run (here fp8 mxfp8/e4m3, ends in bf16) with bf16 and
    mxfp8 overrides at default override flags: bf16 overrides quantized modules, a quantized config
    leaves the bf16 ends alone (override_nonquantized_autocast defaults to false)."""
    recipe = RecipeConfig(fp8_recipe="mxfp8", fp8_format="e4m3")
    path = config_file(tmp_path, {"bf16": te(), "mxfp8": te(fp8_quantization_recipe="mxfp8")},
                       [("*.linear_proj", "bf16"), ("*.linear_fc1", "mxfp8")])
    fp8 = Precision.uniform("fp8")
    base = {n: (BF16 if n.startswith("decoder.layers.0.") else fp8) for n in module_names(2)}
    got = read_megatron_config(path, PipelineLayout(2), recipe=recipe, base=base)
    # Layer 0 keeps its bf16 autocast: neither config overrides a non-quantized one.
    assert got == {"decoder.layers.1.self_attention.linear_proj": BF16, "decoder.layers.1.mlp.linear_fc1": fp8}


def test_a_config_that_depends_on_an_unknown_base_is_refused(tmp_path):
    path = config_file(tmp_path, {"fp8": te(fp8_quantization_recipe="tensorwise", fp8_format="hybrid")},
                       [("*.linear_fc2", "fp8")])
    with pytest.raises(PlanError, match=r"override_nonquantized_autocast is false, so decoder.layers.0.mlp.linear_fc2 "
                                        r"would run fp8 or keep .* set override_nonquantized_autocast: true"):
        read_megatron_config(path, PipelineLayout(2), recipe=RECIPE)


@pytest.mark.parametrize("configs,message", [
    ({"c": te(fp8_quantization_recipe="custom", custom_recipe_factory="x.y")},
     "fp8_quantization_recipe 'custom' is not one this program runs per module (tensorwise, blockwise, mxfp8)"),
    ({"c": te(fp4_quantization_recipe="custom", custom_recipe_factory="x.y")},
     "fp4_quantization_recipe 'custom' is not one this program runs (nvfp4)"),
    ({"c": te(fp8_quantization_recipe="delayed")}, "Delayed scaling not in scope"),
    ({"c": te(fp8_quantization_recipe="blockwise", override_nonquantized_autocast=True)},
     "fp8_format e4m3, but every FP8 module runs the run's --fp8-format hybrid; give --fp8-format e4m3"),
    ({"c": {**te(), "evaluation_recipe": {"fp4_quantization_recipe": "nvfp4"}}}, "an evaluation_recipe other than"),
    ({"c": te(fp8_recipe="tensorwise")}, "Field 'fp8_recipe' not valid"),
    ({"c": {"training_recipe": {}}}, "must have 'transformer_engine_config_type' key"),
])
def test_recipes_this_program_cannot_run_are_refused_naming_the_file(tmp_path, configs, message):
    path = config_file(tmp_path, configs, [("*", "c")])
    with pytest.raises(PlanError) as e:
        read_megatron_config(path, PipelineLayout(2), recipe=RECIPE)
    text = str(e.value)
    assert text.startswith(f"{path}: config 'c'") and message in text and "\n" not in text


def test_unreadable_files_and_unmatched_matchers_are_refused(tmp_path):
    with pytest.raises(PlanError, match="file not found"):
        read_megatron_config(tmp_path / "none.yaml", PipelineLayout(2), recipe=RECIPE)
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs: [\n")
    with pytest.raises(PlanError, match=f"^{bad}: not valid YAML"):
        read_megatron_config(bad, PipelineLayout(2), recipe=RECIPE)
    path = config_file(tmp_path, {"b": te()}, [("*.linear_kv_up_proj", "b")])
    with pytest.raises(PlanError, match=r"matcher GlobMatcher\(pattern=\*.linear_kv_up_proj, config_key=b\) matches "
                                        "none of this model's linear modules"):
        read_megatron_config(path, PipelineLayout(2), recipe=RECIPE)
    path = config_file(tmp_path, {"b": te()}, {"m": {"type": "regex", "pattern": "x", "config": "b",
                                                     "enabled": True}})
    with pytest.raises(PlanError, match="Match type 'regex' not implemented"):
        read_megatron_config(path, PipelineLayout(2), recipe=RECIPE)


def test_a_file_is_refused_under_another_layout(tmp_path):
    """Stage-local paths: the one-chunk file of an 8-layer model would set stage 1's layers 4..7 from its
    layers 0..3 at PP 2; a stage's file would set every stage from its own; an even stage's file would set
    other layers under uneven stages."""
    plan = random_plan(8, seed=1)
    files = megatron_config_files(plan, RECIPE, PipelineLayout(8, 2))
    whole, stage1 = tmp_path / "p.yaml", tmp_path / "p.pp1.yaml"
    whole.write_text(files[""])
    stage1.write_text(files[".pp1"])
    with pytest.raises(PlanError, match=r"written for the whole model in one chunk of a 8-layer model at pipeline "
                                        r"size 1, but read here for every stage"):
        read_megatron_config(whole, PipelineLayout(8, 2), recipe=RECIPE)
    with pytest.raises(PlanError, match="written for pipeline stage 1 of a 8-layer model at pipeline size 2"):
        read_megatron_config(stage1, PipelineLayout(8, 2), recipe=RECIPE)
    with pytest.raises(PlanError, match="read here for chunk"):
        read_megatron_config(stage1, PipelineLayout(8, 2), recipe=RECIPE, chunk=(0, 0))
    with pytest.raises(PlanError, match="of a 4-layer model"):
        read_megatron_config(whole, PipelineLayout(4), recipe=RECIPE)
    with pytest.raises(PlanError, match=r"written for pipeline stage 1 of a 8-layer model at pipeline size 2, but read "
                                        r"here for chunk \(1, 0\) of a 8-layer model at pipeline size 2 \(stages of 1 "
                                        r"\+ 7 layers\)"):
        read_megatron_config(stage1, PipelineLayout(8, 2, first_stage_layers=1), recipe=RECIPE, chunk=(1, 0))


# -- the flag ----------------------------------------------------------------------------------------------

def test_the_flag_sets_the_plan_over_precision_and_the_ends(tmp_path):
    """Without --snip: the file over --precision and --first-last-layers-bf16, as Megatron-LM reads it."""
    path = config_file(tmp_path, {"bf16": te(), "nvfp4": te(fp4_quantization_recipe="nvfp4")},
                       [("*.linear_proj", "bf16"), ("*.linear_fc1", "nvfp4")])
    plan, source = initial_plan(run_config("--precision", "fp8", "--first-last-layers-bf16",
                                           "--te-precision-config-file", str(path)))
    assert source == f"--precision fp8, --first-last-layers-bf16, --te-precision-config-file {path}"
    want = {n: (BF16 if n.startswith(("decoder.layers.0.", "decoder.layers.3.")) or n.endswith("linear_proj")
                else Precision.uniform("nvfp4") if n.endswith("linear_fc1") else Precision.uniform("fp8"))
            for n in module_names(4)}
    assert {n: plan[n] for n in module_names(4)} == want


def test_the_flag_and_a_json_plan_both_setting_the_plan_is_an_error(tmp_path):
    path = config_file(tmp_path, {"b": te()}, [("*", "b")])
    PrecisionPlan.uniform("fp8").save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match=f"--te-precision-config-file {path} and --precision-plan .* both set the plan"):
        initial_plan(run_config("--te-precision-config-file", str(path), "--precision-plan",
                                str(tmp_path / "plan.json")))


def test_a_bad_file_fails_at_start_up_naming_the_flag(tmp_path):
    path = config_file(tmp_path, {"c": te(fp4_quantization_recipe="custom", custom_recipe_factory="x")},
                       [("*", "c")])
    with pytest.raises(ArgumentError, match=f"^--te-precision-config-file {path}: config 'c'"):
        run_config("--snip", "--snip-interval", "2", "--snip-fp4-target", "0.5", "--te-precision-config-file",
                   str(path))


# -- in training (processes) -------------------------------------------------------------------------------

@pytest.mark.integration
def test_megatron_cores_module_paths_are_stage_local_and_the_chunk_files_match_them(tiny_data, tmp_path):
    """In the real models of a PP2 x VPP2 run (4 layers, one per chunk), every linear module's path in
    its chunk's ``GPTModel.named_modules()`` is ``decoder.layers.0...``; megatron-core's resolution of
    the chunk's file on that path gives the plan's precision of the module's global name."""
    plan = random_plan(4, seed=5)
    plan.save(tmp_path / "plan.json")
    launch(4, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
                         "2", iters=2),
           script="tests/drivers/megatron_paths.py", env={"PLAN": str(tmp_path / "plan.json"), "OUT": str(tmp_path)})
    seen = {}
    for rank in range(4):
        seen.update(json.loads((tmp_path / f"rank{rank}.json").read_text()))
    assert set(seen) == set(module_names(4))
    for name, (path, resolved) in seen.items():
        assert path == "decoder.layers.0." + name.split(".", 3)[3]
        assert resolved == str(plan[name])


@pytest.mark.integration
def test_a_snip_run_writes_yaml_plans_megatron_core_reads_back_identically(tiny_data, tmp_path):
    """A quickstart-style tiny SNIP run at PP 2 with uneven stages (--decoder-first-pipeline-num-layers 1: layer 0
    on stage 0, layers 1-3 on stage 1) and the config file's modules as pins, read as Megatron-LM reads one file
    on every stage: linear_proj in fp8 everywhere, and decoder.layers.2.mlp.linear_fc1 only on stage 1 (its
    third layer, global layer 3; stage 0 has one). Every cycle writes its plan as snip_iter_N.yaml (one chunk)
    and .pp0 / .pp1 files, the checkpoint as te_precision_config[.pp<stage>].yaml; megatron-core resolves every
    module of them, on its stage-local path, to the plan, read back here they are the plan, and the pins hold."""
    from megatron_snip.training.checkpointing import read_record

    pins = config_file(tmp_path, {"fp8": te(fp8_quantization_recipe="tensorwise", fp8_format="hybrid",
                                             override_nonquantized_autocast=True)},
                       [("*.linear_proj", "fp8"), ("decoder.layers.2.mlp.linear_fc1", "fp8")])
    pinned = {n for n in module_names(4) if n.endswith("linear_proj")} | {"decoder.layers.3.mlp.linear_fc1"}
    layout = PipelineLayout(4, 2, first_stage_layers=1)
    save = tmp_path / "ckpt"
    launch(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
                         "--snip", "--snip-fp4-target", "0.5", "--snip-interval", "2", "--snip-probe-passes", "1",
                         "--te-precision-config-file", str(pins), "--save", str(save), "--save-interval", "4", iters=4))

    def assert_stage_files_are(stem: str, plan: PrecisionPlan):
        for chunk in layout.chunks():
            names = [module_name(layer, m) for layer in chunk.layers for m in LINEAR_MODULES]
            path = f"{stem}.pp{chunk.stage}.yaml"
            assert_resolves_to(path, plan, RECIPE, {n: chunk.local_path(n) for n in names})
            assert read_megatron_config(path, layout, recipe=RECIPE, chunk=(chunk.stage, 0)) == {
                n: plan[n] for n in names}

    for it in (2, 4):
        stem = save / "snip" / f"snip_iter_{it:07d}"
        record = json.loads(stem.with_suffix(".json").read_text())
        assert (record["run"]["pipeline_stages"], record["run"]["first_stage_layers"]) == (2, 1)
        assert record["cycle"]["stage_fp4_fraction"]["0"] >= 0.5 - 1e-9  # stage 0: layer 0's own FLOPs
        plan = PrecisionPlan.from_dict(record["cycle"]["plan"])
        assert all(plan[n] == Precision.uniform("fp8") for n in pinned)
        assert_resolves_to(f"{stem}.yaml", plan, RECIPE, {n: n for n in module_names(4)})
        assert PrecisionPlan(read_megatron_config(f"{stem}.yaml", PipelineLayout(4), recipe=RECIPE)) == plan
        assert_stage_files_are(str(stem), plan)
    assert_stage_files_are(str(save / "iter_0000004" / "te_precision_config"),
                           PrecisionPlan.from_dict(read_record(str(save)).precision_plan))
    # Offline: tools/snip_solve.py writes each policy's plan in the same form, the pins held.
    out = tmp_path / "offline"
    subprocess.run([sys.executable, str(ROOT / "tools" / "snip_solve.py"), f"{stem}.json", "--targets", "0.5",
                    "--policies", "snip", "uniform", "--write-plans", str(out), "--write-megatron-configs", str(out)],
                   check=True, capture_output=True, timeout=120)
    for policy in ("snip", "uniform"):
        plan = PrecisionPlan.load(out / f"{policy}_fp4-0.50.json")
        assert all(plan[n] == Precision.uniform("fp8") for n in pinned)
        assert_resolves_to(out / f"{policy}_fp4-0.50.yaml", plan, RECIPE, {n: n for n in module_names(4)})
        assert_stage_files_are(str(out / f"{policy}_fp4-0.50"), plan)
        assert sorted(p.name for p in out.glob(f"{policy}_*.yaml")) == [
            f"{policy}_fp4-0.50.pp0.yaml", f"{policy}_fp4-0.50.pp1.yaml", f"{policy}_fp4-0.50.yaml"]

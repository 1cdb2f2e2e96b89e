"""The statistics file's blocks are typed records from the re-planner that writes them to every reader, and
files of older schema versions still load (tests/data/snip_iter_schema1.json: the quickstart's first cycle,
TP2 x PP2, 4 layers, written on 2026-11-25; a schema-0 file is made from it by removing what version 0 lacked)."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import ROOT

from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.precision.gemm_speed import peak_speed_model
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.snip.decisions import CycleReport, Decision
from megatron_snip.snip.estimators import Divergence
from megatron_snip.snip.ilp import solve
from megatron_snip.snip.statistics import STATISTICS_SCHEMA_VERSION
from megatron_snip.snip.statistics_file import Budget, RunSettings, StatisticsFile

SCHEMA1 = ROOT / "tests" / "data" / "snip_iter_schema1.json"


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_the_run_block_and_the_cycle_are_typed_and_write_back_what_they_read():
    """Typed -> JSON -> typed loses nothing: each block written from its record equals the file's own
    (the re-planner writes the same records, so the file's layout is unchanged)."""
    record = json.loads(SCHEMA1.read_text())
    loaded = StatisticsFile.load(SCHEMA1)
    run, cycle = loaded.run, loaded.cycle
    assert isinstance(run, RunSettings) and isinstance(run.recipe, RecipeConfig)
    assert run.dims.num_layers == 4 and run.formats == ("bf16", "fp8", "nvfp4") and run.speed_model.name == "blackwell"
    # Keys added since: last, as an even layout (uneven stages need --decoder-first/last-pipeline-num-layers)
    since = {"first_stage_layers": None, "last_stage_layers": None}
    assert _json(run.to_dict()) == {**record["run"], **since} and list(run.to_dict()) == [*record["run"], *since]
    assert isinstance(cycle, CycleReport) and all(isinstance(d, Decision) for d in cycle.decisions)
    assert len(cycle.decisions) == 16 and cycle.decisions[0].module == "decoder.layers.0.self_attention.linear_qkv"
    assert set(cycle.stage_fp4_fraction) == {0, 1}  # JSON's string keys back as the stage numbers they were
    assert _json(cycle.to_dict()) == {**record["cycle"], "unresolved_curvatures": None}
    assert cycle.plan.to_dict() == record["cycle"]["plan"]
    div = loaded.divergences["decoder.layers.0.mlp.linear_fc1"]["nvfp4"]
    assert isinstance(div, Divergence) and div.forward == record["divergences"]["decoder.layers.0.mlp.linear_fc1"][
        "nvfp4"]["forward"]


def test_a_schema_0_file_loads_with_what_the_run_had_then(tmp_path):
    """Version 0 (no schema_version field) had no decisions in the cycle and, in its run block, no virtual
    stages, speed model, speeds, recipe or pins: they read as 1, none, the default recipe and no pins, and
    the file still plans."""
    record = json.loads(SCHEMA1.read_text())
    old = copy.deepcopy(record)
    del old["schema_version"], old["cycle"]["decisions"]
    for key in ("virtual_stages", "speed_model", "speeds", "recipe", "pins"):
        del old["run"][key]
    path = tmp_path / "snip_iter_0000010.json"
    path.write_text(json.dumps(old))
    loaded = StatisticsFile.load(path)
    run = loaded.run
    assert (run.layout, run.speed_model, run.speeds, run.recipe, dict(run.pins)) == (
        PipelineLayout(4, record["run"]["pipeline_stages"]), None, None, RecipeConfig(), {})
    assert loaded.cycle.decisions == [] and loaded.cycle.iteration == record["cycle"]["iteration"]
    assert loaded.speed_model_name() == peak_speed_model("auto").name  # no recorded model: the published peaks'
    assert solve(loaded.problem(Budget(0.75), solver="highs"), "highs").fp4_fraction >= 0.75 - 1e-9


def test_pins_come_back_as_precisions_and_reach_the_problem(tmp_path):
    record = json.loads(SCHEMA1.read_text())
    name = "decoder.layers.0.self_attention.linear_qkv"
    record["run"]["pins"] = {name: "bf16"}
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(record))
    loaded = StatisticsFile.load(path)
    assert loaded.run.pins == {name: Precision.parse("bf16")}
    assert solve(loaded.problem(Budget(0.5), solver="highs"), "highs").plan[name] == "bf16"
    assert solve(StatisticsFile.load(SCHEMA1).problem(Budget(0.5), solver="highs"), "highs").plan[name] != "bf16"


def test_a_newer_schema_is_refused_naming_the_file(tmp_path):
    record = json.loads(SCHEMA1.read_text())
    path = tmp_path / "future.json"
    path.write_text(json.dumps({**record, "schema_version": STATISTICS_SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match=r"future.json: statistics file schema version \d+ is newer"):
        StatisticsFile.load(path)

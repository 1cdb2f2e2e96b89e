"""The checkpoint's record (its replicated, non-tensor state): typed, versioned, and old checkpoints and SNIP
statistics files still load (tests/data/checkpoint_v0: a 1-layer model trained 2 iterations on --mock-data
and saved by megatron-snip before the record had a version; tests/data/snip_iter_schema1.json)."""

from __future__ import annotations

import shutil

import pytest
from conftest import ROOT, launch

from megatron_snip.numerics.recipes import Precision
from megatron_snip.training.checkpoint_record import (
    CHECKPOINT_RECORD_VERSION,
    VERSION_KEY,
    CheckpointRecord,
    PlanChange,
    PlanEvent,
)
from megatron_snip.training.checkpointing import CheckpointError, read_record

OLD = ROOT / "tests" / "data" / "checkpoint_v0"
# The flags OLD was trained with (its model shape comes back from the checkpoint itself).
OLD_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--lr", "1e-3", "--eval-iters", "0", "--seed", "3", "--log-interval", "1"]


def test_the_record_round_trips_through_the_common_state():
    record = CheckpointRecord(7, {"num_layers": 2}, 56, precision_plan={"default": "bf16"},
                              precision_schedule=["fwd=bf16@0.9"], layout={"tp": 2, "pp": 1, "dp": 1},
                              no_rng_state=True)
    common = {**record.to_common(), "opt_param_scheduler": {"num_steps": 7}}  # the scheduler's entry beside it
    assert common[VERSION_KEY] == CHECKPOINT_RECORD_VERSION
    assert CheckpointRecord.from_common(common, "x") == record


def test_the_plan_history_is_typed_and_stored_as_checkpoints_always_stored_it():
    """The history's entries as every checkpoint since --promote-on-fault holds them (plain dicts, "old -> new"
    per module) read as PlanChange records and are written back unchanged, key order included."""
    stored = [
        {"iteration": 4, "event": "snip cycle", "modules": {"decoder.layers.0.mlp.linear_fc1": "bf16 -> nvfp4",
                                                            "decoder.layers.1.mlp.linear_fc2": "nvfp4 -> fp8/bf16"}},
        {"iteration": 6, "event": "promotion", "reason": "non-finite loss at iteration 6",
         "modules": {"decoder.layers.1.mlp.linear_fc2": "fp8/bf16 -> bf16"}}]
    record = CheckpointRecord.from_common({"iteration": 6, "precision_history": stored}, "ckpt/iter_0000006")
    cycle, promotion = record.precision_history
    assert cycle == PlanChange(4, PlanEvent.SNIP_CYCLE, {
        "decoder.layers.0.mlp.linear_fc1": (Precision.uniform("bf16"), Precision.uniform("nvfp4")),
        "decoder.layers.1.mlp.linear_fc2": (Precision.uniform("nvfp4"), Precision("fp8", "bf16"))})
    assert promotion.event is PlanEvent.PROMOTION and promotion.reason == "non-finite loss at iteration 6"
    written = record.to_common()["precision_history"]
    assert written == stored and [list(e) for e in written] == [list(e) for e in stored]
    with pytest.raises(ValueError, match=r"ckpt/iter_0000006: unreadable plan history entry .*'event': 'merge'"):
        CheckpointRecord.from_common({"iteration": 6, "precision_history": [{**stored[0], "event": "merge"}]},
                                     "ckpt/iter_0000006")


def test_a_newer_or_foreign_record_is_refused_naming_the_checkpoint():
    with pytest.raises(ValueError, match=r"ckpt/iter_0000007: checkpoint record version 99 is newer"):
        CheckpointRecord.from_common({"iteration": 7, VERSION_KEY: 99}, "ckpt/iter_0000007")
    with pytest.raises(ValueError, match="not a megatron-snip checkpoint"):
        CheckpointRecord.from_common({"args": {}}, "elsewhere")


def test_a_checkpoint_saved_before_the_record_reads_with_its_fields():
    record = read_record(str(OLD))
    assert record.version == 0 and record.iteration == 2 and record.consumed_samples == 4
    assert record.args["num_layers"] == 1 and record.args["hidden_size"] == 16
    assert record.precision_plan is not None and record.precision_schedule == []
    assert dict(record.layout) == {"tp": 1, "pp": 1, "dp": 1}
    assert not (record.model_only or record.no_optimizer_state or record.no_rng_state)


def test_a_damaged_record_is_a_checkpoint_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    (ckpt / "iter_0000002" / "common.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="iter_0000002"):
        read_record(str(ckpt))


@pytest.mark.integration
def test_training_resumes_from_a_checkpoint_saved_before_the_record(tmp_path):
    """Weights, optimizer, scheduler and RNG of the old checkpoint load; the next save writes the current
    record version."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    out = launch(1, [*OLD_FLAGS, "--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt),
                     "--save-interval", "1"])
    assert "resumed from" in out.stdout and "at iteration 2" in out.stdout
    record = read_record(str(ckpt))
    assert (record.version, record.iteration, record.consumed_samples) == (CHECKPOINT_RECORD_VERSION, 3, 6)


def test_a_statistics_file_of_schema_version_1_still_plans():
    """tests/data/snip_iter_schema1.json: the quickstart's first SNIP cycle (TP2 x PP2, 4 layers, statistics
    version 2), as written on 2026-11-25; later programs must keep reading it."""
    from megatron_snip.snip.ilp import solve
    from megatron_snip.snip.statistics_file import Budget, StatisticsFile

    stats = StatisticsFile.load(ROOT / "tests" / "data" / "snip_iter_schema1.json")
    assert len(stats.stats.modules) == 16 and stats.run.pipeline_stages == 2
    solution = solve(stats.problem(Budget(0.75), solver="highs"), "highs")
    assert solution.fp4_fraction >= 0.75 - 1e-9

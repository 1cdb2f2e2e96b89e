"""The checkpoint's record (its replicated, non-tensor state): typed, versioned, stored beside Megatron-LM's fields,
and old checkpoints and SNIP statistics files still load (tests/data/checkpoint_v0: a 1-layer model trained 2
iterations on --mock-data and saved by megatron-snip before the record had a version, with NullTokenizer's
--vocab-size 64 then meaning 64 ids; tests/data/snip_iter_schema1.json)."""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import ROOT, launch

from megatron_snip.numerics.recipes import Precision
from megatron_snip.training.checkpoint_record import (
    CHECKPOINT_RECORD_VERSION,
    RECORD_KEY,
    CheckpointRecord,
    PlanChange,
    PlanEvent,
)
from megatron_snip.training.checkpointing import CheckpointError, read_record

OLD = ROOT / "tests" / "data" / "checkpoint_v0"
# Its model (a Megatron-LM script's flags; tied).
OLD_SHAPE = ["--num-layers", "1", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-attention-heads", "2",
             "--seq-length", "16", "--max-position-embeddings", "16", "--swiglu", "--disable-bias-linear",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
# The flags OLD was trained with (its model shape comes back from the checkpoint itself); its 64 ids are
# Megatron-LM's --vocab-size 63; the defaults of then that are Megatron-LM's no longer (cosine decay, no dropout)
# stated.
OLD_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--lr", "1e-3", "--eval-iters", "0", "--seed", "3", "--log-interval", "1",
             "--lr-decay-style", "cosine", "--attention-dropout", "0", "--hidden-dropout", "0"]


def train_losses(stdout: str) -> dict[int, float]:
    """iteration -> the lm loss of its progress line."""
    return {int(i): float(v) for i, v in re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([\d.E+-]+)", stdout)}


def _common(record: CheckpointRecord) -> dict:
    """What a save puts into common.pt for ``record``, after a pickle round trip as dist_checkpointing does."""
    import pickle

    from megatron_snip.training.megatron_lm_checkpoint import common_state

    return pickle.loads(pickle.dumps(common_state(record)))


def test_the_record_round_trips_through_the_common_state():
    from megatron_snip.training.megatron_lm_checkpoint import read_common

    record = CheckpointRecord(7, {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, 56, 8, 0, 3.5e9,
                              scheduler={"num_steps": 56, "lr_decay_steps": 80}, content_metadata={"x": 1},
                              precision_plan={"default": "bf16"}, precision_schedule=["fwd=bf16@0.9"],
                              layout={"tp": 2, "pp": 1, "dp": 1, "cp": 1}, no_rng_state=True)
    common = _common(record)
    assert common[RECORD_KEY]["version"] == CHECKPOINT_RECORD_VERSION == 2
    assert (common["iteration"], common["opt_param_scheduler"], common["num_floating_point_operations_so_far"]) == (
        7, {"num_steps": 56, "lr_decay_steps": 80}, 3.5e9)
    assert "iteration" not in common[RECORD_KEY]  # one place for each field: Megatron-LM's, where it has one
    common["content_metadata"] = {"x": 1}  # stored by dist_checkpointing.save
    assert read_common(common, "x") == record


def test_the_plan_history_is_typed_and_stored_as_checkpoints_always_stored_it():
    """The history's entries as every checkpoint since --promote-on-fault holds them (plain dicts, "old -> new"
    per module) read as PlanChange records and are written back unchanged, key order included."""
    stored = [
        {"iteration": 4, "event": "snip cycle", "modules": {"decoder.layers.0.mlp.linear_fc1": "bf16 -> nvfp4",
                                                            "decoder.layers.1.mlp.linear_fc2": "nvfp4 -> fp8/bf16"}},
        {"iteration": 6, "event": "promotion", "reason": "non-finite loss at iteration 6",
         "modules": {"decoder.layers.1.mlp.linear_fc2": "fp8/bf16 -> bf16"}}]
    record = CheckpointRecord.from_legacy({"iteration": 6, "precision_history": stored}, "ckpt/iter_0000006")
    cycle, promotion = record.precision_history
    assert cycle == PlanChange(4, PlanEvent.SNIP_CYCLE, {
        "decoder.layers.0.mlp.linear_fc1": (Precision.uniform("bf16"), Precision.uniform("nvfp4")),
        "decoder.layers.1.mlp.linear_fc2": (Precision.uniform("nvfp4"), Precision("fp8", "bf16"))})
    assert promotion.event is PlanEvent.PROMOTION and promotion.reason == "non-finite loss at iteration 6"
    written = record.stored()["precision_history"]
    assert written == stored and [list(e) for e in written] == [list(e) for e in stored]
    with pytest.raises(ValueError, match=r"ckpt/iter_0000006: unreadable plan history entry .*'event': 'merge'"):
        CheckpointRecord.from_legacy({"iteration": 6, "precision_history": [{**stored[0], "event": "merge"}]},
                                     "ckpt/iter_0000006")


def test_a_newer_or_foreign_record_is_refused_naming_the_checkpoint():
    from megatron_snip.training.megatron_lm_checkpoint import read_common

    newer = _common(CheckpointRecord(7))
    newer[RECORD_KEY]["version"] = 99
    with pytest.raises(ValueError, match=r"ckpt/iter_0000007: checkpoint record version 99 is newer"):
        read_common(newer, "ckpt/iter_0000007")
    with pytest.raises(ValueError, match=r"elsewhere: neither a Megatron-LM nor a megatron-snip checkpoint"):
        read_common({"model": {}}, "elsewhere")


def test_a_checkpoint_saved_before_the_record_reads_as_the_current_version_means_it():
    """Version 0 (tests/data/checkpoint_v0): its fields at the top of common.pt, the scheduler in iterations and
    NullTokenizer's --vocab-size 64 counting the end-of-document id read as samples (global batch 2) and as
    Megatron-LM's --vocab-size 63; its optimizer format is the one every optimizer was given then."""
    record = read_record(str(OLD))
    assert record.version == 0 and record.legacy and record.iteration == 2 and record.consumed_samples == 4
    assert record.args["num_layers"] == 1 and record.args["hidden_size"] == 16 and record.args["vocab_size"] == 63
    assert record.precision_plan is not None and record.precision_schedule == []
    assert dict(record.layout) == {"tp": 1, "pp": 1, "dp": 1}
    assert not (record.model_only or record.no_optimizer_state or record.no_rng_state)
    assert (record.scheduler["num_steps"], record.scheduler["lr_decay_steps"], record.scheduler["wd_incr_steps"],
            record.scheduler["lr_warmup_steps"]) == (4, 4, 4, 0)
    assert record.content_metadata == {"distrib_optim_sharding_type": "dp_reshardable"}


def test_an_old_null_tokenizer_size_is_named_with_the_one_that_means_it_now():
    from megatron_snip.arguments import ArgumentError, parse_config

    flags = [f if f != "63" else "64" for f in OLD_FLAGS]
    with pytest.raises(ArgumentError, match=r"--vocab-size 64: the checkpoint in .* was saved by an earlier "
                                            r"megatron-snip, whose --vocab-size counted NullTokenizer's "
                                            r"end-of-document id \(64 ids\); .* pass --vocab-size 63 for the same "
                                            r"64 ids"):
        parse_config([*flags, "--train-iters", "3", "--load", str(OLD)], world_size=1, cuda=False)


def test_a_damaged_record_is_a_checkpoint_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    (ckpt / "iter_0000002" / "common.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="iter_0000002"):
        read_record(str(ckpt))


@pytest.mark.integration
def test_training_resumes_from_a_checkpoint_saved_before_the_record(tmp_path):
    """Weights, data position, scheduler and RNG of the old checkpoint load: its third iteration's loss is an
    uninterrupted run's (whose first two reproduce the ones the checkpoint recorded); the next save writes the
    current record version, in samples."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    flags = [*OLD_FLAGS, "--train-iters", "3"]
    whole = launch(1, [*flags, *OLD_SHAPE, "--lr-decay-iters", "2"])
    out = launch(1, [*flags, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1"])
    assert "resumed from" in out.stdout and "at iteration 2" in out.stdout
    losses, resumed = train_losses(whole.stdout), train_losses(out.stdout)
    saved = read_record(str(OLD)).numerical_safety["recent"]  # the losses of iterations 1 and 2 it was saved with
    assert [losses[1], losses[2]] == pytest.approx(saved, rel=1e-6) and resumed == {3: losses[3]}
    record = read_record(str(ckpt))
    assert (record.version, record.iteration, record.consumed_samples) == (CHECKPOINT_RECORD_VERSION, 3, 6)
    assert record.scheduler["num_steps"] == 6 and record.scheduler["lr_decay_steps"] == 4


def test_a_statistics_file_of_schema_version_1_still_plans():
    """tests/data/snip_iter_schema1.json: the quickstart's first SNIP cycle (TP2 x PP2, 4 layers, statistics
    version 2), as written on 2026-11-25; later programs must keep reading it."""
    from megatron_snip.precision.pipeline_layout import PipelineLayout
    from megatron_snip.snip.ilp import solve
    from megatron_snip.snip.statistics_file import Budget, StatisticsFile

    stats = StatisticsFile.load(ROOT / "tests" / "data" / "snip_iter_schema1.json")
    assert len(stats.stats.modules) == 16 and stats.run.layout == PipelineLayout(4, 2)
    solution = solve(stats.problem(Budget(0.75), solver="highs"), "highs")
    assert solution.fp4_fraction >= 0.75 - 1e-9

"""Which precision a resumed run uses: flags given > the checkpoint's plan and recipe > defaults;
and precision schedules across a checkpoint."""

from __future__ import annotations

import shutil

import pytest
from conftest import launch, scalars, train_args

from megatron_snip.arguments import ArgumentError, parse_config
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.training import tags
from megatron_snip.training.checkpointing import read_record
from megatron_snip.training.precision_setup import initial_plan

pytestmark = pytest.mark.integration  # every test here launches processes

FP4 = tags.FP4_FRACTION
SAVED = ("--precision", "nvfp4", "--fp8-recipe", "blockwise", "--nvfp4-disable-rht",
         "--precision-schedule", "fwd=bf16@3", "--lr-decay-style", "constant")


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """4 steps in nvfp4 (forward GEMMs bf16 from step 3 on), checkpoints at 2 and 4."""
    d = tmp_path_factory.mktemp("precision_resume")
    launch(1, train_args(tiny_data, *SAVED, "--save", str(d / "ckpt"), "--save-interval", "2",
                         "--tensorboard-dir", str(d / "tb"), iters=4))
    return d


def resumed_at_2(run, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(run / "ckpt" / "iter_0000002", ckpt / "iter_0000002")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    return ckpt


def resume(data, ckpt, *extra):
    config = parse_config(train_args(data, "--load", str(ckpt), *extra, iters=4), world_size=1, cuda=False)
    return config.precision, initial_plan(config, None if config.checkpoint.finetune else read_record(str(ckpt)))


def test_schedule_changes_the_plan_at_its_step_and_survives_a_resume(tiny_data, run, tmp_path):
    assert scalars(run / "tb", FP4) == pytest.approx({1: 1.0, 2: 1.0, 3: 2 / 3, 4: 2 / 3})
    ckpt = resumed_at_2(run, tmp_path)
    # No precision flags: the checkpoint's plan, recipe and schedule go on, bit for bit.
    launch(1, train_args(tiny_data, "--load", str(ckpt), "--lr-decay-style", "constant",
                         "--tensorboard-dir", str(tmp_path / "tb"), iters=4))
    assert scalars(tmp_path / "tb", FP4) == pytest.approx({3: 2 / 3, 4: 2 / 3})
    full, again = scalars(run / "tb", tags.LM_LOSS), scalars(tmp_path / "tb", tags.LM_LOSS)
    assert again == {k: full[k] for k in (3, 4)}


def test_without_flags_the_checkpoint_plan_and_recipe_are_kept(tiny_data, run):
    prec, (plan, source) = resume(tiny_data, run / "ckpt")
    assert plan == PrecisionPlan.uniform("nvfp4") and source.startswith("the checkpoint's (iteration 4")
    assert (prec.fp8_recipe, prec.nvfp4_disable_rht, prec.fp4_recipe) == ("blockwise", True, "nvfp4")
    assert prec.precision_notes == ()


def test_given_flags_win_and_are_named(tiny_data, run):
    prec, (plan, source) = resume(tiny_data, run / "ckpt", "--precision", "bf16", "--fp8-recipe", "tensorwise",
                                  "--no-nvfp4-disable-rht")
    assert plan == PrecisionPlan.uniform("bf16") and source == "--precision bf16"
    assert (prec.fp8_recipe, prec.nvfp4_disable_rht) == ("tensorwise", False)
    assert prec.precision_notes == ("--fp8-recipe tensorwise replaces the checkpoint's blockwise",
                                    "--nvfp4-disable-rht False replaces the checkpoint's True")
    _, (plan, source) = resume(tiny_data, run / "ckpt", "--fp4-recipe", "mxfp4")
    assert plan == PrecisionPlan.uniform("mxfp4") and "its FP4 modules in --fp4-recipe mxfp4" in source


def test_finetune_starts_from_the_command_line_precision(tiny_data, run):
    prec, (plan, source) = resume(tiny_data, run / "ckpt", "--finetune")
    assert plan == PrecisionPlan.uniform("bf16") and source == "bf16 (the default)"
    assert prec.fp8_recipe == "tensorwise"


def test_conflicting_plan_flags_are_one_error(tiny_data, run, tmp_path):
    PrecisionPlan.uniform("fp8").save(tmp_path / "plan.json")
    with pytest.raises(ArgumentError, match=r"--precision nvfp4 and --precision-plan .*plan.json both set the plan"):
        resume(tiny_data, run / "ckpt", "--precision", "nvfp4", "--precision-plan", str(tmp_path / "plan.json"))
    with pytest.raises(ArgumentError, match=r"--precision-schedule 'fwd=bf16': expected PASSES=PRECISION@START"):
        resume(tiny_data, run / "ckpt", "--precision-schedule", "fwd=bf16")


def test_a_resume_with_a_new_precision_trains_in_it(tiny_data, run, tmp_path):
    ckpt = resumed_at_2(run, tmp_path)
    proc = launch(1, train_args(tiny_data, "--load", str(ckpt), "--precision", "fp8",
                                "--precision-schedule", "all=fp8@4", "--lr-decay-style", "constant",
                                "--tensorboard-dir", str(tmp_path / "tb"), iters=4))
    assert scalars(tmp_path / "tb", FP4) == {3: 0.0, 4: 0.0}
    assert scalars(tmp_path / "tb", tags.FP8_FRACTION) == {3: 1.0, 4: 1.0}
    assert "precision: plan --precision fp8" in proc.stdout
    assert "precision schedule (--precision-schedule): all=fp8@4" in proc.stdout

"""Training with per-module precision through pretrain_llama.py, under TP and PP."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, free_port, launch, scalars, train_args

from megatron_snip.numerics.recipes import Precision
from megatron_snip.precision.flops import LlamaLinearDims, flop_fractions
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.training import tags

LOSS, FP4, FP8 = tags.LM_LOSS, tags.FP4_FRACTION, tags.FP8_FRACTION
# The TINY_MODEL shape of conftest.py.
DIMS = LlamaLinearDims(num_layers=4, hidden_size=64, ffn_hidden_size=192, kv_channels=16, num_query_groups=2)


def mixed_plan() -> PrecisionPlan:
    return PrecisionPlan({
        "decoder.layers.0.self_attention.linear_qkv": Precision("fp8", "fp8"),
        "decoder.layers.1.mlp.linear_fc1": Precision("mxfp4", "mxfp4"),
        "decoder.layers.2.mlp.linear_fc2": Precision("nvfp4", "bf16"),
        "decoder.layers.3.self_attention.linear_proj": Precision("bf16", "nvfp4"),
    }, default=Precision.uniform("nvfp4"))


@pytest.mark.integration
def test_uniform_nvfp4_trains_at_tp2_pp2(tiny_data, tmp_path):
    launch(4, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--precision", "nvfp4", "--tensorboard-dir", str(tmp_path / "tb"), iters=12))
    losses = scalars(tmp_path / "tb", LOSS)
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[12] < losses[1] - 0.3
    assert set(scalars(tmp_path / "tb", FP4).values()) == {1.0}


@pytest.mark.integration
def test_mixed_plan_file_at_tp2(tiny_data, tmp_path):
    plan = mixed_plan()
    plan.save(tmp_path / "plan.json")
    launch(2, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--precision-plan",
                         str(tmp_path / "plan.json"), "--tensorboard-dir", str(tmp_path / "tb"), iters=6))
    want = flop_fractions(plan, DIMS)
    assert 0 < want.fp4 < 1 and 0 < want.fp8 < 1
    assert scalars(tmp_path / "tb", FP4)[6] == pytest.approx(want.fp4, rel=1e-6)
    assert scalars(tmp_path / "tb", FP8)[6] == pytest.approx(want.fp8, rel=1e-6)
    losses = scalars(tmp_path / "tb", LOSS)
    assert losses[6] < losses[1]


@pytest.mark.integration
def test_resume_continues_the_quantization_state_bit_for_bit(tiny_data, tmp_path):
    """Stochastic rounding (nvfp4, mxfp4 gradients) and delayed scaling (fp8) carry state from
    step to step; a run resumed at 3 must draw the same rounding and use the same scales as
    the run that went on."""
    plan = mixed_plan()
    plan.save(tmp_path / "plan.json")
    # A history longer than the run (Megatron-LM's default keeps 1 amax): every step's amaxes must survive.
    common = ("--tensor-model-parallel-size", "2", "--precision-plan", str(tmp_path / "plan.json"),
              "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max",
              "--save-interval", "3", "--lr-decay-style", "constant")
    full = tmp_path / "full"
    launch(2, train_args(tiny_data, *common, "--save", str(full), "--tensorboard-dir", str(tmp_path / "tb"),
                         iters=6))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest_checkpointed_iteration.txt").write_text("3")
    launch(2, train_args(tiny_data, *common, "--load", str(resumed), "--save", str(resumed),
                         "--tensorboard-dir", str(tmp_path / "tb2"), iters=6))
    losses, again = scalars(tmp_path / "tb", LOSS), scalars(tmp_path / "tb2", LOSS)
    assert sorted(again) == [4, 5, 6]
    assert {k: losses[k] for k in again} == again


@pytest.mark.integration
def test_plan_change_takes_effect_next_iteration_and_survives_checkpoint(tiny_data, tmp_path):
    plan = mixed_plan()
    plan.save(tmp_path / "plan.json")
    want = flop_fractions(plan, DIMS).fp4
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "tests" / "drivers" / "switch_plan.py"),
           *train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                       "--tensorboard-dir", str(tb), iters=4)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "SWITCH_AT": "2",
                               "SWITCH_PLAN": str(tmp_path / "plan.json")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert scalars(tb, FP4) == pytest.approx({1: 0.0, 2: 0.0, 3: want, 4: want})
    # Resume without naming a plan: the checkpoint's plan is restored.
    launch(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--load", str(ckpt),
                         "--tensorboard-dir", str(tmp_path / "tb2"), iters=6))
    assert scalars(tmp_path / "tb2", FP4) == pytest.approx({5: want, 6: want})


def test_bad_plan_file_is_reported(tiny_data, tmp_path):
    from megatron_snip.arguments import ArgumentError, parse_config

    (tmp_path / "plan.json").write_text('{"version": 1, "default": "fp6", "modules": {}}')
    with pytest.raises(ArgumentError, match=r"--precision-plan .*plan.json.*fp6"):
        parse_config(train_args(tiny_data, "--precision-plan", str(tmp_path / "plan.json")), world_size=1, cuda=False)
    with pytest.raises(ArgumentError, match=r"--precision-plan .*missing.json: file not found"):
        parse_config(train_args(tiny_data, "--precision-plan", str(tmp_path / "missing.json")), world_size=1,
                   cuda=False)

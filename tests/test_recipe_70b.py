"""The 70B recipe's combination of layouts and features, at tiny scale on CPU.

The flags come from ``examples/slurm/pretrain_llama.sbatch`` itself (recorded as test_examples.py
does), so the test follows the script: sequence parallelism, the distributed optimizer, overlapped
grad reduce and param gather, recompute, bf16 and SNIP, with the parallel sizes scaled down to
TP2 x PP2 x VPP2 (one layer per chunk) = 4 gloo ranks. It trains 4 iterations with a SNIP re-plan
and a checkpoint every 2, then resumes from iteration 2: losses and the next re-plan match bit for bit.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT, launch, scalars, train_args
from test_examples import recorded_launches

from megatron_snip.arguments import parse_args
from megatron_snip.training import tags

SCRIPT = ROOT / "examples" / "slurm" / "pretrain_llama.sbatch"
SWITCHES = ("sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "bf16",
            "snip")
VALUES = ("recompute_granularity", "recompute_method", "recompute_num_layers", "snip_fp4_target", "snip_time_target")
TINY_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1"]


def recipe_flags(tmp_path) -> list[str]:
    """The sbatch script's feature flags, with the tiny layout instead of its parallel sizes."""
    (launch,) = recorded_launches(SCRIPT, tmp_path)
    args = parse_args(launch[launch.index("pretrain_llama.py") + 1:])
    # The recipe this test stands for: TP with sequence parallelism, interleaved pipeline, SNIP.
    assert args.tensor_model_parallel_size > 1 and args.sequence_parallel and args.snip
    assert args.num_layers_per_virtual_pipeline_stage or args.virtual_pipeline_model_parallel_size
    flags = [f"--{name.replace('_', '-')}" for name in SWITCHES if getattr(args, name)]
    for name in VALUES:
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + TINY_LAYOUT


def plan_at(save_dir, iteration: int) -> dict:
    return json.loads((save_dir / "snip" / f"snip_iter_{iteration:07d}.json").read_text())["cycle"]["plan"]


@pytest.mark.integration
def test_recipe_trains_replans_and_resumes_exactly(tiny_data, tmp_path):
    flags = recipe_flags(tmp_path / "record")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    launch(4, train_args(tiny_data, *flags, "--save", str(full), "--save-interval", "2",
                         "--tensorboard-dir", str(full / "tb"), iters=4), timeout=600)
    losses = scalars(full / "tb", tags.LM_LOSS)
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v for v in losses.values())
    # The re-plan at iteration 2 is in force from iteration 3 on: at least the FP4 target.
    fp4 = scalars(full / "tb", tags.FP4_FRACTION)
    assert fp4[2] == 0.0 and fp4[3] >= 0.75 - 1e-6
    resumed.mkdir()
    shutil.copytree(full / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    launch(4, train_args(tiny_data, *flags, "--load", str(resumed), "--save", str(resumed), "--save-interval", "2",
                         "--tensorboard-dir", str(resumed / "tb"), iters=4), timeout=600)
    again = scalars(resumed / "tb", tags.LM_LOSS)
    assert sorted(again) == [3, 4]
    assert again == {k: losses[k] for k in again}  # bit-identical, SNIP's plan restored from the checkpoint
    assert plan_at(resumed, 4) == plan_at(full, 4)


@pytest.mark.integration  # runs the script under bash
def test_long_sequence_recipe_splits_each_sequence_over_context_parallel_nodes(tmp_path):
    """The script's long-sequence form (CONTEXT_PARALLEL=4 SEQ_LENGTH=32768 on 8 nodes): TP8 + SP in a node, CP4
    over nodes, 2 pipeline stages, SNIP on, validated for its 64 GPUs."""
    from test_examples import world_size

    from megatron_snip.arguments import resolve

    (launch_args,) = recorded_launches(SCRIPT, tmp_path, env={
        "CONTEXT_PARALLEL": "4", "SEQ_LENGTH": "32768", "ROTARY_BASE": "500000", "GLOBAL_BATCH": "128",
        "SLURM_NNODES": "8", "SLURM_JOB_NODELIST": "node[001-008]"})
    entry = launch_args.index("pretrain_llama.py")
    world, flags = world_size(launch_args[:entry]), launch_args[entry + 1:]
    assert world == 64
    run = resolve(parse_args(flags), world_size=world, cuda=True, check_files=False)
    assert run.snip.enabled
    par = run.parallel
    assert (par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size,
            par.data_parallel_size, par.sequence_parallel) == (8, 4, 2, 1, True)
    assert (run.model.seq_length, run.model.rotary_base, run.training.num_microbatches) == (32768, 500000, 128)

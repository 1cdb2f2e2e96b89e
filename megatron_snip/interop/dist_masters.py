"""The fp32 master weights of a ``--use-distributed-optimizer`` checkpoint, as a model-only checkpoint.

megatron-core's distributed optimizer saves its state (the ``dp_reshardable`` format) as flat
buffers that follow the gradient buckets of each TP x PP rank: only that rank's own model, DDP and
optimizer know where a parameter lies in them. Export therefore runs this module under torchrun
with one process per TP x PP (x virtual stage) rank of the saved layout and data-parallel size 1
(the format reshards over DP, and at DP 1 each master covers its whole parameter); each process
builds the saved run's model, DDP wrapper and optimizer, loads the checkpoint, and the fp32
masters are written as an fp32 model-only checkpoint, which loads at TP 1 x PP 1.

    python -m torch.distributed.run --nproc-per-node TP*PP -m megatron_snip.interop.dist_masters LOAD OUT
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def launch(load_dir: str, out_dir: str, saved: dict, port: int) -> None:
    """Run this module on the saved layout's TP x PP processes; raise with their output on failure."""
    ranks = saved["tensor_model_parallel_size"] * saved["pipeline_model_parallel_size"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port),
           "-m", "megatron_snip.interop.dist_masters", load_dir, out_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"reading the distributed optimizer's fp32 masters of {load_dir} failed "
                           f"({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def _run_config(saved: dict):
    """The saved run's configuration (its layout, DDP buckets and optimizer define the state's layout)
    on this machine: gloo, megatron-core's local layers, data-parallel size 1."""
    from dataclasses import replace

    from megatron_snip.training.config import RunConfig

    run = RunConfig.from_flags(saved)  # flags added after the checkpoint was saved take their defaults
    return replace(run, parallel=replace(run.parallel, distributed_backend="gloo", data_parallel_size=1),
                   model=replace(run.model, transformer_impl="local"))


def main(load_dir: str, out_dir: str) -> None:
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    import torch.distributed as dist

    from megatron_snip.compat.device import setup_device
    from megatron_snip.interop.checkpoint_args import saved_args
    from megatron_snip.model.llama import build_model, transformer_config
    from megatron_snip.training import checkpointing
    from megatron_snip.training.checkpoint_record import CheckpointRecord
    from megatron_snip.training.setup import build_optimizer, build_scheduler, initialize_distributed, wrap_ddp

    saved, record = saved_args(load_dir)
    run = _run_config(saved)
    setup_device()
    initialize_distributed(run.parallel, run.training.seed)
    config = transformer_config(run.model, run.parallel)
    config.perform_initialization = False  # every weight is loaded
    ddps = wrap_ddp(run.parallel, config, build_model(run.model, run.parallel, config, run.model.vocab_size))
    optimizer = build_optimizer(run.training, run.model, run.parallel, ddps)
    chunks = [d.module for d in ddps]
    checkpointing.load_checkpoint(load_dir, chunks, optimizer, build_scheduler(run.training, optimizer),
                                  load_rng=False)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            # megatron-core's DistributedOptimizer hangs each bf16 parameter's fp32 master shard on it.
            master = getattr(p, "main_param", None)
            if master is None or master.numel() != p.numel():
                raise RuntimeError(f"{load_dir}: parameter {name} has no whole fp32 master at data-parallel size 1")
            p.data = master.detach().view(p.shape)
    state = {str(i): chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    checkpointing.save_model_checkpoint(out_dir, CheckpointRecord(record.iteration, {**saved, "bf16": False}), state)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
